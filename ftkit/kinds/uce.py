"""``uce``: an uncorrectable memory error in the KV cache, the weights or the activations.

Injected: the region ``params.region`` names is overwritten with garbage (the first KV block of
the fault's request in the first layer, up to a page of a parameter, or the step's input
buffer), its address reported to the device, and the UCE error raised. Damage: the device
says where; KV blocks lose their owners' KV (recomputed), weights are reloaded from the
checkpoint on this rank, an activation is recomputed by the re-run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NoReturn

from pydantic import Field

from ftkit.errors import InjectionError
from ftkit.faults import FaultKind, UceError
from ftkit.kinds.base import (
    DeviceRecovery,
    EMULATED,
    DamageSource,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    Loc,
    MemoryMap,
    Params,
    Problem,
    Repair,
    detail_of,
    require_device,
    require_memory,
)

if TYPE_CHECKING:
    import torch

    from ftkit.scenario.model import EngineSpec, FaultSpec


class UceParams(Params):
    """The params of ``uce``."""

    region: Literal["kv", "weights", "activation"] = Field(
        "kv", description="what the error hits: `kv` (KV cache blocks of the fault's "
                          "request), `weights` (a model parameter) or `activation` (an "
                          "activation buffer of the step)")
    parameter: str | None = Field(
        None, min_length=1, description="for region `weights`: the name of the parameter hit "
                                        "(default: the model's final norm weight)")


# --- rules ----------------------------------------------------------------------------------

def kv_after_prefill(at: Loc, fault: FaultSpec, params: Any, engine: EngineSpec
                     ) -> list[Problem]:
    if (params is not None and params.region == "kv" and fault.phase == "before"
            and fault.at.token == 0):
        return [(at + ("at", "token"), "before its prefill a request holds no KV block to "
                                       "hit: use token >= 1 or phase forward")]
    return []


# --- injection ------------------------------------------------------------------------------

class CorruptMemory(Injection):
    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        require_device(kind, site)
        require_memory(kind, site)
        if params.region == "weights" and params.parameter is not None:
            assert site.memory is not None
            known = site.memory.parameter_names()
            if params.parameter not in known:
                raise InjectionError(
                    f"uce: the model has no parameter {params.parameter!r} that holds its "
                    f"data here; known: {', '.join(sorted(known))}")
            # Refused before the run: a hit there would end the run, not be repaired.
            why = site.memory.not_reloadable(params.parameter)
            if why is not None:
                raise InjectionError(f"uce: parameter {params.parameter!r} could not be "
                                     f"reloaded after the fault: {why}; hit another one")

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        assert site.device is not None and site.memory is not None
        memory = site.memory
        region_name = firing.params.region
        if region_name == "kv":
            blocks = memory.request_blocks(firing.request_matches(site.run_id))
            if not blocks:
                raise InjectionError(f"uce: request {firing.request} holds no KV block yet")
            region, where = memory.block_region(blocks[0])
        elif region_name == "weights":
            name = firing.params.parameter or memory.default_uce_parameter()
            region, where = memory.param_region(name)
        else:
            region, where = memory.activation_region()
        _corrupt(region)
        site.device.report_memory_fault(where)
        raise UceError(f"{detail_of(firing, site)}: {region_name} at 0x{where.address:x} "
                       f"({where.size} bytes)")


def _corrupt(region: torch.Tensor) -> None:
    """Overwrite a memory region with garbage, the same garbage every time (finite values:
    a real bit flip rarely makes a NaN, and NaN would hide in the maths differently)."""
    import torch  # only where a fault fires: scenario loading does not need torch

    gen = torch.Generator().manual_seed(0xF7)
    noise = torch.rand(region.shape, generator=gen, dtype=torch.float32) * 8 - 4
    if region.is_floating_point():
        region.copy_(noise.to(region.dtype))
    else:
        region.copy_((noise * 1000).to(region.dtype).abs())


# --- damage ---------------------------------------------------------------------------------

def what_was_hit(backend: DamageSource, memory: MemoryMap | None) -> Repair:
    """The KV blocks and parameters at the addresses the device reported."""
    faults = backend.memory_faults()
    if not faults:
        return Repair(unrecoverable="the device reported no address for the memory error, "
                                    "so what it hit is unknown")
    if memory is None:
        return Repair(unrecoverable="no map of the device memory to classify the error")
    hits = memory.classify(faults)
    return Repair(kv_lost=tuple(sorted(hits.kv_blocks)),
                  reload_params=tuple(sorted(hits.params)))


SPECS = (
    KindSpec(
        kind=FaultKind.UCE,
        summary="an uncorrectable memory error in the KV cache, the weights or the "
                "activations (params.region); only what was hit is repaired",
        implemented=True, collective=False, ends_process=False,
        params=UceParams, rules=(kv_after_prefill,),
        injection=CorruptMemory(), assess_damage=what_was_hit,
        device=DeviceRecovery(restart=True),
        doctor=DoctorRow({"*": (EMULATED, (
            "a memory region is overwritten and reported at its address: software cannot "
            "cause a real uncorrectable memory error"))},
            fault_model_method="report_memory_fault"),
    ),
)
