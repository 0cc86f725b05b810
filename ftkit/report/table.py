"""What every report shows of a scenario, shared by the CLI, JUnit and HTML reports.

The verdict table has one row per scenario: scenario, verdict, requests, tokens (compared),
divergence (the first difference from the baseline: "req R tok T" for a token id, with the
field named for another, as "req R tok T logprob"; see ``divergence_label``), faults
(fired/planned), re-inferences, recovery (total seconds). Around it: fault labels and
descriptions, the tokens around a divergence, and a serve scenario's client view
(``client_summary``).
"""

from __future__ import annotations

from ftkit.results import (
    FINISH_REASON,
    LOGPROBS,
    PROMPT_LOGPROBS,
    STOP_REASON,
    TEXT,
    TOP_LOGPROBS,
    ClientView,
    FaultRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)

__all__ = ["NONE", "TABLE_COLUMNS", "client_summary", "describe_fault", "divergence_label",
           "fault_label", "seconds_label", "table_cells", "tokens_around", "verdict_label"]

TABLE_COLUMNS = ("scenario", "verdict", "requests", "tokens", "divergence", "faults",
                 "re-inferences", "recovery")

#: What an empty cell shows.
NONE = "-"

_LABELS = {
    Verdict.PASS: "PASS",
    Verdict.FAIL: "FAIL",
    Verdict.NOT_APPLIED: "NOT APPLIED",
    Verdict.ERROR: "ERROR",
}


def verdict_label(verdict: Verdict | str) -> str:
    """How a verdict is written in tables: ``PASS``, ``FAIL``, ``NOT APPLIED``, ``ERROR``."""
    return _LABELS[Verdict(verdict)]


def table_cells(result: ScenarioResult) -> tuple[str, ...]:
    """The row of one scenario, one string per entry of ``TABLE_COLUMNS``."""
    diverged = result.first_mismatch
    fired = sum(1 for f in result.faults if f.fired)
    return (
        result.name,
        verdict_label(result.verdict),
        str(len({r.index for r in result.requests})),  # a request with n > 1 counts once
        str(result.tokens_compared),
        NONE if diverged is None else divergence_label(diverged),
        f"{fired}/{len(result.faults)}",
        str(result.reinferences),
        f"{result.recovery_s:.3f} s" if result.recoveries else NONE,
    )


#: How ``divergence_label`` names a field other than the token ids, after its position.
_FIELD_LABELS = {
    LOGPROBS: "logprob",
    TOP_LOGPROBS: "top-k",
    FINISH_REASON: "finish reason",
    STOP_REASON: "stop reason",
    TEXT: "text",
}


def divergence_label(comparison: RequestComparison) -> str:
    """Where a completion first differs, in a few words: ``req 1 tok 9`` (token id), ``req 2
    tok 14 logprob``, ``req 0 tok 3 top-k``, ``req 0 prompt 5`` (prompt logprobs), ``req 1
    finish reason``, ``req 1 stop reason``, ``req 1 text``; a second sample of a request is
    ``req 1 s1 ...``."""
    request = f"req {comparison.index}"
    if comparison.samples > 1 or comparison.sample:
        request += f" s{comparison.sample}"
    field = comparison.diverged_field
    if not comparison.beyond_token_ids:
        return f"{request} tok {comparison.first_divergence}"
    if field == PROMPT_LOGPROBS:
        return f"{request} prompt" + ("" if comparison.position is None
                                      else f" {comparison.position}")
    if field in (LOGPROBS, TOP_LOGPROBS):
        request += f" tok {comparison.position}"
    return f"{request} {_FIELD_LABELS.get(field, field)}"


def tokens_around(comparison: RequestComparison, context: int = 3
                  ) -> list[tuple[int, str, str]]:
    """``(token index, expected, actual)`` for the tokens around a request's first divergence.

    ``context`` tokens each side; a token a stream lacks is ``NONE``. Empty when the request
    does not diverge.
    """
    index = comparison.first_divergence
    if index is None:
        return []
    stop = min(max(len(comparison.expected), len(comparison.actual)), index + context + 1)
    return [(i, _token(comparison.expected, i), _token(comparison.actual, i))
            for i in range(max(0, index - context), max(stop, index + 1))]


def _token(tokens: list[int], index: int) -> str:
    return str(tokens[index]) if index < len(tokens) else NONE


def fault_label(fault: FaultRecord) -> str:
    """A short label: kind, rank and failing attempts, e.g. "oom rank 0, 2 attempts"."""
    attempts = "1 attempt" if fault.attempts == 1 else f"{fault.attempts} attempts"
    return f"{fault.kind} rank {fault.rank}, {attempts}"


def describe_fault(fault: FaultRecord) -> str:
    """One line on a fault: its trigger and what became of it."""
    trigger = (f"{fault.kind} on rank {fault.rank} at request {fault.request} token "
               f"{fault.token} (phase {fault.phase}, times {fault.times})")
    if not fault.fired:
        return f"{trigger}: did not fire"
    where = f" at step {fault.fired_at.step}" if fault.fired_at is not None else ""
    when = f", {fault.at_s:.3f} s into the workload" if fault.at_s is not None else ""
    if fault.recovered:
        took = f" in {fault.recovery_s:.3f} s" if fault.recovery_s is not None else ""
        if fault.restart_s is not None:
            took += f" (engine restart {fault.restart_s:.1f} s)"
        outcome = f"recovered{took}"
    else:
        outcome = "not recovered"
    return f"{trigger}: fired{where}{when}, {fault.attempts} attempt(s), {outcome}"


def seconds_label(seconds: float | None) -> str:
    """``1.234 s``, or ``NONE`` for a time not known."""
    return NONE if seconds is None else f"{seconds:.3f} s"


def client_summary(client: ClientView) -> str:
    """A serve scenario's client view in one line: the faulted run's streams, its longest time
    to first token, its largest gap between two tokens of a stream (and the fault-free run's),
    and the requests that failed or were retried (the clients never retry)."""
    background = sum(1 for s in client.run if s.background)
    streams = f"{len(client.run)} stream(s)" + (f", {background} of them background load"
                                               if background else "")
    return (f"clients ({client.api}): {streams}; first token within "
            f"{seconds_label(client.max_ttft_s)}; largest gap between two tokens "
            f"{seconds_label(client.max_gap_s)} (fault-free run: "
            f"{seconds_label(client.baseline_max_gap_s)}); failed requests "
            f"{client.failed_requests}, retried 0")
