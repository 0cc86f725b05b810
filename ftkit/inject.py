"""The fault injector that runs inside every worker: fires a scenario's faults at the step
that computes a chosen output token of a chosen request, on the chosen ranks and phases.

Phases, and what a fault does at each:

* ``before``: at the start of the step's RPC, before the runner touches its state;
* ``forward``: inside the model forward. A link fault breaks this rank's link, so its next
  collective raises ``LinkError`` without entering while the peers block in it; other kinds
  act from a hook at the start of the forward;
* ``sample``: inside sampling, after the sampler ran (generators advanced, the step's forward
  state already consumed), before the tokens are booked.

What each kind does on the CPU fault model (``ftkit.backends.cpu``), where it fires:

* ``link_break`` / ``link_flap``: breaks this rank's link (see above);
* ``device_reset``: force-stops the device (its operations and collectives raise FORCE STOP)
  and raises; the device's restart during recovery poisons this rank's whole KV cache;
* ``uce``: corrupts the region named by ``params.region`` (the first KV block of the fault's
  request in the first layer, up to a page of a parameter, or the step's input buffer),
  reports its address to the device and raises the UCE error;
* ``hang``: the operator never returns until the operator timeout ``params.op_timeout_s``;
* ``oom``: raises the out-of-memory error;
* ``process_kill``: SIGKILLs this worker's process or the engine core (``params.target``).

``times`` failing attempts of the same step make a flap. Every firing is written to the event
log before it acts, so the runner can prove that a fault fired (a fault that never fires is
reported ``not_applied``, never ``pass``), even when the firing kills the process.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ftkit.errors import InjectionError
from ftkit.faults import KINDS, FaultKind, ForceStopError, LinkError, UceError
from ftkit.recovery.coordinator import RpcKind
from ftkit.recovery.events import EventLog
from ftkit.scenario.params import parse_params

log = logging.getLogger("ftkit")

#: Request ids the runner gives its requests: ``ftkit:<run_id>:<index>``, and
#: ``ftkit:<run_id>:<index>+<offset>`` for a request resumed after ``offset`` output tokens
#: (vLLM appends a random suffix to the id it uses internally).
REQUEST_ID = "ftkit:{run_id}:{index}"
_REQUEST_ID_RE = re.compile(
    r"^ftkit:(?P<run>[A-Za-z0-9_.]+):(?P<index>\d+)(?:\+(?P<offset>\d+))?(?:-|$)")


class RequestRef(NamedTuple):
    run_id: str
    index: int
    #: Output tokens the request had produced before it was resumed (0: not resumed).
    offset: int = 0


def request_id(run_id: str, index: int, offset: int = 0) -> str:
    rid = REQUEST_ID.format(run_id=run_id, index=index)
    return f"{rid}+{offset}" if offset else rid


def parse_request_id(req_id: str) -> RequestRef | None:
    m = _REQUEST_ID_RE.match(req_id)
    if not m:
        return None
    return RequestRef(m.group("run"), int(m.group("index")), int(m.group("offset") or 0))


class FaultModel(Protocol):
    """What the injector needs of the device it fails (the CPU backend's fault model)."""

    def break_link(self, detail: str) -> None: ...
    def force_stop(self, detail: str, on_restart: Callable[[], None] | None = None) -> None: ...
    def hang(self, detail: str, timeout_s: float) -> Any: ...
    def report_memory_fault(self, fault: Any) -> None: ...
    def set_op_timeout(self, seconds: float | None) -> None: ...


class MemoryTargets(Protocol):
    """Where the injector's memory errors land (``ftkit.vllm.memory.RunnerMemory``)."""

    def poison_kv(self) -> None: ...
    def request_blocks(self, match: Callable[[str], bool]) -> list[int]: ...
    def block_region(self, block_id: int, layer: int = 0) -> tuple[torch.Tensor, Any]: ...
    def param_region(self, name: str) -> tuple[torch.Tensor, Any]: ...
    def default_uce_parameter(self) -> str: ...
    def parameter_names(self) -> list[str]: ...
    def activation_region(self) -> tuple[torch.Tensor, Any]: ...


@dataclass
class PlannedFault:
    index: int
    kind: FaultKind
    rank: int | str
    request: int
    token: int
    phase: str
    times: int
    params: Any
    step: int | None = None
    fired: int = 0

    @classmethod
    def from_dict(cls, index: int, raw: dict[str, Any]) -> PlannedFault:
        at = raw["at"]
        kind = FaultKind(raw["kind"])
        if not KINDS[kind].implemented:
            raise InjectionError(f"fault kind {kind} is not implemented yet")
        try:
            params = parse_params(kind, raw.get("params"))
        except ValueError as exc:
            raise InjectionError(f"fault {index} ({kind}): bad params: {exc}") from exc
        return cls(index=int(raw.get("index", index)), kind=kind, rank=raw["rank"],
                   request=int(at["request"]), token=int(at["token"]),
                   phase=raw.get("phase", "forward"), times=int(raw.get("times", 1)),
                   params=params, fired=int(raw.get("fired", 0)))

    def on_rank(self, rank: int) -> bool:
        return self.rank == "all" or self.rank == rank


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
        self._device = device
        self._memory = memory
        self._kill_target = kill_target
        self.run_id: str | None = None
        self.faults: list[PlannedFault] = []
        self._armed: PlannedFault | None = None  # to fire at the forward/sample hook

    def set_plan(self, run_id: str | None, faults: list[dict[str, Any]]) -> None:
        """Plan the faults of run ``run_id``. A fault dict may carry ``index`` (its place in
        the scenario) and ``fired`` (attempts already failed before the engine restarted)."""
        planned = [PlannedFault.from_dict(i, f) for i, f in enumerate(faults)]
        mine = [f for f in planned if f.on_rank(self.rank)]
        for fault in mine:
            self._check_injectable(fault)
        self.run_id = run_id
        self.faults = [f for f in mine if f.fired < f.times]
        self._armed = None

    def _check_injectable(self, fault: PlannedFault) -> None:
        needs_device = fault.kind is not FaultKind.OOM and fault.kind is not FaultKind.PROCESS_KILL
        if needs_device and self._device is None:
            raise InjectionError(f"{fault.kind} cannot be injected here: this backend has no "
                                 "fault model for it")
        if fault.kind in (FaultKind.DEVICE_RESET, FaultKind.UCE) and self._memory is None:
            raise InjectionError(f"{fault.kind} cannot be injected here: no map of the "
                                 "runner's memory")
        if fault.kind is FaultKind.PROCESS_KILL and self._kill_target is None:
            raise InjectionError("process_kill cannot be injected here: the engine core runs "
                                 "in the caller's process (an in-process engine); start the "
                                 "engine with its core in a process of its own")
        if (fault.kind is FaultKind.UCE and fault.params.region == "weights"
                and fault.params.parameter is not None and self._memory is not None):
            known = self._memory.parameter_names()
            if fault.params.parameter not in known:
                raise InjectionError(
                    f"uce: the model has no parameter {fault.params.parameter!r} that holds "
                    f"its data here; known: {', '.join(sorted(known))}")

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
        self.events.emit("step_recovered", step=step, rpc_kind=rpc_kind.value,
                         failures=failures, recovery_s=recovery_s, rollback_s=rollback_s,
                         rerun_s=rerun_s)

    # --- hooks inside the step --------------------------------------------------------------

    def forward_hook(self, *_: Any) -> None:
        fault = self._armed
        if fault is not None and fault.phase == "forward":
            self._armed = None
            self._act(fault)

    def sample_hook(self, *_: Any) -> None:
        fault = self._armed
        if fault is not None and fault.phase == "sample":
            self._armed = None
            self._act(fault)

    # --- internals --------------------------------------------------------------------------

    def _target(self, step: int, scheduler_output: Any) -> None:
        indices: dict[int, int] | None = None
        for fault in self.faults:
            if fault.step is not None:
                continue
            if indices is None:
                indices = {}
                for req_id, token in self._token_indices(scheduler_output).items():
                    ref = parse_request_id(req_id)
                    if ref is not None and ref.run_id == self.run_id:
                        # A resumed request counts its tokens from where it resumed.
                        indices[ref.index] = ref.offset + token
            if indices.get(fault.request) == fault.token:
                fault.step = step

    def _fire(self, fault: PlannedFault, step: int) -> None:
        fault.fired += 1
        self.events.emit("fault_fired", run_id=self.run_id, index=fault.index,
                         kind=fault.kind.value, request=fault.request, token=fault.token,
                         phase=fault.phase, step=step, attempt=fault.fired, pid=os.getpid())
        log.warning("ftkit: injecting %s on rank %d at step %d (%s, attempt %d of %d)",
                    fault.kind, self.rank, step, fault.phase, fault.fired, fault.times)
        if KINDS[fault.kind].collective:
            assert self._device is not None
            self._device.break_link(f"ftkit injected {fault.kind} at step {step}")
            if fault.phase == "forward":
                return  # the broken link makes the step's first collective raise
        if fault.phase == "before":
            self._act(fault)
        self._armed = fault

    def _act(self, fault: PlannedFault) -> None:
        """Do what the fault does, where it fires. Raises (or ends the process)."""
        detail = f"ftkit injected {fault.kind} on rank {self.rank}"
        kind = fault.kind
        if KINDS[kind].collective:
            raise LinkError(detail)
        if kind is FaultKind.OOM:
            raise torch.OutOfMemoryError(f"{detail}: CPU out of memory (tried to allocate "
                                         "the step's activations)")
        if kind is FaultKind.DEVICE_RESET:
            assert self._device is not None and self._memory is not None
            self._device.force_stop(detail, on_restart=self._memory.poison_kv)
            raise ForceStopError(detail)
        if kind is FaultKind.UCE:
            raise self._memory_error(fault, detail)
        if kind is FaultKind.HANG:
            assert self._device is not None
            self._device.hang(detail, fault.params.op_timeout_s)
        if kind is FaultKind.PROCESS_KILL:
            self._kill(fault)
        raise InjectionError(f"no injector for fault kind {kind}")

    def _memory_error(self, fault: PlannedFault, detail: str) -> BaseException:
        assert self._device is not None and self._memory is not None
        region_name = fault.params.region
        if region_name == "kv":
            prefix = request_id(self.run_id or "", fault.request)
            blocks = self._memory.request_blocks(
                lambda rid: rid == prefix or rid.startswith((prefix + "-", prefix + "+")))
            if not blocks:
                raise InjectionError(f"uce: request {fault.request} holds no KV block yet")
            region, where = self._memory.block_region(blocks[0])
        elif region_name == "weights":
            name = fault.params.parameter or self._memory.default_uce_parameter()
            region, where = self._memory.param_region(name)
        else:
            region, where = self._memory.activation_region()
        _corrupt(region)
        self._device.report_memory_fault(where)
        return UceError(f"{detail}: {region_name} at 0x{where.address:x} "
                        f"({where.size} bytes)")

    def _kill(self, fault: PlannedFault) -> None:
        assert self._kill_target is not None
        pid = self._kill_target(fault.params.target)
        log.warning("ftkit: SIGKILL to pid %d (%s)", pid, fault.params.target)
        os.kill(pid, signal.SIGKILL)
        # Killing the engine core from a worker: the worker's own end follows from it.
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise InjectionError(f"process {pid} was sent SIGKILL but this worker lives on")


#: How long a worker that killed the engine core waits for its own end before it gives up.
KILL_WAIT_S = 30.0


def _corrupt(region: torch.Tensor) -> None:
    """Overwrite a memory region with garbage, the same garbage every time (finite values:
    a real bit flip rarely makes a NaN, and NaN would hide in the maths differently)."""
    gen = torch.Generator().manual_seed(0xF7)
    noise = torch.rand(region.shape, generator=gen, dtype=torch.float32) * 8 - 4
    if region.is_floating_point():
        region.copy_(noise.to(region.dtype))
    else:
        region.copy_((noise * 1000).to(region.dtype).abs())
