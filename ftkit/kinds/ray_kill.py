"""``ray_worker_kill`` and ``node_loss``: death on vLLM's Ray executor.

Both are injected for real, from the worker of the fault's rank, which on the Ray executor
is a Ray actor's process:

* ``ray_worker_kill``: the rank's Ray worker is killed through Ray (``ray.kill`` of its own
  actor, no restart), as an operator, or Ray's memory monitor, ends a worker. Ray's raylet
  kills the process; the executor learns it from Ray.
* ``node_loss``: every process of the rank's Ray node is killed with SIGKILL at once: the
  raylet (the worker's parent), every process below it (the node's workers and agents) and,
  where the node was started with ``ray start --block`` (as ftkit starts its nodes), that
  process and everything else below it: on the head node the GCS too. Nothing on the node
  runs any clean-up, as when the host goes down.

A dead process takes no part in a recovery round: the engine is replaced (a lost node first
started again, with the cluster's head if that was it) and every request resumed from its
tokens (``ends_process``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import psutil

from ftkit.errors import InjectionError
from ftkit.faults import FaultKind
from ftkit.kinds.base import (
    REAL,
    DeviceRecovery,
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
from ftkit.kinds.process_kill import await_own_end, killed_once

if TYPE_CHECKING:
    from ftkit.scenario.model import EngineSpec, FaultSpec

log = logging.getLogger("ftkit")


class RayKillParams(Params):
    """``ray_worker_kill`` and ``node_loss`` take no params."""


def on_ray(at: Loc, fault: FaultSpec, params: Any, engine: EngineSpec) -> list[Problem]:
    if not engine.uses_ray:
        return [(at + ("kind",), f"{fault.kind} needs vLLM's Ray executor: add "
                                 f"`distributed_executor_backend: ray` to engine.args")]
    return []


def _ray_worker() -> Any:
    """Ray, in a worker that runs as a Ray actor; ``InjectionError`` elsewhere."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() \
            or ray.get_runtime_context().current_actor is None:
        raise InjectionError("this worker is no Ray actor: the Ray fault kinds need vLLM's "
                             "Ray executor (distributed_executor_backend: ray)")
    return ray


class _RayKill(Injection):
    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        _ray_worker()


class KillRayWorker(_RayKill):
    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        ray = _ray_worker()
        actor = ray.get_runtime_context().current_actor
        log.warning("ftkit: ray.kill of this rank's Ray worker (rank %d, pid %d)", site.rank,
                    os.getpid())
        ray.kill(actor, no_restart=True)
        await_own_end("the Ray worker was killed, but this worker lives on")


class LoseNode(_RayKill):
    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        _ray_worker()
        victims = node_processes(psutil.Process())
        log.warning("ftkit: node loss: SIGKILL to the %d processes of rank %d's Ray node",
                    len(victims), site.rank)
        me = os.getpid()
        for proc in sorted(victims, key=lambda p: p.pid == me):  # this worker last
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue  # gone already
        await_own_end("the node was killed, but this worker lives on")


def node_processes(worker: psutil.Process) -> list[psutil.Process]:
    """Every process of the Ray node ``worker`` (a Ray worker process) runs on: its raylet and
    everything below it, and where a process owns the node (``ray start``, or the worker node
    of ftkit's cluster, ``ftkit.vllm.ray_node``), that one and everything below it."""
    raylet = worker.parent()
    if raylet is None or "raylet" not in raylet.name():
        raise InjectionError(f"this worker's parent is not a raylet "
                             f"({raylet.name() if raylet else 'none'}): no Ray node to lose")
    root = raylet
    owner = raylet.parent()
    try:
        if owner is not None and _owns_a_node(owner.cmdline()):
            root = owner
    except psutil.Error:
        pass
    return [root, *root.children(recursive=True)]


def _owns_a_node(cmdline: list[str]) -> bool:
    words = [os.path.basename(part) for part in cmdline]
    return ("ray" in words and "start" in words) or "ftkit.vllm.ray_node" in words


SPECS = (
    KindSpec(
        kind=FaultKind.RAY_WORKER_KILL,
        summary="the rank's Ray worker is killed through Ray (ray.kill of its actor); the "
                "engine restarts and resumes every request",
        implemented=True, collective=False, ends_process=True,
        params=RayKillParams, rules=(killed_once, on_ray), injection=KillRayWorker(),
        assess_damage=no_damage,
        device=DeviceRecovery(restart=False),
        doctor=DoctorRow({"*": (REAL, "ray.kill of the rank's Ray actor (vLLM's Ray "
                                      "executor)")}),
    ),
    KindSpec(
        kind=FaultKind.NODE_LOSS,
        summary="every process of the rank's Ray node is killed at once (raylet, workers, "
                "agents; the GCS on the head); the node is started again, the engine "
                "restarted and every request resumed",
        implemented=True, collective=False, ends_process=True,
        params=RayKillParams, rules=(killed_once, on_ray), injection=LoseNode(),
        assess_damage=no_damage,
        device=DeviceRecovery(restart=False),
        doctor=DoctorRow({"*": (REAL, "SIGKILL to every process of the rank's Ray node")}),
    ),
)
