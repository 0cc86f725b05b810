"""Completion comparison and verdicts: the scenario engine's oracle.

The oracle is the fault-free run (the *baseline*) of the same workload on the same engine
configuration. ``verify`` compares a scenario's run with it and returns a
:class:`~ftkit.results.ScenarioResult`. The rules, in the order they are applied (the first
one that decides wins):

1. **error: unusable baseline.** The baseline ended with an error or timed out, or the run
   reports a completion (request, sample) the baseline does not have. There is nothing
   trustworthy to compare with.
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
   b. **fail** if a completion differs from the baseline's within the compared window
      (below); the reason names the first difference: completion, position and field;
   c. **fail** if, with ``recovery.enabled``, a fault fired but nothing recovered it: no
      recovery round ran at the step where it fired, or, for a fault that ends a process
      (``process_kill``), no engine restart resumed the requests;
   d. **fail** if a recovery round took longer than ``expect.max_recovery_s``;
   e. otherwise **pass**.

6. For ``expect.outcome: failed``:

   a. **fail** if the run ended without an error (the fault was swallowed);
   b. **fail** if a completion differs from the baseline's before the error, within the
      compared window (below), with the first difference in the reason;
   c. otherwise **pass**.

Any exception raised while applying these rules gives verdict **error** with the exception
in the reason: ``verify`` itself never raises for a malformed run.

What is compared, per completion (key ``(request, sample)``: a request with ``n > 1`` has
several), in this order, the first difference being the one reported:

* the prompt logprobs, where the baseline has them (they come with the first token: only
  when the window includes token 0 and the run produced it);
* then position by position through the window: the logprob of the sampled token, the top-k
  logprobs where the baseline has them (``[token id, logprob]`` pairs in vLLM's order), and
  the token id; logprobs are compared up to the first differing token id;
* only when the whole stream is compared and the baseline's completion finished: the finish
  reason, the stop reason and the finished text.

Logprobs are compared exactly: bit for bit, except that ``-0.0`` equals ``0.0``; ``-inf``
equals ``-inf``, and a NaN equals only a NaN of the same bits. ``expect.logprob_tolerance``
(default 0) allows an absolute difference, for a dtype or platform that is not bit-exact.

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
import math
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.kinds import kind_spec
from ftkit.results import (
    FINISH_REASON,
    LOGPROBS,
    PROMPT_LOGPROBS,
    STOP_REASON,
    TEXT,
    TOKEN_IDS,
    TOP_LOGPROBS,
    FaultRecord,
    PositionLogprobs,
    RecoveryRecord,
    RequestComparison,
    RequestOutput,
    RunOutput,
    ScenarioResult,
    Verdict,
)

__all__ = ["compare_completion", "compare_tokens", "describe_divergence", "planned_faults",
           "same_logprob", "verify"]

OUTCOME_RECOVERED = "recovered"
OUTCOME_FAILED = "failed"
TOKENS_IDENTICAL = "identical"
TOKENS_PREFIX = "prefix"

#: Characters of text shown each side of where two texts differ.
TEXT_CONTEXT = 20


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


def same_logprob(expected: float, actual: float, tolerance: float = 0.0) -> bool:
    """Whether two logprobs are the same: equal (``-inf`` equals ``-inf``), both NaN with
    the same bits, or finite and at most ``tolerance`` apart."""
    if math.isnan(expected) or math.isnan(actual):
        return _bits(expected) == _bits(actual)
    return expected == actual or abs(expected - actual) <= tolerance


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def describe_divergence(comparison: RequestComparison) -> str:
    """One sentence naming where a completion first differs from the baseline: completion,
    position, field and the two values (for token ids: expected and actual token id)."""
    if comparison.detail:
        return comparison.detail
    index = comparison.first_divergence
    if index is None:
        return f"{comparison.name} matches the baseline"
    return _token_sentence(comparison.name, comparison.expected, comparison.actual, index)


def _token_sentence(name: str, expected: Sequence[int], actual: Sequence[int],
                    index: int) -> str:
    want = _token_at(expected, index, "end of stream")
    got = _token_at(actual, index, "end of stream")
    return f"{name} diverges at token {index}: expected {want}, got {got}"


def _token_at(tokens: Sequence[int], index: int, missing: str) -> str:
    return str(tokens[index]) if index < len(tokens) else missing


# --- completion comparison ------------------------------------------------------------------

@dataclass(frozen=True)
class _Mismatch:
    """The first difference of a completion (``RequestComparison``'s fields of that name)."""

    field: str
    position: int | None
    expected: Any
    actual: Any
    detail: str


class _Missing:
    """A value the run lacks where the baseline has one."""

    def __repr__(self) -> str:
        return "missing"


_MISSING: Any = _Missing()


def compare_completion(expected: RequestOutput, actual: RequestOutput,
                       window: int | None = None, *, samples: int = 1,
                       tolerance: float = 0.0) -> RequestComparison:
    """Compare one completion of the run with the baseline's (the rules of the module
    docstring). ``window``: how many leading tokens are compared (``None``: the whole stream,
    and then the finish reason, stop reason and text too); ``samples``: the request's number
    of completions (named in the sentence when more than one); ``tolerance``: the absolute
    difference allowed between two logprobs."""
    want, got = list(expected.token_ids), list(actual.token_ids)
    cut_want = want if window is None else want[:window]
    cut_got = got if window is None else got[:window]
    comparison = RequestComparison(index=expected.index, expected=want, actual=got,
                                   first_divergence=compare_tokens(cut_want, cut_got),
                                   actual_times=list(actual.token_times),
                                   sample=expected.sample, samples=samples)
    mismatch = _first_mismatch(expected, actual, window, comparison, tolerance)
    if mismatch is not None:
        comparison.diverged_field = mismatch.field
        comparison.position = mismatch.position
        comparison.expected_value = mismatch.expected
        comparison.actual_value = mismatch.actual
        comparison.detail = mismatch.detail
    return comparison


def _first_mismatch(expected: RequestOutput, actual: RequestOutput, window: int | None,
                    comparison: RequestComparison, tolerance: float) -> _Mismatch | None:
    name, divergence = comparison.name, comparison.first_divergence
    # Prompt logprobs come with the first token: without it, its absence is the difference.
    if comparison.actual and (window is None or window > 0):
        found = _prompt_mismatch(expected, actual, name, tolerance)
        if found is not None:
            return found
    compared = len(comparison.expected) if window is None else min(window,
                                                                   len(comparison.expected))
    # Past the first differing token id the logprobs are those of other tokens.
    for position in range(compared if divergence is None else divergence):
        found = (_logprob_mismatch(expected, actual, position, name, tolerance)
                 or _top_mismatch(expected, actual, position, name, tolerance))
        if found is not None:
            return found
    if divergence is not None:
        return _Mismatch(TOKEN_IDS, divergence, _item(comparison.expected, divergence),
                         _item(comparison.actual, divergence),
                         _token_sentence(name, comparison.expected, comparison.actual,
                                         divergence))
    if window is None and expected.finish_reason is not None:
        return _ending_mismatch(expected, actual, name)
    return None


def _logprob_mismatch(expected: RequestOutput, actual: RequestOutput, position: int,
                      name: str, tolerance: float) -> _Mismatch | None:
    want = _item(expected.logprobs, position)
    if want is None:  # the baseline has no logprob here: nothing to compare
        return None
    got = _item(actual.logprobs, position)
    if got is not None and same_logprob(want, got, tolerance):
        return None
    return _Mismatch(LOGPROBS, position, want, got,
                     f"logprob drift at {name}, token {position}: {want!r} vs "
                     f"{_shown(got)}{_allowing(tolerance)}")


def _top_mismatch(expected: RequestOutput, actual: RequestOutput, position: int, name: str,
                  tolerance: float) -> _Mismatch | None:
    want = _item(expected.top_logprobs, position)
    if want is None:
        return None
    got = _item(actual.top_logprobs, position)
    rank = _differing_rank(want, got, tolerance)
    if rank is None:
        return None
    return _Mismatch(TOP_LOGPROBS, position, want, got,
                     f"top-k logprobs differ at {name}, token {position}, rank {rank}: "
                     f"{_shown(_item(want, rank))} vs {_shown(_item(got, rank))}"
                     f"{_allowing(tolerance)}")


def _prompt_mismatch(expected: RequestOutput, actual: RequestOutput, name: str,
                     tolerance: float) -> _Mismatch | None:
    wanted = expected.prompt_logprobs
    if wanted is None:
        return None
    got_all = actual.prompt_logprobs
    if got_all is None:
        return _Mismatch(PROMPT_LOGPROBS, None, None, None,
                         f"prompt logprobs missing at {name}: the baseline has "
                         f"{len(wanted)} prompt position(s), the run none")
    for position in range(max(len(wanted), len(got_all))):
        want = wanted[position] if position < len(wanted) else _MISSING
        got = got_all[position] if position < len(got_all) else _MISSING
        if want is None and got is None:  # the first prompt position has none
            continue
        where = f"prompt logprobs differ at {name}, prompt position {position}"
        if isinstance(want, list) and isinstance(got, list):
            rank = _differing_rank(want, got, tolerance)
            if rank is None:
                continue
            detail = (f"{where}, rank {rank}: {_shown(_item(want, rank))} vs "
                      f"{_shown(_item(got, rank))}{_allowing(tolerance)}")
        else:
            detail = f"{where}: {want!r} vs {got!r}"
        return _Mismatch(PROMPT_LOGPROBS, position, _value(want), _value(got), detail)
    return None


def _differing_rank(expected: PositionLogprobs, actual: PositionLogprobs | None,
                    tolerance: float) -> int | None:
    """The first rank where two positions' ``[token id, logprob]`` pairs differ, or None."""
    if actual is None:
        return 0
    for rank in range(max(len(expected), len(actual))):
        if rank >= len(expected) or rank >= len(actual):
            return rank
        (want_token, want), (got_token, got) = expected[rank], actual[rank]
        if want_token != got_token or not same_logprob(want, got, tolerance):
            return rank
    return None


def _ending_mismatch(expected: RequestOutput, actual: RequestOutput,
                     name: str) -> _Mismatch | None:
    """The finish reason, stop reason and text of a finished completion."""
    if actual.finish_reason != expected.finish_reason:
        return _Mismatch(FINISH_REASON, None, expected.finish_reason, actual.finish_reason,
                         f"finish reason differs at {name}: {expected.finish_reason!r} vs "
                         f"{actual.finish_reason!r}")
    if actual.stop_reason != expected.stop_reason:
        return _Mismatch(STOP_REASON, None, expected.stop_reason, actual.stop_reason,
                         f"stop reason differs at {name}: {expected.stop_reason!r} vs "
                         f"{actual.stop_reason!r}")
    if expected.text is None or actual.text == expected.text:
        return None
    if actual.text is None:
        return _Mismatch(TEXT, None, _around(expected.text, 0), None,
                         f"text differs at {name}: {_around(expected.text, 0)!r} vs none")
    at = _first_difference(expected.text, actual.text)
    want, got = _around(expected.text, at), _around(actual.text, at)
    return _Mismatch(TEXT, at, want, got,
                     f"text differs at {name}, character {at}: {want!r} vs {got!r}")


def _first_difference(expected: str, actual: str) -> int:
    for index, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return index
    return min(len(expected), len(actual))


def _around(text: str, index: int) -> str:
    return text[max(0, index - TEXT_CONTEXT):index + TEXT_CONTEXT]


def _item(values: Sequence[Any] | None, index: int) -> Any:
    """``values[index]``, or None where the list or the item is missing."""
    return values[index] if values is not None and index < len(values) else None


def _shown(value: Any) -> str:
    return "missing" if value is None or value is _MISSING else repr(value)


def _value(value: Any) -> Any:
    """A value for the report: ``None`` for one that is missing."""
    return None if value is _MISSING else value


def _allowing(tolerance: float) -> str:
    return f" (logprob_tolerance {tolerance!r})" if tolerance else ""


# --- the verdict ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Decision:
    verdict: Verdict
    reason: str


def verify(scenario: Any, baseline: RunOutput, run: RunOutput, *, file: str,
           duration_s: float) -> ScenarioResult:
    """The verdict on one scenario run, with the evidence behind it.

    ``scenario`` is a loaded :class:`ftkit.scenario.Scenario` (for the verdict only
    ``name``, ``faults``, ``expect`` and ``recovery.enabled`` are read). ``duration_s`` is the
    wall time of the whole scenario (baseline included), reported as is. Never raises: a
    problem while verifying is verdict ``error``.
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
    known = {r.key for r in baseline.requests}
    extra = sorted(r.key for r in run.requests if r.key not in known)
    if extra:
        names = ", ".join(str(index) if sample == 0 else f"{index} sample {sample}"
                          for index, sample in extra)
        return _Decision(Verdict.ERROR, f"the run reports request(s) {names} that the "
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
    diverged = result.first_mismatch
    if diverged is not None:
        return _Decision(Verdict.FAIL, describe_divergence(diverged))
    unrecovered = _unrecovered_fault(scenario, run, result.faults)
    if unrecovered is not None:
        return _Decision(Verdict.FAIL, unrecovered)
    slow = _slow_recovery(run.recoveries, _expect_field(scenario, "max_recovery_s"))
    if slow is not None:
        return _Decision(Verdict.FAIL, slow)
    return _Decision(Verdict.PASS, _pass_reason(result))


def _judge_expected_failure(run: RunOutput, result: ScenarioResult) -> _Decision:
    if run.error is None:
        return _Decision(Verdict.FAIL, "expected the fault to surface as an error, but the run "
                                       "succeeded")
    diverged = result.first_mismatch
    if diverged is not None:
        return _Decision(Verdict.FAIL, f"before the error: {describe_divergence(diverged)}")
    return _Decision(Verdict.PASS, f"the fault surfaced as expected: {run.error}")


def _unrecovered_fault(scenario: Any, run: RunOutput,
                       faults: Sequence[FaultRecord]) -> str | None:
    """The first fired fault that nothing recovered, named, with recovery on; else None.

    A fault is recovered in place by a recovery round at the step where it fired; a fault
    that ends a process, by an engine restart that resumed the requests (its record's
    ``restart_s``). A fault that fired without either was absorbed somewhere it should not
    have been, however right the tokens look."""
    if not getattr(getattr(scenario, "recovery", None), "enabled", True):
        return None
    round_steps = {r.step for r in run.recoveries}
    for position, fault in enumerate(faults):
        if not fault.fired:
            continue
        if kind_spec(fault.kind).ends_process:
            if fault.recovered and fault.restart_s is not None:
                continue
            missing = "no engine restart resumed the requests"
        else:
            step = fault.fired_at.step if fault.fired_at is not None else None
            if (step in round_steps) if step is not None else bool(round_steps):
                continue
            missing = "no recovery round ran" + (f" at step {step}" if step is not None
                                                  else "")
        return f"fault {position} ({_describe_fault(fault)}) fired but {missing}"
    return None


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
    requests = len({r.index for r in result.requests})
    matched = (f"{requests} request(s)" if requests == len(result.requests)
               else f"{len(result.requests)} completion(s) of {requests} request(s)")
    return (f"{matched} match the baseline; {fired} fault(s) fired, "
            f"{result.reinferences} re-inference(s)")


# --- request comparisons --------------------------------------------------------------------

def _compare_requests(scenario: Any, baseline: RunOutput,
                      run: RunOutput) -> list[RequestComparison]:
    """One comparison per baseline completion, in baseline order; a missing one is empty."""
    produced = {r.key: r for r in run.requests}
    samples = Counter(r.index for r in baseline.requests)
    outcome = _expected_outcome(scenario)
    mode = _token_mode(scenario)
    fault_token = _first_fault_token(scenario)
    tolerance = float(_expect_field(scenario, "logprob_tolerance") or 0.0)
    comparisons = []
    for expected in baseline.requests:
        actual = produced.get(expected.key, RequestOutput(index=expected.index, token_ids=[],
                                                          sample=expected.sample))
        window = _window(outcome, mode, fault_token, len(actual.token_ids))
        comparisons.append(compare_completion(expected, actual, window,
                                              samples=samples[expected.index],
                                              tolerance=tolerance))
    return comparisons


def _window(outcome: str, mode: str, fault_token: int | None, produced: int) -> int | None:
    """How many leading tokens of a request are compared; ``None`` for the whole stream."""
    limit = fault_token if mode == TOKENS_PREFIX else None
    if outcome == OUTCOME_FAILED:
        return produced if limit is None else min(limit, produced)
    return limit


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
