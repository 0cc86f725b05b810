"""The fault injector that runs inside every worker: fires a scenario's faults at the step
that computes a chosen output token of a chosen request, on the chosen ranks and phases.

Phases, and what a fault does at each:

* ``before``: at the start of the step's RPC, before the runner touches its state;
* ``forward``: inside the model forward. A link fault breaks this rank's link, so its next
  collective raises ``LinkError`` without entering while the peers block in it; other kinds
  act from a hook at the start of the forward;
* ``sample``: inside sampling, after the sampler ran (generators advanced, the step's forward
  state already consumed), before the tokens are booked.

What each kind does where it fires is its injection (``KindSpec.injection``, registered with
the kind in ``ftkit.kinds``): a link fault breaks this rank's link, a device reset
force-stops the device, a UCE corrupts memory and reports its address, and so on; the
injector only decides when and where it fires.

The plan comes as a ``FaultPlan`` (``ftkit.contracts.plan``). ``times`` failing attempts of
the same step make a flap. Every firing is written to the event log (``FaultFired``) before it
acts, so the runner can prove that a fault fired (a fault that never fires is reported
``not_applied``, never ``pass``), even when the firing kills the process.

The request-id helpers (``request_id``, ``parse_request_id``) live in
``ftkit.contracts.requests`` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.contracts.eventlog import EventLog, FaultFired, FaultSkipped, StepRecovered
from ftkit.contracts.plan import FaultPlan, PlannedFault
# Request ids belong to the contract between the runner and the workers; re-exported here.
from ftkit.contracts.requests import (  # noqa: F401
    REQUEST_ID,
    RequestRef,
    parse_request_id,
    request_id,
    resumed_offset,
    served_request_matches,
)
from ftkit.contracts.step import RpcKind
from ftkit.errors import InjectionError
from ftkit.faults import FaultKind
from ftkit.kinds import kind_spec
from ftkit.kinds.base import FaultModel, Firing, InjectionSite, KindSpec, MemoryTargets

log = logging.getLogger("ftkit")


@dataclass
class _Pending:
    """The injector's own state of one fault of the plan it still has to fire."""

    planned: PlannedFault
    spec: KindSpec
    #: The fault's params, parsed by its kind's model.
    params: Any
    #: The step that computes the fault's token, once the injector saw it scheduled.
    step: int | None = None
    #: Failing attempts fired so far (with those that fired before an engine restart).
    fired: int = 0
    #: A fault planned ``after_steps`` ahead: the steps still to run before its own.
    steps_left: int | None = None

    @property
    def kind(self) -> FaultKind:
        return self.planned.spec.kind

    @property
    def phase(self) -> str:
        return self.planned.spec.phase

    @property
    def times(self) -> int:
        return self.planned.spec.times

    @property
    def request(self) -> int:
        return self.planned.spec.at.request


def _pending(planned: PlannedFault) -> _Pending:
    """The fault ready to fire; ``InjectionError`` if its kind or params are not."""
    kind = planned.spec.kind
    spec = kind_spec(kind)
    if not spec.implemented:
        raise InjectionError(f"fault kind {kind} is not implemented yet")
    try:
        params = spec.params.model_validate(dict(planned.spec.params or {}))
    except ValueError as exc:
        raise InjectionError(f"fault {planned.index} ({kind}): bad params: {exc}") from exc
    return _Pending(planned, spec, params, fired=planned.fired,
                    steps_left=planned.after_steps)


class Injector:
    """A ``StepHook`` that fires planned faults. One per worker.

    ``device`` and ``memory`` are the fault model the faults act on (``None`` where the
    backend has none: planning a fault that needs it is then an ``InjectionError``);
    ``kill_target(target)`` gives the pid a ``process_kill`` fault sends SIGKILL to.
    """

    def __init__(self, rank: int, events: EventLog, *,
                 token_indices: Callable[[Any], dict[str, int]],
                 device: FaultModel | None = None, memory: MemoryTargets | None = None,
                 kill_target: Callable[[str], int] | None = None) -> None:
        self.rank = rank
        self.events = events
        self._token_indices = token_indices
        self._site = InjectionSite(rank, None, device, memory, kill_target)
        self.faults: list[_Pending] = []
        self._armed: tuple[_Pending, Firing] | None = None  # to fire at the forward/sample hook

    @property
    def attempts_wanted(self) -> bool:
        """Only a plan with faults of this rank needs to see the attempts."""
        return bool(self.faults)

    @property
    def run_id(self) -> str | None:
        return self._site.run_id

    def set_plan(self, plan: FaultPlan) -> None:
        """Plan the faults of ``plan`` that are this rank's and have attempts left (those that
        fired before an engine restart count). Raises ``InjectionError`` when a fault of the
        plan cannot be injected here; the previous plan then stays."""
        pending = [_pending(f) for f in plan.faults]
        mine = [f for f in pending if f.planned.on_rank(self.rank)]
        for fault in mine:
            fault.spec.injection.check(fault.kind, fault.params, self._site)
        self._site = dataclasses.replace(self._site, run_id=plan.run_id)
        self.faults = [f for f in mine if f.fired < f.times]
        self._armed = None

    def add_live(self, plan: FaultPlan, *, check_only: bool = False) -> None:
        """Add the faults of ``plan``, planned in a live server (``PlannedFault.live``), to
        those still pending; the run stays as it was. ``InjectionError`` (and nothing added)
        when one of them cannot be injected here; ``check_only``: only that check."""
        pending = [_pending(f) for f in plan.faults]
        for fault in pending:
            if not fault.planned.live:
                raise InjectionError(f"fault {fault.planned.index} names no client request "
                                     f"and no step: a live fault needs one")
        mine = [f for f in pending if f.planned.on_rank(self.rank)]
        for fault in mine:
            fault.spec.injection.check(fault.kind, fault.params, self._site)
        if not check_only:
            self.faults = [f for f in self.faults if f.fired < f.times] + mine

    # --- StepHook ---------------------------------------------------------------------------

    def on_attempt(self, rpc_kind: RpcKind, step: int, attempt: int, payload: Any) -> None:
        self._armed = None
        if not self.faults:
            return
        if rpc_kind is RpcKind.EXECUTE and attempt == 0:
            self._target(step, payload)
        phases = ("before", "forward") if rpc_kind is RpcKind.EXECUTE else ("sample",)
        for fault in self.faults:
            if fault.step == step and fault.phase in phases and fault.fired < fault.times:
                self._fire(fault, step)
                return

    def on_recovered(self, rpc_kind: RpcKind, step: int, failures: int, recovery_s: float,
                     *, rollback_s: float, rerun_s: float) -> None:
        self.events.emit(StepRecovered(step=step, rpc_kind=rpc_kind.value, failures=failures,
                                       recovery_s=recovery_s, rollback_s=rollback_s,
                                       rerun_s=rerun_s))

    # --- hooks inside the step --------------------------------------------------------------

    def forward_hook(self, *_: Any) -> None:
        self._act_at("forward")

    def sample_hook(self, *_: Any) -> None:
        self._act_at("sample")

    # --- internals --------------------------------------------------------------------------

    def _act_at(self, phase: str) -> None:
        armed = self._armed
        if armed is not None and armed[1].phase == phase:
            self._armed = None
            fault, firing = armed
            self._act(fault, firing)

    def _act(self, fault: _Pending, firing: Firing) -> None:
        """Let ``fault`` act. A live fault that cannot act here (an ``InjectionError`` of its
        kind's, such as a request that holds no KV block) is skipped, never the engine's end:
        the server took it through its route, and its clients' requests run on."""
        try:
            fault.spec.injection.act(firing, self._site)
        except InjectionError as exc:
            if not fault.planned.live:
                raise
            fault.fired = fault.times  # no attempt of it is left
            log.error("ftkit: live fault %d (%s) could not act at step %d on rank %d, and is "
                      "skipped: %s", fault.planned.index, fault.kind, firing.step, self.rank,
                      exc)
            self.events.emit(FaultSkipped(index=fault.planned.index, kind=fault.kind.value,
                                          step=firing.step, phase=fault.phase,
                                          reason=str(exc)))

    def _target(self, step: int, scheduler_output: Any) -> None:
        indices: dict[int, int] | None = None
        tokens: dict[str, int] | None = None
        for fault in self.faults:
            if fault.step is not None:
                continue
            if fault.steps_left is not None:
                if fault.steps_left == 0:
                    fault.step = step
                fault.steps_left -= 1
                continue
            key = fault.planned.request_key
            if key is not None:
                if tokens is None:
                    tokens = self._token_indices(scheduler_output)
                # A request a restarted server resumed counts its tokens from where it
                # resumed (its id says how many it had).
                if any(resumed_offset(rid) + token == fault.planned.spec.at.token
                       and served_request_matches(rid, key) for rid, token in tokens.items()):
                    fault.step = step
                continue
            if indices is None:
                indices = {}
                for req_id, token in self._token_indices(scheduler_output).items():
                    ref = parse_request_id(req_id)
                    if ref is not None and ref.run_id == self.run_id:
                        # A resumed request counts its tokens from where it resumed.
                        indices[ref.index] = ref.offset + token
            if indices.get(fault.request) == fault.planned.spec.at.token:
                fault.step = step

    def _fire(self, fault: _Pending, step: int) -> None:
        fault.fired += 1
        at = fault.planned.spec.at
        self.events.emit(FaultFired(run_id=self.run_id, index=fault.planned.index,
                                    kind=fault.kind.value, request=at.request, token=at.token,
                                    phase=fault.phase, step=step, attempt=fault.fired,
                                    pid=os.getpid()))
        log.warning("ftkit: injecting %s on rank %d at step %d (%s, attempt %d of %d)",
                    fault.kind, self.rank, step, fault.phase, fault.fired, fault.times)
        firing = Firing(fault.kind, at.request, fault.phase, fault.params, step,
                        fault.planned.request_key)
        injection = fault.spec.injection
        if injection.arm(firing, self._site):
            return  # the fault acts by itself (a broken link makes a collective raise)
        if fault.phase == "before":
            self._act(fault, firing)
            return
        self._armed = (fault, firing)
