"""The stop of the shared-memory transport, switched off: a rank blocked in a collective its
peer never joins is released by its monitor's stop at once; when the group's wait ignores the
stop, the same rank stays blocked until its own deadline and fails with a timeout instead."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftkit.backends import shm

from _harness import free_port
from test_shm import _Stop

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180),
              pytest.mark.skipif(not shm.available(), reason="needs x86-64 and /dev/shm")]

#: The blocked rank's own deadline.
DEADLINE_S = 6.0


def _rank(rank: int, world: int, port: int, outdir: str, ignore_stop: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = dist.distributed_c10d._get_default_store().clone()
    stop = _Stop()
    group = shm.rendezvous(store, "s", rank, world, stopped=stop, timeout_s=DEADLINE_S)
    if ignore_stop:
        group._stopped = lambda: stop() and False  # the cripple: the wait ignores the stop
    one = torch.ones(4)
    group.all_reduce(one)  # both ranks: the transport works
    result = {"sum": one.tolist()}
    dist.barrier()
    if rank == 0:  # rank 1 never joins this all-reduce
        stop.armed = True  # the stop comes once the rank is blocked
        try:
            group.all_reduce(torch.ones(4))
            result["blocked"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            result["blocked"] = f"{type(exc).__name__}: {exc}"
        result["polls"] = stop.polls
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _blocked_rank(tmp_path: Path, ignore_stop: bool) -> dict:
    ctx = mp.start_processes(_rank, args=(2, free_port(), str(tmp_path), ignore_stop),
                             nprocs=2, join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["sum"] == r1["sum"] == [2.0] * 4
    return r0


def test_the_stop_releases_a_blocked_rank_at_once_and_without_it_only_the_deadline_does(
        tmp_path):
    (tmp_path / "stop").mkdir()
    stopped = _blocked_rank(tmp_path / "stop", ignore_stop=False)
    assert stopped["blocked"].startswith("CommunicationStopped: rank 0: shared-memory "
                                         "collective stopped while blocked")
    # Released by the first poll that saw the stop, not by the deadline.
    assert stopped["polls"]["clear"] >= 1 and stopped["polls"]["set"] == 1, stopped["polls"]

    (tmp_path / "crippled").mkdir()
    crippled = _blocked_rank(tmp_path / "crippled", ignore_stop=True)
    # Still blocked after the stop was set (the wait saw it set and went on): released only
    # by its own deadline, as a timeout.
    assert crippled["blocked"].startswith(
        f"OperatorTimeout: rank 0: shared-memory collective timed out after {DEADLINE_S:g} s")
    assert crippled["polls"]["clear"] >= 1 and crippled["polls"]["set"] > 1, crippled["polls"]
