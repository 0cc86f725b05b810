"""RecoveryMonitor's bookkeeping of where a rank stands, with a peer played by the test."""

from __future__ import annotations

import threading

import pytest

from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError
from ftkit.recovery import (Cause, Coordinator, MemoryChannel, RankState, RankStatus,
                            RecoveryMonitor, SideChannels)
from ftkit.recovery.coordinator import trigger_key


def peer_reports(channel: MemoryChannel, epoch: int, status: RankStatus) -> None:
    channel.set(f"round/{epoch}/status/{status.rank}", status.to_json())
    channel.set(trigger_key(epoch), str(status.rank))
    channel.wait([f"round/{epoch}/status/0"], 10)
    channel.set(f"round/{epoch}/done/{status.rank}", "x")


def make_monitor(channel: MemoryChannel) -> RecoveryMonitor:
    coordinator = Coordinator(0, 2, max_reinference=3, round_timeout_s=10,
                              rebuild=lambda decision, times: None)
    return RecoveryMonitor(coordinator, SideChannels(channel, lambda: channel),
                           stop_communication=lambda: None, gate_timeout_s=5)


def test_rank_between_a_failed_attempt_and_its_rerun_reports_the_rpc_it_will_rerun():
    """Regression: a peer's second flap arrived while this rank was between its rolled-back
    attempt and the re-run; the monitor reported the failed RPC as completed, and the round
    wrongly found the ranks out of step."""
    channel = MemoryChannel()
    monitor = make_monitor(channel)
    monitor.start()
    try:
        monitor.enter_step(4, RpcKind.SAMPLE, 1)
        assert monitor.exit_step_ok() is None
        # RPC 5 fails on the peer; this rank is stopped in it and joins the round.
        monitor.enter_step(5, RpcKind.EXECUTE, 2)
        peer = threading.Thread(target=peer_reports, args=(channel, 0, RankStatus(
            1, RankState.FAILED, 5, RpcKind.EXECUTE, 2, failures=1, kind="link_break")))
        peer.start()
        first = monitor.join_after_failure(
            RankStatus(0, RankState.STOPPED, 5, RpcKind.EXECUTE, 2, failures=1))
        peer.join(10)
        assert first.recompute
        # Before this rank re-enters RPC 5, the peer fails it again: the monitor answers.
        peer_reports(channel, 1, RankStatus(1, RankState.FAILED, 5, RpcKind.EXECUTE, 2,
                                            failures=2, kind="link_break"))
        mine = RankStatus.from_json(channel.get("round/1/status/0"))
        assert mine.state is RankState.IDLE
        assert mine.next_rpc == 5
        assert channel.wait(["round/1/done/0"], 10)
        assert channel.get("round/1/done/0") == b"recompute"
    finally:
        monitor.shutdown()


def test_a_peer_that_never_reports_makes_the_round_raise_as_peer_silent():
    coordinator = Coordinator(0, 2, max_reinference=3, round_timeout_s=0.05,
                              rebuild=lambda decision, times: None)
    decision = coordinator.participate(MemoryChannel(), 0, RankStatus(
        0, RankState.FAILED, 3, RpcKind.EXECUTE, 2, failures=1, kind="link_break"))
    assert decision.cause is Cause.PEER_SILENT
    assert "rank(s) [1] did not report" in decision.reason


def test_a_rebuild_that_raises_ends_the_rank_as_round_failed_and_shuts_its_gate():
    def broken_rebuild(decision, times):
        raise RuntimeError("communicators could not be rebuilt")

    coordinator = Coordinator(0, 1, max_reinference=3, round_timeout_s=1,
                              rebuild=broken_rebuild)
    outcomes = []
    monitor = RecoveryMonitor(coordinator, SideChannels(MemoryChannel(), None),
                              stop_communication=lambda: None, gate_timeout_s=1,
                              on_round=outcomes.append)
    monitor.enter_step(1, RpcKind.EXECUTE, 1)
    decision = monitor.join_after_failure(RankStatus(
        0, RankState.FAILED, 1, RpcKind.EXECUTE, 1, failures=1, kind="oom"))
    assert decision.cause is Cause.ROUND_FAILED and decision.error is RecoveryError
    assert [o.decision for o in outcomes] == [decision]
    assert outcomes[0].epoch == 0 and outcomes[0].stop_requested is None
    with pytest.raises(RecoveryError, match="an earlier recovery round failed"):
        monitor.enter_step(2, RpcKind.EXECUTE, 2)


def test_the_round_outcome_carries_the_rebuild_parts_the_rebuild_timed():
    def rebuild(decision, times):
        times.device_s, times.repair_s = 0.25, 0.5

    coordinator = Coordinator(0, 1, max_reinference=3, round_timeout_s=1, rebuild=rebuild)
    outcomes = []
    monitor = RecoveryMonitor(coordinator, SideChannels(MemoryChannel(), None),
                              stop_communication=lambda: None, gate_timeout_s=1,
                              on_round=outcomes.append)
    monitor.enter_step(1, RpcKind.EXECUTE, 1)
    assert monitor.join_after_failure(RankStatus(
        0, RankState.FAILED, 1, RpcKind.EXECUTE, 1, failures=1, kind="oom")).recompute
    (outcome,) = outcomes
    assert (outcome.times.device_s, outcome.times.comms_s, outcome.times.repair_s) == \
        (0.25, None, 0.5)
    assert outcome.status.kind == "oom" and outcome.duration_s >= 0
