"""How ftkit builds a vLLM engine: default engine arguments, the recovery settings in
``additional_config``, and the process environment the engine's processes read at start."""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.scenario.model import EngineSpec

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
def engine_environment(tp: int, multiprocess: bool, tmp_dir: str | None = None
                       ) -> Iterator[None]:
    """The environment (and CPU affinity) an engine of ``tp`` ranks starts in; restored
    afterwards.

    ``tmp_dir``: the engine's own temporary folder. vLLM leaves files in the temporary folder
    that nothing removes when its processes are killed (the file store of its distributed
    group, ``vllm_dist_<hex>``, one per engine); with this, they go into a folder its owner
    removes whole. The compiled-kernel cache of torch's inductor stays where it was, shared
    by every engine."""
    saved = {k: os.environ.get(k) for k in [*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING",
                                             "VLLM_CPU_OMP_THREADS_BIND", "TMPDIR",
                                             "TORCHINDUCTOR_CACHE_DIR"]}
    saved_tempdir = tempfile.tempdir
    if tmp_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
        os.environ["TMPDIR"] = tmp_dir  # the engine's processes (spawned) read it
        tempfile.tempdir = tmp_dir  # an in-process engine's executor, in this process
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
        tempfile.tempdir = saved_tempdir
        me.cpu_affinity(affinity)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _inductor_cache_dir() -> str:
    """Where torch's inductor keeps compiled kernels by default (its ``default_cache_dir``):
    ``torchinductor_<user>`` in the temporary folder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(),
                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
