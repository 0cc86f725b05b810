"""A real multi-process rig for the recovery engine, without vLLM.

Each rank is a spawned process with a real gloo world (``tcp://127.0.0.1:<port>``). It builds
the recovery engine with ``ftkit.recovery.assemble``, as ``ftkit/vllm/worker.py`` does: a
``CpuBackend`` that takes over a "tp" group's communicator, side channels over the job's
store, and the ``StepWrapper`` around each RPC. Only vLLM's ``GroupCoordinator`` bookkeeping is
replaced, by ``StandInGroup``; the collectives, the process groups, the stop and the rebuild
are real.

A "step" is two RPCs, like vLLM's: ``execute`` (three all-reduces, two on the device group and
one on the cpu group, and a change to the rank's state) and ``sample`` (rank-local: a change to
the state and a value). ``expected_outputs`` computes the fault-free values in-process, the
oracle the tests compare with.

Faults are planned per rank, RPC, step, attempt and collective index:

* ``link``: ``backend.break_link`` (after ``delay_s``): the next collective raises ``LinkError``
  without entering, and the peers block in it for real;
* ``oom`` (``MemoryError``) and ``value_error`` (``ValueError``): raised from the step;
* ``exit_before_report``: a link break, then the rank announces the round without reporting
  its status and dies (``os._exit(17)``) half a second later;
* ``exit_in_rebuild``: a link break, then the rank dies (``os._exit(18)``) when the round's
  rebuild starts (before its communicators are rebuilt).

Scenario keys: ``transport`` (``gloo``, the default, or ``shm``), ``steps``, ``max_reinference``,
``round_timeout_s``, ``faults``, ``idle_gaps`` (a rank sleeps before a step, as if waiting for
the next RPC), ``exit_barrier_s`` and ``debug``.

``backend`` chooses the backend the rig assembles (``cpu``, the default, as above):

* ``ascend``: ``AscendBackend`` on the torch_npu stand-in of ``tests/contract/standin`` (put
  first on ``sys.path`` of the rank; ``torch_npu`` options: ``restart_signature`` (``new`` or
  ``old``) and ``missing`` (APIs left out)). Device ``r`` is rank ``r``'s NPU; the device group
  is an ``hccl`` group (the stand-in's HCCL over gloo), the cpu group gloo, and the
  communicator has the ``all_reduce`` of vLLM-Ascend's. Extra fault actions: ``device_error``
  (``text``: the device raises it until restarted) and ``uce`` (``ptr``, ``size``: the
  device reports a memory error there; with ``recorded_after_s``, the device records it that
  long after, from another thread, while the rank goes on into the collective). The rank's
  memory is ``StandInMemory`` (weights and KV blocks at made-up addresses); the repairs a
  round decides are recorded (``reloaded``, ``kv_lost``). ``recorded_fault_check: false``
  cripples the question a stopped rank asks its device (``Backend.recorded_fault``).
* ``cuda``: ``CudaBackend`` over gloo device groups (``device_backend="gloo"``): its
  host-waited collectives, stop, abort and rebuild run for real, without a GPU.

Ranks record ``device`` (the stand-in's record of every torch_npu call, ascend only),
``cpu_group_replaced`` and ``device_group_replaced``.

Every rank writes what it saw to ``<outdir>/rank<r>.json``: outputs, rollbacks, rounds,
rebuilds, the moments faults fired and collectives were stopped, and its final error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Collectives per execute RPC: (which group, op). Index = the collective index in a fault.
COLLECTIVES = ("device", "device", "cpu")
VECTOR = 4

EXIT_BEFORE_REPORT = 17
EXIT_IN_REBUILD = 18


# --- the parent's side --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(procs: list[Any], deadline: float) -> None:
    """Start ``procs`` and wait for each until ``deadline`` (``time.monotonic()``); those still
    alive then (or on any failure) are killed and reaped."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_world(world: int, scenario: dict[str, Any], outdir: Path,
              timeout_s: float = 40.0) -> tuple[list[dict[str, Any] | None], list[int | None],
                                                float]:
    """Run ``scenario`` on ``world`` spawned ranks; return (results, exit codes, wall seconds).

    Every wait is bounded: ranks still alive at the deadline are killed (by pid) and show up
    with a ``None`` result or a negative exit code.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, scenario, str(outdir)),
                         name=f"ftkit-test-rank{r}", daemon=True) for r in range(world)]
    started = time.monotonic()
    run_processes(procs, started + timeout_s)
    wall = time.monotonic() - started
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        path = outdir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results, [p.exitcode for p in procs], wall


def expected_outputs(world: int, steps: int) -> list[dict[str, Any]]:
    """The fault-free outputs of every step (the same on every rank)."""
    import torch

    acc = torch.zeros(VECTOR, dtype=torch.float64)
    out = []
    for s in range(1, steps + 1):
        acc += 1.0
        ts = [_base(s, r) for r in range(world)]
        for i in range(len(COLLECTIVES)):
            total = sum(ts[1:], ts[0].clone())
            ts = [total * 0.5 + i for _ in range(world)]
        acc += ts[0]
        executed = ts[0].tolist()
        acc -= 0.25
        out.append({"step": s, "execute": executed, "sample": float(acc.sum())})
    return out


def _base(step: int, rank: int):
    import torch

    return torch.arange(VECTOR, dtype=torch.float64) + 10.0 * step + rank


# --- the rank's side ----------------------------------------------------------------------------

class Communicator:
    """The attributes of vLLM's ``CpuCommunicator`` that the backend and the step use."""

    def __init__(self, cpu_group: Any, device_group: Any) -> None:
        import torch.distributed as dist

        self.dist_module: Any = dist
        self.cpu_group = cpu_group
        self.device_group = device_group


class NpuCommunicator:
    """What the backend and the step use of vLLM-Ascend's ``NPUCommunicator``."""

    def __init__(self, cpu_group: Any, device_group: Any) -> None:
        self.cpu_group = cpu_group
        self.device_group = device_group

    def all_reduce(self, input_: Any) -> Any:
        import torch.distributed as dist

        dist.all_reduce(input_, group=self.device_group)
        return input_


class GpuCommunicator(NpuCommunicator):
    """What the backend uses of vLLM's ``CudaCommunicator`` (whose collectives it replaces)."""

    def __init__(self, cpu_group: Any, device_group: Any, ranks: list[int], rank: int) -> None:
        super().__init__(cpu_group, device_group)
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank)

    def all_reduce(self, input_: Any) -> Any:
        out = input_.clone()
        return super().all_reduce(out)


class StandInGroup:
    """Stands in for ``ftkit.vllm.comms.VllmGroup`` (a GroupCoordinator's bookkeeping)."""

    def __init__(self, name: str, ranks: list[int], communicator: Communicator) -> None:
        self.name = name
        self.ranks = ranks
        self.communicator = communicator
        self.replacements: list[dict[str, Any]] = []

    def current_groups(self) -> tuple[Any, Any]:
        return self.communicator.cpu_group, self.communicator.device_group

    def replace_groups(self, cpu_group: Any, device_group: Any) -> None:
        old_cpu, old_dev = self.current_groups()
        self.communicator.cpu_group = cpu_group
        self.communicator.device_group = device_group
        self.replacements.append({
            "thread": threading.current_thread().name,
            "new_objects": cpu_group is not old_cpu and device_group is not old_dev,
            "distinct": cpu_group is not device_group,
        })


class RecordingState:
    """The ``StepState`` stand-in: the rank's mutable state, recorded and rolled back."""

    def __init__(self) -> None:
        import torch

        self.acc = torch.zeros(VECTOR, dtype=torch.float64)
        self.step = 0
        self.rollbacks: list[list[Any]] = []
        #: Steps before which the rank emptied its batch (its first execute after a round).
        self.resets: list[int] = []
        self._reset_pending = False

    def execute_starts(self, step: int) -> None:
        """Called by the step itself (each attempt): the state before its first attempt is
        what a rollback of it restores (the step's input alone cannot say). A step re-run
        from its forward pass is undone with the one after it: the last two are kept."""
        if self.step != step:
            self.step = step
            self._before = {s: t for s, t in getattr(self, "_before", {}).items()
                            if step - 2 <= s < step}
            self._before.setdefault(step, self.acc.clone())
        if self._reset_pending:  # emptied before this attempt of the step
            self.resets.append(step)
            self._reset_pending = False

    def rollback_execute(self, scheduler_output: Any) -> None:
        self.rollbacks.append(["execute", scheduler_output])
        self.acc.copy_(self._before[scheduler_output])

    def begin_sample(self, scheduler_output: Any) -> Any:
        assert scheduler_output == self.step
        return scheduler_output, self.acc.clone()

    def rollback_sample(self, record: Any) -> None:
        step, before = record
        self.rollbacks.append(["sample", step])
        self.acc.copy_(before)

    def reset_batch(self) -> None:
        self._reset_pending = True

    repair_pending = False  # it loses no device state

    def prepare(self, scheduler_output: Any) -> Any:
        return scheduler_output

    def before_attempt(self, scheduler_output: Any, call: Any) -> None:
        raise AssertionError("before_attempt runs only while repair_pending")

    def pending_kv(self) -> tuple[int, ...]:
        return ()


class StandInMemory:
    """Stands in for ``ftkit.vllm.memory.RunnerMemory``: one parameter and a few KV blocks
    at made-up device addresses."""

    WEIGHTS = ("model.norm.weight", 0x7F00_0000_0000, 1 << 20)
    KV_BASE, KV_BLOCK, KV_BLOCKS = 0x7E00_0000_0000, 1 << 16, 16

    def classify(self, faults: list[Any]) -> Any:
        from types import SimpleNamespace

        hits = SimpleNamespace(kv_blocks=set(), params=set(), other=0)
        name, start, size = self.WEIGHTS
        for fault in faults:
            block = (fault.address - self.KV_BASE) // self.KV_BLOCK
            if start <= fault.address < start + size:
                hits.params.add(name)
            elif 0 <= block < self.KV_BLOCKS:
                hits.kv_blocks.add(block)
            else:
                hits.other += 1
        return hits


class DyingChannel:
    """The main thread's side channel of a rank that dies in a round before reporting."""

    def __init__(self, inner: Any, rig: Rig) -> None:
        self._inner = inner
        self._rig = rig

    def set(self, key: str, value: str) -> None:
        armed = self._rig.armed_exit == "exit_before_report"
        if armed and "/status/" in key:
            return  # never reports
        self._inner.set(key, value)
        if armed and key.endswith("/trigger"):
            self._rig.record["exit_at"] = time.time()
            time.sleep(0.5)  # the peers are stopped and waiting for this rank's report
            self._rig.write()
            os._exit(EXIT_BEFORE_REPORT)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        return self._inner.wait(keys, timeout_s)

    def has(self, key: str) -> bool:
        return self._inner.has(key)


class Rig:
    def __init__(self, rank: int, world: int, scenario: dict[str, Any], outdir: str) -> None:
        import torch.distributed as dist

        from ftkit.backends.cpu import CpuBackend
        from ftkit.config import RecoveryConfig
        from ftkit.recovery import SideChannels, assemble, assess_damage, side_channels

        self.rank = rank
        self.world = world
        self.scenario = scenario
        self.outdir = Path(outdir)
        self.round_timeout_s = float(scenario.get("round_timeout_s", 10.0))
        self.faults = [f for f in scenario.get("faults", []) if f["rank"] == rank]
        self.armed_exit: str | None = None
        self.current: tuple[str, int, int] = ("", 0, 0)
        self.record: dict[str, Any] = {
            "rank": rank, "outputs": [], "rounds": [], "rebuilds": [], "fired": [],
            "stops": [], "link_errors": [], "recovered": [], "error": None,
        }

        ranks = list(range(world))
        timeout = timedelta(seconds=30)
        self.backend_kind = scenario.get("backend", "cpu")
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        device_group = dist.new_group(
            ranks, backend="hccl" if self.backend_kind == "ascend" else "gloo", timeout=timeout)
        self.initial_groups = (cpu_group, device_group)
        if self.backend_kind == "cpu":
            self.comm: Any = Communicator(cpu_group, device_group)
            # "transport": "shm" gives the backend the job's store, so that the device
            # group's collectives take the shared-memory path; the default is gloo alone.
            shm_store = (dist.distributed_c10d._get_default_store().clone()
                         if scenario.get("transport") == "shm" else None)
            self.backend: Any = CpuBackend(rank, shm_store)
        elif self.backend_kind == "ascend":
            from ftkit.backends.ascend import AscendBackend

            self.comm = NpuCommunicator(cpu_group, device_group)
            self.backend = AscendBackend(rank, None, device_id=rank)
        elif self.backend_kind == "cuda":
            from ftkit.backends.cuda import CudaBackend

            self.comm = GpuCommunicator(cpu_group, device_group, ranks, rank)
            self.backend = CudaBackend(rank, None, device_backend="gloo")
        else:
            raise AssertionError(f"unknown backend {self.backend_kind!r}")
        self.group = StandInGroup("tp", ranks, self.comm)
        self.backend.take_over([self.group])
        if self.backend_kind == "cpu":
            assert bool(self.backend._shm) == (shm_store is not None)
            assert self.comm.dist_module is self.backend.collectives

        self._record_rebuilds()
        store = dist.distributed_c10d._get_default_store()
        self.harness_store = store.clone()
        channels = side_channels(store)
        if any(f["action"] == "exit_before_report" for f in self.faults):
            channels = SideChannels(DyingChannel(channels.main, self), channels.for_monitor)
        self.state = RecordingState()
        self.record["reloaded"], self.record["kv_lost"] = [], []
        memory = StandInMemory()
        if not scenario.get("recorded_fault_check", True):
            self.backend.recorded_fault = lambda: None
        config = RecoveryConfig(enabled=True,
                                max_reinference=int(scenario.get("max_reinference", 3)),
                                round_timeout_s=self.round_timeout_s)
        self.recovery = assemble(rank=rank, world=world, channels=channels,
                                 backend=self.backend, state=self.state, config=config,
                                 hooks=[self], on_round=self._on_round,
                                 assess=lambda kind: assess_damage(kind, self.backend, memory),
                                 repairs=self._repairs)

    # --- the StepHook protocol ------------------------------------------------------------

    attempts_wanted = True  # it records the attempt a fault of its own fires in

    def on_attempt(self, rpc_kind: Any, step: int, attempt: int, payload: Any) -> None:
        self.current = (rpc_kind.value, step, attempt)

    def on_recovered(self, rpc_kind: Any, step: int, failures: int, recovery_s: float,
                     **_times: float) -> None:
        self.record["recovered"].append({"rpc": rpc_kind.value, "step": step,
                                         "failures": failures, "recovery_s": recovery_s})

    # --- recovery callbacks ---------------------------------------------------------------

    def _record_rebuilds(self) -> None:
        """Record each rebuild (it starts with the device's recovery), and die there when
        armed to."""
        recover_device = self.backend.recover_device

        def recording_recover_device(kinds: tuple[str, ...]) -> None:
            self.record["rebuilds"].append({"thread": threading.current_thread().name,
                                            "kinds": list(kinds), "at": time.time()})
            if self.backend_kind == "ascend":
                from torch_npu import _standin

                # What the device still records when the round brings it back.
                self.record["rebuilds"][-1]["device_uce"] = list(_standin.DEVICE.uce)
            if self.armed_exit == "exit_in_rebuild":
                self.write()
                os._exit(EXIT_IN_REBUILD)
            recover_device(kinds)

        self.backend.recover_device = recording_recover_device

    def _repairs(self, decision: Any) -> None:
        """What the worker repairs after a round (``ftkit.vllm.worker``), recorded."""
        own = decision.status_of(self.rank)
        if own is not None and own.reload_params:
            self.record["reloaded"].append(list(own.reload_params))
        if decision.kv_lost or decision.kv_lost_all:
            self.record["kv_lost"].append("all" if decision.kv_lost_all
                                          else list(decision.kv_lost))

    def _on_round(self, outcome: Any) -> None:
        status, decision = outcome.status, outcome.decision
        self.record["rounds"].append({
            "epoch": outcome.epoch, "thread": threading.current_thread().name,
            "state": status.state.value, "rpc": status.rpc, "rpc_kind": status.rpc_kind.value,
            "failures": status.failures, "kind": status.kind,
            "decision": decision.action.value, "reason": decision.reason,
            "states": {str(s.rank): s.state.value for s in decision.statuses},
            "duration_s": outcome.duration_s,
        })

    # --- the fake RPCs --------------------------------------------------------------------

    def _maybe_fault(self, rpc: str, index: int) -> None:
        kind, step, attempt = self.current
        assert kind == rpc, (kind, rpc)
        for f in self.faults:
            if (f["rpc"] != rpc or f["step"] != step or attempt not in f.get("attempts", [0])
                    or f.get("at", 0) != index):
                continue
            if f.get("delay_s"):
                time.sleep(f["delay_s"])
            self.record["fired"].append({"action": f["action"], "rpc": rpc, "step": step,
                                         "attempt": attempt, "at": time.time()})
            action = f["action"]
            if action in ("link", "exit_before_report", "exit_in_rebuild"):
                if action != "link":
                    self.armed_exit = action
                self.backend.break_link(f"injected link break at step {step}")
            elif action == "oom":
                raise MemoryError(f"injected out of memory at step {step}")
            elif action == "value_error":
                raise ValueError(f"injected bug at step {step}")
            elif action == "device_error":
                from torch_npu import _standin

                _standin.inject_device_error(f["text"])
            elif action == "uce":
                from torch_npu import _standin

                if f.get("recorded_after_s") is None:
                    _standin.inject_uce(f["ptr"], f["size"])
                else:
                    threading.Timer(f["recorded_after_s"], _standin.inject_uce,
                                    (f["ptr"], f["size"])).start()
            else:
                raise AssertionError(f"unknown fault action {action!r}")

    def _collective(self, t: Any, index: int) -> None:
        from ftkit.faults import CommunicationStopped, LinkError

        group = self.comm.device_group if COLLECTIVES[index] == "device" else self.comm.cpu_group
        entered = time.monotonic()
        try:
            if self.backend_kind == "cpu":
                self.comm.dist_module.all_reduce(t, group=group)
            elif COLLECTIVES[index] == "device":
                t.copy_(self.comm.all_reduce(t))  # through the (wrapped) communicator
            else:
                import torch.distributed as dist

                dist.all_reduce(t, group=group)  # vLLM uses its cpu_group directly
        except Exception as exc:
            _, step, attempt = self.current
            if isinstance(exc, LinkError):
                self.record["link_errors"].append({"step": step, "attempt": attempt,
                                                   "index": index, "at": time.time()})
            elif isinstance(exc, CommunicationStopped) or self.backend.is_stop_error(exc):
                self.record["stops"].append({"step": step, "attempt": attempt, "index": index,
                                             "blocked_s": time.monotonic() - entered,
                                             "at": time.time(), "error": str(exc)[:200]})
            raise

    def execute(self, step: int) -> Any:
        self.state.execute_starts(step)
        self.state.acc += 1.0
        t = _base(step, self.rank)
        for i in range(len(COLLECTIVES)):
            self._maybe_fault("execute", i)
            self._collective(t, i)
            t = t * 0.5 + i
        self.state.acc += t
        return t.clone()

    def sample(self, step: int) -> float:
        self.state.acc -= 0.25
        self._maybe_fault("sample", 0)
        return float(self.state.acc.sum())

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        gaps = {(g["rank"], g["step"]): g["seconds"] for g in self.scenario.get("idle_gaps", [])}
        for s in range(1, int(self.scenario.get("steps", 5)) + 1):
            if (self.rank, s) in gaps:
                time.sleep(gaps[(self.rank, s)])  # waiting for the next RPC, between steps
            executed = self.recovery.wrapper.execute_model(self.execute, s)
            sampled = self.recovery.wrapper.sample_tokens(self.sample, s)
            self.record["outputs"].append({"step": s, "execute": executed.tolist(),
                                           "sample": sampled})

    def finish(self) -> None:
        self.record["rollbacks"] = self.state.rollbacks
        self.record["resets"] = self.state.resets
        self.record["replacements"] = self.group.replacements
        cpu, dev = self.group.current_groups()
        self.record["groups_replaced"] = (cpu is not self.initial_groups[0]
                                          and dev is not self.initial_groups[1])
        self.record["cpu_group_replaced"] = cpu is not self.initial_groups[0]
        self.record["device_group_replaced"] = dev is not self.initial_groups[1]
        if self.backend_kind == "ascend":
            from torch_npu import _standin

            self.record["device"] = _standin.snapshot()

    def write(self) -> None:
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - the record matters more
            pass
        write_record(self.outdir, self.rank, self.record)

    def barrier(self, timeout_s: float) -> None:
        """Keep the store (served by rank 0) up until every rank is done with it."""
        self.harness_store.set(f"harness/exit/{self.rank}", "1")
        try:
            self.harness_store.wait([f"harness/exit/{r}" for r in range(self.world)],
                                    timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - a dead peer; nothing left to wait for
            pass


def write_record(outdir: Path, rank: int, record: dict[str, Any]) -> None:
    tmp = outdir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, outdir / f"rank{rank}.json")


class _WarningRecorder(logging.Handler):
    """Keeps the ``ftkit`` logger's warnings and errors for the rank's record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


#: The torch_npu stand-in the ``ascend`` backend runs on (``tests/contract/standin``).
STANDIN_DIR = Path(__file__).resolve().parents[1] / "contract" / "standin"


def _load_torch_npu_standin(rank: int, options: dict[str, Any]) -> None:
    """Make ``import torch_npu`` find the stand-in, configured as ``options`` says, and bind
    this rank's main thread to its NPU (device ``rank``), as vLLM-Ascend's worker does."""
    import sys

    if options.get("restart_signature"):
        os.environ["FTKIT_STANDIN_RESTART_SIGNATURE"] = options["restart_signature"]
    if options.get("missing"):
        os.environ["FTKIT_STANDIN_MISSING"] = ",".join(options["missing"])
    sys.path.insert(0, str(STANDIN_DIR))
    import torch_npu

    assert torch_npu.__file__.startswith(str(STANDIN_DIR)), torch_npu.__file__
    torch_npu.npu.set_device(rank)


def rank_main(rank: int, world: int, port: int, scenario: dict[str, Any], outdir: str) -> None:
    """One rank's process: set up, run the steps, record, and leave without teardown."""
    logging.basicConfig(level=logging.DEBUG if scenario.get("debug") else logging.WARNING,
                        format=f"[rank {rank} %(threadName)s] %(levelname)s %(message)s")
    warnings = _WarningRecorder()
    logging.getLogger("ftkit").addHandler(warnings)
    record: dict[str, Any] = {"rank": rank, "error": None}
    rig: Rig | None = None
    try:
        if scenario.get("backend") == "ascend":
            _load_torch_npu_standin(rank, scenario.get("torch_npu", {}))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        rig = Rig(rank, world, scenario, outdir)
        record = rig.record
        try:
            rig.run()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            record["error"] = {"type": type(exc).__name__, "message": str(exc),
                               "at": time.time(), "mro": [c.__name__ for c in type(exc).__mro__],
                               "traceback": traceback.format_exc()}
        rig.finish()
        rig.barrier(float(scenario.get("exit_barrier_s", 2.0)) if record["error"] else 10.0)
    except BaseException as exc:  # noqa: BLE001 - set-up failed
        record["setup_error"] = traceback.format_exc()
        record.setdefault("error", None)
        record["error"] = record["error"] or {"type": type(exc).__name__, "message": str(exc),
                                              "at": time.time(), "mro": [],
                                              "traceback": traceback.format_exc()}
    finally:
        record["warnings"] = warnings.messages
        write_record(Path(outdir), rank, record)
        # No process-group teardown: with a dead or failed peer it can block; the test only
        # needs the record, and the parent reaps the process.
        os._exit(0)
