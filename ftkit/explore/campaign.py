"""A campaign: generate scenarios from a seed, run them, shrink every failure, count coverage.

Generation and shrinking are Hypothesis's (see ``docs/design.md``, "Chaos search"). A campaign
is a series of rounds; each round is one Hypothesis search of ``round_size`` examples over
``ftkit.explore.space.scenarios``, seeded from the campaign's seed and the round's number, so
that the same seed generates the same scenarios. The property each example checks is "this
scenario passes"; a failure raises an exception of a class made for its signature
(``Outcome.signature``), which is what Hypothesis tells bugs apart by: each signature is shrunk
on its own, to the simplest scenario that still fails *with the same signature*, and a round
that found failures ends with their shrinking. Signatures already found are not raised again
in later rounds (one bug is shrunk and reported once); their runs still count.

Every scenario runs on a ``ScenarioRunner`` that keeps its engines (one per engine
configuration, plain and with ftkit) and the baselines; a scenario run twice (Hypothesis may
draw it again, and shrinking revisits) is answered from the campaign's memo.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed, settings
from hypothesis.errors import Unsatisfiable

from ftkit.errors import FtkitError
from ftkit.explore.results import (CampaignResult, CoverageCell, ExploredRun, Failure,
                                   Outcome)
from ftkit.explore.space import ExploreSpace, features_of, model_prompt_tokens, scenarios
from ftkit.results import ScenarioResult, Verdict
from ftkit.scenario.errors import ScenarioErrors
from ftkit.scenario.model import Scenario

#: Runs one scenario: ``execute(scenario, file)``. The default runs it on real engines.
Execute = Callable[[Scenario, str], ScenarioResult]

#: Engine ranks a campaign keeps alive between scenarios: a generated engine at tensor
#: parallel 2 holds about 2.6 GB in all (its KV cache is small: ``space.KV_BLOCKS``); twelve
#: ranks keep every engine configuration a campaign draws at tensor parallel 2 (three, plain
#: and with ftkit).
MEMORY_RANKS = 12

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|min)\s*$")


@dataclass(frozen=True)
class Budget:
    """How long a campaign generates: a wall time, or a number of scenarios."""

    seconds: float | None = None
    scenarios: int | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """``5m``, ``90s``, ``1h`` (wall time) or ``40`` (scenarios)."""
        text = str(text).strip()
        if text.isdigit() and int(text) > 0:
            return cls(scenarios=int(text))
        found = _DURATION.match(text)
        if found and float(found.group(1)) > 0:
            unit = {"s": 1, "m": 60, "min": 60, "h": 3600}[found.group(2)]
            return cls(seconds=float(found.group(1)) * unit)
        raise FtkitError(f"--budget {text!r}: give a wall time (90s, 5m, 1h) or a number of "
                         f"scenarios (40)")

    def __str__(self) -> str:
        if self.scenarios is not None:
            return f"{self.scenarios} scenarios"
        return f"{self.seconds:g} s"


@dataclass
class ExploreOptions:
    seed: int = 0
    budget: Budget = field(default_factory=lambda: Budget(scenarios=20))
    space: ExploreSpace = field(default_factory=ExploreSpace)
    #: Where shrunk failures are written as scenario files (``failures/``); none: not written.
    out_dir: Path | None = None
    use_cache: bool = True
    shrink: bool = True
    #: Examples per Hypothesis round.
    round_size: int = 25
    #: Wall time a round may spend shrinking its failures, from the first one; after it, the
    #: smallest failing scenario so far is reported (``Failure.shrink_complete`` false).
    shrink_budget_s: float = 240.0
    #: Engine hosts kept between scenarios (each engine configuration needs two: plain and
    #: with ftkit); none: as many as ``MEMORY_RANKS`` ranks of the largest tensor parallel
    #: size drawn.
    max_idle_hosts: int | None = None


def idle_hosts(options: ExploreOptions) -> int:
    """Engine hosts a campaign's runner keeps: ``options.max_idle_hosts``, or as many as
    ``MEMORY_RANKS`` ranks of its largest tensor parallel size."""
    return options.max_idle_hosts or max(2, MEMORY_RANKS // max(options.space.tp))


@dataclass
class CampaignEvent:
    """Progress of a campaign: ``run`` (a scenario ran), ``found`` (a new failure signature),
    ``shrunk`` (a failure's smallest scenario is known and written)."""

    kind: str
    run: ExploredRun | None = None
    failure: Failure | None = None
    detail: str = ""


class ExploreFailure(Exception):
    """Raised inside Hypothesis's test for a failing scenario; one subclass per signature."""


class _BudgetSpent(BaseException):
    """Ends a round that found nothing once the budget is spent. Not an ``Exception``:
    Hypothesis lets it through instead of taking it for a failure to shrink."""


class Campaign:
    """One campaign. ``run()`` returns its ``CampaignResult``; a Ctrl-C stops it early and the
    result (``stopped: interrupted``) holds what was found until then."""

    def __init__(self, options: ExploreOptions, *, execute: Execute | None = None,
                 on_event: Callable[[CampaignEvent], None] = lambda event: None) -> None:
        self.options = options
        self._execute_fn = execute
        self._on_event = on_event
        self._memo: dict[str, Outcome] = {}
        self._classes: dict[str, type[ExploreFailure]] = {}
        self._latest: dict[str, dict[str, Any]] = {}  # signature -> smallest failing mapping
        self._first: dict[str, tuple[int, dict[str, Any], Outcome]] = {}
        self._shrink_runs: dict[str, int] = {}
        self._known: set[str] = set()  # signatures found in earlier rounds
        self._round_failed: list[str] = []
        self._round_failed_at = 0.0
        self._cut: set[str] = set()  # signatures whose shrinking ran out of time
        self._started = 0.0
        self.result = CampaignResult(seed=options.seed, space=options.space.describe(),
                                     budget=str(options.budget), started_at=time.time(),
                                     out_dir=str(options.out_dir) if options.out_dir else None)

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> CampaignResult:
        self._started = time.monotonic()
        runner = None
        try:
            if self._execute_fn is None:
                from ftkit.runner.core import ScenarioRunner

                runner = ScenarioRunner(use_cache=self.options.use_cache,
                                        max_idle_hosts=idle_hosts(self.options))
                self._execute_fn = lambda scenario, file: runner.run(scenario, file=file)
                if self.options.space.prompt_tokens is None:
                    self.options.space = dataclasses.replace(
                        self.options.space, prompt_tokens=model_prompt_tokens())
            self._cover_each_kind_and_phase()
            round_no = 0
            while not self._spent():
                before = self.result.scenarios_run
                self._round(round_no)
                round_no += 1
                if self.result.scenarios_run == before and not self._round_failed \
                        and round_no > 3:
                    self.result.stopped = "space exhausted"  # rounds draw nothing new
                    break
            self._finish(runner)
        except KeyboardInterrupt:
            self.result.stopped = "interrupted"
            self._finish(None)
        finally:
            if runner is not None:
                runner.close()
            self.result.duration_s = time.monotonic() - self._started
        return self.result

    def _cover_each_kind_and_phase(self) -> None:
        """Before the search, the simplest scenario of each kind in each phase (one draw of a
        space narrowed to them, at the lowest tensor parallel size the kind runs at): a short
        campaign then covers every kind and phase, whatever its draws."""
        space = self.options.space
        for index, (kind, phase) in enumerate(
                (k, p) for k in space.kinds for p in space.phases):
            tp = tuple(t for t in space.tp if t > 1 or kind in space.kinds_for(1))
            if not tp or self._spent():
                continue
            narrow = dataclasses.replace(space, tp=tp, kinds=(kind,), phases=(phase,))
            self._round(-1 - index, space=narrow, examples=1)

    def _spent(self) -> bool:
        budget = self.options.budget
        if budget.scenarios is not None:
            return self.result.scenarios_run >= budget.scenarios
        return time.monotonic() - self._started >= (budget.seconds or 0.0)

    def _round(self, round_no: int, *, space: ExploreSpace | None = None,
               examples: int | None = None) -> None:
        self._round_failed = []
        self._round_failed_at = 0.0
        phases = [Phase.generate] + ([Phase.shrink] if self.options.shrink else [])
        config = settings(max_examples=examples or self.options.round_size, deadline=None,
                          database=None,
                          phases=phases, report_multiple_bugs=True, derandomize=False,
                          suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                          print_blob=False)
        test = seed(self.options.seed * 1_000_003 + round_no)(
            config(given(scenarios(space or self.options.space))(self._check)))
        try:
            test()
        except (Unsatisfiable, _BudgetSpent):
            pass  # the budget ran out
        except ExploreFailure:
            pass
        except BaseExceptionGroup as group:  # several signatures in one round
            _, rest = group.split(ExploreFailure)
            if rest is not None:
                raise rest
        self._known.update(self._round_failed)

    def _check(self, raw: dict[str, Any]) -> None:
        """Hypothesis's property: the scenario ``raw`` passes."""
        key = json.dumps(raw, sort_keys=True)
        outcome = self._memo.get(key)
        if outcome is None:
            if not self._round_failed and self._spent():
                raise _BudgetSpent  # generation is over (a round shrinking goes on)
            if self._round_failed and \
                    time.monotonic() - self._round_failed_at > self.options.shrink_budget_s:
                # Out of shrinking time: what was not run is not run; to Hypothesis it
                # passes, which ends the round with the smallest failures found so far.
                self._cut.update(self._round_failed)
                return
            outcome = self._execute(raw)
            if outcome is None:
                self.result.rejected += 1
                reject()
            self._memo[key] = outcome
        if outcome.failed and outcome.signature not in self._known:
            sig = outcome.signature
            if sig not in self._round_failed:
                if not self._round_failed:
                    self._round_failed_at = time.monotonic()
                self._round_failed.append(sig)
            self._latest[sig] = raw
            raise self._failure_class(sig)(sig)

    def _failure_class(self, signature: str) -> type[ExploreFailure]:
        if signature not in self._classes:
            self._classes[signature] = type(f"ExploreFailure{len(self._classes)}",
                                            (ExploreFailure,), {"signature": signature})
        return self._classes[signature]

    def _execute(self, raw: dict[str, Any]) -> Outcome | None:
        """Run one generated scenario; None when the draw is not a valid scenario."""
        index = len(self.result.runs)
        name = f"explore-s{self.options.seed}-{index:04d}"
        try:
            scenario = Scenario.model_validate({"name": name, **raw})
        except ScenarioErrors:
            return None
        shrinking = bool(self._round_failed)
        started = time.monotonic()
        try:
            outcome = Outcome.of(self._execute_fn(scenario, f"<explore {name}>"))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # an ftkit bug shows as a failure, with its class
            outcome = Outcome(Verdict.ERROR.value, type(exc).__name__, (),
                              f"the run raised {type(exc).__name__}: {exc}")
        run = ExploredRun(
            index=index, name=name, tp=raw["engine"]["tensor_parallel_size"],
            faults=[f"{f['kind']}/{f['phase']}" for f in raw["faults"]],
            features=features_of(raw), verdict=outcome.verdict, what=outcome.what,
            signature=outcome.signature if outcome.failed else None, reason=outcome.reason,
            duration_s=time.monotonic() - started, shrinking=shrinking)
        self.result.runs.append(run)
        for sig in self._round_failed:
            self._shrink_runs[sig] = self._shrink_runs.get(sig, 0) + int(shrinking)
        if outcome.failed and outcome.signature not in self._first:
            self._first[outcome.signature] = (index, raw, outcome)
            self._on_event(CampaignEvent("found", run=run, detail=outcome.signature))
        self._on_event(CampaignEvent("run", run=run))
        return outcome

    # --- the end ------------------------------------------------------------------------

    def _finish(self, runner: Any) -> None:
        """Coverage, the failures (merged, checked on a fresh engine, written)."""
        self.result.coverage = coverage(self.result.runs)
        failures = []
        for sig, (index, first, outcome) in self._first.items():
            smallest = self._latest.get(sig, first)
            failure = Failure(
                signature=sig, verdict=outcome.verdict, what=outcome.what, found_at=index,
                reason=self._memo[json.dumps(smallest, sort_keys=True)].reason,
                file=None, **_size(smallest), original=_size(first),
                shrink_runs=self._shrink_runs.get(sig, 0),
                shrink_complete=self.options.shrink and sig not in self._cut)
            failures.append((failure, smallest))
        kept = merge_subsumed([failure for failure, _ in failures])
        for failure, smallest in failures:
            if any(failure is k for k in kept):
                if runner is not None:
                    failure.reproduced = self._reproduces(runner, failure, smallest)
                failure.file = self._write(failure, smallest)
                self._on_event(CampaignEvent("shrunk", failure=failure))
        self.result.failures = kept

    def _reproduces(self, runner: Any, failure: Failure, raw: dict[str, Any]) -> bool:
        """Whether the shrunk scenario fails the same way alone, on a new engine: a run whose
        recovery failed may have left its kept engine damaged for the runs after it, which
        then fail for a reason that is not theirs."""
        name = f"explore-s{self.options.seed}-check"
        scenario = Scenario.model_validate({"name": name, **raw})
        try:
            result = runner.run(scenario, file=f"<explore {name}>", fresh_engine=True)
        except Exception:  # noqa: BLE001 - reported as not reproduced
            return False
        return Outcome.of(result).signature == failure.signature

    def _write(self, failure: Failure, raw: dict[str, Any]) -> str | None:
        if self.options.out_dir is None:
            return None
        folder = Path(self.options.out_dir) / "failures"
        folder.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "_", failure.signature.lower()).strip("_")[:80]
        name = f"explore_s{self.options.seed}_{slug}"
        path = folder / f"{name}.yaml"
        path.write_text(scenario_yaml(name, raw, failure, seed=self.options.seed))
        return str(path)


def _size(raw: dict[str, Any]) -> dict[str, Any]:
    workload = raw["workload"]
    lengths = [r["sampling"].get("max_tokens", workload["max_tokens"])
               for r in workload["requests"]]
    return {"tp": raw["engine"]["tensor_parallel_size"], "requests": len(lengths),
            "max_tokens": max(lengths),
            "faults": [f"{f['kind']}/{f['phase']}" for f in raw["faults"]],
            "features": features_of(raw)}


def merge_subsumed(failures: list[Failure]) -> list[Failure]:
    """Failures whose shrunk scenario holds another's faults and more, with the same verdict
    and field, are the same bug seen with an extra fault: report them once, under the one
    with fewer faults."""
    kept = []
    for failure in failures:
        smaller = next((other for other in failures if other is not failure
                        and (other.verdict, other.what) == (failure.verdict, failure.what)
                        and set(other.faults) < set(failure.faults)), None)
        if smaller is None:
            kept.append(failure)
        else:
            smaller.also_seen_as.append(failure.signature)
    return kept


def coverage(runs: list[ExploredRun]) -> list[CoverageCell]:
    """Generated runs (shrinking's excluded) counted by kind, phase, feature and tensor
    parallel size; a run counts once in every cell it touches."""
    cells: dict[tuple[str, str, str, int], CoverageCell] = {}
    for run in runs:
        if run.shrinking:
            continue
        touched = {(*fault.split("/", 1), feature, run.tp)
                   for fault in run.faults for feature in (run.features or ["none"])}
        for key in touched:
            cell = cells.setdefault(key, CoverageCell(*key))
            cell.runs += 1
            cell.failures += int(run.signature is not None)
            cell.not_fired += int(run.what == "not_fired")
    return sorted(cells.values(), key=lambda c: (c.kind, c.phase, c.feature, c.tp))


def _without_empty(value: Any) -> Any:
    """``value`` without the empty mappings it holds (``sampling: {}``, ``args: {}``)."""
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v != {}}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


def scenario_yaml(name: str, raw: dict[str, Any], failure: Failure, *, seed: int) -> str:
    """A scenario file for ``raw``, with what it showed in its description."""
    description = (f"Found by `ftkit explore --seed {seed}` and shrunk: {failure.signature}. "
                   f"{failure.reason}")
    document = {"name": name, "description": description, **_without_empty(raw)}
    return f"# Written by ftkit explore (seed {seed}); `ftkit run` reproduces it.\n" + \
        yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
