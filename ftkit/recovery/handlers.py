"""One handler per fault kind: what a rank's own fault destroyed, and how it is repaired.

When a rank's step fails with a fault it classified, its handler assesses the damage before
the rank reports to the round (``Repair``). The round then decides for all ranks, and each
rank applies the repairs after its device and communicators are back:

=============  ============================================================================
link_break     nothing on the device; the communicators are rebuilt (every round does)
link_flap      as link_break, once per failing attempt
device_reset   the device restarts empty: every KV block is lost, every rank recomputes the
               KV of every running request before the step re-runs
uce            the device says where: KV blocks (their owners' KV is recomputed), weights
               (the hit parameters are reloaded from the checkpoint on this rank) or neither
               (an activation: the re-run recomputes it)
hang           the operator timeout ended the hung operator; the communicators are rebuilt
               and the step re-runs
oom            memory the runner can spare is released (the backend); then the step re-runs
process_kill   not handled here: a dead process takes no part in a round; the engine is
               restarted and the requests resumed (``ftkit.vllm.engine``)
=============  ============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ftkit.backends.base import MemoryFault
from ftkit.faults import FaultKind


@dataclass(frozen=True)
class Repair:
    """What a rank reports about the damage of its own fault (fields of ``RankStatus``)."""

    kv_lost: tuple[int, ...] = ()
    kv_lost_all: bool = False
    reload_params: tuple[str, ...] = ()
    #: Why the damage cannot be repaired (the round then raises), or "".
    unrecoverable: str = ""


class MemoryHitsLike(Protocol):
    kv_blocks: set[int]
    params: set[str]
    other: int


class MemoryMap(Protocol):
    """Tells what lives at device addresses (``ftkit.vllm.memory.RunnerMemory``)."""

    def classify(self, faults: list[MemoryFault]) -> MemoryHitsLike: ...


class DamageSource(Protocol):
    def memory_faults(self) -> list[MemoryFault]: ...


def assess(kind: FaultKind | None, backend: DamageSource, memory: MemoryMap | None) -> Repair:
    """The repair this rank's own fault of ``kind`` needs."""
    if kind is FaultKind.DEVICE_RESET:
        return Repair(kv_lost_all=True)
    if kind is FaultKind.UCE:
        return _assess_uce(backend, memory)
    return Repair()


def _assess_uce(backend: DamageSource, memory: MemoryMap | None) -> Repair:
    faults = backend.memory_faults()
    if not faults:
        return Repair(unrecoverable="the device reported no address for the memory error, "
                                    "so what it hit is unknown")
    if memory is None:
        return Repair(unrecoverable="no map of the device memory to classify the error")
    hits = memory.classify(faults)
    return Repair(kv_lost=tuple(sorted(hits.kv_blocks)),
                  reload_params=tuple(sorted(hits.params)))
