"""Coordinated recovery of link faults on a real tensor-parallel vLLM engine (2 ranks, CPU).

A link fault makes one rank raise the network error without entering the collective; the
other rank genuinely blocks in it until its monitor stops it. Both ranks roll back, rebuild
their communicators and re-run the step. Every request's tokens must equal the fault-free
run of a plain vLLM engine.
"""

from __future__ import annotations

import time

import pytest

from ftkit.contracts.eventlog import RecoveryRound, only, read_events
from ftkit.scenario import EngineSpec
from ftkit.vllm.engine import EngineSession

from conftest import (GREEDY, SEEDED, assert_reaped, fault, new_block_token, recovery_config,
                      run_with_faults)

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_fault_free_tensor_parallel_run_matches_plain_vllm(tp2_engine, baseline):
    before = tp2_engine.llm.collective_rpc("ftkit_transport_counts")
    run = run_with_faults(tp2_engine, GREEDY, [])
    assert run.error is None and not run.fired and not run.rounds
    assert run.tokens == baseline.tokens["greedy"]
    # ftkit's shared-memory transport, not a silent gloo fallback, carried the model's
    # collectives on both ranks (the tests of this module recover on that transport).
    after = tp2_engine.llm.collective_rpc("ftkit_transport_counts")
    for rank, (was, now) in enumerate(zip(before, after)):
        ran = {key: now[key] - was.get(key, 0) for key in now if now[key] != was.get(key, 0)}
        assert ran.get("all_reduce/shm", 0) > 0, (rank, ran)
        assert "all_reduce/gloo" not in ran and "all_gather_into_tensor/gloo" not in ran, \
            (rank, ran)


@pytest.mark.parametrize("where", ["prefill", "decode", "new_block"])
@pytest.mark.parametrize("phase", ["before", "forward", "sample"])
@pytest.mark.parametrize("rank", [0, 1])
def test_link_break_recovers_on_every_rank(tp2_engine, baseline, rank, phase, where):
    request = 2
    token = {"prefill": 0, "decode": 9,
             "new_block": new_block_token(baseline.prompt_lens[request])}[where]
    run = run_with_faults(tp2_engine, GREEDY, [fault("link_break", rank, request, token, phase)])
    assert run.error is None
    assert [(e.rank, e.token) for e in run.fired] == [(rank, token)]
    assert run.rounds and all(r.decision == "recompute" for r in run.rounds)
    # Both ranks took part in the round: the faulty one and its peer.
    assert {r.rank for r in run.rounds} == {0, 1}
    states = {r.rank: r.state for r in run.rounds}
    assert states[rank] == "failed"
    assert run.tokens == baseline.tokens["greedy"]


def test_sampling_fault_before_a_step_that_admits_a_late_request(tp2_engine, baseline):
    """Regression (seen in CI): rank 1 re-samples step N while rank 0, already in step N+1,
    is stopped there and rolls N+1 back; N+1 admits a request that arrived late. Rank 1
    never ran N+1. Unless both ranks rebuild their batch alike, their rows come out in a
    different order and every all-reduce of N+1 sums different tokens: wrong tokens for all.

    The condition is held in place by two hangs, each far longer than the work it waits for:
    rank 0 hangs in step N's forward first (its operator timeout ends it), so the engine
    core, which waits for rank 0's output, schedules N+1 after the late request (submitted
    after step N-1's output) has arrived; then rank 1 hangs in step N's sampling, while rank
    0 goes on into N+1 and blocks there. The rounds and token times assert that it held."""
    arrivals = [0, 0, 0, 5]
    run = run_with_faults(tp2_engine, GREEDY,
                          [fault("hang", 0, 0, 5, "forward", op_timeout_s=1.0),
                           fault("hang", 1, 0, 5, "sample", op_timeout_s=1.0)],
                          submit_after_steps=arrivals)
    assert run.error is None
    assert [(e.rank, e.phase) for e in run.fired] == [(0, "forward"), (1, "sample")]
    assert run.tokens == baseline.tokens["greedy"]
    by_epoch = {}
    for r in run.rounds:
        by_epoch.setdefault(r.epoch, {})[r.rank] = (r.state, r.rpc_kind)
    rounds = [by_epoch[e] for e in sorted(by_epoch)]
    assert rounds[-1] == {0: ("stopped", "execute"), 1: ("failed", "sample")}, rounds
    # Request 3's first token came from the step after the faulty one (request 0's token 6):
    # tokens of one engine step share one time.
    assert run.token_times[3][0] == run.token_times[0][6]


def test_healthy_rank_was_really_blocked_and_stopped(tp2_engine, baseline):
    run = run_with_faults(tp2_engine, GREEDY, [fault("link_break", 1, 0, 12, "forward")])
    assert run.error is None
    peer = [r for r in run.rounds if r.rank == 0]
    # Rank 0 was inside the step's collective when rank 1 failed: its monitor stopped it and
    # it reported "stopped" (not idle, not completed).
    assert [r.state for r in peer] == ["stopped"]
    assert run.tokens == baseline.tokens["greedy"]


def test_link_flap_within_max_reinference(tp2_engine, baseline):
    run = run_with_faults(tp2_engine, GREEDY, [fault("link_flap", 1, 0, 17, "forward", times=3)])
    assert run.error is None
    assert [e.attempt for e in run.fired] == [1, 2, 3]
    assert len({r.epoch for r in run.rounds}) == 3
    assert run.tokens == baseline.tokens["greedy"]


def test_faults_on_both_ranks_in_the_same_step(tp2_engine, baseline):
    run = run_with_faults(tp2_engine, GREEDY, [fault("link_break", "all", 1, 5, "forward")])
    assert run.error is None
    assert sorted(e.rank for e in run.fired) == [0, 1]
    assert run.tokens == baseline.tokens["greedy"]


def test_several_faults_in_one_run(tp2_engine, baseline):
    faults = [fault("link_break", 0, 0, 0, "forward"), fault("link_flap", 1, 1, 11, "before", 2),
              fault("link_break", 1, 3, 30, "sample"), fault("oom", 0, 2, 40, "forward")]
    run = run_with_faults(tp2_engine, GREEDY, faults)
    assert run.error is None
    assert sorted(e.index for e in run.fired) == [0, 1, 1, 2, 3]
    assert run.tokens == baseline.tokens["greedy"]


def test_seeded_sampling_survives_a_link_break(tp2_engine, baseline):
    run = run_with_faults(tp2_engine, SEEDED, [fault("link_break", 1, 2, 6, "sample"),
                                               fault("link_flap", 0, 0, 20, "forward", 2)])
    assert run.error is None and len(run.fired) == 3
    assert run.tokens == baseline.tokens["seeded"]


#: Request 3 arrives after the engine has run three steps of the workload: it finishes alone,
#: in the workload's last step. (Submitted at once, the requests reach a multi-process engine
#: core at its pace: some may be admitted a step later than others, and a request's last token
#: is then not the workload's last step.)
LAST_ALONE = [0, 0, 0, 3]


def _last_step_sample_fault(baseline) -> tuple[int, int]:
    """(request, token) of the workload's last token when requests arrive as ``LAST_ALONE``
    says: the step after which the engine has every output."""
    return 3, len(baseline.tokens["greedy"][3]) - 1


def test_sampling_fault_on_rank_1_in_the_last_step_is_recovered_within_the_run(
        tp2_engine, baseline):
    """Regression (found by ``ftkit explore``): the engine reads a step's output from rank 0
    only, so it had the whole workload while rank 1 still recovered from a fault in the last
    step's sampling; the run ended without that round (reported as a fault no round
    recovered), and the round ran into the next workload. The run now ends once every rank
    has settled."""
    request, token = _last_step_sample_fault(baseline)
    run = run_with_faults(tp2_engine, GREEDY,
                          [fault("device_reset", 1, request, token, "sample", times=2)],
                          submit_after_steps=LAST_ALONE)
    assert run.error is None
    assert [(e.rank, e.attempt) for e in run.fired] == [(1, 1), (1, 2)]
    fired_step = run.fired[0].step
    failed = [r for r in run.rounds if r.rank == 1 and r.state == "failed"]
    assert [r.step for r in failed] == [fired_step, fired_step]
    assert {r.rank for r in run.rounds} == {0, 1}
    assert run.tokens == baseline.tokens["greedy"]


def test_without_settling_the_last_step_round_is_missing_from_the_run(
        tp2_engine, baseline, monkeypatch):
    """The crippled variant: without waiting for every rank at the end, the run ends while
    rank 1 still hangs in the last step's sampling (2 s, its operator timeout): the round
    that recovers rank 1's fault begins after the run returned, and its records lack it."""
    request, token = _last_step_sample_fault(baseline)
    started = time.time()
    with monkeypatch.context() as patched:
        patched.setattr(tp2_engine, "_settle", lambda deadline: None)
        run = run_with_faults(tp2_engine, GREEDY,
                              [fault("hang", 1, request, token, "sample", op_timeout_s=2.0)],
                              submit_after_steps=LAST_ALONE)
    returned = time.time()
    # Rank 1 is still recovering: let it finish before the next test's workload.
    tp2_engine._settle(None)
    assert run.error is None
    assert run.tokens == baseline.tokens["greedy"]  # rank 0's output: the tokens look right
    assert [e.rank for e in run.fired][:1] == [1]
    assert not [r for r in run.rounds if r.rank == 1 and r.state == "failed"]
    # The round did happen, after the run had ended.
    late = [e for e in only(read_events(tp2_engine.recovery.event_log_dir), RecoveryRound)
            if e.time >= started and e.rank == 1 and e.state == "failed"]
    assert [e.fault for e in late] == ["hang"]
    assert late[0].started >= returned


def test_flap_beyond_max_reinference_fails_cleanly_and_reaps(tiny_model, baseline, tmp_path):
    engine = EngineSession(EngineSpec(model=tiny_model, tensor_parallel_size=2),
                           recovery=recovery_config(str(tmp_path), max_reinference=3))
    with engine:
        run = run_with_faults(engine, GREEDY, [fault("link_flap", 1, 0, 17, "forward", times=4)],
                              timeout_s=120)
    # Ended by the exhaustion that the fourth failure made every rank decide (a run past its
    # deadline would have raised RunTimeout instead).
    assert run.error is not None and "max_reinference is 3" in run.error
    assert len(run.fired) == 4
    assert [r.decision for r in run.rounds if r.rank == 0] == ["recompute"] * 3 + ["raise"]
    raised = [r for r in run.rounds if r.decision == "raise"]
    assert sorted(r.rank for r in raised) == [0, 1]
    assert all(run.fired[-1].time <= r.started for r in raised)
    for got, want in zip(run.tokens, baseline.tokens["greedy"]):
        assert got == want[: len(got)]
    assert len(run.tokens[0]) <= 17
    assert_reaped(engine.pids)
