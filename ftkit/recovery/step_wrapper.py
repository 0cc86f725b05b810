"""StepWrapper: token-level re-inference around one rank's step.

vLLM runs a step as two RPCs on every rank: ``execute_model`` (forward, collectives) and then
``sample_tokens`` (rank-local sampling). ``StepWrapper`` wraps both. For each RPC it

1. records what the RPC is about to change: nothing for ``execute_model``, whose scheduler
   output says all it changes (``StepState.rollback_execute`` derives the undo from it); for
   ``sample_tokens``, ``StepState.begin_sample`` (references, and copies only of what a random
   re-sample needs),
2. runs it; if it raises, classifies the error and joins a recovery round with every rank
   (``RecoveryMonitor``): detect, stop, recover the device, rebuild communicators, agree,
3. on ``recompute``: restores the recorded state and runs the same RPC again, up to
   ``max_reinference`` times; on ``raise``: surfaces the error to the engine, as the class
   of ``ftkit.errors`` that the decision's cause names (``Decision.error``), or as the
   original error when it is not a fault ftkit handles.

The fault-free path adds no collective, no device synchronisation and no lock: the sample
record and the gate's flags (``RecoveryMonitor``). A hook runs only while it wants attempts
(the injector, while a plan has faults), the lost-KV repair only while KV is lost. It is the
per-step cost of ftkit that the overhead benchmark's own-time table measures, piece by piece
(``make bench``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ftkit.contracts.step import RpcKind, StepHook
from ftkit.faults import FaultKind, classify, is_peer_stop
from ftkit.recovery.coordinator import RankState, RankStatus
from ftkit.recovery.damage import Repair
from ftkit.recovery.monitor import RecoveryMonitor

log = logging.getLogger("ftkit")


class StepState(Protocol):
    """What the recovery engine needs from the model runner (given by ``ftkit.vllm``)."""

    #: True while device state a fault destroyed (lost KV) waits to be rebuilt: only then
    #: does the wrapper call ``before_attempt``.
    repair_pending: bool

    def rollback_execute(self, scheduler_output: Any) -> None:
        """Undo what ``execute_model(scheduler_output)`` changed, however far it got."""
    def begin_sample(self, scheduler_output: Any) -> Any:
        """What ``sample_tokens`` after the step of ``scheduler_output`` will change."""
    def rollback_sample(self, record: Any) -> None: ...
    def reset_batch(self) -> None: ...
    def before_attempt(self, scheduler_output: Any, call: Callable[[Any], Any]) -> None: ...


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
                 assess: Callable[[FaultKind | None], Repair] | None = None) -> None:
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
        self.rpc = 0  # RPCs received (execute and sample), the same count on every rank
        self.step = 0  # execute_model calls received
        #: The scheduler output of the last ``execute_model`` (the step being sampled).
        self._scheduled: Any = None
        #: Recovery rounds seen when the persistent batch was last laid out afresh.
        self._layout_epoch = 0

    def hooks_changed(self) -> None:
        """Re-read which hooks want ``on_attempt`` (call it between steps, when a hook's
        ``attempts_wanted`` changed: the injector's, when a plan is set)."""
        self._attempt_hooks = [hook for hook in self.hooks if hook.attempts_wanted]

    def execute_model(self, call: Callable[[Any], Any], scheduler_output: Any) -> Any:
        self.step = step = self.step + 1
        self.rpc = rpc = self.rpc + 1
        self._scheduled = scheduler_output
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
            return self._recover(_EXECUTE, call, scheduler_output, scheduler_output,
                                 state.rollback_execute, exc)
        joined = monitor.exit_step_ok()
        if joined is not None:
            self._check_joined(joined)
        return out

    def sample_tokens(self, call: Callable[[Any], Any], grammar_output: Any) -> Any:
        self.rpc = rpc = self.rpc + 1
        state = self.state
        record = state.begin_sample(self._scheduled)
        monitor = self.monitor
        monitor.enter_step(rpc, _SAMPLE, self.step)
        try:
            for hook in self._attempt_hooks:
                hook.on_attempt(_SAMPLE, self.step, 0, grammar_output)
            out = call(grammar_output)
        except Exception as exc:  # noqa: BLE001 - every failure goes through a round
            return self._recover(_SAMPLE, call, grammar_output, record,
                                 state.rollback_sample, exc)
        joined = monitor.exit_step_ok()
        if joined is not None:
            self._check_joined(joined)
        return out

    def _lay_out_afresh(self, epoch: int) -> None:
        """A round happened since this rank last laid out its batch: every rank rebuilds it
        from the request states, so that all lay it out alike."""
        self.state.reset_batch()
        self._layout_epoch = epoch

    def _check_joined(self, joined: Any) -> None:
        """After an attempt that returned: the round it joined (a peer's fault) must have
        decided to go on."""
        if not joined.recompute:
            raise joined.error(f"ftkit: step {self.step}: a peer's fault could not be "
                               f"recovered: {joined.reason}")

    def _recover(self, rpc_kind: RpcKind, call: Callable[[Any], Any], arg: Any, record: Any,
                 rollback: Callable[[Any], None], exc: Exception) -> Any:
        """After the first attempt of an RPC raised ``exc``: rounds, rollbacks and re-runs
        until an attempt returns or a round decides to raise."""
        if not self.recovery_enabled:
            raise exc
        monitor, state, execute = self.monitor, self.state, rpc_kind is _EXECUTE
        first_failure = time.monotonic()
        failures = 0
        while True:
            # ``exc``: the attempt that just failed.
            failures += 1
            decision = monitor.join_after_failure(self._status(rpc_kind, failures, exc))
            if not decision.recompute:
                if classify(exc) is None and not self.is_stop_error(exc):
                    raise exc  # not a fault ftkit handles: the engine sees the original error
                raise decision.error(f"ftkit: step {self.step} not recovered: "
                                     f"{decision.reason}") from exc
            log.warning("ftkit: rank %d step %d (%s) re-inference %d after %s: %s",
                        self.rank, self.step, rpc_kind.value, failures,
                        type(exc).__name__, exc)
            rollback_started = time.monotonic()
            rollback(record)
            rerun_from = time.monotonic()
            rollback_s = rerun_from - rollback_started
            epoch = monitor.enter_step(self.rpc, rpc_kind, self.step)
            if execute and epoch != self._layout_epoch:
                self._lay_out_afresh(epoch)
            try:
                for hook in self._attempt_hooks:
                    hook.on_attempt(rpc_kind, self.step, failures, arg)
                if execute and state.repair_pending:
                    state.before_attempt(arg, call)
                out = call(arg)
            except Exception as again:  # noqa: BLE001 - every failure goes through a round
                exc = again
                continue
            joined = monitor.exit_step_ok()
            if joined is not None:
                self._check_joined(joined)
            done = time.monotonic()
            for hook in self.hooks:
                hook.on_recovered(rpc_kind, self.step, failures, done - first_failure,
                                  rollback_s=rollback_s, rerun_s=done - rerun_from)
            return out

    def _status(self, rpc_kind: RpcKind, failures: int, exc: BaseException) -> RankStatus:
        stopped = self.is_stop_error(exc)
        kind = None if stopped else classify(exc)
        repair = self.assess(kind) if kind is not None else Repair()
        return RankStatus(
            rank=self.rank,
            state=RankState.STOPPED if stopped else RankState.FAILED,
            rpc=self.rpc,
            rpc_kind=rpc_kind,
            step=self.step,
            failures=failures,
            kind=None if kind is None else kind.value,
            error=f"{type(exc).__name__}: {exc}"[:500],
            kv_lost=repair.kv_lost,
            kv_lost_all=repair.kv_lost_all,
            reload_params=repair.reload_params,
            unrecoverable=repair.unrecoverable,
        )
