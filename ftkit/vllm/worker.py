"""FtkitWorker: one vLLM worker's recovery engine, fault injector and event log.

The recovery engine is assembled by ``ftkit.recovery.assemble``; this module only supplies
what vLLM knows: the backend of the current platform, the job's store, the model runner's
step state and memory map, the repairs that need the runner (reload parameters, recompute
lost KV), and the records each rank writes to its event log.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
from typing import Any

from ftkit.backends.platforms import backend_class
from ftkit.config import INJECT_SECRET_ENV, RecoveryConfig
from ftkit.contracts.eventlog import (
    Event,
    EventLog,
    FaultFired,
    KvRecomputed,
    ParamsReloaded,
    RecoveryRound,
    StepRecovered,
)
from ftkit.contracts.plan import FaultPlan
from ftkit.errors import FtkitError, InjectionError
from ftkit.inject import Injector
from ftkit.recovery import (
    Coordinator,
    Decision,
    Recovery,
    RoundOutcome,
    StepWrapper,
    assemble,
    assess_damage,
    side_channels,
)
from ftkit.serve.state import RankPublisher, served_rank
from ftkit.vllm.kv_recompute import RecomputeReport
from ftkit.vllm.memory import RunnerMemory
from ftkit.vllm.plugin import STEP_METHODS, bind_step_method
from ftkit.vllm.resume import parking_discarded_generators, show_earlier_outputs
from ftkit.vllm.runner_state import V1RunnerState

log = logging.getLogger("ftkit")


def make_backend(rank: int, store: Any) -> Any:
    """The backend of vLLM's current platform: cpu, cuda or npu (vllm-ascend)."""
    from vllm.platforms import current_platform

    return backend_class(current_platform.device_type)(rank, store)


def secret_problem(presented: str | None, environ: Any = os.environ) -> str | None:
    """Why a worker refuses a fault plan, or ``None``: where its process has an injection
    secret (``INJECT_SECRET_ENV``: a server with injection on, whose workers inherit it), a
    plan must present it. ftkit's route passes it on; a plan that reaches the workers
    another way (vLLM's ``/collective_rpc`` under ``VLLM_SERVER_DEV_MODE=1``) has none."""
    expected = environ.get(INJECT_SECRET_ENV)
    if not expected:
        return None
    if presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
        return (f"a fault plan without this server's secret ({INJECT_SECRET_ENV}) is refused: "
                f"plan faults through ftkit's route (ftkit inject)")
    return None


class FtkitWorker:
    """Owns one rank's recovery engine, fault injector and event log."""

    def __init__(self, worker: Any, vllm_config: Any, config: RecoveryConfig) -> None:
        self.worker = worker
        self.vllm_config = vllm_config
        self.config = config
        #: This rank in its engine (its recovery rounds span this engine's ranks).
        self.rank = int(getattr(worker, "rank", 0))
        #: This rank among every rank of a server: a server with data parallelism runs one
        #: engine per replica, each of ``world`` ranks numbered from 0 (vLLM's independent
        #: replicas of a dense model); its ranks are numbered across replicas, rank ``r`` of
        #: replica ``i`` being ``i * world + r``, where faults are planned for and counted.
        self.served_rank = served_rank(getattr(vllm_config, "parallel_config", None), self.rank)
        #: Publishes this rank's counts for a server's health view and metrics
        #: (``ftkit.serve.state``): only on events, only where the API server made the state
        #: directory of this instance (an offline engine has none).
        instance_id = str(getattr(vllm_config, "instance_id", "") or "")
        self.publisher = (RankPublisher.for_instance(instance_id, self.served_rank)
                          if config.enabled and instance_id else None)
        self.events = (EventLog(self.served_rank, config.event_log_dir)
                       if self.publisher is None else
                       _PublishingEventLog(self.served_rank, config.event_log_dir,
                                           self.publisher))
        self.recovery: Recovery | None = None
        #: The wrapper of this worker's step RPCs, built at the first step.
        self.step_wrapper: StepWrapper | None = None
        self.injector: Injector | None = None
        self.backend: Any = None
        #: ``self.recovery.coordinator``, once built (``set_fault_plan`` sets its budget).
        self.coordinator: Coordinator | None = None
        #: The injector's module hooks (model forward, sampler), registered only while its
        #: plan has faults: a module with a hook takes PyTorch's slower call path.
        self._hook_handles: list[Any] = []

    # --- the wrapped step methods -------------------------------------------------------------

    # The plugin binds the worker's ``execute_model`` / ``sample_tokens`` to these (with the
    # worker's own method as ``inner``) until the recovery engine is built, at the first step;
    # then straight to the step wrapper's, so that a fault-free step runs no ftkit frame but
    # the wrapper's own.

    def execute_model(self, inner: Any, scheduler_output: Any) -> Any:
        return self._ready().execute_model(inner, scheduler_output)

    def sample_tokens(self, inner: Any, grammar_output: Any) -> Any:
        return self._ready().sample_tokens(self._sampling(inner), grammar_output)

    def _sampling(self, inner: Any) -> Any:
        # A partial prefill chunk's discarded draw stays off a seeded request's CPU generator
        # (``ftkit.vllm.resume``: vLLM would rewind it, which CPU generators cannot do).
        return parking_discarded_generators(self.worker.model_runner, inner)

    # --- control (called through collective_rpc) ----------------------------------------------

    def set_fault_plan(self, plan_json: str, secret: str | None = None) -> None:
        """Plan the faults of a ``FaultPlan`` (its ``to_json``); its ``max_reinference`` (if
        set) applies from this run on. Reached through ``collective_rpc``
        (``ftkit_set_fault_plan``), so every rank gets the same plan. ``secret``: the
        injection secret, where this process has one (``secret_problem``)."""
        problem = secret_problem(secret)
        if problem is not None:
            raise InjectionError(problem)
        plan = FaultPlan.from_json(plan_json)
        self._ready()
        assert self.injector is not None and self.coordinator is not None
        self.injector.set_plan(plan)
        self._register_injection_hooks()
        assert self.step_wrapper is not None
        self.step_wrapper.hooks_changed()
        max_reinference = plan.max_reinference
        if max_reinference is not None:
            if isinstance(max_reinference, bool) or not isinstance(max_reinference, int) \
                    or max_reinference < 0:
                raise FtkitError(f"max_reinference must be an integer >= 0, got "
                                 f"{max_reinference!r}")
            self.coordinator.max_reinference = max_reinference

    def add_live_faults(self, plan_json: str, check_only: bool = False,
                        secret: str | None = None) -> dict[str, Any]:
        """Add the live faults of a ``FaultPlan`` (its ``to_json``) that ``ftkit inject``
        planned in a running server; the faults already pending stay. Reached through
        ``collective_rpc`` (``ftkit_add_live_faults``) from ftkit's server route
        (``ftkit.serve.control``), so every rank gets them between the same two steps.
        Refused unless this engine's settings say ``injection: true``. Answers
        ``{"rank", "error"}`` (``error``: ``None`` when planned) rather than raising, so a
        refused fault never reaches vLLM as a failed call. ``check_only``: only whether this
        rank could inject them (the route asks every rank before any rank keeps them);
        ``secret``: the server's injection secret, which the route passes on
        (``secret_problem``)."""
        if not self.config.injection:
            return {"rank": self.served_rank,
                    "error": "injection is not enabled in this engine's fault_tolerance settings"}
        problem = secret_problem(secret)
        if problem is not None:
            log.warning("ftkit: rank %d refused live faults: %s", self.served_rank, problem)
            return {"rank": self.served_rank, "error": problem}
        try:
            plan = FaultPlan.from_json(plan_json)
            self._ready()
            assert self.injector is not None and self.step_wrapper is not None
            self.injector.add_live(plan, check_only=check_only)
            if check_only:
                return {"rank": self.served_rank, "error": None}
            self._register_injection_hooks()
            self.step_wrapper.hooks_changed()
        except FtkitError as exc:
            return {"rank": self.served_rank, "error": str(exc)}
        log.warning("ftkit: rank %d planned %d live fault(s) from ftkit inject",
                    self.served_rank, len(plan.faults))
        return {"rank": self.served_rank, "error": None}

    def settle(self) -> None:
        """Return once this rank is quiet: every step RPC it was sent has returned (the call
        is queued behind them) and no recovery round runs for it; raise if one failed.
        Reached through ``collective_rpc`` (``ftkit_settle``), which waits for every rank,
        not only the one whose output the engine reads (``RecoveryMonitor.settle``)."""
        if self.recovery is not None:
            self.recovery.monitor.settle()

    def transport_counts(self) -> dict[str, int]:
        """The collectives this rank's backend ran, by operation and path (``all_reduce/shm``:
        ftkit's shared-memory transport; ``/gloo``: the fallback), when it counts them.
        Reached through ``collective_rpc`` (``ftkit_transport_counts``)."""
        self._ready()
        counts = getattr(self.backend, "transport_counts", None)
        return counts() if counts is not None else {}

    # --- set-up -------------------------------------------------------------------------------

    def _ready(self) -> StepWrapper:
        if self.step_wrapper is None:
            self.step_wrapper = wrapper = self._build()
            worker = self.worker
            for name in STEP_METHODS:
                entry = getattr(worker, name)
                if isinstance(entry, functools.partial) and entry.func == getattr(self, name):
                    [inner] = entry.args
                    if name == "sample_tokens":
                        inner = self._sampling(inner)
                    bind_step_method(worker, name, getattr(wrapper, name), inner)
        return self.step_wrapper

    def _build(self) -> StepWrapper:
        """Assembles this rank's recovery engine (from its process groups, which exist once
        vLLM runs a step) and returns its step wrapper."""
        import torch.distributed as dist

        runner = self.worker.model_runner
        world = dist.get_world_size() if dist.is_initialized() else 1
        store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self.backend = make_backend(self.rank, store.clone() if store is not None else None)
        self.backend.set_op_timeout(self.config.op_timeout_s)  # None: the default bound
        memory = RunnerMemory(runner, getattr(self.vllm_config.model_config, "model", None))
        show_earlier_outputs(runner)  # penalties and bad words of resumed requests
        state = V1RunnerState(runner, rng=self.backend, on_kv_recomputed=self._record_kv)
        if world > 1:
            from ftkit.vllm.comms import vllm_groups
            from ftkit.vllm.pipeline import take_over_stage_transfers

            groups = vllm_groups()
            stages = [g for g in groups if g.name == "pp"]
            if not self.config.enabled:
                # Nothing to stop: the pipeline's transfers stay vLLM's (and any pipeline
                # vLLM runs, runs).
                groups = [g for g in groups if g.name != "pp"]
            self.backend.take_over(groups)
            if self.config.enabled:
                for group in stages:
                    take_over_stage_transfers(group, self.backend)
        self.injector = Injector(
            self.served_rank, self.events, token_indices=state.output_token_indices,
            device=self.backend if hasattr(self.backend, "force_stop") else None,
            memory=memory, kill_target=self._kill_target if _own_engine_process() else None)

        def repairs(decision: Decision) -> None:
            """What the round's faults destroyed: this rank's own parameters, every rank's
            share of the lost KV."""
            own = decision.status_of(self.rank)
            if own is not None and own.reload_params:
                reloaded = memory.reload_params(set(own.reload_params))
                self.events.emit(ParamsReloaded(params=reloaded))
            if decision.kv_lost_all or decision.kv_lost:
                state.mark_kv_lost(decision.kv_lost, all_blocks=decision.kv_lost_all)

        log.info("ftkit: recovery %s on rank %d of %d (max_reinference=%d)",
                 "on" if self.config.enabled else "off", self.rank, world,
                 self.config.max_reinference)
        self.recovery = assemble(
            rank=self.rank, world=world, channels=side_channels(store), backend=self.backend,
            state=state, config=self.config, hooks=[self.injector], repairs=repairs,
            on_round=self._record_round,
            on_round_start=self.publisher.round_started if self.publisher is not None else None,
            assess=lambda kind: assess_damage(kind, self.backend, memory))
        self.coordinator = self.recovery.coordinator
        return self.recovery.wrapper

    def _register_injection_hooks(self) -> None:
        """Register the injector's hooks inside the step while its plan has faults (set with
        the plan, between steps); remove them when it has none."""
        assert self.injector is not None
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        if self.injector.faults:
            runner = self.worker.model_runner
            self._hook_handles = [
                runner.sampler.register_forward_hook(self.injector.sample_hook),
                runner.get_model().register_forward_pre_hook(self.injector.forward_hook)]

    def _kill_target(self, target: str) -> int:
        """The pid a ``process_kill`` fault kills: this worker, or the engine core (named by
        the engine core as its executor started: the workers' parent under the multi-process
        executor, not under Ray's; this very process for an engine of one rank)."""
        world = int(self.vllm_config.parallel_config.world_size)
        if target == "rank" or world == 1:
            return os.getpid()
        from ftkit.procs import identified_process
        from ftkit.vllm.environment import ENGINE_CORE_ENV

        identity = os.environ.get(ENGINE_CORE_ENV)
        core = identified_process(identity) if identity else None
        if core is None:
            raise InjectionError("process_kill of the engine core: this worker cannot find it "
                                 "(it runs on another host, or its executor did not name "
                                 "it): kill a worker (target rank) instead")
        return core.pid

    def _record_kv(self, report: RecomputeReport) -> None:
        wrapper = self.step_wrapper
        self.events.emit(KvRecomputed(requests=report.requests, tokens=report.tokens,
                                      passes=report.passes, duration_s=report.seconds,
                                      step=wrapper.step if wrapper is not None else 0))

    def _record_round(self, outcome: RoundOutcome) -> None:
        status, decision, times = outcome.status, outcome.decision, outcome.times
        self.events.emit(RecoveryRound(
            epoch=outcome.epoch, state=status.state.value, step=status.step, rpc=status.rpc,
            rpc_kind=status.rpc_kind.value, failures=status.failures, fault=status.kind,
            error=status.error, decision=decision.action.value, reason=decision.reason,
            kinds=list(decision.kinds), duration_s=outcome.duration_s, started=outcome.started,
            kv_lost_all=status.kv_lost_all, kv_lost_blocks=len(status.kv_lost),
            reload_params=list(status.reload_params), stop_requested=outcome.stop_requested,
            statuses_s=times.statuses_s, rebuild_s=times.rebuild_s,
            peers_done_s=times.peers_done_s, device_s=times.device_s, comms_s=times.comms_s,
            repair_s=times.repair_s))


class _PublishingEventLog(EventLog):
    """A server's rank's event log: every event it writes is counted in the rank's published
    state too (``ftkit.serve.state``). Events come only with faults: a fault-free step writes
    nothing."""

    def __init__(self, rank: int, directory: str | None, publisher: RankPublisher) -> None:
        super().__init__(rank, directory)
        self.publisher = publisher

    def emit(self, event: Event) -> Event:
        event = super().emit(event)
        publisher = self.publisher
        if isinstance(event, FaultFired):
            publisher.fault_fired(event.kind, event.index)
        elif isinstance(event, RecoveryRound):
            publisher.round_ended(event.decision, event.duration_s)
        elif isinstance(event, StepRecovered):
            publisher.step_reinferred()
        elif isinstance(event, KvRecomputed):
            publisher.kv_recomputed()
        return event


def _own_engine_process() -> bool:
    """True when the engine core runs in a process of its own (vLLM's multiprocessing
    front end): only then can a worker or the engine core be killed without the caller."""
    from vllm import envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
