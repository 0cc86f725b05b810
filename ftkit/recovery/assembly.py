"""The recovery engine of one rank, assembled in one place.

``assemble`` wires the parts from what a host knows about its rank; the vLLM adapter
(``ftkit.vllm.worker``) and the multi-process tests (``tests/multiprocess/_harness.py``) both
call it, so the engine the tests exercise is the engine vLLM runs::

    recovery = assemble(rank=rank, world=world, channels=side_channels(store),
                        backend=backend, state=state, hooks=[injector], config=config,
                        repairs=repair_what_faults_destroyed, on_round=record_round)
    out = recovery.wrapper.execute_model(inner_execute_model, scheduler_output)

What it builds:

* the side channels: one store client for the main thread, one for the monitor thread
  (``side_channels``; in memory for a world of one);
* the ``Coordinator``, whose rebuild after a ``recompute`` decision is, on every rank:
  recover the device, rebuild the communicators (more than one rank), then the caller's
  ``repairs`` (what the faults destroyed: reload parameters, mark KV lost); each part is
  timed into the round's ``RoundTimes`` (``device_s``, ``comms_s``, ``repair_s``);
* the ``RecoveryMonitor`` (monitor thread, started here, and step gate), whose gate waits at
  most ``GATE_TIMEOUT_ROUNDS`` round timeouts;
* the ``StepWrapper`` around the two step RPCs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ftkit.backends.base import Backend
from ftkit.bounds import GATE_TIMEOUT_ROUNDS
from ftkit.config import RecoveryConfig
from ftkit.contracts.step import StepHook
from ftkit.faults import FaultKind
from ftkit.recovery.channel import SideChannels
from ftkit.recovery.coordinator import Coordinator, Decision, RoundTimes
from ftkit.recovery.damage import Repair
from ftkit.recovery.monitor import RecoveryMonitor, RoundCallback, RoundStartCallback
from ftkit.recovery.step_wrapper import StepState, StepWrapper


#: Repairs what the round's faults destroyed, on every rank, once its device and
#: communicators are back (``Decision.kv_lost``, ``Decision.status_of(rank).reload_params``).
Repairs = Callable[[Decision], None]


def gate_timeout_s(round_timeout_s: float) -> float:
    """How long a step waits at the gate for a round the monitor runs."""
    return GATE_TIMEOUT_ROUNDS * round_timeout_s


@dataclass(frozen=True)
class Recovery:
    """One rank's assembled recovery engine."""

    wrapper: StepWrapper
    monitor: RecoveryMonitor
    #: Its ``max_reinference`` may be changed between runs (the same on every rank).
    coordinator: Coordinator


def assemble(*, rank: int, world: int, channels: SideChannels, backend: Backend,
             state: StepState, config: RecoveryConfig, hooks: list[StepHook] | None = None,
             repairs: Repairs | None = None, on_round: RoundCallback | None = None,
             on_round_start: RoundStartCallback | None = None,
             assess: Callable[[FaultKind | None], Repair] | None = None) -> Recovery:
    """Builds and starts rank ``rank``'s recovery engine (see the module docstring).

    ``backend`` must already have taken over the communicators. ``assess`` says what this
    rank's own fault destroyed (default: nothing); ``on_round_start`` gets every round's
    epoch as this rank's part of it begins, ``on_round`` its outcome when it ends.
    With ``config.enabled`` false the hooks still run and every error surfaces unchanged.
    """
    timeout = config.round_timeout_s

    def rebuild(decision: Decision, times: RoundTimes) -> None:
        started = time.monotonic()
        backend.recover_device(decision.kinds)
        times.device_s = time.monotonic() - started
        if world > 1:
            started = time.monotonic()
            backend.rebuild_communicators(timeout, decision.kinds)
            times.comms_s = time.monotonic() - started
        started = time.monotonic()
        if repairs is not None:
            repairs(decision)
        times.repair_s = time.monotonic() - started

    coordinator = Coordinator(rank, world, max_reinference=config.max_reinference,
                              round_timeout_s=timeout, rebuild=rebuild)
    monitor = RecoveryMonitor(coordinator, channels,
                              stop_communication=backend.stop_communication,
                              gate_timeout_s=gate_timeout_s(timeout), on_round=on_round,
                              on_round_start=on_round_start)
    monitor.start()
    wrapper = StepWrapper(rank=rank, monitor=monitor, state=state, hooks=hooks,
                          recovery_enabled=config.enabled, is_stop_error=backend.is_stop_error,
                          assess=assess, recorded_fault=backend.recorded_fault)
    return Recovery(wrapper, monitor, coordinator)
