"""What a run produces: token streams, fired faults, recoveries, verdicts.

These are plain dataclasses with ``to_dict`` so the JSON report, the CLI and the pytest
plugin all read the same objects. Times are seconds; token times are measured from the
moment the workload was submitted to the engine.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftkit.contracts.job import EngineRestart


#: One position's top logprobs: ``[token id, logprob]`` pairs (lists, as JSON keeps them), in
#: vLLM's order (the sampled token first, then by rank).
PositionLogprobs = list[list[Any]]


@dataclass
class RequestOutput:
    """One completion of one request: its tokens, in order, with the time each arrived, and
    what the oracle compares besides them.

    ``sample`` tells the completions of a request with ``n > 1`` apart (vLLM's
    ``CompletionOutput.index``). ``logprobs`` holds the sampled token's logprob at each
    position (ftkit always asks vLLM for it); ``top_logprobs`` the top-k of each position when
    the request asks for ``logprobs: k > 0``; ``prompt_logprobs`` those of each prompt
    position when it asks for ``prompt_logprobs`` (the first position has none: ``None``).
    ``text`` is the finished text (vLLM's detokenized output), ``None`` until it finished.
    """

    index: int
    token_ids: list[int]
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    sample: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    text: str | None = None
    #: vLLM's ``stop_reason``: the stop string or token id that ended it, if one did.
    stop_reason: int | str | None = None

    @property
    def key(self) -> tuple[int, int]:
        """(request, sample): what identifies a completion in a run."""
        return (self.index, self.sample)


@dataclass
class FiredAt:
    request: int
    token: int
    step: int


@dataclass
class FaultRecord:
    """One scenario fault and what became of it."""

    kind: str
    rank: int | str
    request: int
    token: int
    phase: str
    times: int
    fired: bool = False
    fired_at: FiredAt | None = None
    #: Failing attempts the fault actually caused (a flap of 3 fires 3 times).
    attempts: int = 0
    recovered: bool = False
    recovery_s: float | None = None
    #: When the fault first fired, seconds after the workload was submitted.
    at_s: float | None = None
    #: For a fault that killed a process: how long the engine took to restart (part of
    #: ``recovery_s``, which runs from the kill until the requests were resumed).
    restart_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RecoveryRecord:
    """One coordinated recovery round, as the ranks agreed on it."""

    step: int
    kind: str
    decision: str  # "recompute" | "raise"
    attempt: int
    ranks: list[int]
    duration_s: float
    reason: str = ""
    #: When the round began, seconds after the workload was submitted.
    at_s: float | None = None


@dataclass
class RunOutput:
    """Everything one engine run of a workload produced."""

    requests: list[RequestOutput]
    faults: list[FaultRecord] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    #: The engine's error, if the run ended with one (the text the engine surfaced).
    error: str | None = None
    timed_out: bool = False
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    #: Wall-clock time (``time.time()``) when the workload was submitted: the zero of every
    #: token time, and the reference for the times of the ranks' event log.
    started_at: float | None = None
    from_cache: bool = False
    #: The run id the engine host gave the workload (fault events carry it).
    run_id: str | None = None
    #: Engine restarts after a process died, in order.
    restarts: list[EngineRestart] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


class Verdict(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    NOT_APPLIED = "not_applied"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass
class RequestComparison:
    index: int
    expected: list[int]
    actual: list[int]
    #: First token index where the streams differ (a missing token counts), else None.
    first_divergence: int | None
    #: When each actual token arrived, seconds after the workload was submitted.
    actual_times: list[float] = field(default_factory=list)


@dataclass
class ScenarioResult:
    """The verdict on one scenario with the evidence behind it."""

    name: str
    file: str
    verdict: Verdict
    reason: str
    duration_s: float
    requests: list[RequestComparison] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    error: str | None = None
    baseline_from_cache: bool = False
    tokens_per_s: float | None = None
    #: The scenario's engine settings (model as written, tensor parallel size, dtype, seed...)
    #: and its workload's sampling (max_tokens, temperature, top_p, seed).
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_compared(self) -> int:
        return sum(min(len(r.expected), len(r.actual)) for r in self.requests)

    @property
    def first_divergence(self) -> tuple[int, int] | None:
        """(request index, token index) of the earliest divergence, if any."""
        for r in self.requests:
            if r.first_divergence is not None:
                return (r.index, r.first_divergence)
        return None

    @property
    def reinferences(self) -> int:
        return sum(1 for r in self.recoveries if r.decision == "recompute")

    @property
    def recovery_s(self) -> float:
        return sum(r.duration_s for r in self.recoveries)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        d["tokens_compared"] = self.tokens_compared
        d["reinferences"] = self.reinferences
        d["recovery_s"] = self.recovery_s
        return d
