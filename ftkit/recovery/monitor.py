"""RecoveryMonitor: one rank's monitor thread and step gate.

The monitor thread waits (event driven, on the side channel) for the announcement of the
next recovery round. When one comes it either

* stops this rank's communication, if the main thread is inside a step: the step's blocked
  or next collective raises ``CommunicationStopped`` and the main thread joins the round; or
* takes part in the round itself, if the main thread is between steps, holding the step gate
  shut so that no step starts while communicators are being rebuilt.

The main thread passes the gate before each attempt of a step (``enter_step``) and leaves it
when the attempt returned (``exit_step_ok``) or joins the round when it raised
(``join_after_failure``). After a round it took part in that decided to re-run, it stays in the
step until an attempt returns (``exit_step_ok`` again). As a round begins, whichever thread
runs it, the round-start callback gets its epoch; after it, the round callback gets a
``RoundOutcome``.

The gate takes no lock on the fault-free path: the main thread writes that it is in a step,
then looks whether the monitor owns a round (or failed one); the monitor, under the lock,
writes its claim on a round, then looks whether the main thread is in a step, and withdraws
the claim if so (``_claim``). Each writes before it reads, and CPython runs the two threads'
bytecodes in one order, so at least one of them sees the other: never both a step and a
round at once. Leaving a step, the main thread writes that it left, then looks for a round
announced meanwhile; the monitor, after announcing one to a step, looks again whether the step
is over, and runs the round itself if it is (whichever of the two takes it under the lock
first runs it). Everything off the fault-free path takes the lock, as before.

A round that re-runs a step from its forward pass (``Decision.replay``, after a sampling
fault, or a forward pass that a peer completed) needs every rank in that forward, an idle one
too: the monitor thread runs the idle rank's part (``replay_when_idle``, the step wrapper's)
before it opens the gate again. Meanwhile a thread of its own watches for a further round (a
peer may fail again in that very forward, a flap): its announcement stops the re-run's
communication, and the monitor thread takes part in that round, still for the idle rank,
stopped in the RPC it was re-running (``IdleReplayStopped``), then re-runs on from there as
that round decides.

The monitor survives every round, whatever its decision, and every one of its waits is
bounded; an unexpected error in it is logged and the loop goes on (the earlier design's
monitor died on its first distributed error and left later faults uncoordinated).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftkit.bounds import MONITOR_ERROR_PAUSE_S, MONITOR_WAKE_S, ROUND_WATCH_SLICE_S
from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError
from ftkit.recovery.channel import SideChannel, SideChannels
from ftkit.recovery.coordinator import (
    Action,
    Cause,
    Coordinator,
    Decision,
    RankState,
    RankStatus,
    RoundTimes,
    trigger_key,
)

log = logging.getLogger("ftkit")


@dataclass(frozen=True)
class RoundOutcome:
    """One rank's part of one round, as the round callback receives it."""

    epoch: int
    #: What this rank reported.
    status: RankStatus
    decision: Decision
    #: Seconds this rank spent in the round.
    duration_s: float
    #: ``time.time()`` when this rank's part of the round began.
    started: float
    #: ``time.time()`` when this rank's monitor stopped its step for this round (it learnt
    #: of a peer's fault then), or ``None``.
    stop_requested: float | None
    times: RoundTimes


RoundCallback = Callable[[RoundOutcome], None]
#: Told the epoch of a round as this rank's part of it begins (either thread).
RoundStartCallback = Callable[[int], None]
#: Runs an idle rank's part of a round that re-runs a step from its forward pass (given the
#: decision and what the rank reported); set by the step wrapper. Raises
#: ``IdleReplayStopped`` when a further round stopped it.
IdleReplay = Callable[[Decision, RankStatus], None]


class IdleReplayStopped(Exception):
    """An idle rank's re-run was stopped by a further round (a peer failed again in it):
    ``status`` is what the rank reports to that round, stopped in the RPC it was re-running.
    The re-run's callback keeps where it was, and goes on from there after that round."""

    def __init__(self, status: RankStatus) -> None:
        super().__init__(f"rank {status.rank}: re-run of RPC {status.rpc} stopped")
        self.status = status


class RecoveryMonitor:
    """The monitor thread and the step gate of one rank, and the state they share."""

    def __init__(self, coordinator: Coordinator, channels: SideChannels, *,
                 stop_communication: Callable[[], None], gate_timeout_s: float,
                 on_round: RoundCallback | None = None,
                 on_round_start: RoundStartCallback | None = None) -> None:
        self.coordinator = coordinator
        self._channels = channels
        #: Bound on a step's wait at the gate while the monitor runs a round.
        self.gate_timeout_s = gate_timeout_s
        self._stop_communication = stop_communication
        self._on_round = on_round
        self._on_round_start = on_round_start
        #: The step wrapper's ``replay_when_idle`` (``None``: nothing to replay).
        self.replay_when_idle: IdleReplay | None = None
        # The lock of everything off the fault-free path (the gate's fast path takes none:
        # see the module); a plain lock, as no thread takes it twice. ``_cond`` waits and
        # notifies on it.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.epoch = 0
        self._in_step = False
        self._owner: str | None = None  # "main" | "monitor" while a round is being run
        self._pending: int | None = None  # epoch announced while the main thread was in a step
        self._failed: Decision | None = None  # a round ended in "raise": the rank is done
        self._rpc = 0  # counter of the RPC in flight (or last entered)
        self._rpc_kind = RpcKind.NONE
        #: The last RPC this rank completed. Between a failed attempt and its re-run the rank
        #: is idle, but its next RPC is the one it failed, not the one after it.
        self._completed = 0
        self._step = 0
        self._shutdown = threading.Event()
        self._thread: threading.Thread | None = None
        #: (epoch, ``time.time()``) of the last round for which the monitor stopped this
        #: rank's step: when this rank learnt of a peer's fault.
        self._last_stop_request: tuple[int, float] | None = None
        #: The monitor thread is running a round for this idle rank, its record included.
        self._monitor_busy = False
        #: The channel of the watch for a further round during an idle re-run (made once).
        self._watch_channel: SideChannel | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._channels.for_monitor is None or self.coordinator.world_size == 1:
            return  # a world of one has nobody to announce faults to it
        self._thread = threading.Thread(target=self._monitor, name="ftkit-monitor", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._shutdown.set()

    # --- main thread --------------------------------------------------------------------------

    def enter_step(self, rpc: int, rpc_kind: RpcKind, step: int) -> int:
        """Called before each attempt of a step RPC; waits (at most ``gate_timeout_s``)
        while the monitor runs a round, and raises ``RecoveryError`` if a round failed.

        Returns the number of recovery rounds this rank has completed (its epoch)."""
        self._in_step = True  # written before the monitor's claim is read: see the module
        if self._owner is None and self._failed is None:
            self._rpc, self._rpc_kind, self._step = rpc, rpc_kind, step
            return self.epoch
        return self._enter_waiting(rpc, rpc_kind, step)

    def _enter_waiting(self, rpc: int, rpc_kind: RpcKind, step: int) -> int:
        with self._lock:
            self._in_step = False  # waiting, not in a step, until the round is over
            self._await_monitor(lambda: self._owner != "monitor")
            self._in_step = True
            self._rpc, self._rpc_kind, self._step = rpc, rpc_kind, step
            return self.epoch

    def exit_step_ok(self) -> Decision | None:
        """Called when a step RPC returned. Joins a round announced meanwhile, if any."""
        self._completed = self._rpc  # before leaving: an idle rank reports it
        self._in_step = False  # written before a round announced meanwhile is read
        if self._pending is None:
            return None
        with self._lock:
            epoch = self._pending
            if epoch is None:
                return None  # the monitor saw this step end and runs the round itself
            self._pending = None
            self._owner = "main"
        status = RankStatus(self.coordinator.rank, RankState.COMPLETED, self._rpc,
                            self._rpc_kind, self._step)
        return self._run_round(self._channels.main, epoch, status, owner="main")

    def settle(self) -> None:
        """(Main thread, between RPCs.) Wait, at most ``gate_timeout_s``, until a round that
        the monitor thread runs for this idle rank is over and recorded; raise
        ``RecoveryError`` if it, or an earlier round, failed.

        A rank whose output nobody waits for (every rank but the output rank) may still be in
        its last step, or recovering it, when the engine already has that step's output: a
        caller that needs every rank quiet (the end of a workload) asks every rank to settle,
        then again, since a peer's round may have begun only after this rank settled."""
        with self._lock:
            self._await_monitor(lambda: not self._monitor_busy)

    def _await_monitor(self, done: Callable[[], bool]) -> None:
        """(Lock held.) Wait, at most ``gate_timeout_s``, until ``done()`` (the monitor
        thread's round is over); raise ``RecoveryError`` if it is not, or a round failed."""
        if not self._cond.wait_for(done, self.gate_timeout_s):
            raise RecoveryError(f"recovery round {self.epoch} did not finish within "
                                f"{self.gate_timeout_s:g} s")
        if self._failed is not None:
            raise RecoveryError(f"an earlier recovery round failed: {self._failed.reason}")

    def join_after_failure(self, status: RankStatus) -> Decision:
        """Called by the main thread when its step raised: runs this rank's part of the round."""
        with self._lock:
            epoch = self.epoch if self._pending is None else self._pending
            self._pending = None
            self._in_step = False
            self._owner = "main"
        return self._run_round(self._channels.main, epoch, status, owner="main")

    # --- monitor thread -------------------------------------------------------------------------

    def _monitor(self) -> None:
        assert self._channels.for_monitor is not None
        channel = self._channels.for_monitor()
        while not self._shutdown.is_set():
            try:
                self._watch_once(channel)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one round
                log.exception("ftkit monitor: error while watching for faults; continuing")
                time.sleep(MONITOR_ERROR_PAUSE_S)

    def _watch_once(self, channel: SideChannel) -> None:
        with self._lock:
            epoch = self.epoch
        if not channel.wait([trigger_key(epoch)], MONITOR_WAKE_S):
            return
        with self._lock:
            if self.epoch != epoch or self._owner == "main":
                claimed = False  # the main thread runs this round
            elif self._pending == epoch:
                # Announced to a step earlier: run it here if that step has ended since.
                claimed = self._claim_pending()
            elif self._claim():
                claimed = True  # the main thread is between steps
            else:
                # The main thread is in a step: stop it; its failure (or its step's end)
                # joins the round, unless the step ended meanwhile without seeing it.
                self._pending = epoch
                self._last_stop_request = (epoch, time.time())
                self._stop_communication()
                claimed = self._claim_pending()
            if not claimed:
                # The main thread runs (or will run) this round; wait until it is over.
                self._cond.wait_for(lambda: self.epoch != epoch or self._shutdown.is_set(),
                                    MONITOR_WAKE_S)
                return
            self._monitor_busy = True
        status = RankStatus(self.coordinator.rank, RankState.IDLE, self._completed,
                            RpcKind.NONE, self._step)
        try:
            decision = self._run_round(channel, epoch, status, owner="monitor")
        finally:
            with self._lock:
                self._monitor_busy = False
                self._cond.notify_all()
        if not decision.recompute:
            log.error("ftkit: recovery round %d decided to raise: %s", epoch, decision.reason)

    def _claim(self) -> bool:
        """(Lock held.) Take the next round for the monitor thread, unless the main thread is
        in a step: the claim is written first, then the step looked at (see the module)."""
        self._owner = "monitor"
        if self._in_step:
            self._owner = None
            return False
        return True

    def _claim_pending(self) -> bool:
        """(Lock held.) Take the round announced to a step that has ended since (its end did
        not see the announcement, or has not taken the lock to run it yet)."""
        if not self._claim():
            return False
        self._pending = None
        return True

    # --- one round ------------------------------------------------------------------------------

    def _replay_idle(self, decision: Decision, status: RankStatus,
                     epoch: int) -> tuple[Decision, RankStatus | None]:
        """(Monitor thread, gate held.) This idle rank's part of a re-run from a forward pass,
        while watching for round ``epoch + 1``: a peer may fail again in that very forward,
        and its round then stops this re-run's communication. Returns the round's decision
        (``raise`` if the re-run failed) and, when round ``epoch + 1`` stopped it, the status
        this rank reports to that round."""
        assert self.replay_when_idle is not None
        stop_watching = self._watch_for_round(epoch + 1)
        try:
            self.replay_when_idle(decision, status)
        except IdleReplayStopped as stopped:
            return decision, stopped.status
        except Exception as exc:  # noqa: BLE001 - a failed replay is a clean failure
            step = decision.replay.step if decision.replay is not None else status.step
            log.exception("ftkit: rank %d could not re-run step %d while idle",
                          self.coordinator.rank, step)
            return Decision(Action.RAISE, Cause.ROUND_FAILED,
                            f"rank {self.coordinator.rank} could not re-run step {step} from "
                            f"its forward pass while idle: {type(exc).__name__}: {exc}",
                            decision.kinds, decision.statuses), None
        finally:
            stop_watching()
        return decision, None

    def _watch_for_round(self, epoch: int) -> Callable[[], None]:
        """Watch, in a thread of its own, for the announcement of round ``epoch`` and stop this
        rank's communication when it comes; returns what ends the watch (and waits for it)."""
        assert self._channels.for_monitor is not None
        done = threading.Event()
        if self._watch_channel is None:  # (one watch at a time: the last is joined)
            self._watch_channel = self._channels.for_monitor()
        channel = self._watch_channel

        def watch() -> None:
            # Polled, not a blocking wait: the store's wait does not end sooner than about a
            # second, which the end of every re-run would then wait for (measured: rounds of
            # an idle re-run took 1.1 s instead of 0.1 s).
            while not done.wait(ROUND_WATCH_SLICE_S):
                if channel.has(trigger_key(epoch)):
                    self._last_stop_request = (epoch, time.time())
                    self._stop_communication()
                    return

        thread = threading.Thread(target=watch, name="ftkit-replay-watch", daemon=True)
        thread.start()

        def stop_watching() -> None:
            done.set()
            thread.join(MONITOR_WAKE_S)

        return stop_watching

    def _run_round(self, channel: SideChannel, epoch: int, status: RankStatus,
                   owner: str) -> Decision:
        if self._on_round_start is not None:
            try:
                self._on_round_start(epoch)
            except Exception:  # noqa: BLE001 - recording must never break recovery
                log.exception("ftkit: recording the start of recovery round %d failed", epoch)
        started = time.monotonic()
        wall = time.time()
        try:
            decision = self.coordinator.participate(channel, epoch, status)
        except Exception as exc:  # noqa: BLE001 - a broken round is a clean failure
            decision = Decision(Action.RAISE, Cause.ROUND_FAILED,
                                f"recovery round {epoch} failed on rank "
                                f"{self.coordinator.rank}: {type(exc).__name__}: {exc}")
        further: RankStatus | None = None
        # (A rank stopped in its own re-run while idle re-runs on, whatever this round re-runs.)
        if owner == "monitor" and self.replay_when_idle is not None and decision.recompute \
                and (decision.replay is not None or status.state is RankState.STOPPED):
            decision, further = self._replay_idle(decision, status, epoch)
        duration = time.monotonic() - started
        with self._lock:
            if not decision.recompute:
                self._failed = decision
            elif owner == "main":
                # The main thread goes on in the step: it undoes and re-runs what the round
                # decided, which the monitor must not take for an idle rank's state (it stops
                # the step for a further round instead); ``exit_step_ok`` ends it.
                self._in_step = True
            self.epoch = epoch + 1
            if self._owner == owner and further is None:
                # (A re-run that the next round stopped keeps the gate shut: this thread runs
                # that round, and re-runs on, before any step may start.)
                self._owner = None
            self._cond.notify_all()
        if self._on_round is not None:
            stop = self._last_stop_request
            outcome = RoundOutcome(epoch, status, decision, duration, wall,
                                   stop[1] if stop is not None and stop[0] == epoch else None,
                                   self.coordinator.last_times)
            try:
                self._on_round(outcome)
            except Exception:  # noqa: BLE001 - recording must never break recovery
                log.exception("ftkit: recording recovery round %d failed", epoch)
        if further is not None:
            # A peer failed again in the re-run: this rank's part of that round, still idle.
            return self._run_round(channel, epoch + 1, further, owner)
        return decision
