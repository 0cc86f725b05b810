"""A killed process: the engine is restarted and every request resumed from its tokens.

A real SIGKILL of a worker: no rank can take part in a recovery round, so ftkit's engine
session sees the engine die, reaps every process of it, starts a new engine and submits each
unfinished request again with its prompt plus the tokens it had produced. The joined stream
must be the fault-free one, no token lost and none duplicated, and no process may survive.
"""

from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest
import torch

from ftkit import procs
from ftkit.contracts.eventlog import FaultFired, only, read_events
from ftkit.contracts.plan import FaultPlan
from ftkit.contracts.requests import parse_request_id, request_id
from ftkit.scenario import EngineSpec
from ftkit.vllm.engine import EngineSession
from ftkit.vllm.resume import _replay_draws

from conftest import GREEDY, PROMPTS, assert_reaped, fault, recovery_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_killed_worker_is_resumed_token_for_token(tiny_model, baseline, tmp_path):
    shm_before = set(os.listdir(procs.SHM_DIR))
    engine = EngineSession(EngineSpec(model=tiny_model, tensor_parallel_size=2),
                           recovery=recovery_config(str(tmp_path)))
    with engine:
        # The CPU communicator's segments of both ranks, and the engine's temporary folder,
        # which holds vLLM's file store of the group.
        first_engine = set(engine.leftovers)
        assert sum("cpushm" in p for p in first_engine) >= 2
        [tmp_dir] = [p for p in first_engine if os.path.isdir(p)]
        assert os.path.dirname(tmp_dir) == tempfile.gettempdir()
        assert any(n.startswith("vllm_dist_") for n in os.listdir(tmp_dir))
        run_id = engine.new_run_id()
        engine.set_fault_plan(FaultPlan.from_specs(
            run_id, [fault("process_kill", 1, 1, 17, "forward")]))
        first_pids = list(engine.pids)
        out = engine.generate(PROMPTS, GREEDY, run_id=run_id, max_restarts=1,
                              deadline=time.monotonic() + 300)
        # The restart removed what the killed engine left (its communicator segments and
        # folder) at once, while the new engine runs: nothing of it waits for ``close``.
        dead_engine = first_engine - engine.leftovers
        assert {p for p in first_engine if "cpushm" in p} | {tmp_dir} <= dead_engine
        assert [p for p in dead_engine if os.path.exists(p)] == []
    assert out.error is None
    assert [r.token_ids for r in out.requests] == baseline.tokens["greedy"]
    [restart] = out.restarts
    assert restart.resumed_requests == (0, 1, 2, 3)
    assert restart.restart_s > 0 and restart.resumed_at_s > restart.died_at_s
    [fired] = only(read_events(tmp_path), FaultFired)
    assert fired.rank == 1 and fired.pid in first_pids
    assert not psutil.pid_exists(fired.pid)
    # The kill was planned once: the new engine got the plan with the attempt that fired,
    # and did not kill again.
    assert len(engine.pids) > len(first_pids)
    assert_reaped(engine.pids)
    # The killed engine ran no clean-up of its own: ftkit removed what it left, and what the
    # second engine held once that one was closed.
    assert not [p for p in first_engine if os.path.exists(p)]
    # (Named semaphores, ``sem.*``, are not the engine's to leave: its spawned processes
    # register them with this process's resource tracker, which unlinks them when this
    # process, the engine's front end, ends.)
    left = {n for n in set(os.listdir(procs.SHM_DIR)) - shm_before if not n.startswith("sem.")}
    assert not left, sorted(left)


def test_resumed_request_ids_carry_their_offset():
    rid = request_id("r1.2", 3, offset=17)
    assert rid == "ftkit:r1.2:3+17"
    assert parse_request_id(rid + "-a1b2c3") == ("r1.2", 3, 17, 0)
    assert parse_request_id("ftkit:r1.2:3-a1b2") == ("r1.2", 3, 0, 0)


def test_fast_forward_replays_exactly_the_samplers_draws(tiny_model):
    """A resumed seeded request continues its stream only if its new generator ends up where
    the lost one was: replaying the sampler's draws must consume exactly what sampling
    ``k`` tokens consumed, on vLLM's own sampler."""
    from types import SimpleNamespace

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    vocab = 512
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    lost = torch.Generator().manual_seed(1234)
    for _ in range(9):  # the lost engine sampled 9 tokens of this request (row 1)
        sampler(logits.clone(), {1: lost}, None, None)
    runner = SimpleNamespace(device="cpu", sampler=SimpleNamespace(topk_topp_sampler=sampler),
                             model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
    resumed = torch.Generator().manual_seed(1234)
    _replay_draws(runner, resumed, 9)
    assert torch.equal(resumed.get_state(), lost.get_state())
    fresh = torch.Generator().manual_seed(1234)
    assert not torch.equal(fresh.get_state(), lost.get_state())
