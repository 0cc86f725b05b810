"""FtkitWorker: assembles the recovery engine around one vLLM worker."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ftkit.backends.platforms import backend_class
from ftkit.errors import FtkitError
from ftkit.inject import Injector
from ftkit.recovery.aware import FaultAware
from ftkit.config import RecoveryConfig
from ftkit.recovery.coordinator import Coordinator, Decision, MemoryChannel, RankStatus, StoreChannel
from ftkit.recovery.events import EventLog
from ftkit.recovery.handlers import assess
from ftkit.recovery.tolerance import FaultTolerance
from ftkit.vllm.kv_recompute import RecomputeReport
from ftkit.vllm.memory import RunnerMemory
from ftkit.vllm.runner_state import V1RunnerState

log = logging.getLogger("ftkit")


def make_backend(rank: int, store: Any) -> Any:
    """The backend of vLLM's current platform: cpu, cuda or npu (vllm-ascend)."""
    from vllm.platforms import current_platform

    return backend_class(current_platform.device_type)(rank, store)


class FtkitWorker:
    """Owns one rank's recovery engine, fault injector and event log."""

    def __init__(self, worker: Any, vllm_config: Any, config: RecoveryConfig) -> None:
        self.worker = worker
        self.vllm_config = vllm_config
        self.config = config
        self.rank = int(getattr(worker, "rank", 0))
        self.events = EventLog(self.rank, config.event_log_dir)
        self.tolerance: FaultTolerance | None = None
        self.injector: Injector | None = None
        self.backend: Any = None
        self.aware: FaultAware | None = None
        #: Seconds each part of the last rebuild took (emitted with the round's event).
        self._rebuild_times: dict[str, float] = {}
        self.coordinator: Coordinator | None = None

    # --- the wrapped step methods -------------------------------------------------------------

    def execute_model(self, inner: Any, scheduler_output: Any) -> Any:
        return self._ready().execute_model(inner, scheduler_output)

    def sample_tokens(self, inner: Any, grammar_output: Any) -> Any:
        return self._ready().sample_tokens(inner, grammar_output)

    # --- control (called through collective_rpc) ----------------------------------------------

    def set_fault_plan(self, run_id: str | None, faults: list[dict[str, Any]],
                       max_reinference: int | None = None) -> None:
        """Plan the faults of run ``run_id``; ``max_reinference`` (if given) applies from this
        run on. Reached through ``collective_rpc``, so every rank gets the same settings."""
        self._ready()
        assert self.injector is not None and self.coordinator is not None
        self.injector.set_plan(run_id, faults)
        if max_reinference is not None:
            if isinstance(max_reinference, bool) or not isinstance(max_reinference, int) \
                    or max_reinference < 0:
                raise FtkitError(f"max_reinference must be an integer >= 0, got "
                                 f"{max_reinference!r}")
            self.coordinator.max_reinference = max_reinference

    # --- set-up -------------------------------------------------------------------------------

    def _ready(self) -> FaultTolerance:
        if self.tolerance is None:
            self.tolerance = self._build()
        return self.tolerance

    def _build(self) -> FaultTolerance:
        import torch.distributed as dist

        runner = self.worker.model_runner
        world = dist.get_world_size() if dist.is_initialized() else 1
        store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self.backend = make_backend(self.rank, store.clone() if store is not None else None)
        if self.config.op_timeout_s is not None:
            self.backend.set_op_timeout(self.config.op_timeout_s)
        memory = RunnerMemory(runner, getattr(self.vllm_config.model_config, "model", None))
        state = V1RunnerState(runner, rng=self.backend, on_kv_recomputed=self._record_kv)
        if world > 1:
            from ftkit.vllm.comms import vllm_groups

            self.backend.take_over(vllm_groups())
        timeout = self.config.round_timeout_s

        def rebuild(decision: Decision) -> None:
            """Every rank, once the round decided to re-run: device, communicators, then
            what the faults destroyed."""
            times = self._rebuild_times = {}
            started = time.monotonic()
            self.backend.recover_device(decision.kinds)
            times["device_s"] = time.monotonic() - started
            if world > 1:
                started = time.monotonic()
                self.backend.rebuild_communicators(timeout, decision.kinds)
                times["comms_s"] = time.monotonic() - started
            started = time.monotonic()
            own = decision.status_of(self.rank)
            if own is not None and own.reload_params:
                reloaded = memory.reload_params(set(own.reload_params))
                self.events.emit("params_reloaded", params=reloaded)
            if decision.kv_lost_all or decision.kv_lost:
                state.mark_kv_lost(decision.kv_lost, all_blocks=decision.kv_lost_all)
            times["repair_s"] = time.monotonic() - started

        coordinator = Coordinator(self.rank, world, max_reinference=self.config.max_reinference,
                                  round_timeout_s=timeout, rebuild=rebuild)
        self.coordinator = coordinator
        if world > 1:
            main_channel: Any = StoreChannel(store.clone())
            factory: Any = lambda: StoreChannel(store.clone())  # noqa: E731 - one client a thread
        else:
            main_channel, factory = MemoryChannel(), None
        self.aware = FaultAware(coordinator, main_channel=main_channel, channel_factory=factory,
                                stop_communication=self.backend.stop_communication,
                                on_round=self._record_round)
        self.aware.start()
        self.injector = Injector(
            self.rank, self.events, token_indices=state.output_token_indices,
            device=self.backend if hasattr(self.backend, "force_stop") else None,
            memory=memory, kill_target=self._kill_target if _own_engine_process() else None)
        runner.sampler.register_forward_hook(self.injector.sample_hook)
        runner.get_model().register_forward_pre_hook(self.injector.forward_hook)
        log.info("ftkit: recovery %s on rank %d of %d (max_reinference=%d)",
                 "on" if self.config.enabled else "off", self.rank, world,
                 self.config.max_reinference)
        return FaultTolerance(rank=self.rank, aware=self.aware, state=state,
                              gate_timeout_s=3 * timeout, hooks=[self.injector],
                              recovery_enabled=self.config.enabled,
                              is_stop_error=self.backend.is_stop_error,
                              assess=lambda kind: assess(kind, self.backend, memory))

    def _kill_target(self, target: str) -> int:
        """The pid a ``process_kill`` fault kills: this worker, or the engine core (the
        parent of the workers of a multi-process executor; this very process otherwise)."""
        world = int(self.vllm_config.parallel_config.world_size)
        if target == "rank" or world == 1:
            return os.getpid()
        return os.getppid()

    def _record_kv(self, report: RecomputeReport) -> None:
        self.events.emit("kv_recomputed", requests=report.requests, tokens=report.tokens,
                         passes=report.passes, duration_s=report.seconds,
                         step=self.tolerance.step if self.tolerance else 0)

    def _record_round(self, epoch: int, status: RankStatus, decision: Decision,
                      duration_s: float, wall: float) -> None:
        assert self.aware is not None
        rebuild, self._rebuild_times = self._rebuild_times, {}
        round_times = self.aware.coordinator.last_times
        stop = self.aware.last_stop_request
        self.events.emit("recovery", epoch=epoch, state=status.state.value, step=status.step,
                         rpc=status.rpc, rpc_kind=status.rpc_kind.value,
                         failures=status.failures, fault=status.kind, error=status.error,
                         decision=decision.action.value, reason=decision.reason,
                         kinds=list(decision.kinds), duration_s=duration_s, started=wall,
                         kv_lost_all=status.kv_lost_all, kv_lost_blocks=len(status.kv_lost),
                         reload_params=list(status.reload_params),
                         stop_requested=stop[1] if stop and stop[0] == epoch else None,
                         statuses_s=round_times.statuses_s, rebuild_s=round_times.rebuild_s,
                         peers_done_s=round_times.peers_done_s, **rebuild)


def _own_engine_process() -> bool:
    """True when the engine core runs in a process of its own (vLLM's multiprocessing
    front end): only then can a worker or the engine core be killed without the caller."""
    from vllm import envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
