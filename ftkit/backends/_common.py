"""What the hardware backends (``ascend``, ``cuda``) share: the emulated part of the fault
model a scenario injects through, ftkit's rebuild of the gloo side groups, and the wrapping of
a vLLM device communicator's collectives.

The emulated faults are the ones software cannot cause on real hardware: a broken link (the
faulty rank raises the collective library's error without entering the collective, so its
peers block in the real collective until recovery stops them), a hung operator, and an
uncorrectable memory error reported at an address. Everything recovery then does (stop,
restart, communicator rebuild) runs for real on the device.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from ftkit.backends.base import Capability, CommGroup, MemoryFault
from ftkit.faults import CommunicationStopped, FaultKind, LinkError, OperatorTimeout
from ftkit.bounds import COLLECTIVE_STOP_SLICE_S
from ftkit.kinds import KIND_SPECS

log = logging.getLogger("ftkit")

#: The collectives of a vLLM device communicator that tensor parallelism uses, and the ones a
#: broken link must also fail (``DeviceCommunicatorBase`` and its CUDA and NPU subclasses).
COMMUNICATOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter",
                            "reduce_scatterv", "gather", "broadcast", "send", "recv",
                            "all_to_all")

#: Fault kinds that are about a collective link (the communicators' links are rebuilt).
LINK_KINDS = frozenset(kind.value for kind, spec in KIND_SPECS.items() if spec.collective)

#: Marks a communicator method ftkit wrapped, so that a second ``take_over`` does not wrap
#: it twice.
_WRAPPED = "__ftkit_collective__"


class EmulatedFaults:
    """The injector's fault model for what cannot be caused for real (``ftkit.kinds``).

    ``stopped`` is the backend's own stop flag (``stop_communication``): an emulated hung
    operator ends when it is set, as a real one ends when the device is stopped.
    """

    def __init__(self, rank: int, stopped: threading.Event) -> None:
        self.rank = rank
        self._stopped = stopped
        self.link_down: str | None = None
        self.memory_faults: list[MemoryFault] = []
        self.on_restart: list[Callable[[], None]] = []
        self.op_timeout_s: float | None = None

    def break_link(self, detail: str) -> None:
        """From now until the next rebuild, this rank's collectives fail without entering."""
        self.link_down = detail

    def check_link(self, op: str) -> None:
        if self.link_down is not None:
            raise LinkError(f"{self.link_down} (rank {self.rank}, {op})")

    def report_memory_fault(self, fault: MemoryFault) -> None:
        self.memory_faults.append(fault)

    def hang(self, detail: str, timeout_s: float | None = None) -> NoReturn:
        """An operator that never returns by itself: it ends by the operator timeout
        (``timeout_s``, else ``op_timeout_s``) or when this rank is stopped."""
        bound = timeout_s if timeout_s is not None else self.op_timeout_s
        started = time.monotonic()
        while True:
            if self._stopped.is_set():
                raise CommunicationStopped(f"rank {self.rank}: hung operator stopped: {detail}")
            if bound is not None and time.monotonic() - started > bound:
                raise OperatorTimeout(f"rank {self.rank}: operator did not finish within the "
                                      f"operator timeout of {bound:g} s: {detail}")
            time.sleep(COLLECTIVE_STOP_SLICE_S)

    def restarted(self) -> None:
        """The device was restarted: run what the emulated fault destroyed, forget it."""
        hooks, self.on_restart = self.on_restart, []
        for hook in hooks:
            hook()
        self.memory_faults.clear()

    def repaired_links(self) -> None:
        self.link_down = None


class EmulatedFaultModel:
    """The parts of the injector's fault model (``ftkit.kinds.base.FaultModel``) a hardware
    backend emulates: a broken link, a hung operator, a reported memory error
    (``self.faults``)."""

    faults: EmulatedFaults

    def break_link(self, detail: str) -> None:
        self.faults.break_link(detail)

    def hang(self, detail: str, timeout_s: float | None = None) -> NoReturn:
        self.faults.hang(detail, timeout_s)

    def report_memory_fault(self, fault: MemoryFault) -> None:
        self.faults.report_memory_fault(fault)

    def recorded_fault(self) -> FaultKind | None:
        """A memory error reported on this rank and not yet cleared by a restart."""
        return FaultKind.UCE if self.faults.memory_faults else None


def wrap_collectives(communicator: Any, before: Callable[[str], None]) -> list[str]:
    """Make every collective of ``communicator`` call ``before(op)`` first; returns the names
    wrapped. The wrappers are instance attributes: vLLM's ``GroupCoordinator`` looks the
    methods up on the instance at every call."""
    wrapped = []
    for name in COMMUNICATOR_COLLECTIVES:
        method = getattr(communicator, name, None)
        if method is None or not callable(method) or getattr(method, _WRAPPED, False):
            continue

        setattr(communicator, name, _guarded(name, method, before))
        wrapped.append(name)
    return wrapped


def _guarded(op: str, inner: Callable[..., Any], before: Callable[[str], None]) -> Any:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        before(op)
        return inner(*args, **kwargs)

    return mark_collective(guarded)


def mark_collective(function: Any) -> Any:
    """Mark a replacement collective as ftkit's (``wrap_collectives`` leaves it alone)."""
    setattr(function, _WRAPPED, True)
    return function


def rebuild_cpu_groups(groups: list[CommGroup], timeout_s: float,
                       device_group: Callable[[CommGroup, Any], Any] | None = None) -> None:
    """Give every group a fresh gloo ``cpu_group`` (and, through ``device_group(group,
    old_device_group)``, a device group of the backend's choosing; the old one by default).

    Collective over the world: every rank calls it in the same round, for the same groups in
    the same order. The replaced gloo groups are aborted.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    for g in groups:
        old_cpu, old_dev = g.current_groups()
        new_cpu = dist.new_group(g.ranks, backend="gloo", timeout=timeout)
        if old_dev is old_cpu:
            new_dev = new_cpu
        else:
            new_dev = device_group(g, old_dev) if device_group is not None else old_dev
        abort_quietly(old_cpu)
        g.replace_groups(new_cpu, new_dev)


def abort_quietly(pg: Any) -> None:
    """Abort a process group that is being replaced; one that refuses is dropped anyway."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception as exc:  # noqa: BLE001 - a broken group may refuse
        log.debug("abort of %r failed: %s", pg, exc)


def warn_unsupported(capabilities: dict[str, Capability], library: str) -> None:
    """The one warning at start for every recovery step ``library`` cannot do here."""
    by_reason: dict[str, list[str]] = {}
    for step, cap in capabilities.items():
        if not cap.supported:
            by_reason.setdefault(cap.detail, []).append(step)
    if by_reason:
        log.warning("ftkit: %s cannot do every recovery step; disabled: %s", library,
                    "; ".join(f"{', '.join(steps)} ({why})" for why, steps in by_reason.items()))
