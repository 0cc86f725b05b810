"""The verdict rules of ``ftkit.verify``, on hand-made run outputs and real scenario models."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ftkit.results import (
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestOutput,
    RunOutput,
    Verdict,
)
from ftkit.scenario.model import Scenario
from ftkit.verify import compare_completion, compare_tokens, same_logprob, verify

BASELINE_TOKENS = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]]
FAULT_TOKEN = 3


def make_scenario(*, outcome: str = "recovered", tokens: str = "identical",
                  faults: list[dict[str, Any]] | None = None, **expect: Any) -> Scenario:
    if faults is None:
        faults = [{"kind": "link_break", "rank": 1, "at": {"request": 0, "token": FAULT_TOKEN}}]
    return Scenario.model_validate({
        "name": "verify-test",
        "engine": {"tensor_parallel_size": 2},
        "workload": {"prompts": ["the quick fox", "a lazy dog"], "max_tokens": 8},
        "faults": faults,
        "expect": {"outcome": outcome, "tokens": tokens, **expect},
    })


def fired(token: int = FAULT_TOKEN, *, recovered: bool = True) -> FaultRecord:
    return FaultRecord(kind="link_break", rank=1, request=0, token=token, phase="forward",
                       times=1, fired=True, fired_at=FiredAt(request=0, token=token, step=token),
                       attempts=1, recovered=recovered, recovery_s=0.01 if recovered else None)


def unfired() -> FaultRecord:
    return FaultRecord(kind="link_break", rank=1, request=0, token=FAULT_TOKEN,
                       phase="forward", times=1)


def recovery(duration_s: float = 0.05, step: int = FAULT_TOKEN) -> RecoveryRecord:
    return RecoveryRecord(step=step, kind="link_break", decision="recompute", attempt=1,
                          ranks=[0, 1], duration_s=duration_s)


def output(tokens: list[list[int]], **kwargs: Any) -> RunOutput:
    requests = [RequestOutput(index=i, token_ids=list(t)) for i, t in enumerate(tokens)]
    return RunOutput(requests=requests, **kwargs)


def baseline() -> RunOutput:
    return output(BASELINE_TOKENS, generate_s=1.0)


def judge(scenario: Scenario, run: RunOutput, base: RunOutput | None = None):
    return verify(scenario, base or baseline(), run, file="s.yaml", duration_s=2.5)


def with_token(tokens: list[list[int]], request: int, index: int, value: int) -> list[list[int]]:
    changed = [list(t) for t in tokens]
    changed[request][index] = value
    return changed


# --- compare_tokens ---------------------------------------------------------------------

@pytest.mark.parametrize(("expected", "actual", "divergence"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([], [], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([1, 2, 3], [7, 2, 3], 0),
    ([1, 2, 3], [1, 2], 2),        # a missing token counts
    ([1, 2], [1, 2, 3], 2),        # so does an extra one
    ([1, 2, 3], [], 0),
])
def test_compare_tokens(expected, actual, divergence):
    assert compare_tokens(expected, actual) == divergence


# --- recovered ----------------------------------------------------------------------------

def test_identical_tokens_with_fired_fault_pass():
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery()], generate_s=2.0)
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.PASS
    assert [r.first_divergence for r in result.requests] == [None, None]
    assert result.tokens_compared == 16
    assert result.reinferences == 1
    assert result.tokens_per_s == pytest.approx(8.0)
    assert result.duration_s == 2.5
    assert result.file == "s.yaml"
    assert result.name == "verify-test"


def test_divergent_token_fails_and_names_the_divergence():
    run = output(with_token(BASELINE_TOKENS, 1, 4, 99), faults=[fired()])
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.FAIL
    assert "request 1 diverges at token 4: expected 24, got 99" in result.reason
    assert result.first_divergence == (1, 4)


def test_missing_token_is_a_divergence():
    short = [BASELINE_TOKENS[0], BASELINE_TOKENS[1][:5]]
    result = judge(make_scenario(), output(short, faults=[fired()]))
    assert result.verdict is Verdict.FAIL
    assert "request 1 diverges at token 5: expected 25, got end of stream" in result.reason


def test_missing_request_is_a_divergence_at_token_zero():
    result = judge(make_scenario(), output([BASELINE_TOKENS[0]], faults=[fired()]))
    assert result.verdict is Verdict.FAIL
    assert result.requests[1].actual == []
    assert result.first_divergence == (1, 0)


def test_engine_error_when_recovery_expected_fails():
    run = output([t[:3] for t in BASELINE_TOKENS], faults=[fired(recovered=False)],
                 error="EngineDeadError: SUSPECT REMOTE ERROR")
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.FAIL
    assert "expected recovery" in result.reason
    assert "SUSPECT REMOTE ERROR" in result.reason
    assert result.error == "EngineDeadError: SUSPECT REMOTE ERROR"


def test_slow_recovery_fails():
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery(duration_s=2.5)])
    result = judge(make_scenario(max_recovery_s=1.0), run)
    assert result.verdict is Verdict.FAIL
    assert "took 2.500 s, over max_recovery_s 1 s" in result.reason


def test_recovery_at_the_bound_passes():
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery(duration_s=1.0)])
    assert judge(make_scenario(max_recovery_s=1.0), run).verdict is Verdict.PASS


def test_prefix_ignores_tokens_from_the_fault_on():
    run = output(with_token(BASELINE_TOKENS, 0, FAULT_TOKEN, 99), faults=[fired()],
                 recoveries=[recovery()])
    result = judge(make_scenario(tokens="prefix"), run)
    assert result.verdict is Verdict.PASS
    assert result.requests[0].actual[FAULT_TOKEN] == 99


def test_prefix_still_fails_before_the_fault():
    run = output(with_token(BASELINE_TOKENS, 0, FAULT_TOKEN - 1, 99), faults=[fired()])
    result = judge(make_scenario(tokens="prefix"), run)
    assert result.verdict is Verdict.FAIL
    assert f"request 0 diverges at token {FAULT_TOKEN - 1}" in result.reason


def test_no_faults_is_a_determinism_check():
    scenario = make_scenario(faults=[])
    assert judge(scenario, output(BASELINE_TOKENS)).verdict is Verdict.PASS
    changed = output(with_token(BASELINE_TOKENS, 0, 7, 1))
    assert judge(scenario, changed).verdict is Verdict.FAIL


# --- not applied --------------------------------------------------------------------------

def test_unfired_fault_is_not_applied_even_with_identical_tokens():
    result = judge(make_scenario(), output(BASELINE_TOKENS, faults=[unfired()]))
    assert result.verdict is Verdict.NOT_APPLIED
    assert "fault 0 (link_break on rank 1 at request 0 token 3" in result.reason
    assert "did not fire" in result.reason


def test_fault_missing_from_the_run_is_not_applied_and_recorded():
    result = judge(make_scenario(), output(BASELINE_TOKENS))
    assert result.verdict is Verdict.NOT_APPLIED
    assert len(result.faults) == 1
    assert result.faults[0].fired is False
    assert result.faults[0].kind == "link_break"
    assert result.faults[0].token == FAULT_TOKEN


def test_second_unfired_fault_is_named():
    faults = [
        {"kind": "link_break", "rank": 1, "at": {"request": 0, "token": 2}},
        {"kind": "link_flap", "rank": 0, "at": {"request": 1, "token": 5}, "times": 2},
    ]
    second = FaultRecord(kind="link_flap", rank=0, request=1, token=5, phase="forward",
                         times=2)
    result = judge(make_scenario(faults=faults), output(BASELINE_TOKENS,
                                                        faults=[fired(2), second]))
    assert result.verdict is Verdict.NOT_APPLIED
    assert result.reason.startswith("fault 1 (link_flap on rank 0 at request 1 token 5")


def test_expected_failure_with_unfired_fault_is_not_applied():
    run = output([[10]], faults=[unfired()], error="some unrelated error")
    result = judge(make_scenario(outcome="failed"), run)
    assert result.verdict is Verdict.NOT_APPLIED
    assert "some unrelated error" in result.reason


# --- error --------------------------------------------------------------------------------

def test_timeout_when_recovery_expected_is_error():
    run = output([t[:4] for t in BASELINE_TOKENS], faults=[fired()], timed_out=True)
    result = judge(make_scenario(timeout_s=30), run)
    assert result.verdict is Verdict.ERROR
    assert "timed out after 30 s" in result.reason


def test_run_that_could_not_run_is_error():
    run = output([[], []], faults=[unfired()], error="EngineError: engine failed to start")
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.ERROR
    assert "could not run" in result.reason
    assert "engine failed to start" in result.reason


def test_failed_baseline_is_error():
    base = output(BASELINE_TOKENS, error="baseline boom")
    result = judge(make_scenario(), output(BASELINE_TOKENS, faults=[fired()]), base)
    assert result.verdict is Verdict.ERROR
    assert "baseline" in result.reason


def test_request_unknown_to_the_baseline_is_error():
    run = output(BASELINE_TOKENS + [[1, 2]], faults=[fired()])
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.ERROR
    assert "request(s) 2" in result.reason


def test_malformed_run_is_error_not_exception():
    run = RunOutput(requests=[RequestOutput(index=0, token_ids=None)],  # type: ignore[arg-type]
                    faults=[fired()])
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.ERROR
    assert result.reason.startswith("internal error while verifying")


# --- expected failure ---------------------------------------------------------------------

def test_surfaced_error_with_matching_prefix_passes():
    run = output([BASELINE_TOKENS[0][:FAULT_TOKEN], BASELINE_TOKENS[1][:FAULT_TOKEN]],
                 faults=[fired(recovered=False)], error="RecoveryError: gave up")
    result = judge(make_scenario(outcome="failed", tokens="prefix"), run)
    assert result.verdict is Verdict.PASS
    assert "RecoveryError: gave up" in result.reason


def test_request_that_stopped_early_is_compared_on_what_it_produced():
    run = output([BASELINE_TOKENS[0][:1], BASELINE_TOKENS[1][:FAULT_TOKEN]],
                 faults=[fired(recovered=False)], error="RecoveryError: gave up")
    result = judge(make_scenario(outcome="failed", tokens="prefix"), run)
    assert result.verdict is Verdict.PASS


def test_wrong_token_before_the_error_fails():
    tokens = [BASELINE_TOKENS[0][:FAULT_TOKEN], [20, 77]]
    run = output(tokens, faults=[fired(recovered=False)], error="RecoveryError: gave up")
    result = judge(make_scenario(outcome="failed", tokens="prefix"), run)
    assert result.verdict is Verdict.FAIL
    assert "request 1 diverges at token 1: expected 21, got 77" in result.reason


def test_expected_failure_that_succeeds_fails():
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery()])
    result = judge(make_scenario(outcome="failed", tokens="prefix"), run)
    assert result.verdict is Verdict.FAIL
    assert "run succeeded" in result.reason


def test_expected_failure_that_hangs_fails():
    run = output([t[:3] for t in BASELINE_TOKENS], faults=[fired(recovered=False)],
                 timed_out=True, error="RunTimeout")
    result = judge(make_scenario(outcome="failed", tokens="prefix"), run)
    assert result.verdict is Verdict.FAIL
    assert "timed out" in result.reason


def test_expected_failure_identical_compares_every_produced_token():
    good = output([BASELINE_TOKENS[0][:5], BASELINE_TOKENS[1][:6]],
                  faults=[fired(recovered=False)], error="RecoveryError: gave up")
    assert judge(make_scenario(outcome="failed"), good).verdict is Verdict.PASS
    bad = output([BASELINE_TOKENS[0][:4] + [99], BASELINE_TOKENS[1][:6]],
                 faults=[fired(recovered=False)], error="RecoveryError: gave up")
    result = judge(make_scenario(outcome="failed"), bad)
    assert result.verdict is Verdict.FAIL
    assert "request 0 diverges at token 4: expected 14, got 99" in result.reason


# --- the evidence -------------------------------------------------------------------------

def test_result_carries_the_evidence():
    base = baseline()
    base.from_cache = True
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery(0.2)], generate_s=0)
    result = judge(make_scenario(), run, base)
    assert result.baseline_from_cache is True
    assert result.tokens_per_s is None
    assert result.recovery_s == pytest.approx(0.2)
    assert result.requests[0].expected == BASELINE_TOKENS[0]
    data = result.to_dict()
    assert data["verdict"] == "pass"
    assert data["faults"][0]["fired_at"] == {"request": 0, "token": FAULT_TOKEN,
                                             "step": FAULT_TOKEN}


def test_result_carries_the_engine_settings_and_seeds_into_the_report(tmp_path):
    from ftkit.report import read_json_report, write_json_report

    scenario = Scenario.model_validate({
        "name": "seeded", "engine": {"tensor_parallel_size": 2, "seed": 7},
        "workload": {"prompts": ["a b", "c d"], "max_tokens": 8, "temperature": 0.7,
                     "seed": 42},
        "faults": []})
    result = judge(scenario, output(BASELINE_TOKENS, generate_s=1.0))
    assert result.engine["tensor_parallel_size"] == 2 and result.engine["seed"] == 7
    assert result.sampling == {"max_tokens": 8, "temperature": 0.7, "top_p": 1.0, "seed": 42}
    [written] = read_json_report(write_json_report([result], tmp_path / "r.json"))["scenarios"]
    assert written["engine"]["seed"] == 7 and written["sampling"]["seed"] == 42
    assert written["engine"]["model"] == "tiny"


# --- logprobs, top-k, prompt logprobs, finish reason, text (the stricter oracle) -----------

#: Completions by (request, sample): request 1 asks n=2. Each has the sampled tokens'
#: logprobs, the top-2 of each position, prompt logprobs, and a finished text.
RICH_TOKENS = {(0, 0): [10, 11, 12, 13, 14, 15], (1, 0): [20, 21, 22, 23, 24, 25],
               (1, 1): [30, 31, 32, 33, 34, 35]}


def rich_completion(index: int, sample: int) -> RequestOutput:
    tokens = RICH_TOKENS[(index, sample)]
    logprobs = [-0.1 - 0.37 * position - 0.01 * sample for position in range(len(tokens))]
    top = [[[token, logprob], [token + 100, logprob - 1.25]]
           for token, logprob in zip(tokens, logprobs)]
    prompt = [None, [[7, -3.5], [8, -4.25]], [[9, -1.75], [7, -2.0]]]
    return RequestOutput(index=index, sample=sample, token_ids=list(tokens),
                         logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt,
                         finish_reason="length", stop_reason=None,
                         text=f"words of request {index} sample {sample} go on and on")


def rich_run(**kwargs: Any) -> RunOutput:
    return RunOutput(requests=[rich_completion(i, s) for i, s in RICH_TOKENS], **kwargs)


def rich_recovered() -> RunOutput:
    return rich_run(faults=[fired()], recoveries=[recovery()])


def completion(run: RunOutput, index: int, sample: int = 0) -> RequestOutput:
    return next(r for r in run.requests if r.key == (index, sample))


def rich_judge(run: RunOutput, **scenario: Any):
    return judge(make_scenario(**scenario), run, rich_run(generate_s=1.0))


def test_the_same_logprobs_top_k_prompt_logprobs_and_text_pass():
    result = rich_judge(rich_recovered())
    assert result.verdict is Verdict.PASS, result.reason
    assert result.reason.startswith("3 completion(s) of 2 request(s) match the baseline")
    assert [(r.index, r.sample, r.samples) for r in result.requests] == [
        (0, 0, 1), (1, 0, 2), (1, 1, 2)]
    assert all(r.matches and r.diverged_field is None for r in result.requests)


def test_a_logprob_one_ulp_off_fails_naming_request_token_and_both_values():
    run = rich_recovered()
    logprobs = completion(run, 0).logprobs
    want = logprobs[4]
    logprobs[4] = math.nextafter(want, 0.0)
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == (f"logprob drift at request 0, token 4: {want!r} vs "
                             f"{logprobs[4]!r}")
    diverged = result.first_mismatch
    assert (diverged.index, diverged.diverged_field, diverged.position) == (0, "logprobs", 4)
    assert (diverged.expected_value, diverged.actual_value) == (want, logprobs[4])
    assert diverged.first_divergence is None  # the token ids are the same
    assert result.first_divergence is None


def test_a_logprob_drift_of_a_second_sample_names_the_sample():
    run = rich_recovered()
    logprobs = completion(run, 1, 1).logprobs
    want = logprobs[2]
    logprobs[2] = want + 0.0625
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == (f"logprob drift at request 1 sample 1, token 2: {want!r} vs "
                             f"{want + 0.0625!r}")
    assert result.first_mismatch.key == (1, 1)


def test_a_missing_logprob_fails():
    run = rich_recovered()
    completion(run, 1).logprobs = completion(run, 1).logprobs[:3]
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("logprob drift at request 1 sample 0, token 3: ")
    assert result.reason.endswith(" vs missing")


def test_the_logprob_tolerance_allows_an_absolute_difference_and_no_more():
    run = rich_recovered()
    logprobs = completion(run, 0).logprobs
    logprobs[1] += 1e-7
    assert rich_judge(run, logprob_tolerance=1e-6).verdict is Verdict.PASS
    assert rich_judge(run).verdict is Verdict.FAIL  # nothing is tolerated by default
    logprobs[1] += 1e-5
    result = rich_judge(run, logprob_tolerance=1e-6)
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("logprob drift at request 0, token 1: ")
    assert result.reason.endswith(" (logprob_tolerance 1e-06)")


def test_the_tolerance_applies_to_top_k_and_prompt_logprobs_too():
    run = rich_recovered()
    completion(run, 0).top_logprobs[2][1][1] += 1e-7
    completion(run, 1).prompt_logprobs[1][0][1] -= 1e-7
    assert rich_judge(run, logprob_tolerance=1e-6).verdict is Verdict.PASS
    assert rich_judge(run).verdict is Verdict.FAIL


def test_a_top_k_logprob_one_ulp_off_fails_naming_token_and_rank():
    run = rich_recovered()
    entry = completion(run, 1, 1).top_logprobs[3][1]
    want = entry[1]
    entry[1] = math.nextafter(want, -math.inf)
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == (f"top-k logprobs differ at request 1 sample 1, token 3, rank 1: "
                             f"[133, {want!r}] vs [133, {entry[1]!r}]")
    diverged = result.first_mismatch
    assert (diverged.diverged_field, diverged.position) == ("top_logprobs", 3)
    assert diverged.expected_value[1] == [133, want]
    assert diverged.actual_value[1] == [133, entry[1]]


def test_another_token_among_the_top_k_fails():
    run = rich_recovered()
    completion(run, 0).top_logprobs[0][1][0] = 999
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("top-k logprobs differ at request 0, token 0, rank 1: "
                                    "[110, ")
    assert "vs [999, " in result.reason


def test_top_k_is_compared_only_where_the_baseline_has_it():
    base = rich_run(generate_s=1.0)
    for request in base.requests:
        request.top_logprobs = None
    run = rich_recovered()
    completion(run, 0).top_logprobs[0][1][0] = 999
    assert judge(make_scenario(), run, base).verdict is Verdict.PASS


def test_a_prompt_logprob_one_ulp_off_fails_naming_the_prompt_position():
    run = rich_recovered()
    entry = completion(run, 0).prompt_logprobs[2][0]
    want = entry[1]
    entry[1] = math.nextafter(want, 0.0)
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == (f"prompt logprobs differ at request 0, prompt position 2, rank 0: "
                             f"[9, {want!r}] vs [9, {entry[1]!r}]")
    assert (result.first_mismatch.diverged_field, result.first_mismatch.position) == (
        "prompt_logprobs", 2)


def test_prompt_logprobs_the_run_lacks_fail():
    run = rich_recovered()
    completion(run, 1, 1).prompt_logprobs = None
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("prompt logprobs missing at request 1 sample 1: the baseline has "
                             "3 prompt position(s), the run none")


def test_a_prompt_position_the_run_lacks_fails():
    run = rich_recovered()
    completion(run, 0).prompt_logprobs = completion(run, 0).prompt_logprobs[:2]
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("prompt logprobs differ at request 0, prompt position 2: "
                             "[[9, -1.75], [7, -2.0]] vs missing")


def test_the_finish_reason_fails():
    run = rich_recovered()
    completion(run, 1).finish_reason = "stop"
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == "finish reason differs at request 1 sample 0: 'length' vs 'stop'"
    assert result.first_mismatch.diverged_field == "finish_reason"
    assert result.first_mismatch.position is None


def test_an_unfinished_completion_fails_on_its_finish_reason():
    run = rich_recovered()
    completion(run, 0).finish_reason = None
    result = rich_judge(run)
    assert result.reason == "finish reason differs at request 0: 'length' vs None"


def test_the_stop_reason_fails():
    run = rich_recovered()
    completion(run, 0).stop_reason = "river"
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == "stop reason differs at request 0: None vs 'river'"


def test_the_text_fails_naming_the_character():
    run = rich_recovered()
    request = completion(run, 0)
    request.text = request.text.replace("go on", "go in")
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    # "words of request 0 sample 0 go on and on": "o" of "on" is character 31; 20 characters
    # are shown each side.
    assert result.reason == ("text differs at request 0, character 31: "
                             "'quest 0 sample 0 go on and on' vs "
                             "'quest 0 sample 0 go in and on'")
    assert (result.first_mismatch.diverged_field, result.first_mismatch.position) == ("text", 31)


def test_a_missing_completion_of_a_request_with_n_samples_diverges_at_token_zero():
    run = rich_recovered()
    run.requests = [r for r in run.requests if r.key != (1, 1)]
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("request 1 sample 1 diverges at token 0: expected 30, got end of "
                             "stream")
    assert result.requests[2].first_divergence == 0


def test_a_sample_the_baseline_lacks_is_error():
    run = rich_recovered()
    run.requests.append(rich_completion(0, 0))
    run.requests[-1].sample = 1
    result = rich_judge(run)
    assert result.verdict is Verdict.ERROR
    assert "request(s) 0 sample 1 that the baseline does not have" in result.reason


def test_a_token_divergence_keeps_its_sentence_and_names_the_sample():
    run = rich_recovered()
    completion(run, 1, 1).token_ids[4] = 99
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == "request 1 sample 1 diverges at token 4: expected 34, got 99"
    diverged = result.first_mismatch
    assert (diverged.diverged_field, diverged.position) == ("token_ids", 4)
    assert (diverged.expected_value, diverged.actual_value) == (34, 99)


def test_the_earliest_difference_is_the_one_reported():
    run = rich_recovered()
    completion(run, 0).token_ids[4] = 99
    completion(run, 0).logprobs[2] -= 0.5
    result = rich_judge(run)
    assert result.reason.startswith("logprob drift at request 0, token 2: ")
    assert result.first_divergence == (0, 4)  # the token ids still diverge at 4


def test_logprobs_past_a_prefix_window_are_not_compared_but_those_before_are():
    run = rich_recovered()
    completion(run, 0).logprobs[FAULT_TOKEN] -= 0.5
    completion(run, 0).text = "something else"
    completion(run, 0).finish_reason = None
    assert rich_judge(run, tokens="prefix").verdict is Verdict.PASS
    completion(run, 0).logprobs[FAULT_TOKEN - 1] -= 0.5
    result = rich_judge(run, tokens="prefix")
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith(f"logprob drift at request 0, token {FAULT_TOKEN - 1}: ")


def test_before_the_error_logprobs_are_compared_and_the_unfinished_text_is_not():
    run = rich_run(faults=[fired(recovered=False)], error="RecoveryError: gave up")
    for request in run.requests:
        request.token_ids = request.token_ids[:FAULT_TOKEN]
        request.logprobs = request.logprobs[:FAULT_TOKEN]
        request.top_logprobs = request.top_logprobs[:FAULT_TOKEN]
        request.finish_reason = request.text = None
    assert rich_judge(run, outcome="failed").verdict is Verdict.PASS
    completion(run, 1).top_logprobs[1][0][1] += 0.25
    result = rich_judge(run, outcome="failed")
    assert result.verdict is Verdict.FAIL
    assert result.reason.startswith("before the error: top-k logprobs differ at request 1 "
                                    "sample 0, token 1, rank 0: ")


def test_prompt_logprobs_are_not_compared_when_no_token_is():
    run = rich_run(faults=[fired(recovered=False)], error="RecoveryError: gave up")
    for request in run.requests:
        request.token_ids, request.logprobs, request.top_logprobs = [], [], []
        request.prompt_logprobs = request.finish_reason = request.text = None
    assert rich_judge(run, outcome="failed").verdict is Verdict.PASS


@pytest.mark.parametrize(("expected", "actual", "tolerance", "same"), [
    (-1.5, -1.5, 0.0, True),
    (-1.5, math.nextafter(-1.5, 0.0), 0.0, False),
    (-1.5, math.nextafter(-1.5, 0.0), 1e-12, True),
    (-math.inf, -math.inf, 0.0, True),
    (-math.inf, -1e308, 0.0, False),
    (-math.inf, -1e308, 1.0, False),     # no tolerance makes -inf finite
    (0.0, -0.0, 0.0, True),
    (math.nan, math.nan, 0.0, True),
    (math.nan, -math.nan, 0.0, False),   # NaNs of other bits
    (math.nan, -1.5, 1e9, False),
])
def test_same_logprob(expected, actual, tolerance, same):
    assert same_logprob(expected, actual, tolerance) is same


def test_a_nan_logprob_in_the_run_fails():
    run = rich_recovered()
    completion(run, 0).logprobs[0] = math.nan
    result = rich_judge(run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == "logprob drift at request 0, token 0: -0.1 vs nan"


def test_compare_completion_without_logprobs_compares_token_ids_only():
    comparison = compare_completion(RequestOutput(index=3, token_ids=[1, 2, 3]),
                                    RequestOutput(index=3, token_ids=[1, 2, 3]))
    assert comparison.matches


# --- a fault that fired must have been recovered --------------------------------------------

def test_a_fired_fault_without_a_recovery_round_fails():
    run = output(BASELINE_TOKENS, faults=[fired()])
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("fault 0 (link_break on rank 1 at request 0 token 3, phase "
                             "forward) fired but no recovery round ran at step 3")


def test_a_round_at_another_step_does_not_count():
    run = output(BASELINE_TOKENS, faults=[fired()], recoveries=[recovery(step=FAULT_TOKEN + 4)])
    result = judge(make_scenario(), run)
    assert result.verdict is Verdict.FAIL
    assert result.reason.endswith("fired but no recovery round ran at step 3")


def test_the_second_fault_without_a_round_is_named():
    faults = [{"kind": "link_break", "rank": 1, "at": {"request": 0, "token": 2}},
              {"kind": "oom", "rank": 0, "at": {"request": 1, "token": 5}}]
    oom = FaultRecord(kind="oom", rank=0, request=1, token=5, phase="forward", times=1,
                      fired=True, fired_at=FiredAt(request=1, token=5, step=6), attempts=1,
                      recovered=True)
    run = output(BASELINE_TOKENS, faults=[fired(2), oom], recoveries=[recovery(step=2)])
    result = judge(make_scenario(faults=faults), run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("fault 1 (oom on rank 0 at request 1 token 5, phase forward) "
                             "fired but no recovery round ran at step 6")
    run.recoveries.append(recovery(step=6))
    assert judge(make_scenario(faults=faults), run).verdict is Verdict.PASS


def test_without_recovery_no_round_is_required():
    from ftkit.scenario.model import RecoverySpec

    # Validation refuses recovery off with outcome recovered when a fault is planned; verify
    # still reads the setting rather than assume it.
    scenario = make_scenario().model_copy(update={"recovery": RecoverySpec(enabled=False)})
    assert judge(scenario, output(BASELINE_TOKENS, faults=[fired()])).verdict is Verdict.PASS


def kill(**fields: Any) -> FaultRecord:
    return FaultRecord(kind="process_kill", rank=1, request=0, token=FAULT_TOKEN,
                       phase="forward", times=1, fired=True,
                       fired_at=FiredAt(request=0, token=FAULT_TOKEN, step=FAULT_TOKEN),
                       attempts=1, at_s=0.5, **fields)


KILL = [{"kind": "process_kill", "rank": 1, "at": {"request": 0, "token": FAULT_TOKEN}}]


def test_a_process_kill_is_recovered_by_an_engine_restart_not_a_round():
    run = output(BASELINE_TOKENS, faults=[kill(recovered=True, recovery_s=9.0, restart_s=8.0)])
    assert judge(make_scenario(faults=KILL, max_recovery_s=60), run).verdict is Verdict.PASS


def test_a_process_kill_without_a_restart_fails():
    run = output(BASELINE_TOKENS, faults=[kill()], recoveries=[recovery()])
    result = judge(make_scenario(faults=KILL), run)
    assert result.verdict is Verdict.FAIL
    assert result.reason == ("fault 0 (process_kill on rank 1 at request 0 token 3, phase "
                             "forward) fired but no engine restart resumed the requests")
