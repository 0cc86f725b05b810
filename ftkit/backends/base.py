"""The protocol the recovery engine uses to stop, recover and rebuild a rank's device and
communicators. One implementation per platform: ``cpu`` (gloo), ``cuda`` and ``ascend``.

The recovery engine never touches device or communication APIs itself; the vLLM layer hands
the backend the communicators it found (``CommGroup``), and the backend owns what happens to
them.
"""

from __future__ import annotations

from typing import Any, Protocol


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

    def take_over(self, groups: list[CommGroup]) -> None:
        """Route the groups' collectives through paths that a stop can interrupt."""

    def stop_communication(self) -> None:
        """Make blocked and future collectives on this rank raise ``CommunicationStopped``.

        Called from the monitor thread; must return at once.
        """

    def recover_device(self, kinds: tuple[str, ...]) -> None:
        """Bring the device back after the faults named (no-op where nothing is needed)."""

    def rebuild_communicators(self, timeout_s: float) -> None:
        """Replace every communicator taken over with a fresh one. Collective: every rank
        calls it in the same round. Clears the stop flag and any broken link."""
