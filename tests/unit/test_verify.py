"""The verdict rules of ``ftkit.verify``, on hand-made run outputs and real scenario models."""

from __future__ import annotations

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
from ftkit.verify import compare_tokens, verify

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
    run = output(with_token(BASELINE_TOKENS, 0, FAULT_TOKEN, 99), faults=[fired()])
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
