"""The damage assessment: what a rank's own fault destroyed, and how it is repaired.

When a rank's step fails with a fault it classified, it assesses the damage before it reports
to the round (``assess_damage`` returns a ``Repair``). So does a rank whose step was stopped
for a peer's fault when its device recorded a fault of its own before the stop
(``Backend.recorded_fault``: a UCE on Ascend), before the round's restart clears the record. The round then decides for all ranks,
and each rank applies the repairs after its device and communicators are back. Each kind's
assessment is registered with the kind (``KindSpec.assess_damage`` in ``ftkit.kinds``):

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
process_kill   nothing here: a dead process takes no part in a round; the engine is
               restarted and the requests resumed (``ftkit.vllm.engine``)
=============  ============================================================================
"""

from __future__ import annotations

from ftkit.faults import FaultKind
from ftkit.kinds import kind_spec
from ftkit.kinds.base import DamageSource, MemoryMap, Repair

__all__ = ["DamageSource", "MemoryMap", "Repair", "assess_damage"]


def assess_damage(kind: FaultKind | None, backend: DamageSource,
                  memory: MemoryMap | None) -> Repair:
    """The repair this rank's own fault of ``kind`` needs (none for ``None``: no fault of
    this rank's own)."""
    if kind is None:
        return Repair()
    return kind_spec(kind).assess_damage(backend, memory)
