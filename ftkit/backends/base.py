"""The protocol the recovery engine uses to stop, recover and rebuild a rank's device and
communicators. One implementation per platform: ``cpu`` (gloo + shared memory, the real fault
model the tests run on), ``cuda`` (NCCL) and ``ascend`` (torch_npu, HCCL).

The recovery engine never touches device or communication APIs itself; the vLLM layer hands
the backend the communicators it found (``CommGroup``), and the backend owns what happens to
them. A round of recovery drives a backend in this order on every rank::

    stop_communication()         monitor thread: unblock this rank's collectives at once
    recorded_fault()             a stopped rank: a fault of its own the device recorded
    memory_faults()              the failing rank, for a UCE: which addresses were hit
    recover_device(kinds)        bring the device back (restart after a force stop / reset)
    rebuild_communicators(...)   collective: fresh communicators, ftkit's own groups included

Backends report what they can do through ``capabilities()``: a step that the installed
device library cannot perform is reported unsupported (with the reason), the recovery that
needs it is refused with a clear error, and nothing crashes at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ftkit.faults import FaultKind

#: The recovery steps a backend may or may not support (keys of ``capabilities()``).
STEP_STOP = "stop"                        # unblock a collective a peer never joins
STEP_DEVICE_RESTART = "device_restart"    # restart a force-stopped / reset device
STEP_COMM_REBUILD = "comm_rebuild"        # abort and rebuild the communicators
STEP_OP_TIMEOUT = "op_timeout"            # make a hung operator raise
STEP_UCE_DETECT = "uce_detect"            # tell where an uncorrectable memory error is
STEP_RNG_STATE = "rng_state"              # save and restore the device's random generator
RECOVERY_STEPS = (STEP_STOP, STEP_DEVICE_RESTART, STEP_COMM_REBUILD, STEP_OP_TIMEOUT,
                  STEP_UCE_DETECT, STEP_RNG_STATE)


@dataclass(frozen=True)
class Capability:
    supported: bool
    #: How the step is done ("torch_npu.npu.restart_device") or why it cannot be.
    detail: str


@dataclass(frozen=True)
class MemoryFault:
    """One uncorrectable memory error the device reported: ``size`` bytes at ``address``
    (a device address as ``Tensor.data_ptr()`` gives it)."""

    address: int
    size: int


class CommGroup(Protocol):
    """One communicator group of the serving job, as the vLLM layer exposes it."""

    name: str
    ranks: list[int]

    @property
    def communicator(self) -> Any:
        """The object whose collectives the step calls (vLLM's device communicator)."""

    def replace_groups(self, cpu_group: Any, device_group: Any) -> None:
        """Point the group (and its communicator) at freshly created process groups."""

    def current_groups(self) -> tuple[Any, Any]:
        """The (cpu_group, device_group) in use now."""


class Backend(Protocol):
    name: str

    def capabilities(self) -> dict[str, Capability]:
        """For every name in ``RECOVERY_STEPS``: whether this backend can do it here."""

    def take_over(self, groups: list[CommGroup]) -> None:
        """Route the groups' collectives through paths that a stop can interrupt."""

    def stop_communication(self) -> None:
        """Make blocked and future collectives on this rank raise at once.

        Called from the monitor thread; must return at once. The error the step then raises
        is recognised by ``is_stop_error``.
        """

    def is_stop_error(self, exc: BaseException) -> bool:
        """True when ``exc`` only reports this rank's own ``stop_communication()`` (a peer
        failed), not a fault of this rank. On Ascend a stopped device raises "FORCE STOP"
        for both, so only the backend can tell them apart."""

    def memory_faults(self) -> list[MemoryFault]:
        """The uncorrectable memory errors the device reports now (empty when none)."""

    def recorded_fault(self) -> FaultKind | None:
        """A fault of this rank's own that its device recorded (a memory error), or
        ``None``. Asked of a rank whose step was stopped for a peer's fault: the stop's error
        hides what the device recorded before it, and the restart would clear the record
        unrepaired."""

    def recover_device(self, kinds: tuple[str, ...]) -> None:
        """Bring the device back after the faults named (no-op where nothing is needed)."""

    def rebuild_communicators(self, timeout_s: float, kinds: tuple[str, ...] = ()) -> None:
        """Replace every communicator taken over with a working one. Collective: every rank
        calls it in the same round, with the same ``kinds``. Clears the stop flag and any
        broken link."""

    def set_op_timeout(self, seconds: float | None) -> None:
        """Make an operator that runs longer than ``seconds`` raise (``None``: the default
        bound, ``ftkit.bounds.DEFAULT_OP_TIMEOUT_S``, where the backend can bound it)."""

    def get_rng_state(self) -> Any:
        """The state of the device's default random generator."""

    def set_rng_state(self, state: Any) -> None:
        """Restore a state ``get_rng_state`` returned."""
