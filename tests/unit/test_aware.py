"""FaultAware's bookkeeping of where a rank stands, with a peer played by the test."""

from __future__ import annotations

import threading

from ftkit.recovery.aware import FaultAware
from ftkit.recovery.coordinator import (Coordinator, MemoryChannel, RankState, RankStatus,
                                        RpcKind, trigger_key)


def peer_reports(channel: MemoryChannel, epoch: int, status: RankStatus) -> None:
    channel.set(f"round/{epoch}/status/{status.rank}", status.to_json())
    channel.set(trigger_key(epoch), str(status.rank))
    channel.wait([f"round/{epoch}/status/0"], 10)
    channel.set(f"round/{epoch}/done/{status.rank}", "x")


def make_aware(channel: MemoryChannel) -> FaultAware:
    coordinator = Coordinator(0, 2, max_reinference=3, round_timeout_s=10,
                              rebuild=lambda decision: None)
    return FaultAware(coordinator, main_channel=channel, channel_factory=lambda: channel,
                      stop_communication=lambda: None)


def test_rank_between_a_failed_attempt_and_its_rerun_reports_the_rpc_it_will_rerun():
    """Regression: a peer's second flap arrived while this rank was between its rolled-back
    attempt and the re-run; the monitor reported the failed RPC as completed, and the round
    wrongly found the ranks out of step."""
    channel = MemoryChannel()
    aware = make_aware(channel)
    aware.start()
    try:
        aware.enter_step(4, RpcKind.SAMPLE, 1, 5)
        assert aware.exit_step_ok() is None
        # RPC 5 fails on the peer; this rank is stopped in it and joins the round.
        aware.enter_step(5, RpcKind.EXECUTE, 2, 5)
        peer = threading.Thread(target=peer_reports, args=(channel, 0, RankStatus(
            1, RankState.FAILED, 5, RpcKind.EXECUTE, 2, failures=1, kind="link_break")))
        peer.start()
        first = aware.join_after_failure(RankStatus(0, RankState.STOPPED, 5, RpcKind.EXECUTE,
                                                    2, failures=1))
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
        aware.shutdown()
