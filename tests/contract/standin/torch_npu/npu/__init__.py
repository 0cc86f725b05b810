"""``torch_npu.npu``: the device and recovery APIs ftkit's Ascend backend uses."""

from __future__ import annotations

import os
from typing import Any

from torch_npu import _standin
from torch_npu.npu import utils
from torch_npu.npu.utils import _get_uce_addr, check_uce_in_memory


def set_device(device: Any) -> None:
    _standin.DEVICE.set_current(int(getattr(device, "index", device)))


def current_device() -> int:
    return _standin.DEVICE.current()


def stop_device(device_id: int) -> int:
    _standin.record("stop_device", device_id)
    _standin.DEVICE.check_id(device_id)
    _standin.DEVICE.stop()
    return 0


def _restart(device_id: int, rebuild_all_resources: bool,
             disable_tensor_unsafe_check: bool) -> None:
    _standin.DEVICE.check_id(device_id)
    _standin.DEVICE.restart(rebuild_all_resources, disable_tensor_unsafe_check)


def _restart_device_new(device_id: int, rebuild_all_resources: bool = False,
                        disable_tensor_unsafe_check: bool = False) -> None:
    _standin.record("restart_device", device_id, rebuild_all_resources=rebuild_all_resources,
                    disable_tensor_unsafe_check=disable_tensor_unsafe_check)
    _restart(device_id, rebuild_all_resources, disable_tensor_unsafe_check)


def _restart_device_old(device_id: int, rebuild_all_resources: bool = False) -> None:
    _standin.record("restart_device", device_id, rebuild_all_resources=rebuild_all_resources)
    _restart(device_id, rebuild_all_resources, False)


restart_device = (_restart_device_old
                  if os.environ.get("FTKIT_STANDIN_RESTART_SIGNATURE") == "old"
                  else _restart_device_new)
restart_device.__name__ = "restart_device"


def set_op_timeout_ms(timeout: int) -> None:
    _standin.record("set_op_timeout_ms", timeout)
    _standin.DEVICE.op_timeout_ms = int(timeout)


def get_rng_state(device: Any = "npu") -> Any:
    return _standin.DEVICE.rng.get_state()


def set_rng_state(new_state: Any, device: Any = "npu") -> None:
    _standin.DEVICE.rng.set_state(new_state)


def empty_cache() -> None:
    _standin.record("empty_cache")


def synchronize(device: Any = None) -> None:
    _standin.DEVICE.launch("synchronize")


for _name in _standin.missing():
    globals().pop(_name, None)
    if _name == "_get_uce_addr":
        delattr(utils, "_get_uce_addr")
