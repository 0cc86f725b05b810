"""``process_kill``: a worker or the engine core (``params.target``) is killed with SIGKILL.

Injected for real: SIGKILL to the process ``kill_target(target)`` names (this worker, or the
engine core). A dead process takes no part in a recovery round, so there is no damage to
assess: the engine is restarted and every request resumed from its tokens
(``ends_process``; the scenario runner and the engine session act on it).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from pydantic import Field

from ftkit.bounds import KILL_WAIT_POLL_S, KILL_WAIT_S
from ftkit.errors import InjectionError
from ftkit.faults import FaultKind
from ftkit.kinds.base import (
    DeviceRecovery,
    REAL,
    DoctorRow,
    Firing,
    Injection,
    InjectionSite,
    KindSpec,
    Loc,
    Params,
    Problem,
    no_damage,
)

if TYPE_CHECKING:
    from ftkit.scenario.model import EngineSpec, FaultSpec

log = logging.getLogger("ftkit")


class ProcessKillParams(Params):
    """The params of ``process_kill``."""

    target: Literal["rank", "engine"] = Field(
        "rank", description="rank: SIGKILL the worker process of the fault's rank; engine: "
                            "SIGKILL the engine core process")


def killed_once(at: Loc, fault: FaultSpec, params: Any, engine: EngineSpec) -> list[Problem]:
    if fault.times != 1:
        return [(at + ("times",), "a killed process fails no further attempt: times must "
                                  "be 1 (add another fault to kill it again)")]
    return []


class Kill(Injection):
    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        if site.kill_target is None:
            raise InjectionError("process_kill cannot be injected here: the engine core runs "
                                 "in the caller's process (an in-process engine); start the "
                                 "engine with its core in a process of its own")

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        assert site.kill_target is not None
        target = firing.params.target
        pid = site.kill_target(target)
        log.warning("ftkit: SIGKILL to pid %d (%s)", pid, target)
        os.kill(pid, signal.SIGKILL)
        # Killing the engine core from a worker: the worker's own end follows from it.
        await_own_end(f"process {pid} was sent SIGKILL but this worker lives on")


def await_own_end(outlived: str) -> NoReturn:
    """Wait for this worker's end, which a kill it sent brings (``KILL_WAIT_S`` at most);
    ``InjectionError(outlived)`` if it outlives that."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(KILL_WAIT_POLL_S)
    raise InjectionError(outlived)


SPECS = (
    KindSpec(
        kind=FaultKind.PROCESS_KILL,
        summary="a worker or the engine core (params.target) is killed with SIGKILL; the "
                "engine restarts and resumes every request",
        implemented=True, collective=False, ends_process=True,
        params=ProcessKillParams, rules=(killed_once,), injection=Kill(),
        assess_damage=no_damage,
        device=DeviceRecovery(restart=False),
        doctor=DoctorRow({"*": (REAL, "SIGKILL to the worker or the engine core process")}),
    ),
)
