"""A shared-memory transport for the CPU backend's collectives that a stop can interrupt.

vLLM's own shared-memory all-reduce spins in C++ and cannot be abandoned, and gloo costs about
a millisecond per collective on a small machine. This transport gives the fault-free path
shared-memory speed while keeping the CPU fault model real: a rank whose peer never arrives
spins on its peer's sequence counter, reads the stop flag on every turn, and abandons the
collective when its monitor stops it.

Layout of one segment (one group, one generation): a 64-byte header line per rank holding its
sequence number and, per sequence parity, what its collective of that sequence is (operation,
dtype, bytes), then two data slots per rank (alternating by sequence parity). Before it reads
its peers' data, a rank checks that every peer's collective of the same sequence is the same
one as its own: a mismatch (the ranks issue different collectives: a desynchronised re-run)
raises ``CollectiveDesync`` instead of summing unrelated data. A rank writes
sequence ``s`` only after every peer reached ``s - 1``, so no slot is overwritten while a peer
may still read it. Reductions sum the ranks' contributions in rank order, in float32 for half
types, so every rank computes bit-identical results.

Ordering: data is written, a full fence is issued (a lock operation), then the sequence number
is stored; readers load the sequence number before the data. That is sound on x86-64 (total
store order), the only architecture this transport is enabled on.

A segment is created by the group's first rank in ``/dev/shm``, opened by the others, and
unlinked as soon as every rank has it mapped: a killed process cannot leak it. A rebuild
starts a new generation with fresh counters.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ftkit.faults import CollectiveDesync, CommunicationStopped, OperatorTimeout

#: Bytes a rank may contribute to one collective; larger messages take the gloo path.
SLOT_BYTES = 4 << 20
_HEADER_LINE = 64
_SHM_DIR = Path("/dev/shm")
_MAX_CACHED_VIEWS = 4096
#: After this many fruitless turns a waiting rank yields its core on every turn.
_SPINS_BEFORE_YIELD = 2000
#: Collective codes in a header's descriptor (bits 56-63), the dtype's code in bits 48-55, the
#: bytes a rank contributes in bits 0-47.
_OPS = {"all_reduce": 1, "gather": 2, "all_gather": 3}
_OP_NAMES = {code: name for name, code in _OPS.items()}
_DTYPES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
     torch.int16, torch.int8, torch.uint8, torch.bool), start=1)}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPES.items()}


def describe(op: str, tensor: torch.Tensor) -> int:
    """One collective's descriptor: the operation, the dtype and the bytes contributed."""
    nbytes = tensor.numel() * tensor.element_size()
    return (_OPS[op] << 56) | (_DTYPES.get(tensor.dtype, 0) << 48) | nbytes


def _explain(descriptor: int) -> str:
    op = _OP_NAMES.get(descriptor >> 56, "unknown")
    dtype = _DTYPE_NAMES.get((descriptor >> 48) & 0xFF, "other")
    return f"an {op} of {descriptor & ((1 << 48) - 1)} bytes ({dtype})"


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and _SHM_DIR.is_dir() and \
        os.access(_SHM_DIR, os.W_OK)


def host_identity() -> str:
    """Which host this process runs on, for telling whether ranks share memory: in a Ray
    worker its Ray node (the nodes of a cluster on one host are told apart: they stand for
    hosts), otherwise the host's name and boot."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return f"ray-node:{ray.get_runtime_context().get_node_id()}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"host:{socket.gethostname()}:{boot}"


class ShmGroup:
    """One generation of one group's shared segment, as seen by one rank."""

    def __init__(self, path: Path, rank: int, world: int, *, create: bool,
                 stopped: Callable[[], bool], timeout_s: float,
                 bound_s: Callable[[], float] | None = None) -> None:
        self.rank = rank
        self.world = world
        self._stopped = stopped
        #: How long a collective waits for a peer (read at each collective: the operator
        #: timeout may change); ``timeout_s`` when not given.
        self._bound_s = bound_s or (lambda: timeout_s)
        self.size = world * _HEADER_LINE + world * 2 * SLOT_BYTES
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, dtype=np.int64, count=world * _HEADER_LINE // 8)
        line = _HEADER_LINE // 8
        self._seqs = header[::line]  # one counter per header line
        # Each rank's descriptor of its collective, per sequence parity (the next sequence
        # may be written while a peer still checks this one).
        self._descriptors = (header[1::line], header[2::line])
        self._data = torch.frombuffer(self._map, dtype=torch.uint8,
                                      offset=world * _HEADER_LINE)
        self._fence = threading.Lock()
        self._views: dict[tuple, torch.Tensor] = {}
        self.seq = 0
        self._peers = [r for r in range(world) if r != rank]
        self._all = list(range(world))

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= SLOT_BYTES

    # --- the protocol ---------------------------------------------------------------------------

    def _slot(self, rank: int, seq: int, like: torch.Tensor) -> torch.Tensor:
        # Views are cached: a step issues the same few shapes over and over.
        key = (rank, seq % 2, like.dtype, like.shape)
        view = self._views.get(key)
        if view is None:
            start = (rank * 2 + seq % 2) * SLOT_BYTES
            nbytes = like.numel() * like.element_size()
            view = self._data[start:start + nbytes].view(like.dtype).view(like.shape)
            if len(self._views) > _MAX_CACHED_VIEWS:
                self._views.clear()
            self._views[key] = view
        return view

    def _wait(self, target: int, ranks) -> None:
        seqs = self._seqs
        spins = 0
        deadline = None
        while True:
            for r in ranks:
                if seqs[r] < target:
                    break
            else:
                return
            if self._stopped():
                raise CommunicationStopped(f"rank {self.rank}: shared-memory collective "
                                           "stopped while blocked: a peer failed")
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()
                if deadline is None:
                    bound = self._bound_s()
                    deadline = time.monotonic() + bound
                elif spins % 1024 == 0 and time.monotonic() > deadline:
                    raise OperatorTimeout(f"rank {self.rank}: shared-memory collective timed "
                                          f"out after {bound:g} s: a peer never joined")

    def _publish(self, tensor: torch.Tensor, descriptor: int) -> int:
        seq = self.seq + 1
        self._wait(seq - 1, self._peers)  # every peer is done reading this slot's last use
        self._slot(self.rank, seq, tensor).copy_(tensor)
        self._descriptors[seq % 2][self.rank] = descriptor
        with self._fence:  # data and descriptor before sequence number
            pass
        self._seqs[self.rank] = seq
        self.seq = seq
        return seq

    def _check_same(self, seq: int, descriptor: int) -> None:
        """After every peer reached ``seq``: each one's collective must be this rank's."""
        theirs = self._descriptors[seq % 2]
        for r in self._peers:
            if theirs[r] != descriptor:
                raise CollectiveDesync(
                    f"rank {self.rank}: collective {seq} of the shared-memory group is "
                    f"{_explain(descriptor)} here but {_explain(int(theirs[r]))} on rank "
                    f"{r}: the ranks are out of step; nothing was combined")

    # --- collectives ----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        descriptor = describe("all_reduce", tensor)
        seq = self._publish(tensor, descriptor)
        self._wait(seq, self._all)
        self._check_same(seq, descriptor)
        # The contributions are summed in rank order, so every rank computes the same bits.
        if tensor.dtype in (torch.float16, torch.bfloat16):
            acc = self._slot(0, seq, tensor).to(dtype=torch.float32)
            for r in range(1, self.world):
                acc += self._slot(r, seq, tensor)
            tensor.copy_(acc)
        elif self.world > 1:
            # Straight into the output: one kernel for the first two, in place for the rest.
            torch.add(self._slot(0, seq, tensor), self._slot(1, seq, tensor), out=tensor)
            for r in range(2, self.world):
                tensor.add_(self._slot(r, seq, tensor))

    def gather(self, tensor: torch.Tensor, gather_list, dst: int) -> None:
        descriptor = describe("gather", tensor)
        seq = self._publish(tensor, descriptor)
        if self.rank != dst:
            return
        self._wait(seq, self._all)
        self._check_same(seq, descriptor)
        for r in range(self.world):
            gather_list[r].copy_(self._slot(r, seq, tensor))

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        descriptor = describe("all_gather", input_)
        seq = self._publish(input_, descriptor)
        self._wait(seq, self._all)
        self._check_same(seq, descriptor)
        chunks = output.view(self.world, -1)
        for r in range(self.world):
            chunks[r].copy_(self._slot(r, seq, input_).reshape(-1))

    def close(self) -> None:
        self._seqs = None
        self._data = None
        self._views = {}
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exists; the mapping goes with the process


def rendezvous(store, key: str, rank: int, world: int, *, stopped: Callable[[], bool],
               timeout_s: float, bound_s: Callable[[], float] | None = None) -> ShmGroup:
    """Create (first rank) or open (the others) a fresh segment; unlink it once all have it.

    ``store`` is the job's key-value store; ``key`` must be unique per group and generation.
    """
    from datetime import timedelta

    wait = timedelta(seconds=timeout_s)
    if rank == 0:
        path = _SHM_DIR / f"ftkit-{uuid.uuid4().hex}"
        group = ShmGroup(path, rank, world, create=True, stopped=stopped, timeout_s=timeout_s,
                         bound_s=bound_s)
        store.set(f"{key}/path", str(path))
        try:
            store.wait([f"{key}/open/{r}" for r in range(1, world)], wait)
        finally:
            path.unlink(missing_ok=True)
        return group
    store.wait([f"{key}/path"], wait)
    path = Path(store.get(f"{key}/path").decode())
    group = ShmGroup(path, rank, world, create=False, stopped=stopped, timeout_s=timeout_s,
                     bound_s=bound_s)
    store.set(f"{key}/open/{rank}", "1")
    return group
