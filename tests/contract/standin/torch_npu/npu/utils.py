"""``torch_npu.npu.utils``: where torch_npu defines the memory-error queries."""

from __future__ import annotations

from typing import Any

from torch_npu import _standin


def check_uce_in_memory(device_id: int) -> int:
    """0: no UCE; 1: outside the memory pool; 2: temporary memory; 3: persistent memory."""
    _standin.record("check_uce_in_memory", device_id)
    _standin.DEVICE.check_id(device_id)
    return _standin.DEVICE.uce_memory_type if _standin.DEVICE.uce else 0


def _get_uce_addr() -> list[dict[str, Any]]:
    _standin.record("_get_uce_addr")
    return [dict(entry) for entry in _standin.DEVICE.uce]
