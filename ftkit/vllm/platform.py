"""The platform vLLM detects on this machine, for ``ftkit doctor`` (vLLM imported on demand)."""

from __future__ import annotations


def current_device_type() -> str:
    """``vllm.platforms.current_platform.device_type``: ``cpu``, ``cuda`` or ``npu``
    (vllm-ascend's platform plugin), ``""`` when vLLM finds no platform."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "")
