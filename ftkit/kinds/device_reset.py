"""``device_reset``: the device is force-stopped (FORCE STOP) and restarted.

Injected: the device is force-stopped (its operations and collectives raise FORCE STOP) and the
rank raises ``ForceStopError``; the device's restart during recovery poisons this rank's whole
KV cache. Damage: the device restarts empty, so every KV block is lost and every rank
recomputes the KV of every running request before the step re-runs.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ftkit.faults import FaultKind, ForceStopError
from ftkit.kinds.base import (
    DeviceRecovery,
    EMULATED,
    REAL,
    DamageSource,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    MemoryMap,
    NoParams,
    Repair,
    detail_of,
    require_device,
    require_memory,
)


class ForceStop(Injection):
    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        require_device(kind, site)
        require_memory(kind, site)

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        assert site.device is not None and site.memory is not None
        detail = detail_of(firing, site)
        site.device.force_stop(detail, on_restart=site.memory.poison_kv)
        raise ForceStopError(detail)


def all_kv_lost(backend: DamageSource, memory: MemoryMap | None) -> Repair:
    return Repair(kv_lost_all=True)


SPECS = (
    KindSpec(
        kind=FaultKind.DEVICE_RESET,
        summary="the device is force-stopped (FORCE STOP) and restarted; its KV cache is lost "
                "and recomputed for every running request",
        implemented=True, collective=False, ends_process=False,
        params=NoParams, rules=(), injection=ForceStop(), assess_damage=all_kv_lost,
        device=DeviceRecovery(restart=True, rebuild_streams=True),
        doctor=DoctorRow({
            "cpu": (EMULATED, "a simulated force stop: FORCE STOP errors until the restart, "
                    "which poisons the KV cache"),
            "npu": (REAL, "torch_npu.npu.stop_device on the faulty rank's NPU; the KV cache "
                    "loss that follows a reset is emulated"),
            "cuda": (EMULATED, "CUDA cannot stop a device in process: the error and the KV "
                     "cache loss are emulated"),
        }, fault_model_method="force_stop"),
    ),
)
