"""What a campaign found: its runs, its coverage and its (shrunk) failures, as plain data.

``CampaignResult.to_dict()`` is the JSON report (``ftkit explore --json``); the rich table and
the HTML page are drawn from it. Every field named here is part of that report's contract.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ftkit.results import ScenarioResult, Verdict

#: Version of the campaign JSON report.
REPORT_VERSION = 1

#: An exception's class as error texts name it: ``RuntimeError: ...``, ``ReinferenceExhausted:``.
_ERROR_NAME = re.compile(r"\b([A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*):")


@dataclass(frozen=True)
class Outcome:
    """How one generated scenario ended, reduced to what groups failures.

    ``what`` is the first compared field that differs (``token_ids``, ``logprobs`` ...), the
    error's class for a run that ended in an error, ``timeout``, ``unrecovered`` (a fault fired
    and nothing recovered it), ``slow`` (a recovery round over its bound), ``not_fired`` for a
    scenario whose fault never fired (not a failure: a stop string may end a request before
    its fault's token), or ``""`` for a pass. ``fired`` holds ``kind/phase`` of the fault that
    fired first (the earliest step; the first in the scenario among those of one step):
    a failure's signature names it, not every fault of a compound scenario, so that the same
    bug seen beside other faults keeps its signature while they are shrunk away.
    """

    verdict: str
    what: str
    fired: tuple[str, ...]
    reason: str

    @property
    def failed(self) -> bool:
        return self.verdict in (Verdict.FAIL.value, Verdict.ERROR.value)

    @property
    def signature(self) -> str:
        """One failure, however many scenarios show it: ``fail: logprobs after uce/sample``."""
        return f"{self.verdict}: {self.what} after {' + '.join(self.fired) or 'no fault'}"

    @classmethod
    def of(cls, result: ScenarioResult) -> Outcome:
        order = sorted((f.fired_at.step if f.fired_at else 0, i)
                       for i, f in enumerate(result.faults) if f.fired)
        fired = tuple(f"{result.faults[i].kind}/{result.faults[i].phase}" for _, i in order[:1])
        verdict = Verdict(result.verdict)
        reason = result.reason or ""
        if verdict is Verdict.PASS:
            what = ""
        elif verdict is Verdict.NOT_APPLIED:
            what = "not_fired"
        elif reason.startswith("the fault-free baseline"):
            # The fault-free run itself failed: vLLM cannot run this configuration, whatever
            # the faults.
            found = _ERROR_NAME.search(reason)
            what = "baseline " + (found.group(1) if found else "error")
            fired = ()
        elif "timed out" in reason:
            what = "timeout"
        elif result.first_mismatch is not None:
            what = result.first_mismatch.diverged_field or "token_ids"
        elif result.error or "failed" in reason or verdict is Verdict.ERROR:
            found = _ERROR_NAME.search(result.error or reason)
            what = found.group(1) if found else "error"
        elif "over max_recovery_s" in reason:
            what = "slow"
        else:
            what = "unrecovered"
        return cls(verdict.value, what, fired, reason)


@dataclass
class ExploredRun:
    """One scenario the campaign ran."""

    index: int
    name: str
    tp: int
    #: ``kind/phase`` of every fault, as generated (fired or not).
    faults: list[str]
    features: list[str]
    verdict: str
    what: str
    signature: str | None
    reason: str
    duration_s: float
    #: True for a run made while shrinking a failure (not counted in the budget).
    shrinking: bool = False


@dataclass
class Failure:
    """One failure signature: the first scenario that showed it, and the smallest one."""

    signature: str
    verdict: str
    what: str
    #: Index of the run that first showed it.
    found_at: int
    reason: str
    #: The shrunk scenario: its file (written by the campaign), size and features.
    file: str | None
    tp: int
    requests: int
    max_tokens: int
    faults: list[str]
    features: list[str]
    #: The size of the first failing scenario, for comparison.
    original: dict[str, Any] = field(default_factory=dict)
    shrink_runs: int = 0
    #: False when shrinking was off or ran out of time (``ExploreOptions.shrink_budget_s``):
    #: the scenario fails, but a smaller one might too.
    shrink_complete: bool = True
    #: Whether the shrunk scenario, run again alone on a new engine, failed the same way
    #: (None: not checked). False means an earlier run of the campaign left its engine
    #: damaged and this scenario failed from that: the damage is the finding.
    reproduced: bool | None = None
    #: Signatures of other failures whose shrunk scenario holds this one's faults and more
    #: (the same bug, seen with an extra fault): reported here, once.
    also_seen_as: list[str] = field(default_factory=list)


@dataclass
class CoverageCell:
    """Runs of one fault kind, phase, workload feature (``none`` for a plain workload) and
    tensor parallel size."""

    kind: str
    phase: str
    feature: str
    tp: int
    runs: int = 0
    failures: int = 0
    not_fired: int = 0


@dataclass
class CampaignResult:
    seed: int
    space: dict[str, Any]
    budget: str
    started_at: float
    duration_s: float = 0.0
    runs: list[ExploredRun] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    coverage: list[CoverageCell] = field(default_factory=list)
    #: Why the campaign stopped: ``budget``, ``interrupted``, ``space exhausted``.
    stopped: str = "budget"
    out_dir: str | None = None
    #: Draws that were not valid scenarios (the scenario rules refused them), not run.
    rejected: int = 0

    @property
    def scenarios_run(self) -> int:
        """Distinct generated scenarios run, shrinking runs excluded."""
        return sum(1 for r in self.runs if not r.shrinking)

    @property
    def generation_s(self) -> float:
        return sum(r.duration_s for r in self.runs if not r.shrinking)

    def per_minute(self) -> float:
        spent = self.generation_s
        return 60.0 * self.scenarios_run / spent if spent > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "seed": self.seed,
            "space": self.space,
            "budget": self.budget,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "stopped": self.stopped,
            "out_dir": self.out_dir,
            "scenarios_run": self.scenarios_run,
            "scenarios_per_minute": round(self.per_minute(), 2),
            "rejected": self.rejected,
            "failures": [asdict(f) for f in self.failures],
            "coverage": [asdict(c) for c in self.coverage],
            "runs": [asdict(r) for r in self.runs],
        }
