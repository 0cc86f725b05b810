"""How ftkit builds a vLLM engine: default engine arguments, the recovery settings in
``additional_config``, and the process environment the engine's processes read at start."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.scenario.model import EngineSpec

#: How vLLM names the file store of a CPU engine's distributed group (and, after it, the
#: group's shared memory segments).
_FILE_STORE_PREFIX = "vllm_dist_"

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
}


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


@contextmanager
def engine_environment(tp: int, multiprocess: bool) -> Iterator[None]:
    """The environment (and CPU affinity) an engine of ``tp`` ranks starts in; restored
    afterwards."""
    saved = {k: os.environ.get(k) for k in [*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING",
                                             "VLLM_CPU_OMP_THREADS_BIND"]}
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    me = psutil.Process()
    affinity = me.cpu_affinity()
    if tp > 1:
        # An in-process engine started earlier in this process pinned it to one core; the
        # workers would inherit that pin and share the core. Give them every core again.
        me.cpu_affinity([])
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        # One core per rank where there are enough (far faster than no binding on 2 cores).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
            "|".join(str(cores[i % len(cores)]) for i in range(tp)) if cores else "nobind")
    # vLLM caches its environment once an engine is up; a second engine in this process must
    # see the settings above, not the first engine's.
    from vllm import envs

    envs.disable_envs_cache()
    try:
        yield
    finally:
        me.cpu_affinity(affinity)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def file_stores_of(segments: Iterable[str]) -> set[str]:
    """vLLM's file stores of the distributed groups whose CPU communicator segments are
    ``segments``: vLLM's CPU worker names each segment after its group's file store
    (``<temp dir>/vllm_dist_<hex>``, from ``get_file_store_init_method``) and never removes
    that file."""
    stores = set()
    for segment in segments:
        name = os.path.basename(segment)
        if name.startswith(_FILE_STORE_PREFIX):
            ident = name.split("-", 1)[0]
            stores.add(os.path.join(tempfile.gettempdir(), ident))
    return stores
