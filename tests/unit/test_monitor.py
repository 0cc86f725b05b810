"""RecoveryMonitor's bookkeeping of where a rank stands, with a peer played by the test."""

from __future__ import annotations

import threading
import time

import pytest

from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError
from ftkit.recovery import (Cause, Coordinator, MemoryChannel, RankState, RankStatus,
                            RecoveryMonitor, SideChannels)
from ftkit.recovery.coordinator import Decision, Replay, trigger_key
from ftkit.recovery.monitor import IdleReplayStopped


def peer_reports(channel: MemoryChannel, epoch: int, status: RankStatus) -> None:
    channel.set(f"round/{epoch}/status/{status.rank}", status.to_json())
    channel.set(trigger_key(epoch), str(status.rank))
    channel.wait([f"round/{epoch}/status/0"], 10)
    channel.set(f"round/{epoch}/done/{status.rank}", "x")


def make_monitor(channel: MemoryChannel, *, round_timeout_s: float = 10,
                 rebuild=lambda decision, times: None, on_round=None) -> RecoveryMonitor:
    coordinator = Coordinator(0, 2, max_reinference=3, round_timeout_s=round_timeout_s,
                              rebuild=rebuild)
    return RecoveryMonitor(coordinator, SideChannels(channel, lambda: channel),
                           stop_communication=lambda: None, gate_timeout_s=5,
                           on_round=on_round)


def test_rank_between_a_failed_attempt_and_its_rerun_reports_the_rpc_it_will_rerun():
    """Regression: a peer's second flap arrived while this rank was between its rolled-back
    attempt and the re-run; the monitor reported the failed RPC as completed, and the round
    wrongly found the ranks out of step. After a round that decided to re-run, the main thread
    stays in its step (it may be undoing RPCs, which the monitor must not answer for): the
    monitor stops it, and its re-run attempt reports the RPC it re-runs."""
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
        # Before this rank re-enters RPC 5, the peer fails it again: the monitor stops the
        # step rather than answer for it, and the re-run attempt joins the round.
        stops = []
        monitor._stop_communication = lambda: stops.append(True)
        peer = threading.Thread(target=peer_reports, args=(channel, 1, RankStatus(
            1, RankState.FAILED, 5, RpcKind.EXECUTE, 2, failures=2, kind="link_break")))
        peer.start()
        assert channel.wait(["round/1/status/1"], 10)
        deadline = time.monotonic() + 10
        while not stops and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stops and not channel.has("round/1/status/0")
        monitor.enter_step(5, RpcKind.EXECUTE, 2)
        second = monitor.join_after_failure(
            RankStatus(0, RankState.STOPPED, 5, RpcKind.EXECUTE, 2, failures=2))
        peer.join(10)
        mine = RankStatus.from_json(channel.get("round/1/status/0"))
        assert mine.state is RankState.STOPPED and mine.next_rpc == 5
        assert second.recompute, second.reason
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


# --- the lock-free gate: each interleaving of a step's edges with a round's announcement -----

def announce(channel: MemoryChannel, epoch: int) -> threading.Thread:
    """A peer fails RPC 2 (sampling: rank-local, so this rank may have completed it) and
    announces round ``epoch``; it returns once the round is done."""
    peer = threading.Thread(target=peer_reports, args=(channel, epoch, RankStatus(
        1, RankState.FAILED, 2, RpcKind.SAMPLE, 1, failures=1, kind="oom")))
    peer.start()
    return peer


def eventually(condition, timeout_s: float = 10) -> bool:
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        deadline.wait(0.01)
    return condition()


def my_status(channel: MemoryChannel, epoch: int) -> RankStatus:
    assert channel.wait([f"round/{epoch}/status/0"], 10)
    return RankStatus.from_json(channel.get(f"round/{epoch}/status/0"))


def test_a_round_announced_between_steps_is_run_by_the_monitor_and_holds_the_gate():
    channel = MemoryChannel()
    entered = threading.Event()
    release = threading.Event()
    coordinator = Coordinator(0, 2, max_reinference=3, round_timeout_s=10,
                              rebuild=lambda decision, times: release.wait(10))
    monitor = RecoveryMonitor(coordinator, SideChannels(channel, lambda: channel),
                              stop_communication=lambda: None, gate_timeout_s=5)
    monitor.enter_step(1, RpcKind.EXECUTE, 1)
    assert monitor.exit_step_ok() is None
    monitor.start()
    try:
        peer = announce(channel, 0)
        assert my_status(channel, 0).state is RankState.IDLE  # the monitor reported
        step = threading.Thread(target=lambda: (monitor.enter_step(2, RpcKind.SAMPLE, 1),
                                                entered.set()))
        step.start()
        assert not entered.wait(0.3), "a step passed the gate during the monitor's round"
        release.set()
        assert entered.wait(10) and monitor.epoch == 1
        peer.join(10)
    finally:
        release.set()
        monitor.shutdown()


def test_a_round_announced_during_a_step_is_joined_when_the_step_ends():
    channel = MemoryChannel()
    stops = []
    monitor = make_monitor(channel)
    monitor._stop_communication = lambda: stops.append(True)
    monitor.start()
    try:
        monitor.enter_step(2, RpcKind.SAMPLE, 1)
        peer = announce(channel, 0)
        assert eventually(lambda: monitor._pending is not None)
        assert stops == [True]  # the step was told to stop
        decision = monitor.exit_step_ok()  # a sample RPC has no collective: it ends well
        assert decision is not None and decision.recompute
        assert my_status(channel, 0).state is RankState.COMPLETED
        peer.join(10)
    finally:
        monitor.shutdown()


def test_a_step_that_ends_without_seeing_the_announcement_leaves_the_round_to_the_monitor():
    """The step's end read "no round announced" just before the monitor announced one: the
    monitor looks again after announcing, sees the step over, and runs the round itself
    (without this, an engine with no further step would leave its peers waiting)."""
    channel = MemoryChannel()
    monitor = make_monitor(channel)

    def step_ends_unseen() -> None:  # the main thread's exit_step_ok, its reads done earlier
        monitor._completed = monitor._rpc
        monitor._in_step = False

    monitor._stop_communication = step_ends_unseen
    monitor.enter_step(2, RpcKind.EXECUTE, 1)
    monitor.start()
    try:
        peer = announce(channel, 0)
        status = my_status(channel, 0)
        assert status.state is RankState.IDLE and status.next_rpc == 3
        peer.join(10)
        assert eventually(lambda: monitor.epoch == 1) and monitor._pending is None
    finally:
        monitor.shutdown()


def test_settle_waits_for_the_round_the_monitor_runs_for_an_idle_rank_and_its_record():
    """``settle`` (the end of a workload) returns only once a round the monitor thread runs
    for this idle rank is over and recorded; at once when there is none."""
    channel = MemoryChannel()
    release = threading.Event()
    recorded = []
    monitor = make_monitor(channel, rebuild=lambda decision, times: release.wait(10),
                           on_round=lambda outcome: recorded.append(outcome.epoch))
    monitor.settle()  # nothing in flight
    monitor.start()
    settled = threading.Event()
    try:
        peer = announce(channel, 0)
        assert my_status(channel, 0).state is RankState.IDLE  # the monitor runs the round
        waiter = threading.Thread(target=lambda: (monitor.settle(), settled.set()))
        waiter.start()
        assert not settled.wait(0.3), "settle returned while the round was running"
        release.set()
        assert settled.wait(10) and recorded == [0]
        peer.join(10)
    finally:
        release.set()
        monitor.shutdown()


def test_settle_raises_after_a_failed_round():
    monitor = make_monitor(MemoryChannel(), round_timeout_s=0.05)
    monitor.settle()
    decision = monitor.join_after_failure(RankStatus(0, RankState.FAILED, 1, RpcKind.EXECUTE, 1,
                                                     failures=1, kind="oom"))
    assert not decision.recompute  # the peer never reports: PEER_SILENT
    with pytest.raises(RecoveryError, match="earlier recovery round failed"):
        monitor.settle()


# --- an idle rank's re-run that a further round stops ------------------------------------------

def idle_rerun_rig() -> tuple[MemoryChannel, RecoveryMonitor, threading.Event, list]:
    """A monitor whose rank completed RPC 3 (a forward) and is idle; its re-run callback
    records each call, and its first call blocks (as in a transfer) until the monitor stops
    the rank's communication, then reports it stopped in RPC 3. The monitor is started."""
    channel = MemoryChannel()
    stopped = threading.Event()
    monitor = RecoveryMonitor(
        Coordinator(0, 2, max_reinference=3, round_timeout_s=10,
                    rebuild=lambda decision, times: stopped.clear()),
        SideChannels(channel, lambda: channel), stop_communication=stopped.set,
        gate_timeout_s=5)
    calls: list[tuple[Decision, RankStatus]] = []

    def replay(decision: Decision, status: RankStatus) -> None:
        calls.append((decision, status))
        if len(calls) == 1:
            assert stopped.wait(10), "the further round did not stop the re-run"
            raise IdleReplayStopped(RankStatus(0, RankState.STOPPED, 3, RpcKind.EXECUTE, 2,
                                               failures=1))

    monitor.replay_when_idle = replay
    monitor.enter_step(3, RpcKind.EXECUTE, 2)
    assert monitor.exit_step_ok() is None
    monitor.start()
    # The peer fails RPC 3, which this rank completed: the monitor thread re-runs it.
    first = threading.Thread(target=peer_reports, args=(channel, 0, failed_again(1)))
    first.start()
    assert eventually(lambda: len(calls) == 1)
    first.join(10)
    return channel, monitor, stopped, calls


def failed_again(failures: int) -> RankStatus:
    return RankStatus(1, RankState.FAILED, 3, RpcKind.EXECUTE, 2, failures=failures,
                      kind="oom")


def step_in_thread(monitor: RecoveryMonitor) -> tuple[threading.Thread, threading.Event]:
    entered = threading.Event()
    step = threading.Thread(target=lambda: (monitor.enter_step(5, RpcKind.EXECUTE, 3),
                                            entered.set()))
    step.start()
    return step, entered


def test_an_idle_rerun_stopped_by_a_further_round_joins_it_with_the_gate_shut():
    """The peer fails again in the forward this idle rank re-runs, before this rank's
    transfer completes: the further round's announcement stops the re-run (its blocked
    collective), the monitor thread reports this rank stopped in RPC 3 to that round, and
    re-runs on afterwards; the step gate stays shut until then. (Before: the re-run watched
    for no further round and waited out the collective's bound: seen with two pipeline stages
    of two ranks.)"""
    channel, monitor, stopped, calls = idle_rerun_rig()
    try:
        assert calls[0][0].replay == Replay(rpc=3, step=2)
        step, entered = step_in_thread(monitor)
        second = threading.Thread(target=peer_reports, args=(channel, 1, failed_again(2)))
        second.start()
        mine = my_status(channel, 1)
        assert (mine.state, mine.rpc, mine.rpc_kind) == (RankState.STOPPED, 3, RpcKind.EXECUTE)
        assert entered.wait(10) and monitor.epoch == 2
        assert len(calls) == 2 and calls[1][1].state is RankState.STOPPED  # re-ran on
        second.join(10)
        step.join(10)
    finally:
        stopped.set()
        monitor.shutdown()


def test_the_gate_stays_shut_between_an_idle_rerun_and_the_round_that_stopped_it():
    """The crippled order: the monitor's first round had opened the gate before its re-run's
    further round, so a step could start beside the re-run (seen with two stages of two
    ranks). Here the further round's peer holds its report back: meanwhile no step passes."""
    channel, monitor, stopped, calls = idle_rerun_rig()
    try:
        channel.set(trigger_key(1), "1")  # the peer announces round 1, reports later
        assert my_status(channel, 1).state is RankState.STOPPED
        step, entered = step_in_thread(monitor)
        assert not entered.wait(0.3), "a step passed the gate between the two rounds"
        channel.set("round/1/status/1", failed_again(2).to_json())
        channel.set("round/1/done/1", "x")
        assert entered.wait(10) and len(calls) == 2
        step.join(10)
    finally:
        stopped.set()
        monitor.shutdown()
