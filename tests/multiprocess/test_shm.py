"""The shared-memory transport on its own: real processes, real segments."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftkit.backends import shm

from _harness import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.available(), reason="needs x86-64 and /dev/shm")]


class _Stop:
    """A rank's stop flag, as its collectives poll it. Once armed, the first poll (the rank
    is then blocked in a collective) has another thread set it, as a monitor does; the polls
    that saw it clear and set are counted."""

    def __init__(self) -> None:
        self.now = False
        self.armed = False
        self.polls = {"clear": 0, "set": 0}
        self._setter: threading.Thread | None = None

    def __call__(self) -> bool:
        if not self.armed:
            return self.now
        if self.now:
            self.polls["set"] += 1
            return True
        self.polls["clear"] += 1
        if self._setter is None:
            self._setter = threading.Thread(target=lambda: setattr(self, "now", True))
            self._setter.start()
        return False


def _rank(rank: int, world: int, port: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = dist.distributed_c10d._get_default_store().clone()
    stop = _Stop()
    group = shm.rendezvous(store, "t", rank, world, stopped=stop, timeout_s=30)
    result = {}
    # Sums equal gloo's, for several shapes and dtypes, many times over (slot reuse).
    for step in range(50):
        for shape, dtype in (((3, 128), torch.float32), ((7,), torch.float32),
                             ((2, 64), torch.bfloat16)):
            t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            t = (t * (rank + 1) + step).to(dtype)
            ref = t.clone()
            dist.all_reduce(ref)
            group.all_reduce(t)
            assert torch.equal(t, ref) or dtype == torch.bfloat16, (shape, dtype)
            if dtype == torch.bfloat16:
                assert torch.allclose(t.float(), ref.float(), rtol=1e-2)
    x = torch.full((4,), float(rank))
    out = torch.empty(4 * world)
    group.all_gather_into_tensor(out, x)
    result["all_gather"] = out.tolist()
    gl = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    group.gather(x, gl, 0)
    result["gather"] = [g.tolist() for g in gl] if gl else None
    # Rank 1 never joins the next all-reduce: rank 0 blocks until it is stopped.
    dist.barrier()
    if rank == 0:
        stop.armed = True
        try:
            group.all_reduce(torch.ones(4))
            result["blocked"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            result["blocked"] = f"{type(exc).__name__}: {exc}"
        result["polls"] = stop.polls
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(fn, tmp_path: Path, *args) -> tuple[dict, dict]:
    """Run ``fn(rank, 2, port, outdir, *args)`` in two spawned processes; their results."""
    ctx = mp.start_processes(fn, args=(2, free_port(), str(tmp_path), *args), nprocs=2,
                             join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + 90
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return tuple(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))


def test_collectives_match_gloo_and_a_stop_unblocks(tmp_path):
    before = set(Path("/dev/shm").glob("ftkit-*"))
    r0, r1 = _run_ranks(_rank, tmp_path)
    assert r0["all_gather"] == r1["all_gather"] == [0.0] * 4 + [1.0] * 4
    assert r0["gather"] == [[0.0] * 4, [1.0] * 4]
    assert r0["blocked"].startswith("CommunicationStopped: rank 0: shared-memory collective "
                                    "stopped while blocked")
    # Blocked (it polled the stop while clear), and released by the first poll that saw it.
    assert r0["polls"]["clear"] >= 1 and r0["polls"]["set"] == 1, r0["polls"]
    # The segment was unlinked as soon as both ranks had it mapped.
    assert not (set(Path("/dev/shm").glob("ftkit-*")) - before)


def test_oversized_messages_do_not_fit():
    class Fake:
        pass

    group = Fake()
    group.fits = shm.ShmGroup.fits.__get__(group)
    assert group.fits(torch.empty(shm.SLOT_BYTES // 4))
    assert not group.fits(torch.empty(shm.SLOT_BYTES // 4 + 1))


def _desync_rank(rank: int, world: int, port: int, outdir: str, check: bool) -> None:
    """Rank 0 all-reduces 4 floats while rank 1 all-reduces 8, then rank 0 all-reduces while
    rank 1 all-gathers: collectives that do not match."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = dist.distributed_c10d._get_default_store().clone()
    group = shm.rendezvous(store, "d", rank, world, stopped=lambda: False, timeout_s=30)
    if not check:  # crippled: the transport as it was, without the descriptors' check
        group._check_same = lambda seq, descriptor: None
    result = {}
    for name, mine in (("size", torch.full((4 if rank == 0 else 8,), float(rank + 1))),
                       ("operation", torch.full((4,), float(rank + 1)))):
        try:
            if name == "operation" and rank == 1:
                group.all_gather_into_tensor(torch.empty(8), mine)
            else:
                group.all_reduce(mine)
            result[name] = mine.tolist()
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            result[name] = f"{type(exc).__name__}: {exc}"
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "crippled"])
def test_mismatched_collectives_raise_a_desync_and_combine_nothing(tmp_path, check):
    r0, r1 = _run_ranks(_desync_rank, tmp_path, check)
    if check:
        # Both sides see it, say what each side issued, and keep their own data untouched.
        assert r0["size"].startswith("CollectiveDesync: rank 0: collective 1 ")
        assert "an all_reduce of 16 bytes (float32) here but an all_reduce of 32 bytes" \
            in r0["size"]
        assert r1["size"].startswith("CollectiveDesync: rank 1: collective 1 ")
        assert "an all_reduce of 16 bytes (float32) here but an all_gather of 16 bytes" \
            in r0["operation"]
        assert "all_gather" in r1["operation"] and "CollectiveDesync" in r1["operation"]
    else:
        # Without the check rank 0 silently sums the first half of rank 1's 8 floats.
        assert r0["size"] == [3.0] * 4
        assert r0["operation"] == [3.0] * 4
