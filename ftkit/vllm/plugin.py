"""The ``vllm.general_plugins`` entry point: wraps the worker's step in every process.

vLLM loads general plugins in the main process, the engine core and every worker (inside
``WorkerWrapperBase.init_worker``, before the worker class is resolved). ``register`` wraps
``WorkerBase.__init__`` so that, once a worker object exists, ftkit installs itself on *that
instance*: it leaves the platform's worker selection alone (CPU, CUDA and vllm-ascend's
``NPUWorker`` alike) and costs nothing when ``additional_config["fault_tolerance"]`` is absent.

The recovery engine itself is set up lazily at the first step, when the model runner and the
process groups exist.

vllm-ascend: its worker (``vllm_ascend.worker.worker.NPUWorker``) derives from ``WorkerBase``
and is reached the same way. Recent vllm-ascend releases validate ``additional_config``
strictly (``vllm_ascend.ascend_config.init_ascend_config`` builds a pydantic ``AscendConfig``
with ``extra="forbid"``, and rejects every key it does not know): ``register`` lets that
validation see everything but ftkit's own key.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any

from ftkit import procs
from ftkit.config import CONFIG_KEY, RecoveryConfig

log = logging.getLogger("ftkit")

#: Marks ftkit's wrappers (vLLM's own decorators already set ``__wrapped__``).
WRAPPED_MARK = "__ftkit_wrapped__"
#: A diagnostic: where set, the name of a file to which every vLLM engine started with ftkit
#: installed appends one JSON line (from its rank 0 worker, once created), ftkit's recovery on
#: or off: a count of the engine starts of a test suite (``tests/conftest.py`` prints its
#: own) or of a benchmark.
ENGINE_STARTS_FILE_ENV = "FTKIT_ENGINE_STARTS_FILE"


def register() -> None:
    """Entry point: idempotent, safe to call in any vLLM process.

    In worker processes vLLM calls this from inside ``WorkerWrapperBase.init_worker``, before
    it creates the worker: wrapping ``WorkerBase.__init__`` reaches that very worker.
    """
    from vllm.v1.worker import worker_base

    _log_like_vllm()
    procs.quick_exit_of_spawned_process()
    _hide_key_from_vllm_ascend()
    _raise_execute_timeout_as_executors_start()
    _restart_dead_engines_in_servers()
    _one_step_in_flight_with_recovery()
    original = worker_base.WorkerBase.__init__
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        _note_engine_start(self, vllm_config)
        install(self, vllm_config)

    setattr(__init__, WRAPPED_MARK, True)
    worker_base.WorkerBase.__init__ = __init__


def _note_engine_start(worker: Any, vllm_config: Any) -> None:
    """Append this engine's line to ``ENGINE_STARTS_FILE_ENV``'s file, from rank 0."""
    path = os.environ.get(ENGINE_STARTS_FILE_ENV)
    if not path or getattr(worker, "rank", None) != 0:
        return
    parallel = vllm_config.parallel_config
    line = json.dumps({"pid": os.getpid(), "time": time.time(),
                       "tensor_parallel_size": parallel.tensor_parallel_size,
                       "pipeline_parallel_size": parallel.pipeline_parallel_size,
                       "recovery": recovery_settings(vllm_config) is not None})
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")
    except OSError as exc:  # a diagnostic never stops an engine
        log.warning("ftkit: could not note the engine start in %s: %s", path, exc)


class _ToVllmHandlers(logging.Handler):
    """Hands ftkit's records to vLLM's own log handlers, so that they show in a server's
    output as vLLM's do (its format: process name and pid, ``(Worker_TP1 pid=...)`` in a
    worker, level, time, file and line). Only while the root logger has no handler: where an
    application configured logging, ftkit's records reach it by propagation instead, so that
    no line shows twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        handlers = logging.getLogger("vllm").handlers or [logging.lastResort]
        for handler in handlers:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def _log_like_vllm() -> None:
    """Give the ``ftkit`` logger vLLM's handlers in this process (idempotent). Without them
    its records reach only Python's last-resort handler: warnings unformatted, info lost. Left
    alone where vLLM does not configure logging (``VLLM_CONFIGURE_LOGGING=0``)."""
    # (vLLM may add its handlers only after it loaded its plugins: the handler looks them up
    # as it emits.)
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0" \
            or any(isinstance(h, _ToVllmHandlers) for h in log.handlers):
        return
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.addHandler(_ToVllmHandlers())


def _restart_dead_engines_in_servers() -> None:
    """In a process that imported vLLM's entry points (a server's API process, or one that uses
    ``vllm.LLM``), let an engine with
    ``max_restarts`` be replaced when it dies (``ftkit.vllm.restart``). Engine cores and
    workers import no entry point, and need nothing of it."""
    if not any(name.startswith("vllm.entrypoints") for name in list(sys.modules)):
        return
    from ftkit.vllm import restart

    restart.install()


def _raise_execute_timeout_as_executors_start() -> None:
    """Wrap the multi-process executor's start, in the engine core, so that settings recovery
    cannot handle are refused before any worker starts, and an engine with
    recovery on gets vLLM's execute timeout raised to what its recovery needs
    (``ftkit.vllm.environment.raise_short_execute_timeout``). Its executor reads the timeout
    from the engine core's environment at every step RPC; the workers cannot change it."""
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:  # (a vLLM without it runs no step RPC with a timeout)
        return
    _check_as_executor_starts(MultiprocExecutor)
    _prepare_ray_executor_when_chosen()


def _prepare_ray_executor_when_chosen() -> None:
    """vLLM's Ray executor (``RayExecutorV2``, a subclass of the multi-process one with a
    start of its own) gets the same wrapping, and on the CPU build ftkit's shim
    (``ftkit.vllm.ray_cpu``), once an engine chooses it: importing it imports Ray, which
    engines of the other executors need not pay for. An engine core process receives the
    class its front end chose, imported before its plugins are loaded."""
    from vllm.v1.executor.abstract import Executor

    module = sys.modules.get("vllm.v1.executor.ray_executor_v2")
    if module is not None:
        _prepare_ray_executor(module)
    original = Executor.__dict__["get_class"].__func__
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def get_class(vllm_config: Any) -> Any:
        chosen = original(vllm_config)
        loaded = sys.modules.get("vllm.v1.executor.ray_executor_v2")
        if loaded is not None and isinstance(chosen, type) \
                and issubclass(chosen, loaded.RayExecutorV2):
            _prepare_ray_executor(loaded)
        return chosen

    setattr(get_class, WRAPPED_MARK, True)
    Executor.get_class = staticmethod(get_class)


def _prepare_ray_executor(module: Any) -> None:
    from ftkit.bounds import RAY_PLACEMENT_TIMEOUT_ENV
    from ftkit.vllm import ray_cpu

    ray_cpu.apply()
    _check_as_executor_starts(module.RayExecutorV2)
    bound = os.environ.get(RAY_PLACEMENT_TIMEOUT_ENV)
    if bound:  # an engine ftkit started on a cluster of its own (``ftkit.vllm.ray_cluster``)
        from vllm.v1.executor import ray_utils

        ray_utils.PG_WAIT_TIMEOUT = float(bound)


def _check_as_executor_starts(executor_class: Any) -> None:
    """Wrap ``executor_class``'s start (see ``_raise_execute_timeout_as_executors_start``)."""
    original = executor_class.__dict__.get("_init_executor")
    if original is None or getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def _init_executor(self: Any) -> Any:
        config = recovery_settings(self.vllm_config)
        if config is not None and config.enabled:
            # Refused here too, before any worker starts: some settings (pipeline
            # parallelism on vLLM-CPU) fail inside the executor's start, before the workers'
            # own check would run.
            from ftkit.vllm.runner_state import check_config

            check_config(self.vllm_config)
        raise_execute_timeout_for(self.vllm_config)
        # The workers' way to the engine core (a ``process_kill`` of target engine): under
        # Ray it is not their parent. Set before the workers start: they inherit it (the
        # multi-process executor) or get the engine core's environment (the Ray executor).
        from ftkit.procs import process_identity
        from ftkit.vllm.environment import ENGINE_CORE_ENV

        os.environ[ENGINE_CORE_ENV] = process_identity()
        return original(self)

    setattr(_init_executor, WRAPPED_MARK, True)
    executor_class._init_executor = _init_executor


def _one_step_in_flight_with_recovery() -> None:
    """An engine with recovery on keeps one step in flight, also with pipeline parallelism
    (``ftkit.vllm.pipeline.one_step_in_flight``)."""
    from ftkit.vllm.pipeline import one_step_in_flight

    def recovery_enabled(vllm_config: Any) -> bool:
        config = recovery_settings(vllm_config)
        return config is not None and config.enabled

    one_step_in_flight(recovery_enabled)


def raise_execute_timeout_for(vllm_config: Any) -> int | None:
    """Raise vLLM's execute timeout for an engine of ``vllm_config`` if its recovery settings
    need it; the timeout set, or ``None``."""
    config = recovery_settings(vllm_config)
    if config is None:
        return None
    from ftkit.vllm.environment import raise_short_execute_timeout

    parallel = getattr(vllm_config, "parallel_config", None)
    return raise_short_execute_timeout(config, int(getattr(parallel, "world_size", 1)))


def recovery_settings(vllm_config: Any) -> RecoveryConfig | None:
    """The recovery settings of ``vllm_config`` (``additional_config["fault_tolerance"]``),
    or ``None`` where it has none."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    return None if raw is None else RecoveryConfig.from_mapping(raw)


def _hide_key_from_vllm_ascend() -> None:
    """Make vllm-ascend's ``init_ascend_config`` validate ``additional_config`` without
    ftkit's key (taken out for the call and put back after it), where vllm-ascend is
    installed. Modules that imported the function by name already get the wrapper too."""
    module = sys.modules.get("vllm_ascend.ascend_config")
    if module is None:
        if importlib.util.find_spec("vllm_ascend") is None:
            return
        try:
            module = importlib.import_module("vllm_ascend.ascend_config")
        except Exception as exc:  # noqa: BLE001 - vllm-ascend reports its own problems
            log.warning("ftkit: cannot prepare vllm-ascend's config validation: %s", exc)
            return
    original = getattr(module, "init_ascend_config", None)
    if original is None or getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def init_ascend_config(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, dict) or CONFIG_KEY not in extra:
            return original(vllm_config, *args, **kwargs)
        ours = extra.pop(CONFIG_KEY)
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            extra[CONFIG_KEY] = ours

    setattr(init_ascend_config, WRAPPED_MARK, True)
    for loaded in list(sys.modules.values()):
        # The module's own namespace only: a module ``__getattr__`` must not run here.
        namespace = getattr(loaded, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("init_ascend_config") is original:
            namespace["init_ascend_config"] = init_ascend_config


#: The worker's methods of one engine step that ftkit wraps.
STEP_METHODS = ("execute_model", "sample_tokens")


def bind_step_method(worker: Any, name: str, wrapper: Any, inner: Any) -> None:
    """Make ``worker.<name>(arg)`` call ``wrapper(inner, arg)`` (``inner``: the worker's own
    method), marked as ftkit's."""
    wrapped = functools.partial(wrapper, inner)
    setattr(wrapped, WRAPPED_MARK, True)
    setattr(worker, name, wrapped)


def install(worker: Any, vllm_config: Any) -> Any | None:
    """Wrap ``worker``'s step methods if the config asks for ftkit; return the wrapper."""
    if getattr(worker, "_ftkit", None) is not None:
        return None
    from ftkit.vllm.pipeline import allocate_cpu_eager_buffer

    allocate_cpu_eager_buffer(worker, vllm_config)  # the CPU build's shim, recovery on or off
    # Which process this worker is (pid and start time), for an engine session whose workers
    # run on a Ray cluster it did not start: what they leave in shared memory is removed.
    from ftkit.procs import process_identity

    worker.ftkit_process_identity = process_identity
    config = recovery_settings(vllm_config)
    if config is None:
        return None
    from ftkit.vllm.runner_state import check_config
    from ftkit.vllm.worker import FtkitWorker

    if config.enabled:
        check_config(vllm_config)  # settings recovery cannot handle: the engine does not start

    ftkit_worker = FtkitWorker(worker, vllm_config, config)
    worker._ftkit = ftkit_worker
    for name in STEP_METHODS:
        bind_step_method(worker, name, getattr(ftkit_worker, name), getattr(worker, name))
    # Reached by name through collective_rpc (a callable would need insecure pickling), with
    # one argument: the plan as JSON (``FaultPlan.to_json``).
    worker.ftkit_set_fault_plan = ftkit_worker.set_fault_plan
    worker.ftkit_transport_counts = ftkit_worker.transport_counts
    worker.ftkit_settle = ftkit_worker.settle
    worker.ftkit_add_live_faults = ftkit_worker.add_live_faults
    return ftkit_worker
