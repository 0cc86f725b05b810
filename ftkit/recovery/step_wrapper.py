"""StepWrapper: token-level re-inference around one rank's step.

vLLM runs a step as two RPCs on every rank: ``execute_model`` (forward, collectives) and then
``sample_tokens`` (rank-local sampling). ``StepWrapper`` wraps both. For each RPC it

1. records what the RPC is about to change (``StepState.begin_*``: cheap; on a decode step
   that allocates no KV block, a few object references and one copy of a small array),
2. runs it; if it raises, classifies the error and joins a recovery round with every rank
   (``RecoveryMonitor``): detect, stop, recover the device, rebuild communicators, agree,
3. on ``recompute``: restores the recorded state and runs the same RPC again, up to
   ``max_reinference`` times; on ``raise``: surfaces the error to the engine, as the class
   of ``ftkit.errors`` that the decision's cause names (``Decision.error``), or as the
   original error when it is not a fault ftkit handles.

The fault-free path adds no collective and no device synchronisation: one record, one call,
two lock acquisitions (the gate), one call per step hook. It is the per-step cost of ftkit
that the overhead benchmark's own-time table measures, piece by piece (``make bench``).
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

    def begin_execute(self, scheduler_output: Any) -> Any: ...
    def rollback_execute(self, record: Any) -> None: ...
    def begin_sample(self) -> Any: ...
    def rollback_sample(self, record: Any) -> None: ...
    def reset_batch(self) -> None: ...
    def before_attempt(self, scheduler_output: Any, call: Callable[[Any], Any]) -> None: ...


class StepWrapper:
    """Runs one rank's step RPCs, each attempt through the gate, failures through a round."""

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
        #: Tells a stop of this rank (a peer failed) from a fault of its own; the backend's.
        self.is_stop_error = is_stop_error
        #: What this rank's own fault destroyed (``ftkit.recovery.damage.assess_damage``).
        self.assess = assess or (lambda kind: Repair())
        self.rpc = 0  # RPCs received (execute and sample), the same count on every rank
        self.step = 0  # execute_model calls received
        #: Recovery rounds seen when the persistent batch was last laid out afresh.
        self._layout_epoch = 0

    def execute_model(self, call: Callable[[Any], Any], scheduler_output: Any) -> Any:
        self.step += 1
        state = self.state
        return self._run(RpcKind.EXECUTE, call, scheduler_output,
                         state.begin_execute(scheduler_output), state.rollback_execute)

    def sample_tokens(self, call: Callable[[Any], Any], grammar_output: Any) -> Any:
        state = self.state
        return self._run(RpcKind.SAMPLE, call, grammar_output, state.begin_sample(),
                         state.rollback_sample)

    def _run(self, rpc_kind: RpcKind, call: Callable[[Any], Any], arg: Any, record: Any,
             rollback: Callable[[Any], None]) -> Any:
        self.rpc += 1
        monitor, execute = self.monitor, rpc_kind is RpcKind.EXECUTE
        failures = 0
        while True:
            epoch = monitor.enter_step(self.rpc, rpc_kind, self.step)
            if execute and epoch != self._layout_epoch:
                # A round happened since this rank last laid out its batch: every rank
                # rebuilds it from the request states, so that all lay it out alike.
                self.state.reset_batch()
                self._layout_epoch = epoch
            try:
                for hook in self.hooks:
                    hook.on_attempt(rpc_kind, self.step, failures, arg)
                if execute:
                    # Device state a fault destroyed (lost KV) is rebuilt first, by forward
                    # passes of its own: inside the attempt, so that a fault there is one too.
                    self.state.before_attempt(arg, call)
                out = call(arg)
            except Exception as exc:  # noqa: BLE001 - every failure goes through a round
                if not self.recovery_enabled:
                    raise
                failures += 1
                if failures == 1:
                    first_failure = time.monotonic()
                decision = monitor.join_after_failure(
                    self._status(rpc_kind, failures, exc))
                if not decision.recompute:
                    if classify(exc) is None and not self.is_stop_error(exc):
                        raise  # not a fault ftkit handles: the engine sees the original error
                    raise decision.error(f"ftkit: step {self.step} not recovered: "
                                         f"{decision.reason}") from exc
                log.warning("ftkit: rank %d step %d (%s) re-inference %d after %s: %s",
                            self.rank, self.step, rpc_kind.value, failures,
                            type(exc).__name__, exc)
                rollback_started = time.monotonic()
                rollback(record)
                rerun_from = time.monotonic()
                rollback_s = rerun_from - rollback_started
                continue
            joined = monitor.exit_step_ok()
            if joined is not None and not joined.recompute:
                raise joined.error(f"ftkit: step {self.step}: a peer's fault could not be "
                                   f"recovered: {joined.reason}")
            if failures:
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
