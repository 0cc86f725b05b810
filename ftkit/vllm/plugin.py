"""The ``vllm.general_plugins`` entry point: wraps the worker's step in every process.

vLLM loads general plugins in the main process, the engine core and every worker (inside
``WorkerWrapperBase.init_worker``, before the worker class is resolved). ``register`` wraps
``WorkerBase.__init__`` so that, once a worker object exists, ftkit installs itself on *that
instance*: it leaves the platform's worker selection alone (CPU, CUDA and vllm-ascend's
``NPUWorker`` alike) and costs nothing when ``additional_config["fault_tolerance"]`` is absent.

The recovery engine itself is set up lazily at the first step, when the model runner and the
process groups exist.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ftkit.recovery.config import CONFIG_KEY, RecoveryConfig

log = logging.getLogger("ftkit")

#: Marks ftkit's wrappers (vLLM's own decorators already set ``__wrapped__``).
_MARK = "__ftkit_wrapped__"


def register() -> None:
    """Entry point: idempotent, safe to call in any vLLM process.

    In worker processes vLLM calls this from inside ``WorkerWrapperBase.init_worker``, before
    it creates the worker: wrapping ``WorkerBase.__init__`` reaches that very worker.
    """
    from vllm.v1.worker import worker_base

    original = worker_base.WorkerBase.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        install(self, vllm_config)

    setattr(__init__, _MARK, True)
    worker_base.WorkerBase.__init__ = __init__


def install(worker: Any, vllm_config: Any) -> Any | None:
    """Wrap ``worker``'s step methods if the config asks for ftkit; return the wrapper."""
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    if raw is None or getattr(worker, "_ftkit", None) is not None:
        return None
    config = RecoveryConfig.from_mapping(raw)
    from ftkit.vllm.worker import FtkitWorker

    ftkit_worker = FtkitWorker(worker, vllm_config, config)
    worker._ftkit = ftkit_worker
    for name in ("execute_model", "sample_tokens"):
        inner = getattr(worker, name)
        wrapped = functools.partial(getattr(ftkit_worker, name), inner)
        setattr(wrapped, _MARK, True)
        setattr(worker, name, wrapped)
    # Reached by name through collective_rpc (a callable would need insecure pickling).
    worker.ftkit_set_fault_plan = ftkit_worker.set_fault_plan
    return ftkit_worker
