"""StepWrapper: token-level re-inference around one rank's step.

vLLM runs a step as two RPCs on every rank: ``execute_model`` (forward, collectives) and then
``sample_tokens`` (rank-local sampling). ``StepWrapper`` wraps both. For each RPC it

1. records what the RPC is about to change: nothing for ``execute_model``, whose scheduler
   output says all it changes (``StepState.rollback_execute`` derives the undo from it); for
   ``sample_tokens``, ``StepState.begin_sample`` (references, and the states of the generators
   it draws from; never the logits),
2. runs it; if it raises, classifies the error and joins a recovery round with every rank
   (``RecoveryMonitor``): detect, stop, recover the device, rebuild communicators, agree,
3. on ``recompute``: undoes the failed attempt and runs the RPC again, up to
   ``max_reinference`` times; on ``raise``: surfaces the error to the engine, as the class
   of ``ftkit.errors`` that the decision's cause names (``Decision.error``), or as the
   original error when it is not a fault ftkit handles.

A failed sampling RPC is not re-run from the logits of its step: the sampler changed them in
place, and the fault may have hit them. The round then decides to re-run the step from its
forward pass on every rank (``Decision.replay``), and each rank gets back to just before that
step's ``execute_model`` from wherever it stands: it undoes the attempt that failed (or was
stopped), then, newest first, the RPCs it completed since (the next step's ``execute_model``
is never completed by then: its collectives need the failed rank). It runs them again in order:
``execute_model`` of the step, its sampling, and the RPC it was in. The output of an RPC the
engine already received is dropped (every rank samples alike; vLLM reads one rank's output).
For that the wrapper keeps the argument of the last two ``execute_model`` RPCs, the last
sampling record, and the worker's two step methods: references, no copies. An idle rank's part
runs in its monitor thread (``replay_when_idle``).

The fault-free path adds no collective, no device synchronisation and no lock: the sample
record and the gate's flags (``RecoveryMonitor``). A hook runs only while it wants attempts
(the injector, while a plan has faults), the lost-KV repair only while KV is lost. It is the
per-step cost of ftkit that the overhead benchmark's own-time table measures, piece by piece
(``make bench``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ftkit.contracts.step import RpcKind, StepHook
from ftkit.faults import FaultKind, classify, is_peer_stop
from ftkit.errors import RecoveryInconsistent
from ftkit.recovery.coordinator import Decision, RankState, RankStatus
from ftkit.recovery.damage import Repair
from ftkit.recovery.monitor import IdleReplayStopped, RecoveryMonitor

log = logging.getLogger("ftkit")


class StepState(Protocol):
    """What the recovery engine needs from the model runner (given by ``ftkit.vllm``)."""

    #: True while passes must run before an attempt (lost KV waits to be rebuilt, or a step
    #: has positions of its own to compute first): only then does the wrapper call
    #: ``before_attempt``.
    repair_pending: bool

    def prepare(self, scheduler_output: Any) -> Any:
        """The step to run (and keep, for re-runs) in place of ``scheduler_output``."""

    def rollback_execute(self, scheduler_output: Any) -> None:
        """Undo what ``execute_model(scheduler_output)`` changed, however far it got."""
    def begin_sample(self, scheduler_output: Any) -> Any:
        """What ``sample_tokens`` after the step of ``scheduler_output`` will change."""
    def rollback_sample(self, record: Any) -> None:
        """Undo what the sampling of ``record`` changed, whether it failed or completed (the
        step's ``rollback_execute`` follows: the step is re-run from its forward pass)."""
    def reset_batch(self) -> None: ...
    def before_attempt(self, scheduler_output: Any, call: Callable[[Any], Any]) -> None: ...
    def pending_kv(self) -> tuple[int, ...]:
        """The KV blocks this rank still has to rebuild (while ``repair_pending``): a fault
        may interrupt the rebuild on one rank after a peer finished it, and the round makes
        every rank rebuild them again (rebuilding is idempotent), so that all run the same
        forward passes before the next attempt."""


_EXECUTE, _SAMPLE = RpcKind.EXECUTE, RpcKind.SAMPLE


class StepWrapper:
    """Runs one rank's step RPCs, each attempt through the gate, failures through a round.

    The first attempt of each RPC is written out in ``execute_model`` / ``sample_tokens``
    (the fault-free path: each Python call there costs about a microsecond with the caches
    the forward pass left cold); re-runs after a failure go through ``_recover``.
    """

    def __init__(self, *, rank: int, monitor: RecoveryMonitor, state: StepState,
                 hooks: list[StepHook] | None = None,
                 recovery_enabled: bool = True,
                 is_stop_error: Callable[[BaseException], bool] = is_peer_stop,
                 assess: Callable[[FaultKind | None], Repair] | None = None,
                 recorded_fault: Callable[[], FaultKind | None] | None = None) -> None:
        self.rank = rank
        #: With recovery off the hooks (fault injection) still run and every error surfaces
        #: as it would without ftkit: the behaviour a scenario compares against.
        self.recovery_enabled = recovery_enabled
        self.monitor = monitor
        self.state = state
        self.hooks: list[StepHook] = list(hooks or [])
        #: The hooks whose ``on_attempt`` runs (``attempts_wanted``; see ``hooks_changed``).
        self._attempt_hooks: list[StepHook] = []
        self.hooks_changed()
        #: Tells a stop of this rank (a peer failed) from a fault of its own; the backend's.
        self.is_stop_error = is_stop_error
        #: What this rank's own fault destroyed (``ftkit.recovery.damage.assess_damage``).
        self.assess = assess or (lambda kind: Repair())
        #: A fault of this rank's own its device recorded, asked when a stop ended the step
        #: (``Backend.recorded_fault``).
        self.recorded_fault = recorded_fault or (lambda: None)
        self.rpc = 0  # RPCs received (execute and sample), the same count on every rank
        self.step = 0  # execute_model calls received
        #: (RPC, step, scheduler output) of the last ``execute_model`` and of the one before:
        #: what a re-run from a forward pass undoes and runs again.
        self._execute: tuple[int, int, Any] | None = None
        self._execute_before: tuple[int, int, Any] | None = None
        #: (RPC, step, grammar output, record) of the last ``sample_tokens``.
        self._sample: tuple[int, int, Any, Any] | None = None
        #: The worker's own step methods (the same on every call).
        self._calls: dict[RpcKind, Callable[[Any], Any]] = {}
        #: Recovery rounds seen when the persistent batch was last laid out afresh.
        self._layout_epoch = 0
        #: (the RPC it was in, the last RPC to run) of an idle re-run a further round stopped.
        self._idle_stopped: tuple[int, int] | None = None
        monitor.replay_when_idle = self.replay_when_idle

    def hooks_changed(self) -> None:
        """Re-read which hooks want ``on_attempt`` (call it between steps, when a hook's
        ``attempts_wanted`` changed: the injector's, when a plan is set)."""
        self._attempt_hooks = [hook for hook in self.hooks if hook.attempts_wanted]

    def execute_model(self, call: Callable[[Any], Any], scheduler_output: Any) -> Any:
        scheduler_output = self.state.prepare(scheduler_output)
        self.step = step = self.step + 1
        self.rpc = rpc = self.rpc + 1
        self._execute_before = self._execute
        self._execute = (rpc, step, scheduler_output)
        self._calls[_EXECUTE] = call
        state = self.state
        monitor = self.monitor
        epoch = monitor.enter_step(rpc, _EXECUTE, step)
        if epoch != self._layout_epoch:
            self._lay_out_afresh(epoch)
        try:
            for hook in self._attempt_hooks:
                hook.on_attempt(_EXECUTE, step, 0, scheduler_output)
            if state.repair_pending:
                # Device state a fault destroyed (lost KV) is rebuilt first, by forward
                # passes of its own: inside the attempt, so that a fault there is one too.
                state.before_attempt(scheduler_output, call)
            out = call(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - every failure goes through a round
            return self._recover(_EXECUTE, exc)
        joined = monitor.exit_step_ok()
        if joined is not None:
            return self._recover(_EXECUTE, None, joined, out)
        return out

    def sample_tokens(self, call: Callable[[Any], Any], grammar_output: Any) -> Any:
        self.rpc = rpc = self.rpc + 1
        step = self.step
        execute = self._execute
        record = self.state.begin_sample(execute[2] if execute is not None else None)
        self._sample = (rpc, step, grammar_output, record)
        self._calls[_SAMPLE] = call
        monitor = self.monitor
        monitor.enter_step(rpc, _SAMPLE, step)
        try:
            for hook in self._attempt_hooks:
                hook.on_attempt(_SAMPLE, step, 0, grammar_output)
            out = call(grammar_output)
        except Exception as exc:  # noqa: BLE001 - every failure goes through a round
            return self._recover(_SAMPLE, exc)
        joined = monitor.exit_step_ok()
        if joined is not None:
            return self._recover(_SAMPLE, None, joined, out)
        return out

    def _lay_out_afresh(self, epoch: int) -> None:
        """A round happened since this rank last laid out its batch: every rank rebuilds it
        from the request states, so that all lay it out alike."""
        self.state.reset_batch()
        self._layout_epoch = epoch

    def _recover(self, rpc_kind: RpcKind, exc: Exception | None,
                 joined: Decision | None = None, out: Any = None) -> Any:
        """After the first attempt of RPC ``self.rpc`` raised ``exc``, or returned ``out`` and
        joined the round that decided ``joined`` (a peer's fault): rounds, undos and re-runs
        until the RPC's attempt returns (that output is returned) or a round decides to raise.
        """
        monitor, goal = self.monitor, self.rpc
        at = goal  # the RPC whose attempt just failed (``exc``) or returned (``joined``)
        first_failure = time.monotonic()
        failures = 0
        rollback_s = 0.0
        while True:
            if exc is not None:
                if not self.recovery_enabled:
                    raise exc
                failures += 1
                kind, step = self._kept(at)[:2]
                status = dataclasses.replace(self._status(kind, failures, exc),
                                             rpc=at, step=step)
                decision = monitor.join_after_failure(status)
                if not decision.recompute:
                    if classify(exc) is None and not self.is_stop_error(exc):
                        raise exc  # not a fault ftkit handles: the engine sees the original error
                    raise decision.error(f"ftkit: step {self.step} not recovered: "
                                         f"{decision.reason}") from exc
                log.warning("ftkit: rank %d step %d (%s) re-inference %d after %s: %s",
                            self.rank, step, kind.value, failures, type(exc).__name__, exc)
            else:
                assert joined is not None
                decision = joined
                if not decision.recompute:
                    raise decision.error(f"ftkit: step {self.step}: a peer's fault could not "
                                         f"be recovered: {decision.reason}")
            rollback_started = time.monotonic()
            position = self._rewind(decision, at, failed=exc is not None)
            if decision.replay is not None and position <= at:
                log.warning("ftkit: rank %d (at RPC %d) re-runs step %d from its forward pass",
                            self.rank, at, decision.replay.step)
            rerun_from = time.monotonic()
            rollback_s = rerun_from - rollback_started
            exc = joined = None
            if position > goal:
                # Nothing to run again (this RPC completed and the round undid nothing): the
                # main thread leaves the step it stayed in for the round.
                joined = monitor.exit_step_ok()
            while joined is None and position <= goal:
                try:
                    result = self._attempt(position, failures)
                except Exception as again:  # noqa: BLE001 - every failure goes through a round
                    exc, at = again, position
                    break
                joined = monitor.exit_step_ok()
                at = position
                if position == goal:
                    out = result
                position += 1
            if exc is None and joined is None:
                if failures:
                    done = time.monotonic()
                    for hook in self.hooks:
                        hook.on_recovered(rpc_kind, self.step, failures, done - first_failure,
                                          rollback_s=rollback_s, rerun_s=done - rerun_from)
                return out

    def _rewind(self, decision: Decision, at: int, *, failed: bool) -> int:
        """Undo what a ``recompute`` decision needs undone, from RPC ``at`` (whose attempt
        failed, or completed); return the first RPC to run again."""
        target = at - 1 if failed else at  # the last RPC whose effects stay
        replay = decision.replay
        if replay is not None and replay.rpc - 1 < target:
            target = replay.rpc - 1
        state = self.state
        for rpc in range(at, target, -1):  # newest first; a failed attempt's, then completed
            kind, _, arg, record = self._kept(rpc)
            if kind is _EXECUTE:
                state.rollback_execute(arg)
            else:
                state.rollback_sample(record)
        return target + 1

    def _attempt(self, rpc: int, attempt: int) -> Any:
        """Run RPC ``rpc`` (this one's or one that it re-runs) through the gate, as attempt
        ``attempt`` of it (at least 1: every RPC here has run before)."""
        kind, step, arg, _ = self._kept(rpc)
        attempt = max(attempt, 1)
        call = self._calls[kind]
        if kind is _SAMPLE:
            self._renew_sample_record(rpc)
        epoch = self.monitor.enter_step(rpc, kind, step)
        if kind is _EXECUTE and rpc == self.rpc and epoch != self._layout_epoch:
            # Only the RPC in flight: a step run again re-adds its rows to the batch its
            # undo emptied, and the next step lays the batch out afresh, as on a rank that
            # ran that step again while idle.
            self._lay_out_afresh(epoch)
        for hook in self._attempt_hooks:
            hook.on_attempt(kind, step, attempt, arg)
        if kind is _EXECUTE and self.state.repair_pending:
            self.state.before_attempt(arg, call)
        return call(arg)

    def replay_when_idle(self, decision: Decision, status: RankStatus) -> None:
        """(Monitor thread, gate held, main thread between RPCs.) This idle rank's part of a
        re-run from a forward pass: undo the RPCs it completed since that step's
        ``execute_model`` and run them again; the engine already has their output.

        A further round may stop the re-run (a peer failed again in it): this raises
        ``IdleReplayStopped`` with the status to report, and keeps where it was. Called again
        after that round, it undoes the stopped attempt (and what the round's own re-run
        point needs) and runs on to the RPC the engine had seen, whatever that round
        decided to re-run."""
        stopped, self._idle_stopped = self._idle_stopped, None
        if stopped is not None:
            at, end = stopped
            start = self._rewind(decision, at, failed=True)
        else:
            replay = decision.replay
            if replay is None or status.rpc < replay.rpc:
                return
            log.warning("ftkit: rank %d (idle after RPC %d) re-runs step %d from its forward "
                        "pass", self.rank, status.rpc, replay.step)
            end = status.rpc
            start = self._rewind(decision, end, failed=False)
        state = self.state
        for rpc in range(start, end + 1):
            kind, step, arg, _ = self._kept(rpc)
            call = self._calls[kind]
            if kind is _SAMPLE:
                self._renew_sample_record(rpc)
            for hook in self._attempt_hooks:
                hook.on_attempt(kind, step, 1, arg)
            try:
                if kind is _EXECUTE and state.repair_pending:
                    state.before_attempt(arg, call)
                call(arg)
            except Exception as exc:
                if not self.is_stop_error(exc):
                    raise
                self._idle_stopped = (rpc, end)
                raise IdleReplayStopped(dataclasses.replace(
                    self._status(kind, 1, exc), rpc=rpc, step=step)) from exc

    def _renew_sample_record(self, rpc: int) -> None:
        """Before sampling RPC ``rpc`` runs again: its record anew, as its first run took it.

        The re-run of the step's forward pass may have rebuilt request states (a request the
        step introduced is forgotten by the undo and added again, with a new generator): the
        record must name the generators this run samples with, and a resumed request's new
        generator must be fast-forwarded again (``StepState.begin_sample``)."""
        _, step, arg, _ = self._kept(rpc)
        # The step's execute_model, when it is kept (``sample_tokens`` takes it as it finds).
        forward = next((kept[2] for kept in (self._execute, self._execute_before)
                        if kept is not None and kept[0] == rpc - 1), None)
        self._sample = (rpc, step, arg, self.state.begin_sample(forward))

    def _kept(self, rpc: int) -> tuple[RpcKind, int, Any, Any]:
        """(kind, step, argument, sample record) of RPC ``rpc``, one of the last three."""
        for kept in (self._execute, self._execute_before):
            if kept is not None and kept[0] == rpc:
                return _EXECUTE, kept[1], kept[2], None
        sample = self._sample
        if sample is not None and sample[0] == rpc:
            return _SAMPLE, sample[1], sample[2], sample[3]
        raise RecoveryInconsistent(f"ftkit: rank {self.rank} cannot re-run RPC {rpc}: it keeps "
                                   f"only its last step and the next forward pass")

    def _status(self, rpc_kind: RpcKind, failures: int, exc: BaseException) -> RankStatus:
        """This rank's report to the round. A rank stopped for a peer's fault may have one of
        its own that the stop's error hides (on Ascend, a UCE its device recorded before the
        stop): asked now, before the round's restart clears the record, it makes the rank
        failed with that kind, and its repair part of the round."""
        error = f"{type(exc).__name__}: {exc}"
        stopped = self.is_stop_error(exc)
        kind = self.recorded_fault() if stopped else classify(exc)
        if stopped and kind is not None:
            error = f"{kind.value} recorded by the device before this rank was stopped; {error}"
        repair = self.assess(kind) if kind is not None else Repair()
        kv_lost = repair.kv_lost
        if self.state.repair_pending:
            kv_lost = tuple(sorted({*kv_lost, *self.state.pending_kv()}))
        return RankStatus(
            rank=self.rank,
            state=RankState.STOPPED if stopped and kind is None else RankState.FAILED,
            rpc=self.rpc,
            rpc_kind=rpc_kind,
            step=self.step,
            failures=failures,
            kind=None if kind is None else kind.value,
            error=error[:500],
            kv_lost=kv_lost,
            kv_lost_all=repair.kv_lost_all,
            reload_params=repair.reload_params,
            unrecoverable=repair.unrecoverable,
        )
