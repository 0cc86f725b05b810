"""The Ascend backend: torch_npu's fault-tolerance APIs behind ftkit's ``Backend`` protocol.

A recovery round drives it, on every rank, as torch_npu intends these APIs to be used::

    stop_communication()        torch_npu.npu.stop_device(device): the device's queued and
                                running tasks are aborted; a healthy rank blocked in an HCCL
                                collective raises "FORCE STOP" (``is_stop_error`` says it is
                                a stop, not a fault of its own)
    memory_faults()             the failing rank, for a UCE: check_uce_in_memory(device) and
                                torch_npu.npu.utils._get_uce_addr(); a rank that was stopped
                                asks check_uce_in_memory too (``recorded_fault``): a UCE its
                                device recorded before the stop is its own fault, repaired
                                in the same round, before restart_device clears the record
    recover_device(kinds)       torch_npu.npu.restart_device(device, ...)
    rebuild_communicators(...)  torch.distributed.reinit_process_group(group, rebuild_link)
                                (patched in by torch_npu): resume the HCCL communicators
                                (rebuild_link=False) or abort them so that their links are
                                built again (True, after a link fault); then ftkit rebuilds
                                the gloo groups (vLLM's ``cpu_group``), which reinit leaves
                                alone

What the code relies on, as read in torch_npu's source (github.com/Ascend/pytorch):

* ``torch_npu/npu/_recovery.py``: ``stop_device(device_id)`` aborts the device's tasks
  (``_npu_stopDevice``), makes later errors surface as "FORCE STOP" and sets the watchdog of
  every HCCL group to stop; it returns 0 on success and 1 on failure
  (``torch_npu/csrc/npu/Module.cpp``). ``restart_device(device_id, rebuild_all_resources=
  False)`` in older releases; newer ones add ``disable_tensor_unsafe_check=False`` (its
  documentation: ``rebuild_all_resources=True`` restores every NPU stream and, unless
  ``disable_tensor_unsafe_check=True``, marks every NPU tensor unsafe). The signature is
  probed at run time: ftkit rebuilds the streams (after a hang or a reset) only where it can
  keep the weights and the KV cache usable, that is, where the newer parameter exists.
* ``torch_npu/utils/_error_code.py``: the error raised after a stop is
  ``RuntimeError("FORCE STOP." + ...)``.
* ``torch_npu/npu/utils.py`` and ``Module.cpp``: ``check_uce_in_memory(device_id)`` returns 0
  (no UCE), 1 (UCE outside torch_npu's memory pool), 2 (in temporary memory: re-running the
  step suffices) or 3 (in persistent memory, or an HBM ECC error); ``_get_uce_addr()``
  returns ``[{"ptr": int, "size": int}, ...]``. ``restart_device`` repairs the reported
  memory (``AclrtMemUceRepair``) and clears the record.
* torch_npu's ``torch.distributed.reinit_process_group(group=None, rebuild_link=True)``:
  with ``rebuild_link=False`` it calls ``resume_hccl_comm(torch.npu.current_device())`` on
  every HCCL group torch knows, so it must run on a thread bound to this rank's device
  (the monitor thread runs rounds too: ftkit binds it first); with ``True`` it aborts the
  HCCL communicator of ``group`` (the default group when ``None``), which is built again at
  its next use. ftkit calls it for the default group, for each device group it took over, and
  for every other HCCL group torch knows on this rank: ``stop_device`` suspended them all, and
  a group ftkit does not take over (vllm-ascend's own, such as the MC2 group whose
  communicator the fused MoE dispatch and combine name) would otherwise stay suspended.
  A rebuilt communicator is a new one: a consumer that holds its name
  (``get_hccl_comm_name``, as vllm-ascend's MC2 token dispatcher does) must read it again.
* ``torch_npu.npu.set_op_timeout_ms(timeout)`` (milliseconds; its documentation names no
  default, and CANN's own is far longer than vLLM's bound on a step): ftkit always sets one,
  ``fault_tolerance.op_timeout_s`` or ``ftkit.bounds.DEFAULT_OP_TIMEOUT_S`` (120 s); and
  ``torch_npu.npu.get_rng_state(device)`` / ``set_rng_state(state, device)``
  (``torch_npu/npu/random.py``).

Capability probing: an API the installed torch_npu lacks disables the recovery step that
needs it, with one warning (logger ``ftkit``) when the backend is built; ``capabilities()``
says why. Nothing crashes at start; a round that needs a missing step fails with that reason.

Faults a scenario injects here (the ``FaultModel`` of ``ftkit.kinds.base``): a device reset is a
real ``stop_device`` of the faulty rank's device; a broken link, a hung operator and a memory
error are emulated (``ftkit.backends._common``), and recovery from them is real.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.backends._common import (
    LINK_KINDS,
    EmulatedFaultModel,
    EmulatedFaults,
    rebuild_cpu_groups,
    warn_unsupported,
    wrap_collectives,
)
from ftkit.backends.base import (
    RECOVERY_STEPS,
    STEP_COMM_REBUILD,
    STEP_DEVICE_RESTART,
    STEP_OP_TIMEOUT,
    STEP_RNG_STATE,
    STEP_STOP,
    STEP_UCE_DETECT,
    Capability,
    CommGroup,
    MemoryFault,
)
from ftkit.bounds import DEFAULT_OP_TIMEOUT_S
from ftkit.errors import FtkitError, InjectionError
from ftkit.faults import CommunicationStopped, FaultKind, SimulatedFault
from ftkit.kinds.base import any_kind

log = logging.getLogger("ftkit")


#: What ``check_uce_in_memory`` answers (torch_npu/csrc/npu/Module.cpp).
UCE_MEMORY_TYPES = {
    0: "no uncorrectable memory error",
    1: "an uncorrectable memory error outside torch_npu's memory pool",
    2: "an uncorrectable memory error in temporary memory (re-running the step suffices)",
    3: "an uncorrectable memory error in persistent memory (weights or KV cache), or an HBM "
       "ECC error",
}

_STOP_ERROR_TEXT = "FORCE STOP"
#: The state ``get_rng_state`` returns when torch_npu has no generator API.
_NO_RNG = object()


@dataclass
class TorchNpuApi:
    """The parts of torch_npu the backend uses, as found in the installed release."""

    version: str | None = None
    import_error: str | None = None
    stop_device: Callable[..., Any] | None = None
    restart_device: Callable[..., Any] | None = None
    #: ``restart_device`` takes ``disable_tensor_unsafe_check`` (newer releases).
    restart_keeps_tensors: bool = False
    reinit_process_group: Callable[..., Any] | None = None
    set_op_timeout_ms: Callable[..., Any] | None = None
    check_uce_in_memory: Callable[..., Any] | None = None
    get_uce_addr: Callable[..., Any] | None = None
    get_rng_state: Callable[..., Any] | None = None
    set_rng_state: Callable[..., Any] | None = None
    current_device: Callable[..., Any] | None = None
    set_device: Callable[..., Any] | None = None
    empty_cache: Callable[..., Any] | None = None

    @classmethod
    def probe(cls) -> TorchNpuApi:
        try:
            import torch_npu
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
            return cls(import_error=f"torch_npu cannot be imported: {type(exc).__name__}: "
                                    f"{exc}")
        import torch.distributed as dist

        npu = getattr(torch_npu, "npu", None)
        utils = getattr(npu, "utils", None)
        restart = getattr(npu, "restart_device", None)
        return cls(
            version=getattr(torch_npu, "__version__", None),
            stop_device=getattr(npu, "stop_device", None),
            restart_device=restart,
            restart_keeps_tensors=_accepts(restart, "disable_tensor_unsafe_check"),
            reinit_process_group=getattr(dist, "reinit_process_group", None),
            set_op_timeout_ms=getattr(npu, "set_op_timeout_ms", None),
            check_uce_in_memory=getattr(npu, "check_uce_in_memory", None),
            get_uce_addr=getattr(utils, "_get_uce_addr", None) or getattr(npu, "_get_uce_addr",
                                                                           None),
            get_rng_state=getattr(npu, "get_rng_state", None),
            set_rng_state=getattr(npu, "set_rng_state", None),
            current_device=getattr(npu, "current_device", None),
            set_device=getattr(npu, "set_device", None),
            empty_cache=getattr(npu, "empty_cache", None),
        )

    def capabilities(self) -> dict[str, Capability]:
        if self.import_error is not None:
            return {step: Capability(False, self.import_error) for step in RECOVERY_STEPS}

        def need(*names: str, how: str) -> Capability:
            missing = [n for n in names if getattr(self, n) is None]
            if missing:
                return Capability(False, "missing in this torch_npu: "
                                  + ", ".join(_API_NAMES[n] for n in missing))
            return Capability(True, how)

        restart = need("restart_device", how=(
            "torch_npu.npu.restart_device(device_id, rebuild_all_resources, "
            "disable_tensor_unsafe_check)" if self.restart_keeps_tensors else
            "torch_npu.npu.restart_device(device_id, rebuild_all_resources) (older signature: "
            "streams are not rebuilt after a hang or a reset, since that would mark every "
            "tensor unsafe)"))
        return {
            STEP_STOP: need("stop_device", how="torch_npu.npu.stop_device: a blocked HCCL "
                            "operator fails with FORCE STOP"),
            STEP_DEVICE_RESTART: restart,
            STEP_COMM_REBUILD: need("reinit_process_group", how=(
                "torch.distributed.reinit_process_group (torch_npu) resumes or rebuilds the "
                "HCCL communicators; ftkit rebuilds its gloo groups")),
            STEP_OP_TIMEOUT: need("set_op_timeout_ms", how="torch_npu.npu.set_op_timeout_ms"),
            STEP_UCE_DETECT: need("check_uce_in_memory", "get_uce_addr", how=(
                "torch_npu.npu.check_uce_in_memory and torch_npu.npu.utils._get_uce_addr")),
            STEP_RNG_STATE: need("get_rng_state", "set_rng_state", how=(
                "torch_npu.npu.get_rng_state / set_rng_state")),
        }


_API_NAMES = {
    "stop_device": "torch_npu.npu.stop_device",
    "restart_device": "torch_npu.npu.restart_device",
    "reinit_process_group": "torch.distributed.reinit_process_group",
    "set_op_timeout_ms": "torch_npu.npu.set_op_timeout_ms",
    "check_uce_in_memory": "torch_npu.npu.check_uce_in_memory",
    "get_uce_addr": "torch_npu.npu.utils._get_uce_addr",
    "get_rng_state": "torch_npu.npu.get_rng_state",
    "set_rng_state": "torch_npu.npu.set_rng_state",
}


def _accepts(function: Any, parameter: str) -> bool:
    if function is None:
        return False
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the older one
        return False


class AscendBackend(EmulatedFaultModel):
    """Backend for vllm-ascend: HCCL collectives, torch_npu device recovery.

    ``device_id``: this rank's NPU (``torch_npu.npu.current_device()`` of the thread that
    first needs it, which is the worker's main thread, when not given). ``warn``: log the
    one warning about missing torch_npu APIs (``ftkit doctor`` reports them itself).
    """

    name = "ascend"

    def __init__(self, rank: int, store: Any = None, *, device_id: int | None = None,
                 warn: bool = True) -> None:
        self.rank = rank
        self._store = store
        self._device_id = device_id
        self._groups: list[CommGroup] = []
        self._stopped = threading.Event()
        #: A real ``stop_device`` the injector asked for (a device reset of this rank).
        self._device_fault: str | None = None
        self.faults = EmulatedFaults(rank, self._stopped)
        self.api = TorchNpuApi.probe()
        self._capabilities = self.api.capabilities()
        self._reported: set[str] = set()
        if warn:
            warn_unsupported(self._capabilities, f"torch_npu {self.api.version or ''}".strip())

    def capabilities(self) -> dict[str, Capability]:
        return dict(self._capabilities)

    @property
    def device_id(self) -> int:
        if self._device_id is None:
            if self.api.current_device is None:
                raise FtkitError("ftkit: cannot tell this rank's NPU: torch_npu.npu."
                                 "current_device is missing")
            self._device_id = int(self.api.current_device())
        return self._device_id

    # --- taking over ------------------------------------------------------------------------

    def take_over(self, groups: list[CommGroup]) -> None:
        self._groups = [g for g in groups if len(g.ranks) > 1]
        _ = self.device_id  # resolved on the worker's main thread, bound to its device
        for g in self._groups:
            if g.communicator is not None:
                wrap_collectives(g.communicator, self.faults.check_link)

    # --- the injector's fault model (break_link, hang, report_memory_fault: emulated) ---------

    def force_stop(self, detail: str, on_restart: Callable[[], None] | None = None) -> None:
        """A device reset of this rank: a real ``stop_device``; its operations then fail with
        FORCE STOP until ``recover_device`` restarts it."""
        if self.api.stop_device is None:
            raise InjectionError("device_reset cannot be injected: torch_npu.npu.stop_device "
                                 "is missing")
        self._device_fault = detail
        if on_restart is not None:
            self.faults.on_restart.append(on_restart)
        self._call_stop_device()

    # --- recovery ---------------------------------------------------------------------------

    def stop_communication(self) -> None:
        self._stopped.set()
        if self.api.stop_device is None:
            self._report_once(STEP_STOP)
            return
        self._call_stop_device()

    def _call_stop_device(self) -> None:
        assert self.api.stop_device is not None
        try:
            result = self.api.stop_device(self.device_id)
        except Exception:  # noqa: BLE001 - the monitor must return; the round reports
            log.exception("ftkit: torch_npu.npu.stop_device(%d) failed", self.device_id)
            return
        if result not in (None, 0):
            log.error("ftkit: torch_npu.npu.stop_device(%d) returned %r (1: the device's "
                      "tasks could not be aborted)", self.device_id, result)

    def is_stop_error(self, exc: BaseException) -> bool:
        if isinstance(exc, CommunicationStopped):
            return True
        # After this rank's own stop_device every device error reads FORCE STOP; an error
        # ftkit injected as this rank's own fault is never a stop.
        return (self._stopped.is_set() and not isinstance(exc, SimulatedFault)
                and _STOP_ERROR_TEXT in str(exc))

    def recorded_fault(self) -> FaultKind | None:
        """A UCE ``check_uce_in_memory`` reports (or an emulated one): the device keeps the
        record until ``restart_device`` repairs the memory."""
        if self.faults.memory_faults:
            return FaultKind.UCE
        check = self.api.check_uce_in_memory
        if check is None:
            self._report_once(STEP_UCE_DETECT)
            return None
        return FaultKind.UCE if int(check(self.device_id)) != 0 else None

    def memory_faults(self) -> list[MemoryFault]:
        faults = list(self.faults.memory_faults)
        check, addresses = self.api.check_uce_in_memory, self.api.get_uce_addr
        if check is None or addresses is None:
            if not faults:
                self._report_once(STEP_UCE_DETECT)
            return faults
        memory_type = int(check(self.device_id))
        if memory_type == 0:
            return faults
        log.warning("ftkit: rank %d: torch_npu.npu.check_uce_in_memory(%d) = %d: %s",
                    self.rank, self.device_id, memory_type,
                    UCE_MEMORY_TYPES.get(memory_type, "unknown answer"))
        faults.extend(MemoryFault(int(entry["ptr"]), int(entry["size"]))
                      for entry in addresses())
        return faults

    def recover_device(self, kinds: tuple[str, ...]) -> None:
        self._bind_thread()
        stopped = self._stopped.is_set() or self._device_fault is not None
        # Which kinds restart the device (their error left its task queue in an exit state
        # only ``restart_device`` clears) and rebuild its streams: each kind's DeviceRecovery.
        if stopped or any_kind(kinds, lambda spec: spec.device.restart):
            streams = any_kind(kinds, lambda spec: spec.device.rebuild_streams)
            self._restart(rebuild_streams=streams)
            self._device_fault = None
            self.faults.restarted()
        if any_kind(kinds, lambda spec: spec.device.release_memory) \
                and self.api.empty_cache is not None:
            self.api.empty_cache()

    def _restart(self, rebuild_streams: bool) -> None:
        restart = self.api.restart_device
        if restart is None:
            raise FtkitError("ftkit: cannot restart the NPU: "
                             + self._capabilities[STEP_DEVICE_RESTART].detail)
        if rebuild_streams and self.api.restart_keeps_tensors:
            restart(self.device_id, rebuild_all_resources=True, disable_tensor_unsafe_check=True)
        else:
            restart(self.device_id, rebuild_all_resources=False)

    def rebuild_communicators(self, timeout_s: float, kinds: tuple[str, ...] = ()) -> None:
        self._bind_thread()
        reinit = self.api.reinit_process_group
        if reinit is None:
            raise FtkitError("ftkit: cannot rebuild the HCCL communicators: "
                             + self._capabilities[STEP_COMM_REBUILD].detail)
        if LINK_KINDS.intersection(kinds) or self.faults.link_down is not None:
            reinit(group=None, rebuild_link=True)
            for group in self._device_groups():
                reinit(group=group, rebuild_link=True)
        else:
            reinit(group=None, rebuild_link=False)
        # reinit_process_group leaves gloo groups alone: ftkit gives each group a new one.
        rebuild_cpu_groups(self._groups, timeout_s)
        self._stopped.clear()
        self.faults.repaired_links()

    def _device_groups(self) -> list[Any]:
        """The distinct groups whose HCCL links a link fault's round rebuilds, other than the
        default group: the device groups taken over, then every other HCCL group torch knows
        on this rank (all ranks of a group hold it, so each group is rebuilt by all of them)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return self._taken_over_device_groups(None)
        world = dist.distributed_c10d._world
        default = world.default_pg
        found = {id(g): g for g in self._taken_over_device_groups(default)}
        for pg, (backend, _store) in list(world.pg_map.items()):
            if pg is not default and "hccl" in str(backend):
                found.setdefault(id(pg), pg)
        return list(found.values())

    def _taken_over_device_groups(self, default: Any) -> list[Any]:
        found: dict[int, Any] = {}
        for g in self._groups:
            cpu_group, device_group = g.current_groups()
            if device_group is not None and device_group is not cpu_group \
                    and device_group is not default:
                found.setdefault(id(device_group), device_group)
        return list(found.values())

    def _bind_thread(self) -> None:
        """Bind the calling thread to this rank's NPU: torch_npu's current device is per
        thread, and the monitor thread runs the rounds of a rank that is between steps."""
        if self.api.set_device is not None:
            self.api.set_device(self.device_id)

    # --- operator timeout, generator --------------------------------------------------------

    def set_op_timeout(self, seconds: float | None) -> None:
        """``None``: ftkit's default, ``DEFAULT_OP_TIMEOUT_S`` (120 s). CANN's own default
        is far longer than vLLM's bound on a step (``ftkit.bounds``), so an operator timeout
        is always set."""
        if seconds is None:
            seconds = DEFAULT_OP_TIMEOUT_S
        self.faults.op_timeout_s = seconds
        if self.api.set_op_timeout_ms is None:
            self._report_once(STEP_OP_TIMEOUT)
            return
        self.api.set_op_timeout_ms(max(1, int(seconds * 1000)))

    def get_rng_state(self) -> Any:
        if self.api.get_rng_state is None:
            return _NO_RNG
        return self.api.get_rng_state(self.device_id)

    def set_rng_state(self, state: Any) -> None:
        if state is _NO_RNG or self.api.set_rng_state is None:
            raise FtkitError("ftkit: cannot restore the NPU's random generator for the re-run: "
                             + self._capabilities[STEP_RNG_STATE].detail)
        self.api.set_rng_state(state, self.device_id)

    def _report_once(self, step: str) -> None:
        if step not in self._reported:
            self._reported.add(step)
            log.error("ftkit: recovery step %s is unavailable on this rank: %s", step,
                      self._capabilities[step].detail)
