"""The simulated NPU behind the torch_npu stand-in, and its HCCL over real gloo.

``DEVICE`` is this process's device: its stop and fault state, the memory errors a test
injected, the generator, and a record of every call ftkit made. ``HcclGroup`` is what a
process group created with ``backend="hccl"`` is here: a real gloo channel whose collectives
wait in short slices, so that a ``stop_device`` makes a blocked one raise FORCE STOP as the
real device does. A suspended communicator (after a stop) refuses work until
``reinit_process_group`` resumes it; a resumed or link-rebuilt communicator starts a fresh
gloo channel at its next collective (all ranks take part in the same round, so the channels
meet), the way HCCL drops an aborted operation when it resumes.

Each group's HCCL communicator has a name (``get_hccl_comm_name``), the handle the fused MoE
operators (``_moe``) take as ``group_ep``. A resumed communicator keeps its name; one whose
links were rebuilt is a new communicator, built at its next use under a new name, and the old
name no longer resolves. Whether a real release names the rebuilt communicator anew (HCCL's
generated name) or reuses the group's name (``hcclCommName`` where CANN supports it) is not
documented: the stand-in takes the case in which a name read before the rebuild fails, the
case vllm-ascend guards against by reading the name again after it recreates its HCCL groups
(``TokenDispatcherWithMC2.refresh_hccl_group``).

Test controls (not torch_npu API): ``inject_device_error``, ``inject_uce``, ``launch``,
``snapshot``, ``reset``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo

#: The text torch_npu raises after ``stop_device`` (torch_npu/utils/_error_code.py).
FORCE_STOP = "FORCE STOP."
_SLICE = timedelta(milliseconds=5)
_MISSING_ENV = "FTKIT_STANDIN_MISSING"


def missing() -> list[str]:
    return [n.strip() for n in os.environ.get(_MISSING_ENV, "").split(",") if n.strip()]


def _error_suffix(device: int) -> str:
    """torch_npu appends this to its errors (``pta_error(ErrCode.ACL)``)."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    return (f"\n[ERROR] {time.strftime('%Y-%m-%d-%H:%M:%S')} (PID:{os.getpid()}, "
            f"Device:{device}, RankID:{rank}) ERR00100 PTA call acl api failed")


class Device:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.id: int | None = None
        self._current = threading.local()
        self.stopped = threading.Event()
        self.error: str | None = None
        self.uce: list[dict[str, int]] = []
        self.uce_memory_type = 2
        self.tensors_unsafe = False
        self.op_timeout_ms: int | None = None
        self.rng = torch.Generator().manual_seed(1234)
        self.calls: list[dict[str, Any]] = []
        self.groups: list[weakref.ref[HcclGroup]] = []

    # --- devices, per thread ------------------------------------------------------------

    def set_current(self, device: int) -> None:
        self._current.device = device
        if self.id is None:
            self.id = device  # the process's own device: the first one it binds

    def current(self) -> int:
        return getattr(self._current, "device", 0)

    def check_id(self, device_id: int) -> None:
        if self.id is not None and device_id != self.id:
            raise RuntimeError(f"invalid device {device_id}: this process drives device "
                               f"{self.id}" + _error_suffix(self.current()))

    # --- state changes ------------------------------------------------------------------

    def stop(self) -> None:
        self.stopped.set()
        for group in self.live_groups():
            if group.device == self.id:
                group.state = "suspended"  # the watchdog is stopped, the comm suspended

    def restart(self, rebuild_all_resources: bool, disable_tensor_unsafe_check: bool) -> None:
        if rebuild_all_resources and not disable_tensor_unsafe_check:
            self.tensors_unsafe = True
        self.stopped.clear()
        self.error = None
        self.uce = []  # restart_device repairs the reported memory (AclrtMemUceRepair)

    def launch(self, op: str) -> None:
        """What a kernel launched on this device meets."""
        device = self.id if self.id is not None else self.current()
        if self.stopped.is_set():
            raise RuntimeError(FORCE_STOP + _error_suffix(device))
        if self.error is not None:
            raise RuntimeError(self.error + _error_suffix(device))
        if self.uce:
            raise RuntimeError("UCE ERROR." + _error_suffix(device))
        if self.tensors_unsafe:
            raise RuntimeError(f"{op}: tensor data is marked unsafe (restart_device with "
                               "rebuild_all_resources and without disable_tensor_unsafe_check)"
                               + _error_suffix(device))

    def live_groups(self) -> list[HcclGroup]:
        return [g for g in (ref() for ref in self.groups) if g is not None]


DEVICE = Device()


def record(call: str, *args: Any, **kwargs: Any) -> None:
    DEVICE.calls.append({"call": call, "args": list(args), "kwargs": kwargs,
                         "thread": threading.current_thread().name,
                         "current_device": DEVICE.current()})


# --- HCCL over gloo ---------------------------------------------------------------------------

class _Work(torch._C._distributed_c10d.Work):
    def __init__(self, inner: Any, group: HcclGroup) -> None:
        super().__init__()
        self._inner = inner
        self._group = group

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        deadline = time.monotonic() + self._group.timeout.total_seconds()
        while True:
            if self._inner.is_completed():
                self._inner.wait()
                return True
            if DEVICE.stopped.is_set():
                raise RuntimeError(FORCE_STOP + _error_suffix(self._group.device))
            try:
                self._inner.wait(_SLICE)
                return True
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError("HCCL operator timed out: a peer never joined"
                                   + _error_suffix(self._group.device))

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()


class HcclGroup(dist.ProcessGroup):
    """A process group of the ``hccl`` backend, on the device current when it was made."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def setup(self, store: Any, rank: int, size: int, timeout: timedelta) -> HcclGroup:
        self._store = store
        self._rank = rank
        self._size = size
        self.timeout = timeout
        self.device = DEVICE.current()
        self.state = "ok"
        self.channels = 0
        self.resumed = 0
        self.links_rebuilt = 0
        self._inner: Any = None
        #: The same on every rank: all ranks create their groups in the same order.
        self.index = len(DEVICE.groups)
        #: The communicator's generation: a new one after each link rebuild or abort.
        self.generation = 0
        #: Whether this generation's communicator was built (at its first use).
        self.comm_built = False
        DEVICE.groups.append(weakref.ref(self))
        return self

    def _channel(self) -> Any:
        if self._inner is None:
            self.channels += 1
            self._inner = ProcessGroupGloo(PrefixStore(f"channel/{self.channels}", self._store),
                                           self._rank, self._size, self.timeout)
            self.comm_built = True
        return self._inner

    def comm_name(self) -> str:
        return f"hccl_group{self.index}_comm{self.generation}"

    def _get_backend(self, device: Any) -> HcclGroup:
        """``ProcessGroup._get_backend(torch.device("npu"))``: the group is its own backend
        here (a CPU torch has no ``npu`` device type, so ``device`` is not checked)."""
        return self

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        """The name of the group's current HCCL communicator. ``init_comm``: build it first
        when it is not built (collective: every rank of the group builds it), else answer
        ``""``."""
        record("get_hccl_comm_name", rankid, init_comm=init_comm)
        if not self.comm_built:
            if not init_comm:
                return ""
            self._channel()
        return self.comm_name()

    def _run(self, op: str, *args: Any) -> _Work:
        DEVICE.launch(f"hccl {op}")
        if self.state == "suspended":
            raise RuntimeError(f"HCCL communicator (device {self.device}) was suspended by "
                               "stop_device and not resumed (reinit_process_group)"
                               + _error_suffix(self.device))
        if self.state == "aborted":
            raise RuntimeError("HCCL communicator was aborted" + _error_suffix(self.device))
        channel = self._channel()
        return _Work(getattr(channel, op)(*args), self)

    def allreduce(self, *args: Any) -> _Work:
        return self._run("allreduce", *args)

    def allgather(self, *args: Any) -> _Work:
        return self._run("allgather", *args)

    def _allgather_base(self, *args: Any) -> _Work:
        return self._run("_allgather_base", *args)

    def all_gather_single(self, output: Any, input: Any, opts: Any) -> _Work:  # noqa: A002
        """What ``torch.distributed.all_gather_into_tensor`` calls."""
        return self._run("_allgather_base", output, input, opts)

    def alltoall_base(self, *args: Any) -> _Work:
        """What ``torch.distributed.all_to_all_single`` calls."""
        return self._run("alltoall_base", *args)

    def broadcast(self, *args: Any) -> _Work:
        return self._run("broadcast", *args)

    def barrier(self, *args: Any) -> _Work:
        return self._run("barrier", *args)

    def resume(self) -> None:
        """``resume_hccl_comm``: the communicator works again, without what was in flight."""
        self.resumed += 1
        self._drop_channel()
        self.state = "ok"

    def rebuild_link(self) -> None:
        """``abort_hccl_comm("reinit")``: built again, links and all, at its next use, as a
        new communicator."""
        self.links_rebuilt += 1
        self._drop_channel()
        self._new_generation()
        self.state = "ok"

    def abort(self) -> None:
        self._drop_channel()
        self._new_generation()
        self.state = "aborted"

    def _new_generation(self) -> None:
        self.generation += 1
        self.comm_built = False

    def _drop_channel(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            try:
                inner.abort()
            except Exception:  # noqa: BLE001 - a broken channel is dropped anyway
                pass

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "hccl"


def create_hccl_group(store: Any, rank: int, size: int, timeout: timedelta) -> HcclGroup:
    return HcclGroup(rank, size).setup(store, rank, size, timeout)


def communicator_named(name: str) -> HcclGroup:
    """The group whose live HCCL communicator is called ``name``, as a fused operator finds
    the communicator its ``group_ep`` names."""
    for group in DEVICE.live_groups():
        if group.comm_built and group.comm_name() == name:
            return group
    device = DEVICE.id if DEVICE.id is not None else DEVICE.current()
    raise RuntimeError(f"HCCL communicator {name!r} not found on device {device}: never "
                       "built, or rebuilt under another name" + _error_suffix(device))


def reinit_process_group(group: Any = None, rebuild_link: bool = True) -> Any:
    """torch_npu's ``torch.distributed.reinit_process_group``."""
    world = dist.distributed_c10d._world
    record("reinit_process_group", group=None if group is None else _describe(group),
           rebuild_link=rebuild_link)
    if not rebuild_link:
        device = DEVICE.current()
        for pg, (backend, _) in list(world.pg_map.items()):
            if "hccl" in str(backend) and isinstance(pg, HcclGroup) and pg.device == device \
                    and pg.state != "aborted":
                pg.resume()
        return None
    if group is None:
        group = world.default_pg
    backend = world.pg_map[group][0]
    if "hccl" in str(backend) and isinstance(group, HcclGroup):
        group.rebuild_link()
    return group


def _describe(pg: Any) -> str:
    world = dist.distributed_c10d._world
    return "default" if pg is world.default_pg else str(world.pg_map[pg][0])


def install() -> None:
    """What ``import torch_npu`` does to torch: the hccl backend and reinit_process_group."""
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", create_hccl_group, devices=["cpu"])
    if "reinit_process_group" not in missing():
        dist.reinit_process_group = reinit_process_group


# --- test controls ----------------------------------------------------------------------------

def inject_device_error(text: str) -> None:
    """The device fails by itself (a reset, a link error the device reports): its work raises
    ``text`` until ``restart_device``."""
    DEVICE.error = text


def inject_uce(ptr: int, size: int, memory_type: int = 2) -> None:
    """An uncorrectable memory error at ``ptr``: device work raises "UCE ERROR" and the
    queries report it until ``restart_device`` repairs it."""
    DEVICE.uce.append({"ptr": int(ptr), "size": int(size)})
    DEVICE.uce_memory_type = memory_type


def launch(op: str) -> None:
    DEVICE.launch(op)


def reset() -> None:
    DEVICE.reset()


def snapshot() -> dict[str, Any]:
    """What happened on this device, for a test's record (JSON-serialisable)."""
    calls = []
    for call in DEVICE.calls:
        calls.append({**call, "args": [a if isinstance(a, (int, str, bool, type(None)))
                                       else repr(a) for a in call["args"]]})
    return {
        "calls": calls,
        "stopped": DEVICE.stopped.is_set(),
        "error": DEVICE.error,
        "uce": list(DEVICE.uce),
        "tensors_unsafe": DEVICE.tensors_unsafe,
        "op_timeout_ms": DEVICE.op_timeout_ms,
        "groups": [{"state": g.state, "channels": g.channels, "resumed": g.resumed,
                    "links_rebuilt": g.links_rebuilt, "device": g.device, "index": g.index,
                    "comm_name": g.comm_name() if g.comm_built else None}
                   for g in DEVICE.live_groups()],
    }
