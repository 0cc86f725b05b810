"""How ftkit builds a vLLM engine: default engine arguments, the recovery settings in
``additional_config``, and the process environment the engine's processes read at start.

vLLM's multi-process executor (tensor parallel 2 and more) ends the engine when one step RPC
takes longer than ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, and every re-run of a step happens
inside that RPC. For the engines ftkit starts, the timeout is raised to what the recovery
settings need at worst (``RecoveryConfig.step_bound``, ``ExecuteTimeout``), and a log line
says so. An engine ftkit did not start (``vllm serve``, ``vllm.LLM``) gets it raised by ftkit's
plugin in its engine core, as its executor starts (``raise_short_execute_timeout``), with a
warning that says so and which setting gives another value.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import tempfile
from collections.abc import Callable, Collection, Iterator
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

from ftkit.procs import QUICK_EXIT_ENV
from ftkit.bounds import VLLM_EXECUTE_TIMEOUT_ENV, StepBound, vllm_execute_timeout_s
from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.scenario.model import EngineSpec

log = logging.getLogger("ftkit")

#: Engine arguments ftkit sets unless the scenario's ``engine.args`` says otherwise.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    # torch.compile costs minutes on CPU for no benefit to a correctness check (and CUDA
    # graphs replay a step that recovery cannot roll back).
    "enforce_eager": True,
    "disable_log_stats": True,
    # The recovery engine restores one step at a time; vLLM on GPU schedules ahead by default.
    "async_scheduling": False,
}
#: Environment for the engine's processes (read by vLLM when the engine starts); a value
#: already in the environment wins.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The recovery engine knows how to restore vLLM's V1 model runner (GPU default: V2).
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    # vLLM's CPU attention decides per step, from the whole batch and its row order, whether
    # to divide a decode row's KV between threads, and a divided row rounds differently. A
    # recovered run recomputes lost KV by prefill and may lay a step's rows out in another
    # order than the fault-free run: with the division on, its logprobs then drift in the
    # last bits (tokens stay). Off, every row computes the same bits whatever its batch, in
    # the fault-free run and the recovered one alike (tests/vllm/test_kv_loss_features.py).
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}
#: Environment for the engine's processes on vLLM's CPU build only (platform ``cpu``), on top
#: of ``ENGINE_ENV``; a value already in the environment wins.
CPU_ENGINE_ENV = {
    # Even in eager mode vLLM compiles a few helpers with torch.compile, with its platform's
    # ``simple_compile_backend`` (inductor on CPU and CUDA; vllm-ascend sets ``eager``, "disable
    # torch.compile"). On the CPU build the helpers that run are integer ones (the vocabulary
    # mask of a tensor-parallel embedding, the rank count of returned logprobs), so compiling
    # them computes the same values, and costs every engine process seconds in its first steps:
    # measured, 7 to 9 s between an engine's start and its first token at TP 2, on every engine
    # start and every engine replacement after a kill. Off, they run as written.
    "TORCH_COMPILE_DISABLE": "1",
}


#: How vLLM's CPU build binds each rank's OpenMP threads to cores ("0|1": rank 0 on core 0,
#: rank 1 on core 1). Unset, vLLM binds each rank to a NUMA node of its own, and an engine of
#: more ranks than the machine has NUMA nodes fails to start ("Not enough allowed NUMA nodes").
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_threads_bind(tp: int, cores: Collection[int]) -> str:
    """The ``THREADS_BIND_ENV`` value for a CPU engine of ``tp`` ranks on ``cores`` (those this
    process may run on): one core per rank, in core order, where there are enough (far faster
    than no binding on two cores); ranks share cores round-robin where there are not;
    ``nobind`` without any core."""
    ordered = sorted(cores)
    if not ordered:
        return "nobind"
    return "|".join(str(ordered[i % len(ordered)]) for i in range(tp))


def engine_env(device_type: str) -> dict[str, str]:
    """The engine environment ftkit sets on the platform ``device_type`` (``cpu``, ``cuda``,
    ``npu``): ``ENGINE_ENV``, and ``CPU_ENGINE_ENV`` on the CPU build."""
    return {**ENGINE_ENV, **(CPU_ENGINE_ENV if device_type == "cpu" else {})}


def engine_env_key() -> dict[str, str]:
    """Every variable ftkit may set for an engine (on any platform), with the value an engine
    started now would see: part of a fault-free run's cache key, without asking vLLM for the
    platform (which imports torch)."""
    return _as_started_now({**ENGINE_ENV, **CPU_ENGINE_ENV})


def effective_engine_env(device_type: str | None = None) -> dict[str, str]:
    """The values of ``engine_env``'s variables an engine started now would see (the
    environment's own, where set): they decide its fault-free tokens' bits too.
    ``device_type``: the platform's, vLLM's own when not given."""
    if device_type is None:
        from ftkit.vllm.platform import current_device_type

        device_type = current_device_type()
    return _as_started_now(engine_env(device_type))


def _as_started_now(defaults: Mapping[str, str]) -> dict[str, str]:
    """``defaults``' variables with the environment's own values where set."""
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


#: The engine core's process (``ftkit.procs.process_identity``), for its workers.
ENGINE_CORE_ENV = "FTKIT_ENGINE_CORE"


def engine_args(spec: EngineSpec, recovery: RecoveryConfig | None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``spec``; with ``recovery``, ftkit's settings
    go into ``additional_config`` (the engine is then an ftkit engine)."""
    args: dict[str, Any] = dict(DEFAULT_ENGINE_ARGS)
    args.update(spec.args)
    if recovery is not None:
        extra = dict(args.pop("additional_config", None) or {})
        extra[CONFIG_KEY] = recovery.to_mapping()
        args["additional_config"] = extra
    return {"model": spec.model, "dtype": spec.dtype,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "max_model_len": spec.max_model_len, "block_size": spec.block_size,
            "seed": spec.seed, **args}


@dataclass(frozen=True)
class ExecuteTimeout:
    """vLLM's bound on one step RPC of an engine, against what its recovery needs."""

    #: What vLLM would use: the environment's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, or 300.
    vllm_s: int
    #: What the recovery settings need at worst (``RecoveryConfig.step_bound``).
    bound: StepBound

    @property
    def short(self) -> bool:
        """vLLM would end the engine before a step's recovery may be over."""
        return not self.bound.fits(self.vllm_s)

    @property
    def seconds(self) -> int:
        """The timeout an engine ftkit starts gets: vLLM's, raised where it is short."""
        return max(self.vllm_s, self.bound.needed_s)

    def describe(self) -> str:
        return (f"recovery may need up to {self.bound.needed_s} s for one step "
                f"({self.bound.describe()}), and vLLM ends the engine when a step takes longer "
                f"than {self.vllm_s} s ({VLLM_EXECUTE_TIMEOUT_ENV})")


def execute_timeout(recovery: RecoveryConfig | None, world_size: int,
                    environ: Mapping[str, str] | None = None) -> ExecuteTimeout | None:
    """vLLM's execute timeout against ``recovery``'s needs, for an engine of ``world_size``
    ranks; ``None`` where no recovery runs or vLLM bounds no step (one rank: its executor
    runs the step in the engine core, without a timeout)."""
    if recovery is None or not recovery.enabled or world_size < 2:
        return None
    return ExecuteTimeout(vllm_execute_timeout_s(os.environ if environ is None else environ),
                          recovery.step_bound())


def raise_short_execute_timeout(recovery: RecoveryConfig, world_size: int) -> int | None:
    """In the engine core of an engine ftkit did not start (``vllm serve``, ``vllm.LLM``), as
    its executor starts: where vLLM's execute timeout would end the engine before a step's
    recovery is over, raise it in this process's environment (vLLM reads it there at every
    step RPC) and say so. Returns the timeout set, ``None`` when it was long enough."""
    timeout = execute_timeout(recovery, world_size)
    if timeout is None or not timeout.short:
        return None
    os.environ[VLLM_EXECUTE_TIMEOUT_ENV] = str(timeout.seconds)
    _forget_vllm_env_cache()
    log.warning("ftkit: %s: raised %s to %d for this engine (set it in the environment of "
                "vllm serve to choose the value, or lower fault_tolerance.max_reinference, "
                "op_timeout_s or round_timeout_s)",
                timeout.describe(), VLLM_EXECUTE_TIMEOUT_ENV, timeout.seconds)
    return timeout.seconds


def _forget_vllm_env_cache() -> None:
    """Make vLLM read its environment variables again (it caches them once an engine has
    started)."""
    from vllm import envs

    if envs._is_envs_cache_enabled():
        envs.disable_envs_cache()
        envs.enable_envs_cache()


def hold_engine_env() -> Callable[[], None]:
    """Keep ``engine_env``'s values in this process's environment (and torch's compile switch,
    ``TORCH_COMPILE_DISABLE``, in its torch) while an in-process engine lives; returns what puts
    them back (call it once the engine is shut down).

    An in-process engine reads some of them at every step, from the environment
    (``VLLM_CPU_ATTN_SPLIT_KV`` in vLLM's CPU attention): ``engine_environment`` restores the
    environment once an engine has started, and vLLM caches it at an in-process engine's start
    only until the next engine's ``engine_environment`` clears that cache (which a new engine
    needs). Without this, an engine started beside an in-process one, even a multi-process
    one, would turn the division of decode rows back on in the in-process engine from then on,
    and its logprobs would drift in the last bits after any recovery."""
    values = effective_engine_env()
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    release_compile = _hold_compile_disable(values)
    return lambda: (_restore_environ(saved), release_compile())


def _hold_compile_disable(values: Mapping[str, str]) -> Callable[[], None]:
    """Apply ``TORCH_COMPILE_DISABLE`` of ``values`` to this process's torch, which read the
    variable once, at its import (an in-process engine's helpers run here); returns what puts
    torch's setting back."""
    import torch._dynamo

    config = torch._dynamo.config
    saved = config.disable
    config.disable = values.get("TORCH_COMPILE_DISABLE", "0") == "1" or saved

    def release() -> None:
        config.disable = saved

    return release


def _restore_environ(saved: Mapping[str, str | None]) -> None:
    """Put the variables of ``saved`` back as they were (``None``: not set)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextmanager
def engine_environment(tp: int, multiprocess: bool, tmp_dir: str | None = None,
                       recovery: RecoveryConfig | None = None
                       ) -> Iterator[ExecuteTimeout | None]:
    """The environment (and CPU affinity) an engine of ``tp`` ranks starts in; restored
    afterwards. Yields the engine's execute timeout (``None`` for one rank or no recovery):
    with ``recovery``, vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` is raised where it
    would end a step before its recovery is over, and a log line says so.

    ``tmp_dir``: the engine's own temporary folder. vLLM leaves files in the temporary folder
    that nothing removes when its processes are killed (the file store of its distributed
    group, ``vllm_dist_<hex>``, one per engine); with this, they go into a folder its owner
    removes whole. The compiled-kernel cache of torch's inductor stays where it was, shared
    by every engine."""
    from ftkit.vllm.platform import current_device_type

    wanted = engine_env(current_device_type())
    saved = {k: os.environ.get(k) for k in [*wanted, "VLLM_ENABLE_V1_MULTIPROCESSING",
                                             THREADS_BIND_ENV, "TMPDIR", QUICK_EXIT_ENV,
                                             "TORCHINDUCTOR_CACHE_DIR",
                                             VLLM_EXECUTE_TIMEOUT_ENV]}
    saved_tempdir = tempfile.tempdir
    if tmp_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
        os.environ["TMPDIR"] = tmp_dir  # the engine's processes (spawned) read it
        tempfile.tempdir = tmp_dir  # an in-process engine's executor, in this process
    os.environ.update({k: v for k, v in wanted.items() if k not in os.environ})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault(QUICK_EXIT_ENV, "1")  # its spawned processes end without teardown
    me = psutil.Process()
    affinity = me.cpu_affinity()
    if tp > 1:
        # An in-process engine started earlier in this process pinned it to one core; the
        # workers would inherit that pin and share the core. Give them every core again.
        me.cpu_affinity([])
    if tp > 1 and THREADS_BIND_ENV not in os.environ:
        os.environ[THREADS_BIND_ENV] = cpu_threads_bind(tp, os.sched_getaffinity(0))
    timeout = execute_timeout(recovery, tp)
    if timeout is not None and timeout.short:
        os.environ[VLLM_EXECUTE_TIMEOUT_ENV] = str(timeout.seconds)
        log.info("ftkit: %s: raised %s to %d s for this engine", timeout.describe(),
                 VLLM_EXECUTE_TIMEOUT_ENV, timeout.seconds)
    # vLLM caches its environment once an engine is up; a second engine in this process must
    # see the settings above, not the first engine's.
    from vllm import envs

    envs.disable_envs_cache()
    release_compile = _hold_compile_disable(os.environ)  # an in-process engine's own start
    try:
        yield timeout
    finally:
        release_compile()
        tempfile.tempdir = saved_tempdir
        me.cpu_affinity(affinity)
        _restore_environ(saved)


def _inductor_cache_dir() -> str:
    """Where torch's inductor keeps compiled kernels by default (its ``default_cache_dir``):
    ``torchinductor_<user>`` in the temporary folder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(),
                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
