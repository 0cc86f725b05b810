"""The pure decision rule of a recovery round (``ftkit.recovery.coordinator.decide``).

Every rank reads the same reports and must reach the same decision on its own, so ``decide``
is tested as a pure function: the fault rules (transient or not, re-run budget) and the
position rule (re-running is exact only when no rank would re-run collectives that its
peers have already passed).
"""

from __future__ import annotations

import itertools

import pytest

from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError, RecoveryInconsistent, ReinferenceExhausted
from ftkit.recovery import Action, Cause, RankState, RankStatus, decide
from ftkit.recovery.coordinator import Replay

EXECUTE, SAMPLE, NONE = RpcKind.EXECUTE, RpcKind.SAMPLE, RpcKind.NONE
LINK = "link_break"


def failed(rank: int, rpc: int, kind: str | None = LINK, *, rpc_kind: RpcKind = EXECUTE,
           failures: int = 1, step: int | None = None, error: str = "") -> RankStatus:
    return RankStatus(rank, RankState.FAILED, rpc, rpc_kind, step if step is not None else rpc,
                      failures, kind, error or f"LinkError: SUSPECT REMOTE ERROR (rank {rank})")


def stopped(rank: int, rpc: int, *, rpc_kind: RpcKind = EXECUTE, failures: int = 1,
            step: int | None = None) -> RankStatus:
    return RankStatus(rank, RankState.STOPPED, rpc, rpc_kind, step if step is not None else rpc,
                      failures, None, "CommunicationStopped: a peer failed")


def idle(rank: int, rpc: int, *, rpc_kind: RpcKind = SAMPLE) -> RankStatus:
    return RankStatus(rank, RankState.IDLE, rpc, rpc_kind, rpc)


def completed(rank: int, rpc: int, *, rpc_kind: RpcKind = EXECUTE) -> RankStatus:
    return RankStatus(rank, RankState.COMPLETED, rpc, rpc_kind, rpc)


# --- the fault rules -------------------------------------------------------------------------

def test_link_failure_with_peer_stopped_at_same_rpc_recomputes():
    d = decide([stopped(0, 7), failed(1, 7)], max_reinference=3)
    assert d.action is Action.RECOMPUTE
    assert d.recompute
    assert d.cause is Cause.RERUN
    assert d.kinds == (LINK,)
    assert [s.rank for s in d.statuses] == [0, 1]
    assert "rank 0 stopped" in d.reason and "rank 1 failed" in d.reason


def test_two_failed_ranks_report_each_kind_once():
    d = decide([stopped(0, 5), failed(1, 5), failed(2, 5, "oom"), failed(3, 5)],
               max_reinference=3)
    assert d.recompute
    assert d.kinds == ("link_break", "oom")


@pytest.mark.parametrize("max_reinference", [1, 3])
def test_failures_exactly_at_max_reinference_recompute(max_reinference):
    n = max_reinference
    d = decide([stopped(0, 4, failures=n), failed(1, 4, failures=n)], max_reinference)
    assert d.recompute, d.reason


@pytest.mark.parametrize("max_reinference", [0, 1, 3])
def test_failures_above_max_reinference_raise_naming_the_budget(max_reinference):
    n = max_reinference + 1
    d = decide([stopped(0, 4, failures=n), failed(1, 4, failures=n)], max_reinference)
    assert d.action is Action.RAISE
    assert d.cause is Cause.REINFERENCE_EXHAUSTED and d.error is ReinferenceExhausted
    assert "max_reinference" in d.reason
    assert f"max_reinference is {max_reinference}" in d.reason
    assert f"failed {n} times" in d.reason


def test_budget_counts_a_stopped_rank_too():
    # The healthy rank re-runs as well; its count is the same stream of attempts.
    d = decide([stopped(0, 4, failures=4), failed(1, 4, failures=1)], max_reinference=3)
    assert d.action is Action.RAISE
    assert "rank 0" in d.reason and "max_reinference" in d.reason


def test_non_transient_error_raises_naming_rank_and_error():
    d = decide([stopped(0, 9), failed(1, 9, None, error="ValueError: bad request")],
               max_reinference=3)
    assert d.action is Action.RAISE
    assert d.cause is Cause.NOT_A_FAULT and d.error is RecoveryError
    assert "rank 1" in d.reason
    assert "not a transient fault" in d.reason
    assert "ValueError: bad request" in d.reason
    assert "max_reinference" not in d.reason
    assert d.kinds == ()


def test_non_transient_error_wins_over_a_transient_one():
    d = decide([failed(0, 3), failed(1, 3, None, error="KeyError: 'x'")], max_reinference=3)
    assert d.action is Action.RAISE
    assert "rank 1" in d.reason and "KeyError" in d.reason
    assert d.kinds == (LINK,)


def test_no_failure_reported_recomputes_harmlessly():
    d = decide([idle(0, 4), completed(1, 5)], max_reinference=3)
    assert d.recompute
    assert "no rank reports a failure" in d.reason


# --- the position (consistency) rule ---------------------------------------------------------

def test_sample_rerun_behind_a_peer_stopped_at_next_execute_recomputes():
    # Rank 0 fails sampling RPC 10; rank 1 already sampled and is blocked in execute RPC 11,
    # which rank 0 will reach after its re-run: the collectives still pair up.
    d = decide([failed(0, 10, "oom", rpc_kind=SAMPLE), stopped(1, 11)], max_reinference=3)
    assert d.recompute, d.reason


@pytest.mark.parametrize("peer", [
    completed(1, 11, rpc_kind=SAMPLE),   # passed the forward's collectives, and sampled
    idle(1, 11),                         # the same, waiting for the next RPC
    idle(1, 10, rpc_kind=EXECUTE),       # a pipeline stage that sent its activations
    completed(1, 10),                    # the same, while the round was pending
])
def test_an_execute_rerun_that_a_peer_completed_reruns_the_step_from_its_forward(peer):
    # Rank 0 would re-run execute RPC 10, which rank 1 completed: a pipeline stage does once
    # it sent its activations (the next stage fails in its own forward), a tensor-parallel
    # rank when its peer failed after the step's last collective. Every rank re-runs step 10
    # from its forward pass, so that the transfers pair up again. (Before: refused as out of
    # step, which ended every pipeline run at its first fault on the last stage.)
    d = decide([failed(0, 10, rpc_kind=EXECUTE), peer], max_reinference=3)
    assert d.recompute, d.reason
    assert d.replay == Replay(rpc=10, step=10)
    assert "re-runs step 10 from its forward pass" in d.reason


def test_an_execute_rerun_beyond_what_a_peer_can_undo_is_out_of_step():
    d = decide([failed(0, 10, rpc_kind=EXECUTE), completed(1, 13, rpc_kind=SAMPLE)],
               max_reinference=3)
    assert d.action is Action.RAISE
    assert d.cause is Cause.OUT_OF_STEP and d.error is RecoveryInconsistent
    assert "beyond what it can undo" in d.reason and "rank 1" in d.reason


@pytest.mark.parametrize("behind, named", [
    (failed(0, 8, "oom", rpc_kind=SAMPLE), "rank 1"),
    (stopped(0, 8, rpc_kind=SAMPLE), "rank 1"),
    (idle(0, 7), "rank 0"),
])
def test_ranks_two_rpcs_apart_raise(behind, named):
    d = decide([behind, failed(1, 10)], max_reinference=3)
    assert d.action is Action.RAISE
    assert d.cause is Cause.OUT_OF_STEP
    assert "out of step" in d.reason
    assert named in d.reason


# --- a failed sampling RPC: every rank re-runs its step from the forward pass ----------------

@pytest.mark.parametrize("peer", [
    stopped(1, 11, step=6),                       # sampled step 5, stopped in the next forward
    failed(1, 11, "oom", step=6),                 # sampled step 5, failed in the next forward
    idle(1, 10),                                  # sampled step 5, waits for the next RPC
    completed(1, 10, rpc_kind=SAMPLE),            # sampled step 5 while the round was pending
    idle(1, 9),                                   # ran the forward of step 5, not its sampling
    completed(1, 9, rpc_kind=EXECUTE),
    stopped(1, 10, rpc_kind=SAMPLE, step=5),      # stopped in the same sampling RPC
    failed(1, 9, "oom", step=5),                  # failed after its last collective of step 5
    idle(1, 8),                                   # not yet at step 5: runs its forward afresh
    idle(1, 11),                                  # sampled step 5 and ran a next step that
    completed(1, 11, rpc_kind=EXECUTE),           # had no forward (it forgot finished requests)
])
def test_a_failed_sampling_rpc_reruns_its_step_from_the_forward_pass(peer):
    d = decide([failed(0, 10, "oom", rpc_kind=SAMPLE, step=5), peer], max_reinference=3)
    assert d.recompute, d.reason
    assert d.replay == Replay(rpc=9, step=5)
    assert "re-runs step 5 from its forward pass" in d.reason


def test_the_earliest_failed_sampling_rpc_sets_the_step_rerun():
    d = decide([stopped(0, 10, rpc_kind=SAMPLE, step=5), failed(1, 10, "oom", rpc_kind=SAMPLE,
                                                                step=5)], max_reinference=3)
    assert d.replay == Replay(rpc=9, step=5)


@pytest.mark.parametrize("peer", [
    completed(1, 12, rpc_kind=SAMPLE),    # sampled the next step too
    stopped(1, 13, step=7),               # two steps ahead
    idle(1, 7),                           # behind the step's forward by a sampling RPC
    failed(1, 12, "oom", rpc_kind=SAMPLE, step=6),  # failed sampling a later step
])
def test_a_rank_beyond_what_it_can_undo_makes_the_rerun_out_of_step(peer):
    d = decide([failed(0, 10, "oom", rpc_kind=SAMPLE, step=5), peer], max_reinference=3)
    assert d.action is Action.RAISE and d.cause is Cause.OUT_OF_STEP
    assert d.error is RecoveryInconsistent
    assert "re-run from its forward pass (RPC 9)" in d.reason
    assert "beyond what it can undo" in d.reason


def test_without_a_sampling_failure_nothing_is_rerun_from_a_forward_pass():
    d = decide([failed(0, 11), idle(1, 10)], max_reinference=3)
    assert d.recompute and d.replay is None


def test_idle_rank_one_behind_recomputes():
    # Rank 1 finished sampling RPC 6 and waits between steps; rank 0 fails in execute RPC 7:
    # both will next run RPC 7.
    d = decide([failed(0, 7), idle(1, 6)], max_reinference=3)
    assert d.recompute, d.reason
    # Idle after the RPC the failing rank re-runs (rank 1 completed sampling RPC 6, rank 0
    # fails sampling RPC 6): rank 0 is the one behind, at a sampling RPC: fine.
    d = decide([failed(0, 6, "oom", rpc_kind=SAMPLE), idle(1, 6)], max_reinference=3)
    assert d.recompute, d.reason


def test_completed_rank_at_same_rpc_as_failed_sampler_recomputes():
    # Rank 1 completed sampling RPC 6 while rank 0's sampling RPC 6 failed.
    d = decide([failed(0, 6, "oom", rpc_kind=SAMPLE), completed(1, 6, rpc_kind=SAMPLE)],
               max_reinference=3)
    assert d.recompute, d.reason


@pytest.mark.parametrize("statuses", [
    [stopped(0, 7), failed(1, 7), idle(2, 6), failed(3, 7, "oom")],
    [failed(0, 10, "oom", rpc_kind=SAMPLE), stopped(1, 11), stopped(2, 11)],
    [failed(0, 10, rpc_kind=EXECUTE), completed(1, 11, rpc_kind=SAMPLE), stopped(2, 11)],
    [failed(0, 10, "oom", rpc_kind=SAMPLE, step=5), stopped(1, 11, step=6), idle(2, 10)],
    [failed(0, 3), failed(1, 3, None, error="ValueError: x"), stopped(2, 3)],
    [stopped(0, 4, failures=4), failed(1, 4, failures=4), idle(2, 3)],
    [failed(0, 8, "oom", rpc_kind=SAMPLE), idle(1, 7), failed(2, 10)],
])
def test_decision_does_not_depend_on_report_order(statuses):
    reference = decide(statuses, max_reinference=3)
    for perm in itertools.permutations(statuses):
        d = decide(list(perm), max_reinference=3)
        assert d == reference  # action, cause, reason and kinds
        assert d.statuses == reference.statuses
        assert [s.rank for s in d.statuses] == sorted(s.rank for s in statuses)


# --- RankStatus ------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [
    failed(1, 12, rpc_kind=SAMPLE, failures=2, step=6),
    stopped(0, 3),
    idle(2, 0, rpc_kind=NONE),
    completed(3, 5),
    failed(4, 1, None, error='ValueError: "quoted" \u00e9'),
])
def test_rank_status_json_round_trip(status):
    text = status.to_json()
    assert isinstance(text, str)
    back = RankStatus.from_json(text)
    assert back == status
    assert back.state is status.state and back.rpc_kind is status.rpc_kind
    assert RankStatus.from_json(text.encode()) == status


def test_rank_status_next_rpc():
    assert failed(0, 5).next_rpc == 5 and failed(0, 5).reruns
    assert stopped(0, 5).next_rpc == 5
    assert idle(0, 5).next_rpc == 6 and not idle(0, 5).reruns
    assert completed(0, 5).next_rpc == 6


# --- repairs: what every rank rebuilds, what a rank cannot repair ---------------------------

def test_lost_kv_is_the_union_of_every_ranks_report():
    import dataclasses

    a = dataclasses.replace(failed(0, 4, "uce"), kv_lost=(7, 3))
    b = dataclasses.replace(failed(1, 4, "uce"), kv_lost=(3, 9))
    decision = decide([a, b], max_reinference=3)
    assert decision.recompute
    assert decision.kv_lost == (3, 7, 9) and not decision.kv_lost_all
    reset = dataclasses.replace(failed(1, 4, "device_reset"), kv_lost_all=True)
    assert decide([stopped(0, 4), reset], 3).kv_lost_all


def test_an_unrepairable_fault_makes_the_round_raise_with_why():
    import dataclasses

    hit = dataclasses.replace(failed(1, 4, "uce"), unrecoverable="no address for the error")
    decision = decide([stopped(0, 4), hit], 3)
    assert decision.action is Action.RAISE
    assert decision.cause is Cause.UNREPAIRABLE and decision.error is RecoveryError
    assert decision.reason == "rank 1: uce cannot be repaired: no address for the error"


def test_status_with_repairs_survives_the_side_channel():
    import dataclasses

    status = dataclasses.replace(failed(1, 4, "uce"), kv_lost=(2, 5),
                                 reload_params=("model.norm.weight",))
    assert RankStatus.from_json(status.to_json()) == status
