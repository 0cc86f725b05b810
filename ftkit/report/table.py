"""What every report shows of a scenario, shared by the CLI, JUnit and HTML reports.

The verdict table has one row per scenario: scenario, verdict, requests, tokens (compared),
divergence (the first, as "req R tok T"), faults (fired/planned), re-inferences, recovery
(total seconds). Around it: fault labels and descriptions, and the tokens around a divergence.
"""

from __future__ import annotations

from ftkit.results import FaultRecord, RequestComparison, ScenarioResult, Verdict

__all__ = ["NONE", "TABLE_COLUMNS", "describe_fault", "fault_label", "table_cells",
           "tokens_around", "verdict_label"]

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
    divergence = result.first_divergence
    fired = sum(1 for f in result.faults if f.fired)
    return (
        result.name,
        verdict_label(result.verdict),
        str(len(result.requests)),
        str(result.tokens_compared),
        NONE if divergence is None else f"req {divergence[0]} tok {divergence[1]}",
        f"{fired}/{len(result.faults)}",
        str(result.reinferences),
        f"{result.recovery_s:.3f} s" if result.recoveries else NONE,
    )


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
