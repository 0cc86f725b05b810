"""Recovery past a thousand tokens of context, exact to the logprob bit.

vLLM's CPU attention sums a query's softmax over the context in tiles whose size depends on
how many query rows the tile holds: past about a thousand tokens of context, a prefill computes
a position's attention in other bits than the decode step that computed it one query token at
a time. Both repairs that rebuild a request's KV meet it:

- after a device reset, the KV recompute writes the lost positions again;
- after a process kill, the new engine prefills each resumed request's prompt and the tokens it
  had produced.

Both compute the positions the request had decoded one token per pass, as its decode steps
did (``ftkit.vllm.kv_recompute``). Each run here faults request 0 at its token 1500 and
compares tokens and sampled-token logprobs with a plain vLLM engine, bit for bit; the crippled
variants prefill those positions instead and drift. A kill on an engine whose step budget (512
tokens) is smaller than the resumed prompt (1509 tokens) takes the path of a resumed prefill
in several chunks.
"""

from __future__ import annotations

import pytest

from conftest import feature_run

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(900)]

AT = 1500
MAX_TOKENS = 1540
WORKLOAD = {"engine_args": {"max_model_len": 2048},
            "prompts": ["the quick brown fox jumps over the lazy dog"],
            "sampling": {"max_tokens": MAX_TOKENS}}
CHUNKED = {**WORKLOAD, "engine_args": {"max_model_len": 2048, "max_num_batched_tokens": 512}}
RESET = {"kind": "device_reset", "rank": 0, "at": {"request": 0, "token": AT}}
KILL = {"kind": "process_kill", "rank": 0, "at": {"request": 0, "token": AT},
        "params": {"target": "engine"}}


@pytest.fixture(scope="module")
def runs(tiny_model: str, tmp_path_factory) -> dict:
    def run(name: str, fault: dict | None = None, cripple: str | None = None,
            workload: dict = WORKLOAD) -> dict:
        return {"name": name, "recovery": fault is not None, "faults": [fault] if fault else [],
                "cripple": cripple, "workload": workload,
                "max_restarts": 1 if fault is KILL else 0}

    return feature_run({
        "model": tiny_model, "multiprocess": True, "env": {"VLLM_CPU_ATTN_SPLIT_KV": "0"},
        "event_log_dir": str(tmp_path_factory.mktemp("long-context")),
        "runs": [run("plain"),
                 run("reset", RESET), run("reset_decodes_prefilled", RESET, "decodes_prefilled"),
                 run("kill", KILL), run("kill_resume_prefilled", KILL, "resume_prefilled"),
                 run("kill_chunked", KILL, workload=CHUNKED)],
    }, timeout_s=840)


def _first_difference(got: list, want: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                None if len(got) == len(want) else min(len(got), len(want)))


def _damage(runs: dict, name: str) -> tuple[int | None, int | None]:
    """Where ``name``'s request first differs from the plain engine's: (token, logprob)."""
    assert runs[name]["error"] is None, runs[name]["error"]
    got, want = runs[name]["outputs"][0], runs["plain"]["outputs"][0]
    assert len(want["tokens"]) == MAX_TOKENS
    return (_first_difference(got["tokens"], want["tokens"]),
            _first_difference(got["logprobs"], want["logprobs"]))


def test_a_device_reset_at_token_1500_recomputes_the_kv_exactly(runs):
    assert runs["reset"]["kv"], "the device reset's lost KV was recomputed"
    assert _damage(runs, "reset") == (None, None)


def test_prefilling_the_decoded_positions_after_a_reset_drifts(runs):
    token, logprob = _damage(runs, "reset_decodes_prefilled")
    assert logprob is not None and logprob >= AT, (token, logprob)


@pytest.mark.parametrize("name", ["kill", "kill_chunked"])
def test_a_request_resumed_at_token_1500_continues_exactly(runs, name):
    assert runs[name]["restarts"] == 1
    assert _damage(runs, name) == (None, None)


def test_prefilling_a_resumed_request_as_vllm_schedules_it_drifts(runs):
    assert runs["kill_resume_prefilled"]["restarts"] == 1
    token, logprob = _damage(runs, "kill_resume_prefilled")
    assert logprob is not None and logprob >= AT, (token, logprob)
