"""What a run produces: token streams, fired faults, recoveries, verdicts.

These are plain dataclasses with ``to_dict`` so the JSON report, the CLI and the pytest
plugin all read the same objects. Times are seconds; token times are measured from the
moment the workload was submitted to the engine.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
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


@dataclass
class StreamView:
    """One stream as a server's client saw it (``engine.mode: serve``). Times in seconds:
    ``ttft_s`` from the request's send to its first token, ``max_gap_s`` the longest wait
    between two streamed tokens (``None`` with fewer than two)."""

    request: int
    tokens: int
    ttft_s: float | None = None
    max_gap_s: float | None = None
    #: A background stream: load beside the workload, its output not compared.
    background: bool = False
    #: What ended the stream early (the client's error), ``None`` when it finished.
    error: str | None = None


@dataclass
class ClientView:
    """The client's view of a serve scenario's runs (``engine.mode: serve``): every stream
    of the fault-free run and of the faulted run. The clients never retry (a retry would hide
    a failure from the oracle), so a failed request is one whose stream ended with an error."""

    api: str
    run: list[StreamView] = field(default_factory=list)
    baseline: list[StreamView] = field(default_factory=list)

    @staticmethod
    def _largest(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    @property
    def max_ttft_s(self) -> float | None:
        """The longest time to first token of the faulted run's streams."""
        return self._largest([s.ttft_s for s in self.run])

    @property
    def max_gap_s(self) -> float | None:
        """The longest gap between two tokens of one stream in the faulted run."""
        return self._largest([s.max_gap_s for s in self.run])

    @property
    def baseline_max_gap_s(self) -> float | None:
        return self._largest([s.max_gap_s for s in self.baseline])

    @property
    def failed_requests(self) -> int:
        """Streams of the faulted run (background ones included) that ended with an error."""
        return sum(1 for s in self.run if s.error is not None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(max_ttft_s=self.max_ttft_s, max_gap_s=self.max_gap_s,
                 baseline_max_gap_s=self.baseline_max_gap_s,
                 failed_requests=self.failed_requests, retried_requests=0)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClientView:
        names = {f.name for f in fields(StreamView)}

        def streams(key: str) -> list[StreamView]:
            return [StreamView(**{k: v for k, v in s.items() if k in names})
                    for s in raw.get(key) or []]

        return cls(api=str(raw.get("api", "")), run=streams("run"),
                   baseline=streams("baseline"))


class Verdict(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    NOT_APPLIED = "not_applied"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


# The fields ``ftkit.verify`` compares, by ``RequestOutput``'s names: the values of
# ``RequestComparison.diverged_field``.
TOKEN_IDS = "token_ids"
LOGPROBS = "logprobs"
TOP_LOGPROBS = "top_logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
FINISH_REASON = "finish_reason"
STOP_REASON = "stop_reason"
TEXT = "text"


@dataclass
class RequestComparison:
    """One completion of the run against the baseline's: its token ids, and the first field
    that differs (``ftkit.verify`` decides which fields are compared, and in what order).

    ``diverged_field`` names the first difference by ``RequestOutput``'s field names
    (``token_ids``, ``logprobs``, ``top_logprobs``, ``prompt_logprobs``, ``finish_reason``,
    ``stop_reason``, ``text``); ``position`` is where it is: a token index (token ids,
    logprobs, top-k logprobs), a prompt position (prompt logprobs), a character (text), or
    None (finish and stop reason, missing prompt logprobs). ``expected_value`` and
    ``actual_value`` are the two values there (for top-k and prompt logprobs the whole
    position's ``[token id, logprob]`` pairs; for text a few characters around the
    difference), ``detail`` the sentence that names it."""

    index: int
    expected: list[int]
    actual: list[int]
    #: First token index where the token ids differ (a missing token counts), else None.
    first_divergence: int | None
    #: When each actual token arrived, seconds after the workload was submitted.
    actual_times: list[float] = field(default_factory=list)
    #: Which completion of the request (``RequestOutput.sample``), and how many it has.
    sample: int = 0
    samples: int = 1
    diverged_field: str | None = None
    position: int | None = None
    expected_value: Any = None
    actual_value: Any = None
    detail: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        """(request, sample), as ``RequestOutput.key``."""
        return (self.index, self.sample)

    @property
    def name(self) -> str:
        """``request 2``, or ``request 2 sample 1`` for a request with several completions."""
        several = self.samples > 1 or self.sample != 0
        return f"request {self.index}" + (f" sample {self.sample}" if several else "")

    @property
    def beyond_token_ids(self) -> bool:
        """True when the first difference is in a field other than the token ids (its two
        values say more than the tokens around it)."""
        return self.diverged_field not in (None, TOKEN_IDS)

    @property
    def matches(self) -> bool:
        """True when nothing compared differs (older journals know token ids only)."""
        return self.diverged_field is None and self.first_divergence is None


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
    #: A serve scenario's client view (time to first token, token gaps, failed requests);
    #: ``None`` for an offline run.
    client: ClientView | None = None

    @property
    def tokens_compared(self) -> int:
        return sum(min(len(r.expected), len(r.actual)) for r in self.requests)

    @property
    def first_divergence(self) -> tuple[int, int] | None:
        """(request index, token index) of the first request whose token ids diverge, if any."""
        for r in self.requests:
            if r.first_divergence is not None:
                return (r.index, r.first_divergence)
        return None

    @property
    def first_mismatch(self) -> RequestComparison | None:
        """The first completion that differs from the baseline in any compared field."""
        return next((r for r in self.requests if not r.matches), None)

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
        d["client"] = self.client.to_dict() if self.client is not None else None
        return d
