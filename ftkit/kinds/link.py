"""``link_break`` and ``link_flap``: the collective link of one rank breaks.

The faulty rank raises the collective library's link error (``LinkError``, what HCCL reports as
a remote error) without entering the collective; its peers block in the real collective until
recovery stops them. A flap is a break that repeats on ``times`` consecutive attempts of the
same step. Nothing on the device is lost: every recovery round rebuilds the communicators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from ftkit.faults import FaultKind, LinkError
from ftkit.kinds.base import (
    DeviceRecovery,
    EMULATED,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    Loc,
    NoParams,
    Problem,
    detail_of,
    no_damage,
    require_device,
)

if TYPE_CHECKING:
    from ftkit.scenario.model import EngineSpec, FaultSpec


def needs_a_peer(at: Loc, fault: FaultSpec, params: Any, engine: EngineSpec) -> list[Problem]:
    if engine.world_size < 2:
        return [(at + ("kind",), f"link faults need a peer: tensor_parallel_size or "
                                 f"pipeline_parallel_size >= 2 (engine.tensor_parallel_size "
                                 f"is {engine.tensor_parallel_size})")]
    return []


def a_flap_repeats(at: Loc, fault: FaultSpec, params: Any, engine: EngineSpec) -> list[Problem]:
    if fault.times < 2:
        return [(at + ("times",), "a flap repeats: times must be at least 2")]
    return []


class BreakLink(Injection):
    """Breaks this rank's link when the fault fires: at phase ``forward`` the step's first
    collective then raises; at ``before`` and ``sample`` the injector raises the link error."""

    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        require_device(kind, site)

    def arm(self, firing: Firing, site: InjectionSite) -> bool:
        assert site.device is not None
        site.device.break_link(f"ftkit injected {firing.kind} at step {firing.step}")
        return firing.phase == "forward"

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        raise LinkError(detail_of(firing, site))


SPECS = (
    KindSpec(
        kind=FaultKind.LINK_BREAK,
        summary="the collective link of one rank breaks once: it raises a network error, its "
                "peers block in the collective until recovery stops them",
        implemented=True, collective=True, ends_process=False,
        params=NoParams, rules=(needs_a_peer,), injection=BreakLink(),
        assess_damage=no_damage,
        device=DeviceRecovery(restart=True),
        doctor=DoctorRow({"*": (EMULATED, (
            "the faulty rank raises the collective library's link error without entering the "
            "collective; its peers block in the real collective until recovery stops them"))},
            fault_model_method="break_link"),
    ),
    KindSpec(
        kind=FaultKind.LINK_FLAP,
        summary="a link break that repeats on `times` consecutive attempts of the same step",
        implemented=True, collective=True, ends_process=False,
        params=NoParams, rules=(needs_a_peer, a_flap_repeats), injection=BreakLink(),
        assess_damage=no_damage,
        device=DeviceRecovery(restart=True),
        doctor=DoctorRow({"*": (EMULATED, (
            "a link break on consecutive attempts of one step; the peers block for real"))},
            fault_model_method="break_link"),
    ),
)
