"""The CUDA backend: NCCL collectives that a stop can abandon and a rebuild can replace.

vLLM's ``CudaCommunicator`` reaches its peers through paths torch cannot interrupt: its own
NCCL communicator (``pynccl``), custom all-reduce kernels that spin on peer flags in device
memory, and NCCL collectives whose Python call returns as soon as the kernel is queued. A peer
that never joins leaves the healthy ranks' streams blocked, and their host threads blocked at
the next synchronisation, with no error to recover from. So ``take_over`` replaces the
communicator's tensor-parallel collectives (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``gather``, ``broadcast``, with the semantics of vLLM's
``DeviceCommunicatorBase``) by collectives that

* go through torch's NCCL process group (the communicator's ``device_group``), issued with
  ``async_op=True``, and
* are waited for on the host (``Work.is_completed`` polled, which queries the work's CUDA
  event; the stop flag read between polls; bounded by the collective timeout).

``stop_communication()`` sets the flag: a healthy rank's wait raises ``CommunicationStopped``
at once. ``rebuild_communicators()`` aborts the abandoned groups (``ProcessGroup.abort``, that
is ``ncclCommAbort``, which ends an NCCL kernel waiting for a peer) and creates new ones with
``torch.distributed.new_group`` on every rank, gloo ``cpu_group`` included.

What this costs and covers, honestly:

* every collective becomes a host synchronisation point (the host cannot run ahead of the
  device across a collective), and CUDA graphs cannot contain these waits: recovery on CUDA
  requires ``enforce_eager=True`` (``ftkit.vllm.runner_state.check_supported`` refuses CUDA
  graphs). vLLM's custom all-reduce is bypassed for the collectives above;
* the operator timeout covers collectives only (ftkit's wait, and torch's process-group
  timeout through ``_set_pg_timeout``, which the NCCL watchdog enforces): CUDA offers no way
  to time out a hung compute kernel;
* CUDA has no in-process device restart: after a sticky CUDA error (illegal address,
  uncorrectable ECC) a process needs to be replaced; a device reset and a UCE are therefore
  reported unsupported, and a scenario can only emulate them;
* torch's NCCL watchdog: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` other than ``0`` it may tear
  the process down on a collective error or timeout before ftkit recovers (torch's own
  ``_abort_process_group`` documentation asks for it to be off); ``take_over`` warns.

No GPU is attached to the machines this project is built on: the probing, the stop of a host
wait and the abort/rebuild sequence are proven against gloo (the same torch APIs; on gloo the
wait uses ``Work.wait`` slices, see ``_finished``), the NCCL parts by reading torch's source
(``torch/distributed/distributed_c10d.py``: ``ProcessGroup.abort``, ``_abort_process_group``,
``_set_pg_timeout``, ``new_group``). See docs/cuda.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftkit.backends._common import (
    COMMUNICATOR_COLLECTIVES,
    EmulatedFaultModel,
    EmulatedFaults,
    abort_quietly,
    mark_collective,
    rebuild_cpu_groups,
    warn_unsupported,
    wrap_collectives,
)
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
from ftkit.errors import FtkitError
from ftkit.kinds.base import any_kind
from ftkit.faults import CommunicationStopped, OperatorTimeout
from ftkit.bounds import COLLECTIVE_STOP_SLICE_S, COLLECTIVE_TIMEOUT_S

log = logging.getLogger("ftkit")

#: ncclCommAbort, which ends a kernel blocked on a peer, appeared in NCCL 2.4.
MIN_NCCL_VERSION = (2, 4, 0)
#: torch's switch for the NCCL watchdog's reaction to errors (0: leave them to the caller).
ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: Polls of a collective before the host wait starts to sleep between them.
_SPINS_BEFORE_SLEEP = 1000
_SLICE = timedelta(seconds=COLLECTIVE_STOP_SLICE_S)

_NO_DEVICE_RESTART = ("CUDA has no in-process device restart: after a sticky CUDA error "
                      "(illegal address, uncorrectable ECC) the process must be replaced")
_NO_UCE_DETECT = ("CUDA reports an uncorrectable ECC error as a sticky error, without its "
                  "address")


@dataclass(frozen=True)
class TorchCudaApi:
    """What the installed torch offers for NCCL recovery."""

    device_backend: str
    cuda: bool
    nccl: bool
    nccl_version: tuple[int, ...] | None
    #: How a process group is aborted here ("" when torch offers no way).
    abort: str
    pg_timeout: bool

    @classmethod
    def probe(cls, device_backend: str = "nccl") -> TorchCudaApi:
        nccl = bool(dist.is_available() and dist.is_nccl_available())
        abort = ("torch.distributed.ProcessGroup.abort" if hasattr(dist.ProcessGroup, "abort")
                 else "torch.distributed.distributed_c10d._abort_process_group"
                 if hasattr(dist.distributed_c10d, "_abort_process_group") else "")
        return cls(device_backend=device_backend, cuda=torch.cuda.is_available(), nccl=nccl,
                   nccl_version=_nccl_version() if nccl else None, abort=abort,
                   pg_timeout=hasattr(dist.distributed_c10d, "_set_pg_timeout"))

    def capabilities(self) -> dict[str, Capability]:
        ready = self._backend_problem()
        stop = Capability(not ready, ready or (
            f"collectives issued asynchronously on the {self.device_backend} group and waited "
            "for on the host (Work.is_completed); a stop abandons them"))
        if ready:
            rebuild = Capability(False, ready)
        elif not self.abort:
            rebuild = Capability(False, "this torch offers neither ProcessGroup.abort nor "
                                 "_abort_process_group")
        else:
            rebuild = Capability(True, f"{self.abort} ends the abandoned collectives, then "
                                 "torch.distributed.new_group builds fresh groups (gloo "
                                 "cpu_group included)")
        timeout = Capability(not ready, ready or (
            "collectives only: ftkit's host wait and the process group's timeout "
            "(_set_pg_timeout); a hung compute kernel cannot be timed out on CUDA"))
        rng = (Capability(True, "torch.cuda.get_rng_state / set_rng_state") if self.cuda
               else Capability(False, "CUDA is not available to this torch"))
        return {STEP_STOP: stop, STEP_DEVICE_RESTART: Capability(False, _NO_DEVICE_RESTART),
                STEP_COMM_REBUILD: rebuild, STEP_OP_TIMEOUT: timeout,
                STEP_UCE_DETECT: Capability(False, _NO_UCE_DETECT), STEP_RNG_STATE: rng}

    def _backend_problem(self) -> str:
        """Why collectives of the device backend cannot be recovered here ("" if they can)."""
        if self.device_backend != "nccl":
            return ""
        if not self.cuda:
            return "CUDA is not available to this torch"
        if not self.nccl:
            return "this torch was built without NCCL"
        if self.nccl_version is not None and self.nccl_version < MIN_NCCL_VERSION:
            return (f"NCCL {'.'.join(map(str, self.nccl_version))} is older than "
                    f"{'.'.join(map(str, MIN_NCCL_VERSION))} (no ncclCommAbort)")
        return ""


def _nccl_version() -> tuple[int, ...] | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without the query: unknown, not fatal
        return None
    if isinstance(version, int):  # older torch: 2708 or 21803 for 2.7.8 / 2.18.3
        major, rest = divmod(version, 10000 if version >= 10000 else 1000)
        minor, patch = divmod(rest, 100)
        return (major, minor, patch)
    return tuple(int(v) for v in version)


class CudaBackend(EmulatedFaultModel):
    """Backend for vLLM's CUDA platform (``device_backend``: the device groups' torch backend,
    ``nccl``; the contract tests run the same code on ``gloo``)."""

    name = "cuda"

    def __init__(self, rank: int, store: Any = None, *, device_backend: str = "nccl",
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, warn: bool = True) -> None:
        self.rank = rank
        self._store = store
        self._groups: list[CommGroup] = []
        self._stopped = threading.Event()
        self._collective_timeout_s = collective_timeout_s
        self._device_fault: str | None = None
        self.faults = EmulatedFaults(rank, self._stopped)
        self.api = TorchCudaApi.probe(device_backend)
        self._capabilities = self.api.capabilities()
        if warn:
            warn_unsupported(self._capabilities, f"torch {torch.__version__} on CUDA")
        #: Collectives issued through ftkit's waits (for tests and diagnostics).
        self.collectives_issued = 0

    def capabilities(self) -> dict[str, Capability]:
        return dict(self._capabilities)

    # --- taking over ------------------------------------------------------------------------

    def take_over(self, groups: list[CommGroup]) -> None:
        self._groups = [g for g in groups if len(g.ranks) > 1]
        for g in self._groups:
            comm = g.communicator
            if comm is None:
                continue
            for name, collective in _abortable_collectives(self, g, comm).items():
                setattr(comm, name, mark_collective(collective))
            # What tensor parallelism does not use still fails at once on a broken link or
            # after a stop, instead of entering a collective that cannot be abandoned.
            wrap_collectives(comm, self._before_collective)
        if (self._groups and self.api.device_backend == "nccl"
                and os.environ.get(ASYNC_ERROR_HANDLING_ENV, "") != "0"):
            log.warning("ftkit: %s is not 0: torch's NCCL watchdog may end this process on a "
                        "collective error before ftkit recovers it", ASYNC_ERROR_HANDLING_ENV)

    def _before_collective(self, op: str) -> None:
        self.faults.check_link(op)
        if self._stopped.is_set():
            raise CommunicationStopped(f"rank {self.rank}: {op} stopped: a peer failed")

    def run_collective(self, op: str, issue: Callable[[], Any]) -> None:
        """Issue one collective (``issue`` returns its ``Work``) and wait for it on the host,
        reading the stop flag between polls; bounded by the collective timeout."""
        self._before_collective(op)
        self.collectives_issued += 1
        work = issue()
        bound = self.collective_bound_s
        deadline = time.monotonic() + bound
        polls = 0
        while not self._finished(work, polls):
            if self._stopped.is_set():
                # Abandoned: its group is aborted and replaced by the rebuild.
                raise CommunicationStopped(f"rank {self.rank}: {op} stopped while blocked: "
                                           "a peer failed")
            if time.monotonic() > deadline:
                raise OperatorTimeout(f"rank {self.rank}: {op} timed out after {bound:g} s: "
                                      "a peer never joined")
            polls += 1
        work.wait()  # raises the collective's own error, if it failed

    def _finished(self, work: Any, polls: int) -> bool:
        """One look at a collective in flight. NCCL: ``is_completed`` queries the work's CUDA
        event without blocking (a ``wait`` with a timeout would abort the communicator when
        it runs out). Gloo, where ``is_completed`` does not follow every collective
        (``reduce_scatter_tensor``): a ``wait`` of one slice, as the CPU backend does."""
        if self.api.device_backend != "nccl":
            try:
                work.wait(_SLICE)
                return True
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
                return False
        if work.is_completed():
            return True
        time.sleep(COLLECTIVE_STOP_SLICE_S if polls > _SPINS_BEFORE_SLEEP else 0)
        return False

    @property
    def collective_bound_s(self) -> float:
        """How long a collective may wait for its peers: the operator timeout if set."""
        timeout = self.faults.op_timeout_s
        return timeout if timeout is not None else self._collective_timeout_s

    # --- the injector's fault model (break_link, hang, report_memory_fault: emulated) ---------

    def force_stop(self, detail: str, on_restart: Callable[[], None] | None = None) -> None:
        """An emulated device reset: CUDA cannot stop and restart a device in process, so
        only what follows the reset is emulated (``on_restart``: the lost KV cache)."""
        self._device_fault = detail
        if on_restart is not None:
            self.faults.on_restart.append(on_restart)

    # --- recovery ---------------------------------------------------------------------------

    def stop_communication(self) -> None:
        self._stopped.set()

    def is_stop_error(self, exc: BaseException) -> bool:
        return isinstance(exc, CommunicationStopped)

    def memory_faults(self) -> list[MemoryFault]:
        # Only emulated ones: CUDA tells no address (see the capabilities).
        return list(self.faults.memory_faults)

    def recover_device(self, kinds: tuple[str, ...]) -> None:
        self._device_fault = None
        self.faults.restarted()
        if any_kind(kinds, lambda spec: spec.device.release_memory) and self.api.cuda:
            torch.cuda.empty_cache()

    def rebuild_communicators(self, timeout_s: float, kinds: tuple[str, ...] = ()) -> None:
        capability = self._capabilities[STEP_COMM_REBUILD]
        if not capability.supported:
            raise FtkitError(f"ftkit: cannot rebuild the communicators: {capability.detail}")
        timeout = timedelta(seconds=timeout_s)

        def fresh_device_group(g: CommGroup, old: Any) -> Any:
            backend = dist.get_backend(old)
            self._abort(old)  # ends an NCCL kernel still waiting for a peer
            return dist.new_group(g.ranks, backend=backend, timeout=timeout)

        rebuild_cpu_groups(self._groups, timeout_s, device_group=fresh_device_group)
        self._stopped.clear()
        self.faults.repaired_links()
        self._apply_pg_timeout()

    def _abort(self, pg: Any) -> None:
        if hasattr(pg, "abort"):
            abort_quietly(pg)
        elif self.api.abort:
            try:
                dist.distributed_c10d._abort_process_group(pg)
            except Exception as exc:  # noqa: BLE001 - a broken group may refuse
                log.debug("abort of %r failed: %s", pg, exc)

    # --- operator timeout, generator --------------------------------------------------------

    def set_op_timeout(self, seconds: float | None) -> None:
        """Bound every collective by ``seconds`` (``None``: the default bound). Covers
        collectives only: CUDA cannot time out a compute kernel."""
        self.faults.op_timeout_s = seconds
        self._apply_pg_timeout()

    def _apply_pg_timeout(self) -> None:
        if not self.api.pg_timeout or self.faults.op_timeout_s is None:
            return
        timeout = timedelta(seconds=self.faults.op_timeout_s)
        for g in self._groups:
            _, device_group = g.current_groups()
            try:
                dist.distributed_c10d._set_pg_timeout(timeout, device_group)
            except Exception as exc:  # noqa: BLE001 - ftkit's own wait still bounds it
                log.debug("cannot set the timeout of %r: %s", device_group, exc)

    def get_rng_state(self) -> Any:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state)


def _abortable_collectives(backend: CudaBackend, group: CommGroup,
                           comm: Any) -> dict[str, Callable[..., Any]]:
    """The communicator's tensor-parallel collectives, issued through ``backend``'s waits on
    the group's current device group, with the semantics of vLLM's ``DeviceCommunicatorBase``
    (``vllm/distributed/device_communicators/base_device_communicator.py``): ``all_reduce``
    returns a new tensor (out of place, as ``CudaCommunicator``'s does), ``all_gather`` and
    ``reduce_scatter`` work along ``dim``, ``gather`` returns the concatenation on ``dst``
    (a rank of the group) and ``None`` elsewhere, ``broadcast`` fills ``tensor`` in place."""

    def device_group() -> Any:
        return group.current_groups()[1]

    def all_reduce(input_: torch.Tensor) -> torch.Tensor:
        out = input_.clone()
        backend.run_collective("all_reduce", lambda: dist.all_reduce(
            out, group=device_group(), async_op=True))
        return out

    def all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        world = comm.world_size
        if dim < 0:
            dim += input_.dim()
        size = input_.size()
        out = torch.empty((size[0] * world,) + size[1:], dtype=input_.dtype,
                          device=input_.device)
        backend.run_collective("all_gather", lambda: dist.all_gather_into_tensor(
            out, input_.contiguous(), group=device_group(), async_op=True))
        out = out.reshape((world,) + size).movedim(0, dim)
        return out.reshape(size[:dim] + (world * size[dim],) + size[dim + 1:])

    def reduce_scatter(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        world = comm.world_size
        if world == 1:
            return input_
        if dim < 0:
            dim += input_.dim()
        moved = input_.movedim(0, dim).contiguous()
        if moved.shape[0] % world:
            raise ValueError(f"reduce_scatter: size {moved.shape[0]} of dim {dim} is not a "
                             f"multiple of the group size {world}")
        out = torch.empty((moved.shape[0] // world,) + moved.shape[1:], dtype=moved.dtype,
                          device=moved.device)
        backend.run_collective("reduce_scatter", lambda: dist.reduce_scatter_tensor(
            out, moved, group=device_group(), async_op=True))
        return out.movedim(0, dim).contiguous()

    def gather(input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        if dim < 0:
            dim += input_.dim()
        mine = comm.rank_in_group == dst
        parts = [torch.empty_like(input_) for _ in range(comm.world_size)] if mine else None
        backend.run_collective("gather", lambda: dist.gather(
            input_, parts, dst=comm.ranks[dst], group=device_group(), async_op=True))
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if comm.world_size == 1:
            return tensor
        backend.run_collective("broadcast", lambda: dist.broadcast(
            tensor, comm.ranks[src], group=device_group(), async_op=True))
        return tensor

    replaced = {"all_reduce": all_reduce, "all_gather": all_gather,
                "reduce_scatter": reduce_scatter, "gather": gather, "broadcast": broadcast}
    assert set(replaced) <= set(COMMUNICATOR_COLLECTIVES)
    return replaced
