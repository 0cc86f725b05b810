"""Faults while sampling, with the request features that change the logits in place.

vLLM's sampler applies repetition and frequency penalties, logit bias and temperature to the
step's float32 logits in place, and an activation error reported while sampling may have hit
them: a failed sampling RPC is re-run from its step's forward pass on every rank. Each test
compares tokens AND the sampled tokens' logprobs (and top logprobs) with a plain vLLM engine
(no ftkit), bit for bit; the crippled variant (the earlier design, re-sampling from the logits
the step left) shows the damage at the faulted positions.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.contracts.eventlog import RecoveryRound, only, read_events
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan

from conftest import PROMPTS, SAMPLE_WORKLOADS, fault

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WORKLOADS = SAMPLE_WORKLOADS
GREEDY = WORKLOADS["greedy"]
#: (request, token) of the sampling faults below.
AT = (1, 6)


def child(tiny_model: str, tmp_path: Path, sampling: SamplingSpec, cripple: str,
          spec=None, tensor_parallel: int = 1) -> dict:
    """A run in a child process of its own (a second in-process engine here would share the
    session engine's process groups): ``plain`` is vLLM without ftkit."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_naive_rerun.py")), tiny_model,
         str(tmp_path), str(sampling.max_tokens), json.dumps(PROMPTS),
         spec.model_dump_json() if spec is not None else "null", cripple,
         json.dumps(dataclasses.asdict(sampling)), str(tensor_parallel)],
        capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def plain(baseline) -> dict[str, dict]:
    """The fault-free outputs of each workload on a plain vLLM engine: the session's
    baseline engine (``conftest.PLAIN_RUNS``)."""
    return {name: {key: [c[key] for c in baseline.plain_runs[f"sample_{name}"]]
                   for key in ("tokens", "logprobs", "top_logprobs")}
            for name in WORKLOADS}


@pytest.fixture(scope="module")
def plain_tp2(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """The same on a plain tensor-parallel engine: its all-reduces sum in another order, so
    its logprobs differ from tensor parallel 1 in the last bits (its tokens do not)."""
    tmp = tmp_path_factory.mktemp("plain-tp2")
    return {name: child(tiny_model, tmp, sampling, "plain", tensor_parallel=2)
            for name, sampling in WORKLOADS.items()}


def run(engine, sampling: SamplingSpec, faults) -> dict:
    run_id = engine.new_run_id()
    engine.set_fault_plan(FaultPlan.from_specs(run_id, faults))
    out = engine.generate(PROMPTS, sampling, run_id=run_id)
    return {"error": out.error, "tokens": [r.token_ids for r in out.requests],
            "logprobs": [r.logprobs for r in out.requests],
            "top_logprobs": [[[list(p) for p in pos] for pos in r.top_logprobs]
                             for r in out.requests]}


def assert_identical(got: dict, want: dict) -> None:
    assert got["error"] is None, got["error"]
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == want["logprobs"]
    assert got["top_logprobs"] == want["top_logprobs"]


def test_the_baselines_carry_every_position_with_its_logprobs(plain):
    # Guards the comparisons below: they are only as strict as what they compare.
    for name in WORKLOADS:
        assert all(len(t) == 24 for t in plain[name]["tokens"]), name
        assert all(len(lp) == 24 for lp in plain[name]["logprobs"]), name
        assert all(len(pos) >= 2 for r in plain[name]["top_logprobs"] for pos in r), name


@pytest.mark.parametrize("workload", ["greedy", "seeded"])
@pytest.mark.parametrize("kind, params", [("oom", {}), ("uce", {"region": "activation"})])
def test_tp1_sampling_fault_gives_identical_tokens_and_logprobs(tp1_engine, plain, workload,
                                                                kind, params):
    request, token = AT
    got = run(tp1_engine, WORKLOADS[workload],
              [fault(kind, 0, request, token, "sample", times=2, **params)])
    assert_identical(got, plain[workload])


@pytest.mark.parametrize("kind, params", [
    ("oom", {}), pytest.param("uce", {"region": "activation"}, marks=pytest.mark.exhaustive)])
def test_tp1_resampling_from_the_kept_logits_shows_the_damage(tiny_model, plain, tmp_path,
                                                              kind, params):
    """The earlier design: the re-sample applies the penalties and the bias a second time to
    the logits they were already applied to, so the faulted step's logprobs drift, for every
    request of that step (all requests of this workload compute token ``token`` together).
    (On CPU the activation error hits the step's input-token buffer, which its forward has
    already read: its damage here is that same drift.)"""
    request, token = AT
    got = child(tiny_model, tmp_path, GREEDY, "resample",
                fault(kind, 0, request, token, "sample", **params))
    want = plain["greedy"]
    assert got["error"] is None, got["error"]
    for r in range(len(PROMPTS)):
        drift = [i for i, (a, b) in enumerate(zip(got["logprobs"][r], want["logprobs"][r]))
                 if a != b]
        assert drift and drift[0] == token, (r, drift)


@pytest.mark.exhaustive  # sampling faults at TP 2 in the fast tier: test_recovery_tp2
@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", ["greedy", "seeded"])
@pytest.mark.parametrize("kind, rank, params", [
    ("link_break", 1, {}),                      # the rank whose output vLLM does not read
    ("link_break", 0, {}),                      # the output rank
    ("uce", 1, {"region": "activation"}),
    ("oom", "all", {}),
])
def test_tp2_sampling_fault_reruns_the_forward_on_every_rank(tp2_engine, plain_tp2, workload,
                                                             kind, rank, params):
    request, token = AT
    got = run(tp2_engine, WORKLOADS[workload],
              [fault(kind, rank, request, token, "sample", **params)])
    assert_identical(got, plain_tp2[workload])


@pytest.mark.exhaustive
@pytest.mark.multiprocess
def test_tp2_a_peer_that_moved_on_undoes_its_step_and_reruns_it(tp2_engine, plain_tp2):
    """Rank 1 fails sampling while rank 0 (the output rank) has sampled the step and gone
    on: into the next forward (stopped there) or idle between RPCs. Both undo what they did
    since the step's forward and run it again; the faults are spread over the run (the last
    one on a request's last token, which the next step forgets as finished)."""
    faults = [fault("link_break", 1, 0, 3, "sample"), fault("link_flap", 1, 2, 11, "sample", 2),
              fault("link_break", 1, 3, 23, "sample")]
    started = time.time()
    got = run(tp2_engine, WORKLOADS["greedy"], faults)
    assert_identical(got, plain_tp2["greedy"])
    # An idle rank's monitor records its round after its part of the re-run, which may end
    # after the engine returned the last step: wait for the records (bounded).
    deadline = time.monotonic() + 20
    while True:
        rounds = [e for e in only(read_events(tp2_engine.recovery.event_log_dir),
                                  RecoveryRound) if e.time >= started]
        if len(rounds) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rounds) == 8 and all(r.decision == "recompute" for r in rounds), rounds
    failed = {r.epoch: r.rpc for r in rounds if r.rank == 1}
    ahead = [(r.state, r.rpc - failed[r.epoch]) for r in rounds if r.rank == 0]
    # Rank 0 had sampled the step rank 1 failed to sample, each time: stopped in the next
    # forward, or idle after the last step (which had no forward: all requests finished).
    assert all(state in ("stopped", "idle") and distance > 0 for state, distance in ahead), \
        ahead
