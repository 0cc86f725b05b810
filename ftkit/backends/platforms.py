"""Which backend serves which vLLM platform (``vllm.platforms.current_platform.device_type``)."""

from __future__ import annotations

import importlib
from typing import Any

from ftkit.errors import FtkitError

#: device_type -> (module, class). vLLM's ROCm platform reports ``cuda`` too (RCCL is NCCL's
#: API); vllm-ascend's platform reports ``npu``.
BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("ftkit.backends.cpu", "CpuBackend"),
    "cuda": ("ftkit.backends.cuda", "CudaBackend"),
    "npu": ("ftkit.backends.ascend", "AscendBackend"),
}


def backend_class(device_type: str) -> Any:
    """The backend class for a platform's device type (imported on demand)."""
    try:
        module, name = BACKENDS[device_type]
    except KeyError:
        raise FtkitError(f"ftkit: no recovery backend for platform {device_type!r} (known: "
                         f"{', '.join(BACKENDS)})") from None
    return getattr(importlib.import_module(module), name)
