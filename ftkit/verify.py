"""Token-stream comparison and verdicts: the scenario engine's oracle.

The oracle is the fault-free run (the *baseline*) of the same workload on the same engine
configuration. ``verify`` compares a scenario's run with it and returns a
:class:`~ftkit.results.ScenarioResult`. The rules, in the order they are applied (the first
one that decides wins):

1. **error: unusable baseline.** The baseline ended with an error or timed out, or the run
   reports a request the baseline does not have. There is nothing trustworthy to compare with.
2. **error / fail: timeout.** The run timed out. If every fault fired and the scenario expects
   ``outcome: failed``, the verdict is *fail* (the fault hung the engine instead of surfacing
   as an error); otherwise it is *error* (the run never got to a verdict).
3. **error: could not run.** The scenario expects ``outcome: recovered``, the run ended with an
   error, no fault fired and no token was produced: the engine did not run at all.
4. **not_applied.** A scenario fault did not fire (``fired=False``, or the run recorded no
   record for it). A fault that silently did nothing is never a pass; the reason names the
   fault (its position, kind, rank and trigger).
5. For ``expect.outcome: recovered``:

   a. **fail** if the run ended with an error (the fault was not recovered);
   b. **fail** if a request's tokens differ from the baseline's within the compared window
      (below); the reason names the first divergence: request, token index, expected and
      actual token id;
   c. **fail** if a recovery round took longer than ``expect.max_recovery_s``;
   d. otherwise **pass**.

6. For ``expect.outcome: failed``:

   a. **fail** if the run ended without an error (the fault was swallowed);
   b. **fail** if a token produced before the error differs from the baseline's within the
      compared window (below), with the first divergence in the reason;
   c. otherwise **pass**.

Any exception raised while applying these rules gives verdict **error** with the exception
in the reason: ``verify`` itself never raises for a malformed run.

The compared window of a request (what ``RequestComparison.first_divergence`` is about):

* ``outcome: recovered, tokens: identical``: the whole stream; a missing or extra token is a
  divergence.
* ``outcome: recovered, tokens: prefix``: the first ``F`` tokens, where ``F`` is the smallest
  trigger token index among the scenario's faults; a stream shorter than that diverges at its
  end.
* ``outcome: failed, tokens: prefix``: the first ``min(F, produced)`` tokens: a request that
  stopped early is compared on what it produced.
* ``outcome: failed, tokens: identical``: every token the request produced (the stream must be
  a prefix of the baseline's: no wrong token was emitted before the error surfaced).

The runner records one :class:`~ftkit.results.FaultRecord` per scenario fault, in scenario
order; ``verify`` relies on that order to say which fault did not fire.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.results import (
    FaultRecord,
    RecoveryRecord,
    RequestComparison,
    RequestOutput,
    RunOutput,
    ScenarioResult,
    Verdict,
)

__all__ = ["compare_tokens", "describe_divergence", "planned_faults", "verify"]

OUTCOME_RECOVERED = "recovered"
OUTCOME_FAILED = "failed"
TOKENS_IDENTICAL = "identical"
TOKENS_PREFIX = "prefix"


# --- token comparison -----------------------------------------------------------------------

def compare_tokens(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Index of the first token where ``actual`` differs from ``expected``, or ``None``.

    A missing or an extra token counts as a difference: if one stream is a strict prefix of
    the other, the answer is the length of the shorter one.
    """
    for index, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return index
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None


def describe_divergence(comparison: RequestComparison) -> str:
    """One sentence naming where a request's stream diverges (request, token, expected, got)."""
    index = comparison.first_divergence
    if index is None:
        return f"request {comparison.index} matches the baseline"
    want = _token_at(comparison.expected, index, "end of stream")
    got = _token_at(comparison.actual, index, "end of stream")
    return f"request {comparison.index} diverges at token {index}: expected {want}, got {got}"


def _token_at(tokens: Sequence[int], index: int, missing: str) -> str:
    return str(tokens[index]) if index < len(tokens) else missing


# --- the verdict ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Decision:
    verdict: Verdict
    reason: str


def verify(scenario: Any, baseline: RunOutput, run: RunOutput, *, file: str,
           duration_s: float) -> ScenarioResult:
    """The verdict on one scenario run, with the evidence behind it.

    ``scenario`` is a loaded :class:`ftkit.scenario.Scenario` (only ``name``, ``faults`` and
    ``expect`` are read). ``duration_s`` is the wall time of the whole scenario (baseline
    included), reported as is. Never raises: a problem while verifying is verdict ``error``.
    """
    result = ScenarioResult(
        name=str(scenario.name),
        file=file,
        verdict=Verdict.ERROR,
        reason="",
        duration_s=duration_s,
        recoveries=list(run.recoveries),
        error=run.error,
        baseline_from_cache=baseline.from_cache,
        tokens_per_s=_tokens_per_s(run),
        engine=_engine_settings(scenario),
        sampling=_sampling_settings(scenario),
    )
    try:
        result.faults = _fault_records(scenario, run)
        result.requests = _compare_requests(scenario, baseline, run)
        decision = _decide(scenario, baseline, run, result)
    except Exception as exc:  # a malformed run must still get a verdict
        decision = _Decision(Verdict.ERROR,
                             f"internal error while verifying: {type(exc).__name__}: {exc}")
    result.verdict = decision.verdict
    result.reason = decision.reason
    return result


def _decide(scenario: Any, baseline: RunOutput, run: RunOutput,
            result: ScenarioResult) -> _Decision:
    outcome = _expected_outcome(scenario)
    for rule in (_unusable_baseline, _timed_out, _could_not_run, _not_applied):
        decision = rule(scenario, baseline, run, result)
        if decision is not None:
            return decision
    if outcome == OUTCOME_FAILED:
        return _judge_expected_failure(run, result)
    return _judge_expected_recovery(scenario, run, result)


# Each rule returns a decision when it applies, None to let the next rule speak.

def _unusable_baseline(scenario: Any, baseline: RunOutput, run: RunOutput,
                       result: ScenarioResult) -> _Decision | None:
    if baseline.timed_out:
        return _Decision(Verdict.ERROR, "the fault-free baseline run timed out")
    if baseline.error is not None:
        return _Decision(Verdict.ERROR, f"the fault-free baseline run failed: {baseline.error}")
    known = {r.index for r in baseline.requests}
    extra = sorted(r.index for r in run.requests if r.index not in known)
    if extra:
        return _Decision(Verdict.ERROR, f"the run reports request(s) {_join(extra)} that the "
                                        "baseline does not have")
    return None


def _timed_out(scenario: Any, baseline: RunOutput, run: RunOutput,
               result: ScenarioResult) -> _Decision | None:
    if not run.timed_out:
        return None
    bound = _expect_field(scenario, "timeout_s")
    after = f" after {bound:g} s" if isinstance(bound, (int, float)) else ""
    if _expected_outcome(scenario) == OUTCOME_FAILED and _unfired(result.faults) is None:
        return _Decision(Verdict.FAIL, f"the run timed out{after} instead of surfacing the "
                                       "fault as an error")
    return _Decision(Verdict.ERROR, f"the run timed out{after}")


def _could_not_run(scenario: Any, baseline: RunOutput, run: RunOutput,
                   result: ScenarioResult) -> _Decision | None:
    if _expected_outcome(scenario) != OUTCOME_RECOVERED or run.error is None:
        return None
    if any(f.fired for f in result.faults) or run.total_tokens > 0:
        return None
    return _Decision(Verdict.ERROR, f"the run could not run: {run.error}")


def _not_applied(scenario: Any, baseline: RunOutput, run: RunOutput,
                 result: ScenarioResult) -> _Decision | None:
    position = _unfired(result.faults)
    if position is None:
        return None
    reason = f"fault {position} ({_describe_fault(result.faults[position])}) did not fire"
    if run.error is not None:
        reason += f"; the run ended with an error: {run.error}"
    return _Decision(Verdict.NOT_APPLIED, reason)


def _judge_expected_recovery(scenario: Any, run: RunOutput,
                             result: ScenarioResult) -> _Decision:
    if run.error is not None:
        return _Decision(Verdict.FAIL, f"expected recovery, but the run failed: {run.error}")
    diverged = _first_diverged(result.requests)
    if diverged is not None:
        return _Decision(Verdict.FAIL, describe_divergence(diverged))
    slow = _slow_recovery(run.recoveries, _expect_field(scenario, "max_recovery_s"))
    if slow is not None:
        return _Decision(Verdict.FAIL, slow)
    return _Decision(Verdict.PASS, _pass_reason(result))


def _judge_expected_failure(run: RunOutput, result: ScenarioResult) -> _Decision:
    if run.error is None:
        return _Decision(Verdict.FAIL, "expected the fault to surface as an error, but the run "
                                       "succeeded")
    diverged = _first_diverged(result.requests)
    if diverged is not None:
        return _Decision(Verdict.FAIL, f"before the error: {describe_divergence(diverged)}")
    return _Decision(Verdict.PASS, f"the fault surfaced as expected: {run.error}")


def _slow_recovery(recoveries: Sequence[RecoveryRecord], bound: Any) -> str | None:
    if not isinstance(bound, (int, float)):
        return None
    for round_ in recoveries:
        if round_.duration_s > bound:
            return (f"recovery of step {round_.step} ({round_.kind}, attempt {round_.attempt}) "
                    f"took {round_.duration_s:.3f} s, over max_recovery_s {bound:g} s")
    return None


def _pass_reason(result: ScenarioResult) -> str:
    fired = sum(1 for f in result.faults if f.fired)
    return (f"{len(result.requests)} request(s) match the baseline; {fired} fault(s) fired, "
            f"{result.reinferences} re-inference(s)")


# --- request comparisons --------------------------------------------------------------------

def _compare_requests(scenario: Any, baseline: RunOutput,
                      run: RunOutput) -> list[RequestComparison]:
    """One comparison per baseline request, in baseline order; a missing request is empty."""
    produced = {r.index: r for r in run.requests}
    outcome = _expected_outcome(scenario)
    mode = _token_mode(scenario)
    fault_token = _first_fault_token(scenario)
    comparisons = []
    for expected in baseline.requests:
        actual = produced.get(expected.index, RequestOutput(index=expected.index, token_ids=[]))
        window = _window(outcome, mode, fault_token, len(actual.token_ids))
        comparisons.append(_compare(expected, actual, window))
    return comparisons


def _window(outcome: str, mode: str, fault_token: int | None, produced: int) -> int | None:
    """How many leading tokens of a request are compared; ``None`` for the whole stream."""
    limit = fault_token if mode == TOKENS_PREFIX else None
    if outcome == OUTCOME_FAILED:
        return produced if limit is None else min(limit, produced)
    return limit


def _compare(expected: RequestOutput, actual: RequestOutput,
             window: int | None) -> RequestComparison:
    want, got = list(expected.token_ids), list(actual.token_ids)
    cut_want = want if window is None else want[:window]
    cut_got = got if window is None else got[:window]
    return RequestComparison(index=expected.index, expected=want, actual=got,
                             first_divergence=compare_tokens(cut_want, cut_got),
                             actual_times=list(actual.token_times))


def _first_diverged(comparisons: Sequence[RequestComparison]) -> RequestComparison | None:
    return next((c for c in comparisons if c.first_divergence is not None), None)


# --- faults ---------------------------------------------------------------------------------

def planned_faults(scenario: Any) -> list[FaultRecord]:
    """One unfired record per scenario fault, in scenario order (for runs that never ran)."""
    return [_unfired_record(fault) for fault in scenario.faults]


def _fault_records(scenario: Any, run: RunOutput) -> list[FaultRecord]:
    """The run's fault records, completed with an unfired record for each one it lacks."""
    records = list(run.faults)
    return records + planned_faults(scenario)[len(records):]


def _unfired_record(fault: Any) -> FaultRecord:
    at = getattr(fault, "at", None)
    return FaultRecord(
        kind=_text(fault.kind),
        rank=fault.rank if isinstance(fault.rank, int) else _text(fault.rank),
        request=int(getattr(at, "request", 0) or 0),
        token=int(getattr(at, "token", 0) or 0),
        phase=_text(getattr(fault, "phase", "")),
        times=int(getattr(fault, "times", 1) or 1),
    )


def _unfired(records: Sequence[FaultRecord]) -> int | None:
    return next((i for i, f in enumerate(records) if not f.fired), None)


def _describe_fault(record: FaultRecord) -> str:
    return (f"{record.kind} on rank {record.rank} at request {record.request} "
            f"token {record.token}, phase {record.phase}")


def _first_fault_token(scenario: Any) -> int | None:
    tokens = [at.token for f in scenario.faults
              if (at := getattr(f, "at", None)) is not None and at.token is not None]
    return min(tokens) if tokens else None


# --- scenario fields ------------------------------------------------------------------------

def _expected_outcome(scenario: Any) -> str:
    return _text(_expect_field(scenario, "outcome") or OUTCOME_RECOVERED)


def _token_mode(scenario: Any) -> str:
    return _text(_expect_field(scenario, "tokens") or TOKENS_IDENTICAL)


def _expect_field(scenario: Any, name: str) -> Any:
    return getattr(getattr(scenario, "expect", None), name, None)


def _text(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def _engine_settings(scenario: Any) -> dict[str, Any]:
    engine_key = getattr(scenario, "engine_key", None)
    return dict(engine_key()) if callable(engine_key) else {}


def _sampling_settings(scenario: Any) -> dict[str, Any]:
    w = getattr(scenario, "workload", None)
    if w is None:
        return {}
    return {name: getattr(w, name, None) for name in ("max_tokens", "temperature", "top_p",
                                                      "seed")}


def _tokens_per_s(run: RunOutput) -> float | None:
    return run.total_tokens / run.generate_s if run.generate_s > 0 else None


def _join(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)
