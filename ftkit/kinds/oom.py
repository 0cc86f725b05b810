"""``oom``: an allocation fails inside the step.

Injected: the out-of-memory error class (``torch.OutOfMemoryError``) is raised inside the step;
it needs nothing of the backend. Damage: none to repair; the memory the runner can spare is
released by the backend's device recovery, then the step re-runs.
"""

from __future__ import annotations

from typing import NoReturn

from ftkit.faults import FaultKind
from ftkit.kinds.base import (
    DeviceRecovery,
    EMULATED,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    NoParams,
    detail_of,
    no_damage,
)


class OutOfMemory(Injection):
    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        import torch  # only where a fault fires: scenario loading does not need torch

        raise torch.OutOfMemoryError(f"{detail_of(firing, site)}: CPU out of memory (tried "
                                     "to allocate the step's activations)")


SPECS = (
    KindSpec(
        kind=FaultKind.OOM,
        summary="an allocation fails inside the step (the out-of-memory error class); what "
                "can be released is released and the step re-run",
        implemented=True, collective=False, ends_process=False,
        params=NoParams, rules=(), injection=OutOfMemory(), assess_damage=no_damage,
        device=DeviceRecovery(restart=False, release_memory=True),
        doctor=DoctorRow({"*": (EMULATED, "the out-of-memory error is raised inside the "
                                          "step")}),
    ),
)
