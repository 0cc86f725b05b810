"""The fault injector that runs inside every worker: fires a scenario's faults at the step
that computes a chosen output token of a chosen request, on the chosen ranks and phases.

Phases, and what a fault does at each:

* ``before``: at the start of the step's RPC, before the runner touches its state;
* ``forward``: inside the model forward. A link fault breaks this rank's link, so its next
  collective raises ``LinkError`` without entering while the peers block in it; other kinds
  raise from a hook at the start of the forward;
* ``sample``: inside sampling, after the sampler ran (generators advanced, the step's forward
  state already consumed), before the tokens are booked.

``times`` failing attempts of the same step make a flap. Every firing is written to the event
log, so the runner can prove that a fault fired (a fault that never fires is reported
``not_applied``, never ``pass``).
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftkit.errors import InjectionError
from ftkit.faults import KINDS, FaultKind, LinkError
from ftkit.recovery.coordinator import RpcKind
from ftkit.recovery.events import EventLog

log = logging.getLogger("ftkit")

#: Request ids the runner gives its requests: ``ftkit:<run_id>:<index>`` (vLLM appends a
#: random suffix to the id it uses internally).
REQUEST_ID = "ftkit:{run_id}:{index}"
_REQUEST_ID_RE = re.compile(r"^ftkit:(?P<run>[A-Za-z0-9_.]+):(?P<index>\d+)(?:-|$)")


def request_id(run_id: str, index: int) -> str:
    return REQUEST_ID.format(run_id=run_id, index=index)


def parse_request_id(req_id: str) -> tuple[str, int] | None:
    m = _REQUEST_ID_RE.match(req_id)
    return (m.group("run"), int(m.group("index"))) if m else None


@dataclass
class PlannedFault:
    index: int
    kind: FaultKind
    rank: int | str
    request: int
    token: int
    phase: str
    times: int
    params: dict[str, Any]
    step: int | None = None
    fired: int = 0

    @classmethod
    def from_dict(cls, index: int, raw: dict[str, Any]) -> PlannedFault:
        at = raw["at"]
        fault = cls(index=index, kind=FaultKind(raw["kind"]), rank=raw["rank"],
                    request=int(at["request"]), token=int(at["token"]),
                    phase=raw.get("phase", "forward"), times=int(raw.get("times", 1)),
                    params=dict(raw.get("params") or {}))
        if not KINDS[fault.kind].implemented:
            raise InjectionError(f"fault kind {fault.kind} is not implemented yet")
        if fault.params:
            raise InjectionError(f"fault kind {fault.kind} takes no params; got "
                                 f"{sorted(fault.params)}")
        return fault

    def on_rank(self, rank: int) -> bool:
        return self.rank == "all" or self.rank == rank


class Injector:
    """A ``StepHook`` that fires planned faults. One per worker."""

    def __init__(self, rank: int, events: EventLog, *,
                 token_indices: Callable[[Any], dict[str, int]],
                 break_link: Callable[[str], None] | None) -> None:
        self.rank = rank
        self.events = events
        self._token_indices = token_indices
        self._break_link = break_link
        self.run_id: str | None = None
        self.faults: list[PlannedFault] = []
        self._armed: PlannedFault | None = None  # to fire at the forward/sample hook

    def set_plan(self, run_id: str | None, faults: list[dict[str, Any]]) -> None:
        planned = [PlannedFault.from_dict(i, f) for i, f in enumerate(faults)]
        self.run_id = run_id
        self.faults = [f for f in planned if f.on_rank(self.rank)]
        self._armed = None

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

    def on_recovered(self, rpc_kind: RpcKind, step: int, failures: int,
                     recovery_s: float) -> None:
        self.events.emit("step_recovered", step=step, rpc_kind=rpc_kind.value,
                         failures=failures, recovery_s=recovery_s)

    # --- hooks inside the step --------------------------------------------------------------

    def forward_hook(self, *_: Any) -> None:
        fault = self._armed
        if fault is not None and fault.phase == "forward":
            self._armed = None
            raise self._error(fault)

    def sample_hook(self, *_: Any) -> None:
        fault = self._armed
        if fault is not None and fault.phase == "sample":
            self._armed = None
            raise self._error(fault)

    # --- internals --------------------------------------------------------------------------

    def _target(self, step: int, scheduler_output: Any) -> None:
        indices: dict[int, int] | None = None
        for fault in self.faults:
            if fault.step is not None:
                continue
            if indices is None:
                indices = {}
                for req_id, token in self._token_indices(scheduler_output).items():
                    parsed = parse_request_id(req_id)
                    if parsed is not None and parsed[0] == self.run_id:
                        indices[parsed[1]] = token
            if indices.get(fault.request) == fault.token:
                fault.step = step

    def _fire(self, fault: PlannedFault, step: int) -> None:
        fault.fired += 1
        self.events.emit("fault_fired", run_id=self.run_id, index=fault.index,
                         kind=fault.kind.value, request=fault.request, token=fault.token,
                         phase=fault.phase, step=step, attempt=fault.fired)
        log.warning("ftkit: injecting %s on rank %d at step %d (%s, attempt %d of %d)",
                    fault.kind, self.rank, step, fault.phase, fault.fired, fault.times)
        collective = KINDS[fault.kind].collective
        if collective:
            if self._break_link is None:
                raise InjectionError("link faults need a backend with a link model")
            self._break_link(f"ftkit injected {fault.kind} at step {step}")
        if fault.phase == "before":
            raise self._error(fault)
        if fault.phase == "forward" and collective:
            return  # the broken link makes the step's first collective raise
        self._armed = fault

    def _error(self, fault: PlannedFault) -> BaseException:
        if KINDS[fault.kind].collective:
            return LinkError(f"ftkit injected {fault.kind} on rank {self.rank}")
        if fault.kind is FaultKind.OOM:
            return torch.OutOfMemoryError(
                f"ftkit injected oom on rank {self.rank}: CPU out of memory "
                "(tried to allocate the step's activations)")
        raise InjectionError(f"no injector for fault kind {fault.kind}")


def release_memory() -> None:
    """What an out-of-memory recovery can release on this rank."""
    gc.collect()
