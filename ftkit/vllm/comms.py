"""vLLM's communicator groups, exposed to the backends as ``CommGroup`` handles."""

from __future__ import annotations

from typing import Any

from ftkit.errors import FtkitError

# The GroupCoordinators a rank may hold, in the order every rank rebuilds them.
_COORDINATOR_NAMES = ("_WORLD", "_TP", "_PP", "_DCP", "_PCP", "_DP", "_EP", "_ETP", "_EPLB")


class VllmGroup:
    """One ``GroupCoordinator``: its ranks, its groups and its device communicator."""

    def __init__(self, name: str, coordinator: Any) -> None:
        self.name = name
        self._coordinator = coordinator
        self.ranks: list[int] = list(coordinator.ranks)
        #: Every group of this kind, this one among them (the tensor-parallel group of each
        #: pipeline stage): a rebuild creates them all, on every rank, in this order.
        self.siblings: list[list[int]] = [list(r) for r in
                                          getattr(coordinator, "group_ranks", [self.ranks])]

    @property
    def coordinator(self) -> Any:
        """vLLM's ``GroupCoordinator`` of this group."""
        return self._coordinator

    @property
    def communicator(self) -> Any:
        return self._coordinator.device_communicator

    def current_groups(self) -> tuple[Any, Any]:
        return self._coordinator.cpu_group, self._coordinator.device_group

    def replace_groups(self, cpu_group: Any, device_group: Any) -> None:
        self._coordinator.cpu_group = cpu_group
        self._coordinator.device_group = device_group
        comm = self._coordinator.device_communicator
        if comm is not None:
            comm.cpu_group = cpu_group
            comm.device_group = device_group


def vllm_groups() -> list[VllmGroup]:
    """The distinct multi-rank groups of this rank, in a fixed order.

    A group of part of the world (a pipeline stage's tensor-parallel group) is supported where
    vLLM says what its siblings are (``GroupCoordinator.group_ranks``, which cover the world):
    creating a group is collective over the world, so a rebuild creates every sibling on every
    rank, in the same order.
    """
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    world = dist.get_world_size() if dist.is_initialized() else 1
    seen: set[int] = set()
    groups: list[VllmGroup] = []
    for name in _COORDINATOR_NAMES:
        coordinator = getattr(parallel_state, name, None)
        if coordinator is None or id(coordinator) in seen or coordinator.world_size <= 1:
            continue
        seen.add(id(coordinator))
        group = VllmGroup(name.strip("_").lower(), coordinator)
        covered = sorted(rank for ranks in group.siblings for rank in ranks)
        if coordinator.world_size != world and covered != list(range(world)):
            raise FtkitError(
                f"ftkit recovery rebuilds groups that, with their siblings, cover the job; "
                f"group {group.name} has {coordinator.world_size} of {world} ranks and its "
                f"siblings cover ranks {covered}")
        groups.append(group)
    return groups
