"""The CPU backend: gloo collectives that a peer's fault can really block and a stop can
really unblock, and a fault model faithful to what HCCL and the NPU do on Ascend.

* A collective is issued asynchronously and waited for in short slices; between slices the
  stop flag is read. The fault-free cost is one asynchronous issue and one wait, the same
  gloo work as a blocking call.
* ``break_link()`` models a broken collective link on this rank: every collective raises
  ``LinkError`` (torch_npu's "SUSPECT REMOTE ERROR" text) *without entering*, so the peers
  block in it for real, until the link is rebuilt.
* ``stop_communication()`` (monitor thread) makes the blocked wait raise
  ``CommunicationStopped`` within one slice; the abandoned work stays on the old group, which
  ``rebuild_communicators()`` aborts and replaces with a new gloo group on every rank.
* ``force_stop()`` models a device that was force-stopped (a reset): its operations and
  collectives raise ``ForceStopError`` ("FORCE STOP") until ``recover_device`` restarts it,
  and the restart runs the reset's damage (the injector poisons the KV cache there).
* ``hang()`` is an operator that never returns: it ends only by the operator timeout
  (``set_op_timeout``, raising ``OperatorTimeout``) or by a stop from the monitor. A collective
  that a peer never joins is bounded by the same timeout.
* ``report_memory_fault()`` is what the device tells about an uncorrectable memory error:
  ``memory_faults()`` returns it until the device has been recovered.
"""

from __future__ import annotations

import gc
import logging
import pickle
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftkit.backends import shm
from ftkit.backends._common import EmulatedFaultModel, EmulatedFaults, abort_quietly
from ftkit.backends.base import (
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
from ftkit.kinds.base import any_kind
from ftkit.errors import FtkitError
from ftkit.faults import CommunicationStopped, ForceStopError, OperatorTimeout
from ftkit.bounds import COLLECTIVE_STOP_SLICE_S, COLLECTIVE_TIMEOUT_S

log = logging.getLogger("ftkit")

_SLICE = timedelta(seconds=COLLECTIVE_STOP_SLICE_S)
#: The garbage-collector generations an oom recovery collects (0 and 1: the young ones).
OOM_GC_GENERATION = 1


class AbortableCollectives:
    """Stands in for ``torch.distributed`` as a communicator's ``dist_module``.

    Only the collectives vLLM's CPU communicator calls are provided; anything else raises
    ``AttributeError`` at once rather than bypassing the stop logic. Collectives that fit a
    shared-memory slot go through the group's ``ShmGroup``; the others through gloo.
    """

    def __init__(self, backend: CpuBackend) -> None:
        self._backend = backend

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
        shm = self._backend.shm_for(group, tensor) if op == dist.ReduceOp.SUM else None
        self._backend.run_collective(
            "all_reduce",
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
            shm and (lambda: shm.all_reduce(tensor)))

    def gather(self, tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None) -> None:
        shm = self._backend.shm_for(group, tensor)
        self._backend.run_collective(
            "gather",
            lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=True),
            shm and (lambda: shm.gather(tensor, gather_list, dist.get_group_rank(group, dst))))

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor,
                               group=None) -> None:
        shm = self._backend.shm_for(group, input_)
        self._backend.run_collective(
            "all_gather_into_tensor",
            lambda: dist.all_gather_into_tensor(output, input_, group=group, async_op=True),
            shm and (lambda: shm.all_gather_into_tensor(output, input_)))

    def all_gather(self, tensor_list, tensor: torch.Tensor, group=None) -> None:
        self._backend.run_collective("all_gather", lambda: dist.all_gather(
            tensor_list, tensor, group=group, async_op=True))

    def reduce_scatter_tensor(self, output: torch.Tensor, input_: torch.Tensor,
                              op=dist.ReduceOp.SUM, group=None) -> None:
        self._backend.run_collective("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(
            output, input_, op=op, group=group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group=None) -> None:
        self._backend.run_collective("broadcast", lambda: dist.broadcast(
            tensor, src=src, group=group, async_op=True))


class CpuBackend(EmulatedFaultModel):
    """Backend for vLLM's CPU platform: shared memory where it fits, gloo otherwise."""

    name = "cpu"

    def __init__(self, rank: int, store=None, *, use_shm: bool = True,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.rank = rank
        self._store = store
        self._use_shm = use_shm and store is not None and shm.available()
        self._collective_timeout_s = collective_timeout_s
        self._groups: list[CommGroup] = []
        self._shm: dict[int, shm.ShmGroup] = {}  # id(device_group) -> its segment
        #: Each rank's host (``shm.host_identity``), once exchanged: a group's segment is
        #: opened only where every member shares this rank's host.
        self._hosts: dict[int, str] | None = None
        self._generation = 0
        self._stopped = threading.Event()
        #: The link, hang and memory-error parts of the fault model (shared with the
        #: hardware backends, which emulate them too).
        self.faults = EmulatedFaults(rank, self._stopped)
        self._device_stopped: str | None = None
        self.collectives = AbortableCollectives(self)
        #: Collectives issued, and how many of each operation took which path (``shm`` or
        #: ``gloo``): for tests and diagnostics (``transport_counts``).
        self.collectives_issued = 0
        self.paths: dict[tuple[str, str], int] = {}

    def capabilities(self) -> dict[str, Capability]:
        return {
            STEP_STOP: Capability(True, "collectives issued so that a stop abandons them "
                                  "(shared memory, asynchronous gloo)"),
            STEP_DEVICE_RESTART: Capability(True, "the simulated device is restarted"),
            STEP_COMM_REBUILD: Capability(True, "gloo groups aborted and created afresh; new "
                                          "shared-memory segments"),
            STEP_OP_TIMEOUT: Capability(True, "simulated operators raise after the timeout"),
            STEP_UCE_DETECT: Capability(True, "injected memory errors are reported with their "
                                        "address"),
            STEP_RNG_STATE: Capability(True, "torch.get_rng_state / set_rng_state"),
        }

    # --- taking over ------------------------------------------------------------------------

    def take_over(self, groups: list[CommGroup]) -> None:
        self._groups = [g for g in groups if len(g.ranks) > 1]
        for g in self._groups:
            comm = g.communicator
            if comm is not None and hasattr(comm, "dist_module"):
                # vLLM's shared-memory all-reduce spins in C++ and cannot be interrupted;
                # recovery needs collectives that a stop can abandon.
                comm.dist_module = self.collectives
                if hasattr(comm, "supports_tensor_dict"):
                    comm.supports_tensor_dict = False
        self._open_segments()

    def _open_segments(self) -> None:
        for segment in self._shm.values():
            segment.close()
        self._shm = {}
        if not self._use_shm:
            return
        for g in self._groups:
            if not self._one_host(g.ranks):
                continue  # ranks on other hosts: the abortable gloo path
            _, device_group = g.current_groups()
            # (Sibling groups, such as each stage's tensor-parallel group, share a name.)
            members = ".".join(str(r) for r in g.ranks)
            key = f"ftkit/shm/{g.name}-{members}/{self._generation}"
            self._shm[id(device_group)] = shm.rendezvous(
                self._store, key, g.ranks.index(self.rank), len(g.ranks),
                stopped=self._stopped.is_set, timeout_s=self._collective_timeout_s,
                bound_s=lambda: self.collective_bound_s)

    def _one_host(self, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` runs on this rank's host (asked of the store once:
        every rank of the engine says where it runs as its groups are first opened)."""
        if self._hosts is None:
            from datetime import timedelta

            ranks_all = sorted({r for g in self._groups for r in g.ranks})
            self._store.set(f"ftkit/host/{self.rank}", shm.host_identity())
            keys = [f"ftkit/host/{r}" for r in ranks_all]
            self._store.wait(keys, timedelta(seconds=self._collective_timeout_s))
            self._hosts = {r: self._store.get(k).decode() for r, k in zip(ranks_all, keys)}
        mine = self._hosts.get(self.rank)
        return all(self._hosts.get(r) == mine for r in ranks)

    def shm_for(self, group, tensor: torch.Tensor) -> shm.ShmGroup | None:
        segment = self._shm.get(id(group))
        return segment if segment is not None and segment.fits(tensor) else None

    # --- the fault model --------------------------------------------------------------------

    @property
    def op_timeout_s(self) -> float | None:
        """Bound of a simulated hung operator and of a collective (``set_op_timeout``)."""
        return self.faults.op_timeout_s

    def force_stop(self, detail: str, on_restart: Callable[[], None] | None = None) -> None:
        """The device is force-stopped: until ``recover_device`` restarts it, its operations
        (``check_device``) and collectives raise ``ForceStopError``. ``on_restart`` runs at the
        restart: what the reset destroyed."""
        self._device_stopped = detail
        if on_restart is not None:
            self.faults.on_restart.append(on_restart)

    def check_device(self) -> None:
        """What a device operation meets on this rank: raises if the device is stopped."""
        if self._device_stopped is not None:
            raise ForceStopError(f"{self._device_stopped} (rank {self.rank})")

    def run_collective(self, op: str, issue, run_shm=None) -> None:
        """Run one collective unless the link is down or a stop was asked for.

        ``run_shm`` (the shared-memory path) spins with its own stop checks; ``issue`` starts
        the gloo path asynchronously, waited for in slices with a stop check between them.
        """
        self.collectives_issued += 1
        self.check_device()
        self.faults.check_link(op)
        if self._stopped.is_set():
            raise CommunicationStopped(f"rank {self.rank}: {op} stopped: a peer failed")
        path = (op, "gloo" if run_shm is None else "shm")
        self.paths[path] = self.paths.get(path, 0) + 1
        if run_shm is not None:
            run_shm()
            return
        work = issue()
        bound = self.collective_bound_s
        deadline = time.monotonic() + bound
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            if self._stopped.is_set() and not work.is_completed():
                # Abandon the work: its group is aborted and replaced by the rebuild. (Work
                # that completed after the slice ran out is not abandoned: every peer took
                # part in it, and this rank re-running it alone would be out of step.)
                raise CommunicationStopped(f"rank {self.rank}: {op} stopped while blocked: "
                                           "a peer failed")
            if time.monotonic() > deadline and not work.is_completed():
                raise OperatorTimeout(f"rank {self.rank}: {op} timed out after {bound:g} s: "
                                      "a peer never joined")

    # --- a pipeline stage's transfers ------------------------------------------------------

    def send_tensor_dict(self, group: CommGroup, tensor_dict: dict[str, Any], dst: int) -> None:
        """Send ``tensor_dict`` to rank ``dst`` of ``group`` (its index in ``group.ranks``),
        a group of two ranks: what the tensors are (a fixed-size header), then the tensors,
        each a broadcast from this rank over the group's current gloo group, waited for like
        any collective (``run_collective``). Not gloo's point-to-point calls: a wait for one
        of those that times out closes the connection, so it cannot be waited in slices."""
        keys, tensors = [], []
        for key, value in tensor_dict.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"ftkit sends only tensors between pipeline stages, not "
                                f"{key}={type(value).__name__}")
            keys.append(key)
            tensors.append(value.contiguous())
        header = _header([(k, tuple(t.shape), t.dtype) for k, t in zip(keys, tensors)])
        self._transfer(group, self.rank, [header, *tensors])

    def recv_tensor_dict(self, group: CommGroup, src: int) -> dict[str, torch.Tensor]:
        """Receive what ``send_tensor_dict`` on rank ``src`` of ``group`` sent."""
        header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        self._transfer(group, group.ranks[src], [header])
        tensors = {key: torch.empty(shape, dtype=dtype)
                   for key, shape, dtype in _read_header(header)}
        self._transfer(group, group.ranks[src], list(tensors.values()))
        return tensors

    def _transfer(self, group: CommGroup, source: int, tensors: list[torch.Tensor]) -> None:
        if len(group.ranks) != 2:
            raise FtkitError(f"ftkit's CPU backend transfers between pipeline stages in "
                             f"groups of two ranks, not {len(group.ranks)}")
        pg = group.current_groups()[0]
        for tensor in tensors:
            if tensor.numel():
                self.run_collective("send" if source == self.rank else "recv",
                                    lambda t=tensor: dist.broadcast(t, src=source, group=pg,
                                                                    async_op=True))

    def transport_counts(self) -> dict[str, int]:
        """Collectives run so far, by ``<operation>/<path>`` (``all_reduce/shm`` ...)."""
        return {f"{op}/{path}": n for (op, path), n in sorted(self.paths.items())}

    # --- recovery ---------------------------------------------------------------------------

    def stop_communication(self) -> None:
        self._stopped.set()

    def is_stop_error(self, exc: BaseException) -> bool:
        return isinstance(exc, CommunicationStopped)

    def memory_faults(self) -> list[MemoryFault]:
        return list(self.faults.memory_faults)

    def set_op_timeout(self, seconds: float | None) -> None:
        self.faults.op_timeout_s = seconds

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def collective_bound_s(self) -> float:
        """How long a collective may wait for its peers: the operator timeout if set."""
        return self.op_timeout_s if self.op_timeout_s is not None else self._collective_timeout_s

    def recover_device(self, kinds: tuple[str, ...]) -> None:
        # Link faults need no device work on CPU: the rebuild repairs them.
        if self._device_stopped is not None:
            self._device_stopped = None
        # The restart: what the reset destroyed is gone now; reported errors are handled.
        self.faults.restarted()
        if any_kind(kinds, lambda spec: spec.device.release_memory):
            # What an oom can give back on CPU is garbage in reference cycles (there is no
            # caching allocator to empty). The young generations hold what recent steps
            # allocated; a full collection would also scan the worker's whole long-lived heap
            # (vLLM, torch, the model: about 0.45 s on two cores) for nothing a step made.
            gc.collect(OOM_GC_GENERATION)

    def rebuild_communicators(self, timeout_s: float, kinds: tuple[str, ...] = ()) -> None:
        timeout = timedelta(seconds=timeout_s)
        for g in self._groups:
            old_cpu, old_dev = g.current_groups()
            for pg in {id(old_cpu): old_cpu, id(old_dev): old_dev}.values():
                abort_quietly(pg)
            # Creating a group is collective over the world: every rank creates every sibling
            # of a group of part of it (each stage's tensor-parallel group), in one order, and
            # keeps its own.
            for ranks in getattr(g, "siblings", [g.ranks]):
                cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
                dev = cpu if old_dev is old_cpu else dist.new_group(
                    ranks, backend="gloo", timeout=timeout)
                if list(ranks) == list(g.ranks):
                    new_cpu, new_dev = cpu, dev
            g.replace_groups(new_cpu, new_dev)
        self._stopped.clear()
        self._generation += 1
        self._open_segments()
        self.faults.repaired_links()


#: The size of the header a pipeline transfer starts with: the keys, shapes and dtypes of its
#: tensors, pickled (two or three activations take about 200 bytes).
_HEADER_BYTES = 4096


def _header(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> torch.Tensor:
    data = pickle.dumps(layout)
    if len(data) > _HEADER_BYTES - 4:
        raise ValueError(f"ftkit: a pipeline transfer of {len(layout)} tensors does not fit "
                         f"its {_HEADER_BYTES}-byte header")
    header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
    header[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    header[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return header


def _read_header(header: torch.Tensor) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    raw = header.numpy().tobytes()
    size = int.from_bytes(raw[:4], "little")
    return pickle.loads(raw[4:4 + size])
