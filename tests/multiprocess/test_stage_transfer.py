"""The CPU backend's transfers between two pipeline stages, on their own: real processes, a
real gloo world.

What vLLM's pipeline sends (``IntermediateTensors``: a few named tensors) arrives equal,
many times over and after a rebuild of the group; a stage that waits for activations its peer
never sends is ended by a stop within a slice, and the rebuilt group transfers again. The
crippled variant is the transport ftkit does not use: gloo's own point-to-point receive,
waited in slices as a stop needs it to be, loses the connection at the first slice that runs
out (measured: ``Application timeout caused pair closure``), so the next transfer fails.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ftkit.backends.cpu import CpuBackend

from _harness import free_port
from test_shm import _run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


class _Comm:
    def __init__(self, pg) -> None:
        self.cpu_group = self.device_group = pg


class _Group:
    """A two-rank ``CommGroup``: the pipeline group of two stages."""

    name = "pp"
    ranks = [0, 1]

    def __init__(self, pg) -> None:
        self.communicator = _Comm(pg)

    def current_groups(self):
        return self.communicator.cpu_group, self.communicator.device_group

    def replace_groups(self, cpu_group, device_group) -> None:
        self.communicator.cpu_group, self.communicator.device_group = cpu_group, device_group


def _activations(step: int) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8) + step,
            "residual": torch.full((3, 8), -float(step)),
            "empty": torch.empty(0, 8)}


def _transfer_rank(rank: int, world: int, port: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    backend = CpuBackend(rank, use_shm=False)
    group = _Group(dist.new_group([0, 1], backend="gloo"))
    backend.take_over([group])
    result: dict = {"equal": []}

    def exchange(step: int) -> None:
        if rank == 0:
            backend.send_tensor_dict(group, _activations(step), 1)
        else:
            got = backend.recv_tensor_dict(group, 0)
            want = _activations(step)
            result["equal"].append(list(got) == list(want) and all(
                torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want))

    for step in range(20):
        exchange(step)
    # Rank 0 never sends: rank 1 waits until it is stopped.
    dist.barrier()
    if rank == 1:
        issued = backend.paths.get(("recv", "gloo"), 0)
        threading.Thread(target=_stop_once_issued, args=(backend, issued)).start()
        try:
            backend.recv_tensor_dict(group, 0)
            result["blocked"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            result["blocked"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    backend.rebuild_communicators(timeout_s=30)  # what the round does on every rank
    for step in range(20, 25):
        exchange(step)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _stop_once_issued(backend: CpuBackend, issued: int) -> None:
    """The monitor's stop, once the rank has issued a receive after its first ``issued`` ones
    (it then waits for it)."""
    deadline = time.monotonic() + 60
    while backend.paths.get(("recv", "gloo"), 0) == issued and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.stop_communication()


def _point_to_point_rank(rank: int, world: int, port: int, outdir: str) -> None:
    """The crippled transport: gloo's ``irecv`` waited in slices of 0.2 s for a send that
    comes 1 s later."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    pg = dist.new_group([0, 1], backend="gloo")
    result: dict = {}
    if rank == 1:
        received = torch.zeros(4)
        work = dist.irecv(received, src=0, group=pg)
        try:
            work.wait(timedelta(seconds=0.2))
            result["slice"] = "completed"
        except RuntimeError as exc:
            result["slice"] = str(exc)
        try:
            dist.recv(received, src=0, group=pg)  # the send that came later
            result["later"] = received.tolist()
        except RuntimeError as exc:
            result["later"] = str(exc)
    else:
        time.sleep(1)
        try:
            dist.send(torch.ones(4), dst=1, group=pg)
        except RuntimeError as exc:
            result["send"] = str(exc)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


def test_activations_arrive_equal_and_a_stop_ends_a_wait_for_them(tmp_path):
    _, r1 = _run_ranks(_transfer_rank, tmp_path)
    assert r1["equal"] == [True] * 25  # 20 before the stop, 5 on the rebuilt group
    # Stopped in its wait (the stop came after the receive was issued), not by the deadline.
    assert r1["blocked"] == ("CommunicationStopped: rank 1: recv stopped while blocked: "
                             "a peer failed")


def test_crippled_gloo_point_to_point_loses_the_connection_when_waited_in_slices(tmp_path):
    _, r1 = _run_ranks(_point_to_point_rank, tmp_path)
    assert "Timed out" in r1["slice"]
    assert not isinstance(r1["later"], list)  # the connection is gone: nothing arrives
