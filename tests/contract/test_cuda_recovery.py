"""The CUDA backend's stop, abort and rebuild across real processes, on gloo.

No GPU exists here. The parts of the CUDA backend that are not NCCL-specific are the same
torch APIs on gloo: collectives issued with ``async_op=True`` and waited for on the host
(``Work.is_completed``), ``ProcessGroup.abort`` and ``new_group``. These tests run them for
real: a healthy rank really blocks on a peer's broken link, the stop really ends its wait, the
rebuild replaces both groups, and the re-run's outputs equal the fault-free oracle. A second
test holds ftkit's replacement collectives to the results of vLLM's own
``DeviceCommunicatorBase`` (whose semantics they copy), in two processes.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import _harness as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

RUN_TIMEOUT_S = 45.0


def test_link_break_blocks_the_peer_in_a_host_waited_collective_and_both_groups_are_rebuilt(
        tmp_path):
    steps, delay = 5, 0.3
    fault = {"rank": 1, "rpc": "execute", "step": 3, "at": 1, "attempts": [0],
             "delay_s": delay, "action": "link"}
    results, codes, wall = h.run_world(2, {"backend": "cuda", "steps": steps,
                                           "faults": [fault]}, tmp_path / "ranks",
                                       RUN_TIMEOUT_S)
    assert codes == [0, 0], results
    r0, r1 = results
    expected = h.expected_outputs(2, steps)
    for res in (r0, r1):
        assert res["error"] is None, res["error"]["traceback"]
        assert res["outputs"] == expected
        assert res["cpu_group_replaced"] and res["device_group_replaced"]
        assert [r["decision"] for r in res["rounds"]] == ["recompute"]
    assert [(s["step"], s["index"]) for s in r0["stops"]] == [(3, 1)]
    assert "stopped while blocked" in r0["stops"][0]["error"]
    assert r0["stops"][0]["blocked_s"] >= delay - 0.1
    assert [(e["step"], e["index"]) for e in r1["link_errors"]] == [(3, 1)]
    assert wall < RUN_TIMEOUT_S


# --- ftkit's collectives against vLLM's -------------------------------------------------------

#: (collective, keyword arguments) compared; dims cover the reshapes of all_gather/gather.
CASES = [("all_reduce", {}), ("all_gather", {"dim": 0}), ("all_gather", {"dim": -1}),
         ("all_gather", {"dim": 1}), ("reduce_scatter", {"dim": 0}),
         ("reduce_scatter", {"dim": -1}), ("gather", {"dst": 0, "dim": -1}),
         ("gather", {"dst": 1, "dim": 0}), ("broadcast", {"src": 1})]


def compare_collectives(rank: int, world: int, port: int, outdir: str) -> None:
    """One rank: each case through vLLM's DeviceCommunicatorBase, then through the CUDA
    backend's replacements on the same (gloo) groups; writes both results."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    from ftkit.backends.cuda import CudaBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    ranks = list(range(world))
    cpu_group = dist.new_group(ranks, backend="gloo")
    device_group = dist.new_group(ranks, backend="gloo")
    comm = DeviceCommunicatorBase(cpu_group, torch.device("cpu"), device_group, "tp:0")

    def inputs() -> torch.Tensor:
        return torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1) + rank

    def results() -> list[Any]:
        out = []
        for name, kwargs in CASES:
            value = getattr(comm, name)(inputs(), **kwargs)
            out.append(None if value is None else value.tolist())
        return out

    reference = results()
    group = h.StandInGroup("tp", ranks, comm)
    backend = CudaBackend(rank, None, device_backend="gloo", warn=False)
    backend.take_over([group])
    replaced = results()
    record = {"reference": reference, "ftkit": replaced,
              "issued": backend.collectives_issued}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)


def test_the_replacement_collectives_give_what_vllms_give(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = h.free_port()
    procs = [ctx.Process(target=compare_collectives, args=(r, 2, port, str(tmp_path)),
                         daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["issued"] == len(CASES)  # every case went through ftkit's waits
        for (name, kwargs), ref, got in zip(CASES, record["reference"], record["ftkit"]):
            assert got == ref, (rank, name, kwargs)
