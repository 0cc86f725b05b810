"""The whole fault catalogue on real vLLM engines: device resets, memory errors, hangs, OOM
and compound faults, at tensor parallel 1 and 2, greedy and seeded.

Each test checks the tokens against the fault-free run of a plain vLLM engine, that every
fault fired, and what the recovery did about it (KV recomputed for exactly the requests that
lost it, weights reloaded, nothing repaired for an activation). That a missed repair really
shows in the tokens is checked in ``test_without_repair_the_damage_shows``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.contracts.plan import FaultPlan

from conftest import GREEDY, PROMPTS, SEEDED, fault, run_with_faults

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


# --- tensor parallel 1 ------------------------------------------------------------------------

@pytest.mark.parametrize("phase, token", [("before", 6), ("forward", 13), ("sample", 33)])
def test_device_reset_recomputes_every_running_request(tp1_engine, baseline, phase, token):
    run = run_with_faults(tp1_engine, GREEDY, [fault("device_reset", 0, 1, token, phase)])
    assert run.error is None and len(run.fired) == 1
    assert [r.fault for r in run.rounds] == ["device_reset"]
    assert [r.decision for r in run.rounds] == ["recompute"]
    # The whole KV cache was lost: the KV of all four running requests was recomputed once.
    [kv] = run.kv
    assert kv.requests == len(PROMPTS) and kv.tokens > 0
    assert run.tokens == baseline.tokens["greedy"]


def test_kv_uce_recomputes_only_the_request_that_owns_the_block(tp1_engine, baseline):
    run = run_with_faults(tp1_engine, GREEDY,
                          [fault("uce", 0, 2, 20, "forward", region="kv")])
    assert run.error is None and len(run.fired) == 1
    [kv] = run.kv
    assert kv.requests == 1
    assert run.reloaded == []
    assert run.tokens == baseline.tokens["greedy"]


def test_weights_uce_reloads_the_hit_parameter_from_the_checkpoint(tp1_engine, baseline):
    run = run_with_faults(tp1_engine, GREEDY,
                          [fault("uce", 0, 0, 9, "sample", region="weights")])
    assert run.error is None and len(run.fired) == 1
    assert [e.params for e in run.reloaded] == [["model.norm.weight"]]
    assert run.kv == []
    assert run.tokens == baseline.tokens["greedy"]


def test_weights_uce_in_a_named_parameter(tp1_engine, baseline):
    run = run_with_faults(tp1_engine, GREEDY, [fault(
        "uce", 0, 3, 4, "forward", region="weights", parameter="lm_head.weight")])
    assert run.error is None
    assert [e.params for e in run.reloaded] == [["lm_head.weight"]]
    assert run.tokens == baseline.tokens["greedy"]


@pytest.mark.parametrize("phase", ["before", "forward"])
def test_activation_uce_just_reruns_the_step(tp1_engine, baseline, phase):
    run = run_with_faults(tp1_engine, GREEDY,
                          [fault("uce", 0, 1, 17, phase, region="activation")])
    assert run.error is None and len(run.fired) == 1
    assert run.kv == [] and run.reloaded == []
    assert run.tokens == baseline.tokens["greedy"]


@pytest.mark.parametrize("phase", ["forward", "sample"])
def test_hang_is_ended_by_the_operator_timeout(tp1_engine, baseline, phase):
    run = run_with_faults(tp1_engine, GREEDY,
                          [fault("hang", 0, 0, 11, phase, op_timeout_s=0.4)])
    assert run.error is None and len(run.fired) == 1
    [fired] = run.fired
    [round_] = run.rounds
    assert round_.fault == "hang" and "operator timeout of 0.4 s" in round_.error
    [recovered] = run.recovered
    # The timeout ended the hang; then the same step was recovered, at its first re-run:
    # fault, round and recovery in that order, all of one step.
    rpc = {"forward": "execute", "sample": "sample"}[phase]
    assert (round_.step, round_.rpc_kind) == (recovered.step, recovered.rpc_kind) \
        == (fired.step, rpc)
    assert recovered.failures == 1
    assert fired.time <= round_.started <= round_.time <= recovered.time
    assert run.tokens == baseline.tokens["greedy"]


def test_seeded_sampling_survives_every_recoverable_kind(tp1_engine, baseline):
    faults = [fault("device_reset", 0, 0, 3, "sample"),
              fault("uce", 0, 1, 9, "sample", region="kv"),
              fault("hang", 0, 2, 15, "sample", op_timeout_s=0.3),
              fault("uce", 0, 3, 21, "forward", region="weights"),
              fault("oom", 0, 0, 27, "sample", times=2)]
    run = run_with_faults(tp1_engine, SEEDED, faults)
    assert run.error is None
    assert sorted(e.index for e in run.fired) == [0, 1, 2, 3, 4, 4]
    assert run.tokens == baseline.tokens["seeded"]


# --- the fault model bites: a missed repair shows in the tokens ------------------------------

@pytest.mark.exhaustive  # the fast tier's: test_cripples' no_kv_recompute and no_reload at TP 2
@pytest.mark.parametrize("fault_spec, cripple", [
    ({"kind": "device_reset", "token": 20}, "kv"),
    ({"kind": "uce", "token": 20, "params": {"region": "kv"}}, "kv"),
    ({"kind": "uce", "token": 20, "params": {"region": "weights"}}, "reload"),
])
def test_without_repair_the_damage_shows(tiny_model, baseline, tmp_path, fault_spec, cripple):
    """Guards the tests above: with the repair switched off (in a child process), the same
    fault gives wrong tokens from the faulty step on; the tokens before it still match."""
    spec = {"rank": 0, "phase": "forward", "times": 1, "params": {},
            "at": {"request": 0, "token": fault_spec["token"]},
            **{k: v for k, v in fault_spec.items() if k != "token"}}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_naive_rerun.py")), tiny_model,
         str(tmp_path), str(GREEDY.max_tokens), json.dumps(PROMPTS), json.dumps(spec),
         cripple], capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["error"] is None
    token = fault_spec["token"]
    want = baseline.tokens["greedy"]
    assert result["tokens"] != want, "the missed repair was expected to change tokens"
    assert all(got[:token] == w[:token] for got, w in zip(result["tokens"], want))


# --- tensor parallel 2 ------------------------------------------------------------------------

@pytest.mark.parametrize("rank, phase, token", [(1, "forward", 14), (0, "sample", 8),
                                                (1, "before", 30)])
def test_device_reset_at_tensor_parallel_2(tp2_engine, baseline, rank, phase, token):
    run = run_with_faults(tp2_engine, GREEDY, [fault("device_reset", rank, 2, token, phase)])
    assert run.error is None and [e.rank for e in run.fired] == [rank]
    states = {r.rank: r.state for r in run.rounds}
    assert states[rank] == "failed" and set(states) == {0, 1}
    # Both ranks ran the KV recompute together (its forward has collectives).
    assert sorted(e.rank for e in run.kv) == [0, 1]
    assert {e.requests for e in run.kv} == {len(PROMPTS)}
    assert run.tokens == baseline.tokens["greedy"]


def test_memory_errors_at_tensor_parallel_2(tp2_engine, baseline):
    faults = [fault("uce", 1, 0, 10, "sample", region="kv"),
              fault("uce", 1, 1, 19, "forward", region="weights"),
              fault("uce", 0, 3, 27, "forward", region="activation")]
    run = run_with_faults(tp2_engine, GREEDY, faults)
    assert run.error is None and len(run.fired) == 3
    assert sorted((e.rank, e.requests) for e in run.kv) == [(0, 1), (1, 1)]
    # Only the rank whose weights were hit reloads them (its own shard).
    assert [(e.rank, e.params) for e in run.reloaded] == [(1, ["model.norm.weight"])]
    assert run.tokens == baseline.tokens["greedy"]


@pytest.mark.parametrize("rank, phase", [(1, "forward"), (0, "sample")])
def test_hang_at_tensor_parallel_2(tp2_engine, baseline, rank, phase):
    run = run_with_faults(tp2_engine, GREEDY,
                          [fault("hang", rank, 1, 16, phase, op_timeout_s=0.5)])
    assert run.error is None and len(run.fired) == 1
    [fired] = run.fired
    [faulty] = [r for r in run.rounds if r.rank == rank]
    [peer] = [r for r in run.rounds if r.rank != rank]
    # One round on both ranks: the hanging rank's own operator timeout ended its hang; its
    # peer, told of the fault, took part without a fault of its own (not held in the step
    # until a bound of its own ran out), after the fault fired.
    assert faulty.state == "failed" and "operator timeout of 0.5 s" in faulty.error
    assert peer.state in ("stopped", "idle") and peer.fault is None, peer
    if peer.state == "stopped":  # blocked in a collective with the hanging rank
        assert "stopped while blocked" in peer.error, peer.error
        assert fired.time <= peer.stop_requested
    assert faulty.epoch == peer.epoch and faulty.step == peer.step == fired.step
    assert fired.time <= faulty.started and fired.time <= peer.started
    assert run.tokens == baseline.tokens["greedy"]


def test_different_kinds_on_two_ranks_in_the_same_step(tp2_engine, baseline):
    run = run_with_faults(tp2_engine, GREEDY, [fault("device_reset", 0, 0, 12, "forward"),
                                               fault("uce", 1, 0, 12, "forward", region="kv")])
    assert run.error is None
    assert sorted((e.rank, e.kind) for e in run.fired) == [(0, "device_reset"),
                                                                 (1, "uce")]
    assert {r.state for r in run.rounds} == {"failed"}
    assert run.tokens == baseline.tokens["greedy"]


def test_a_second_fault_while_the_first_is_recovered(tp2_engine, baseline):
    """Rank 1's device resets; on the re-run, rank 0's link breaks (a flap of 2), so the
    extra forward that recomputes the lost KV fails too. The lost KV stays marked until a
    recompute succeeds."""
    run = run_with_faults(tp2_engine, GREEDY, [fault("device_reset", 1, 3, 22, "forward"),
                                               fault("link_flap", 0, 3, 22, "forward", 2)])
    assert run.error is None
    assert sorted(e.attempt for e in run.fired if e.kind == "link_flap") == [1, 2]
    assert len({r.epoch for r in run.rounds}) == 2
    # The recompute that the link break interrupted did not count: it succeeded once, later.
    assert sorted(e.rank for e in run.kv) == [0, 1]
    assert run.tokens == baseline.tokens["greedy"]


def test_seeded_compound_faults_at_tensor_parallel_2(tp2_engine, baseline):
    faults = [fault("device_reset", 0, 0, 4, "forward"),
              fault("link_break", "all", 2, 11, "forward"),
              fault("uce", 1, 1, 18, "sample", region="kv"),
              fault("hang", 0, 0, 25, "before", op_timeout_s=0.3),
              fault("oom", 1, 2, 33, "forward", times=2)]
    run = run_with_faults(tp2_engine, SEEDED, faults)
    assert run.error is None
    assert sorted(e.index for e in run.fired) == [0, 1, 1, 2, 3, 4, 4]
    assert run.tokens == baseline.tokens["seeded"]


def test_a_parameter_that_holds_no_data_is_refused_when_planned(tp1_engine):
    # vLLM's CPU linear layers keep their weights packed elsewhere: no address to hit.
    bad = fault("uce", 0, 0, 5, "forward", region="weights",
                parameter="model.layers.0.self_attn.qkv_proj.weight")
    with pytest.raises(Exception, match="no parameter 'model.layers.0.self_attn.qkv_proj"):
        tp1_engine.set_fault_plan(FaultPlan.from_specs(tp1_engine.new_run_id(), [bad]))
