"""``hang``: an operator never returns until the operator timeout or the monitor ends it.

Injected: the operator blocks until ``params.op_timeout_s`` (torch_npu's ``set_op_timeout_ms``
on Ascend) raises ``OperatorTimeout``, or until this rank is stopped. Damage: none on the
device; the communicators are rebuilt and the step re-runs. Every hung attempt and its round
happen inside one step RPC, which vLLM bounds: validation refuses a hang whose attempts do not
fit (``ftkit.bounds.step_bound``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from pydantic import Field

from ftkit.faults import FaultKind
from ftkit.kinds.base import (
    DeviceRecovery,
    EMULATED,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    Params,
    detail_of,
    no_damage,
    require_device,
)


class HangParams(Params):
    """The params of ``hang``."""

    op_timeout_s: float = Field(
        2.0, gt=0, le=600, description="the operator timeout that ends the hung operator, in "
                                       "seconds (torch_npu's set_op_timeout_ms on Ascend)")


class Hang(Injection):
    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        require_device(kind, site)

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        assert site.device is not None
        site.device.hang(detail_of(firing, site), firing.params.op_timeout_s)
        super().act(firing, site)  # a hang never returns by itself


SPECS = (
    KindSpec(
        kind=FaultKind.HANG,
        summary="an operator never returns until the operator timeout (params.op_timeout_s) "
                "or the monitor ends it",
        implemented=True, collective=False, ends_process=False,
        params=HangParams, rules=(), injection=Hang(), assess_damage=no_damage,
        device=DeviceRecovery(restart=True, rebuild_streams=True),
        doctor=DoctorRow({"*": (EMULATED, (
            "an operator that does not return until the operator timeout or a stop"))},
            fault_model_method="hang"),
    ),
)
