"""The recovery half of ftkit: token-level re-inference of a failed step, agreed by all ranks.

It knows no vLLM: a host (``ftkit.vllm.worker``, or the multi-process test rig) gives it a
device backend, the model runner's step state and the job's store, and wraps its two step
RPCs::

    from ftkit.recovery import assemble, side_channels

    recovery = assemble(rank=rank, world=world, channels=side_channels(store),
                        backend=backend, state=state, config=config, hooks=[injector])
    out = recovery.wrapper.execute_model(inner_execute_model, scheduler_output)

The modules, top-down as a recovery runs:

=================  ==========================================================================
``assembly``       ``assemble``: every part below wired in one place (``Recovery``)
``step_wrapper``   ``StepWrapper``: records, runs and on failure re-runs each step RPC
``monitor``        ``RecoveryMonitor``: the monitor thread and the step gate; ``RoundOutcome``
``coordinator``    ``Coordinator`` and the pure ``decide``: one round's reports and decision
``damage``         ``assess_damage``: what a rank's own fault destroyed (``Repair``)
``channel``        ``SideChannel`` over the job's store (``StoreChannel``, ``MemoryChannel``)
=================  ==========================================================================

It imports the backends' protocol (``ftkit.backends.base``) and the contracts below both halves
(``ftkit.contracts.step``); nothing in ``ftkit.backends``, ``ftkit.inject`` or
``ftkit.contracts`` imports it.
"""

from ftkit.recovery.assembly import Recovery, Repairs, assemble, gate_timeout_s
from ftkit.recovery.channel import (
    MemoryChannel,
    SideChannel,
    SideChannels,
    StoreChannel,
    side_channels,
)
from ftkit.recovery.coordinator import (
    Action,
    Cause,
    Coordinator,
    Decision,
    RankState,
    RankStatus,
    RoundTimes,
    decide,
)
from ftkit.recovery.damage import Repair, assess_damage
from ftkit.recovery.monitor import RecoveryMonitor, RoundCallback, RoundOutcome
from ftkit.recovery.step_wrapper import StepState, StepWrapper

__all__ = [
    "Action",
    "Cause",
    "Coordinator",
    "Decision",
    "MemoryChannel",
    "RankState",
    "RankStatus",
    "Recovery",
    "RecoveryMonitor",
    "Repair",
    "Repairs",
    "RoundCallback",
    "RoundOutcome",
    "RoundTimes",
    "SideChannel",
    "SideChannels",
    "StepState",
    "StepWrapper",
    "StoreChannel",
    "assemble",
    "assess_damage",
    "decide",
    "gate_timeout_s",
    "side_channels",
]
