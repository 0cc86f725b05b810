"""Lost KV with the engine features that move KV around: the prefix cache, chunked prefill and
preemption (issue 10, point 4), exact to the logprob bit.

After a device reset every KV block of the rank is lost, after a KV memory error (UCE) the hit
block: blocks the prefix cache keeps for finished requests too. Every test compares each
request's tokens AND sampled-token logprobs with a plain vLLM engine (no ftkit) running the
same workload, bit for bit; its crippled variant switches one repair off and shows the damage
at the positions it must appear. Each workload also proves it exercised the feature: vLLM's
scheduler is watched in the child (``_feature_run``) for prefix-cache hits, steps that prefill
several requests and preemptions.

vLLM's CPU attention splits a decode row's KV between threads according to the rows of the
batch (``VLLM_CPU_ATTN_SPLIT_KV``, on by default), which changes that row's rounding: a KV
recompute (a prefill, never split) then cannot reproduce the KV of tokens whose decode was
split. The prefix-cache workload runs with the split on (its lost KV was written by prefills),
the others with it off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(600)]

RUNNER = Path(__file__).with_name("_feature_run.py")
#: 84 tokens: two full KV blocks of 32 (what the prefix cache shares) and a partial one.
LONG = "river mountain city ocean forest " * 6
FOX = "the quick brown fox jumps over the lazy dog "
COUNT = "one two three four five six seven eight nine ten "


def reset(request: int, token: int) -> dict:
    return {"kind": "device_reset", "rank": 0, "at": {"request": request, "token": token}}


# --- prefix cache: request 0 leaves LONG's blocks in the cache and finishes; request 2 (and
# later request 3) find its two full blocks there (64 tokens). Request 1 runs throughout.
PREFIX = {
    "engine_args": {"enable_prefix_caching": True},
    "prompts": [LONG, FOX.strip(), LONG, LONG],
    "sampling": {"max_tokens": 40, "requests": [{"max_tokens": 4}, {}, {"max_tokens": 8},
                                                {"max_tokens": 8}]},
    "submit_after_steps": [0, 0, 24, 36],
}
#: Before request 2 arrives: every block is lost, request 0's cached ones included.
PREFIX_RESET = reset(1, 12)
#: A memory error in request 2's first block: the cached block it shares with request 0.
PREFIX_UCE = {"kind": "uce", "rank": 0, "at": {"request": 2, "token": 3},
              "params": {"region": "kv"}}

# --- chunked prefill: three prompts of about 100 tokens, 64 tokens a step.
CHUNKED = {
    "engine_args": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64,
                    "enable_prefix_caching": False},
    "prompts": [LONG, (FOX * 4).strip(), (COUNT * 4).strip()],
    "sampling": {"max_tokens": 16},
}
#: The step of request 2's last prefill chunk: its earlier chunks, request 1's whole prompt and
#: request 0's prompt and first tokens are lost.
CHUNKED_RESET = reset(2, 0)

# --- preemption: 10 KV blocks of 32 tokens for three requests that grow to 4 blocks each.
PREEMPT = {
    "engine_args": {"num_gpu_blocks_override": 10, "max_model_len": 256,
                    "enable_prefix_caching": True},
    "prompts": [LONG, (FOX * 4).strip(), (COUNT * 4).strip()],
    "sampling": {"max_tokens": 40},
}
#: While request 2 waits preempted (its blocks freed, some kept in the prefix cache).
PREEMPT_WAITING = reset(1, 20)
#: After request 2 resumed.
PREEMPT_RESUMED = reset(2, 20)


def run_child(tiny_model: str, tmp_path: Path, env: dict, runs: list[dict]) -> dict:
    config = {"model": tiny_model, "event_log_dir": str(tmp_path), "env": env, "runs": runs}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(config)],
                          capture_output=True, text=True, timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def split_kv(tiny_model: str, tmp_path_factory) -> dict:
    """The prefix-cache workload with the attention KV split on (vLLM's default)."""
    return run_child(tiny_model, tmp_path_factory.mktemp("split_kv"),
                     {"VLLM_CPU_ATTN_SPLIT_KV": "1"}, [
        {"name": "baseline", "recovery": False, "workload": PREFIX},
        {"name": "reset", "recovery": True, "faults": [PREFIX_RESET], "workload": PREFIX},
        {"name": "reset_prefix_not_recomputed", "recovery": True, "faults": [PREFIX_RESET],
         "cripple": "prefix", "workload": PREFIX},
        {"name": "reset_rows_in_scheduler_order", "recovery": True, "faults": [PREFIX_RESET],
         "cripple": "layout", "workload": PREFIX},
    ])


@pytest.fixture(scope="module")
def no_split(tiny_model: str, tmp_path_factory) -> dict:
    """The other workloads, with the attention KV split off."""
    return run_child(tiny_model, tmp_path_factory.mktemp("no_split"),
                     {"VLLM_CPU_ATTN_SPLIT_KV": "0"}, [
        {"name": "prefix", "recovery": False, "workload": PREFIX},
        {"name": "prefix_uce", "recovery": True, "faults": [PREFIX_UCE], "workload": PREFIX},
        {"name": "prefix_uce_not_recomputed", "recovery": True, "faults": [PREFIX_UCE],
         "cripple": "kv", "workload": PREFIX},
        {"name": "chunked", "recovery": False, "workload": CHUNKED},
        {"name": "chunked_reset", "recovery": True, "faults": [CHUNKED_RESET],
         "workload": CHUNKED},
        {"name": "chunked_reset_not_recomputed", "recovery": True, "faults": [CHUNKED_RESET],
         "cripple": "kv", "workload": CHUNKED},
        {"name": "preempt", "recovery": False, "workload": PREEMPT},
        {"name": "preempt_reset_waiting", "recovery": True, "faults": [PREEMPT_WAITING],
         "workload": PREEMPT},
        {"name": "preempt_reset_resumed", "recovery": True, "faults": [PREEMPT_RESUMED],
         "workload": PREEMPT},
        {"name": "preempt_reset_waiting_not_recomputed", "recovery": True,
         "faults": [PREEMPT_WAITING], "cripple": "kv", "workload": PREEMPT},
    ])


def first_differences(baseline: dict, run: dict) -> list[tuple[int | None, int | None]]:
    """Per request: the first position whose token, and the first whose logprob, differs from
    the baseline's (``None``: none)."""
    assert run["error"] is None
    firsts = []
    for want, got in zip(baseline["outputs"], run["outputs"], strict=True):
        assert want["key"] == got["key"]
        tokens = [i for i, (a, b) in enumerate(zip(want["tokens"], got["tokens"])) if a != b]
        logprobs = [i for i, (a, b) in enumerate(zip(want["logprobs"], got["logprobs"]))
                    if a != b]
        assert len(want["tokens"]) == len(got["tokens"])
        firsts.append((tokens[0] if tokens else None, logprobs[0] if logprobs else None))
    return firsts


def assert_identical(baseline: dict, run: dict) -> None:
    assert first_differences(baseline, run) == [(None, None)] * len(baseline["outputs"])
    assert [o["finish_reason"] for o in run["outputs"]] == \
        [o["finish_reason"] for o in baseline["outputs"]]


def recomputed(run: dict) -> list[tuple[int, int]]:
    """(requests, tokens) of each KV recompute the run's rank 0 logged."""
    return [(e["requests"], e["tokens"]) for e in run["kv"] if e["rank"] == 0]


# --- the prefix cache -------------------------------------------------------------------------

def test_prefix_cache_reuse_after_a_device_reset_is_exact(split_kv):
    base = split_kv["baseline"]
    # The workload reuses request 0's two full blocks, for request 2 and for request 3.
    assert base["schedule"]["prefix_hits"] == {"0": 0, "1": 0, "2": 64, "3": 64}
    run = split_kv["reset"]
    assert run["schedule"]["prefix_hits"] == base["schedule"]["prefix_hits"]
    assert_identical(base, run)
    # Request 1 (running at the reset: 18 prompt + 11 output tokens), then request 2's 64
    # cached tokens before its prefix-hit step; request 3 finds them valid again.
    assert recomputed(run) == [(1, 29), (1, 64)]


def test_prefix_cache_blocks_not_recomputed_poison_every_later_hit(split_kv):
    base, run = split_kv["baseline"], split_kv["reset_prefix_not_recomputed"]
    # Requests 2 and 3 read the reset's poisoned blocks from their first token on.
    assert first_differences(base, run) == [(None, None), (None, None), (0, 0), (0, 0)]
    assert recomputed(run) == [(1, 29)]


def test_rows_re_added_in_the_scheduler_order_drift_in_the_last_bits(split_kv):
    """The recompute passes empty vLLM's batch; ftkit puts its rows back where vLLM had them.
    Re-added in the scheduler's order instead, request 2 (new, added before request 1)
    attends in another KV split: same tokens, logprobs off from its first decode on."""
    base, run = split_kv["baseline"], split_kv["reset_rows_in_scheduler_order"]
    assert first_differences(base, run) == [(None, None), (None, None), (None, 1), (None, None)]


def test_a_kv_memory_error_in_a_shared_prefix_block_is_exact(no_split):
    base = no_split["prefix"]
    assert base["schedule"]["prefix_hits"] == {"0": 0, "1": 0, "2": 64, "3": 64}
    run = no_split["prefix_uce"]
    assert_identical(base, run)
    # Request 2 (84 prompt + 2 output tokens), the owner of the hit block still running.
    assert recomputed(run) == [(1, 86)]


def test_a_kv_memory_error_not_recomputed_poisons_the_owner_and_the_next_hit(no_split):
    base, run = no_split["prefix"], no_split["prefix_uce_not_recomputed"]
    # Request 2 from its faulted token on; request 3 finds the hit block in the cache.
    assert first_differences(base, run) == [(None, None), (None, None), (3, 3), (0, 0)]


# --- chunked prefill --------------------------------------------------------------------------

def test_device_reset_mid_chunked_prefill_is_exact(no_split):
    base = no_split["chunked"]
    # Two steps prefill two requests each (request 0's last chunk beside request 1's first,
    # then request 1's last beside request 2's first); the reset hits request 2's last chunk.
    assert base["schedule"]["joint_prefills"] == [[0, 1], [1, 2]]
    run = no_split["chunked_reset"]
    assert run["schedule"]["joint_prefills"] == base["schedule"]["joint_prefills"]
    assert_identical(base, run)
    # All three, request 2 mid-prefill, in passes of the 64-token budget.
    assert [n for n, _ in recomputed(run)] == [3]


def test_chunked_prefill_kv_not_recomputed_corrupts_every_request(no_split):
    base, run = no_split["chunked"], no_split["chunked_reset_not_recomputed"]
    # From the faulted step on: request 0's token 2, request 1's token 1, request 2's token 0.
    assert first_differences(base, run) == [(2, 2), (1, 1), (0, 0)]


# --- preemption -------------------------------------------------------------------------------

def test_kv_loss_under_preemption_is_exact(no_split):
    base = no_split["preempt"]
    # vLLM preempts request 2 after its 13th token (and resumes it later).
    assert base["schedule"]["preempted"] == [[2, 13]]
    for name in ("preempt_reset_waiting", "preempt_reset_resumed"):
        run = no_split[name]
        assert run["schedule"]["preempted"] == [[2, 13]], name
        assert_identical(base, run)
    # While request 2 waits: requests 0 and 1 at once, then request 2 when it resumes with the
    # one block of its own it found in the prefix cache.
    assert recomputed(no_split["preempt_reset_waiting"]) == [(2, 191), (1, 32)]


def test_kv_loss_under_preemption_not_recomputed(no_split):
    base, run = no_split["preempt"], no_split["preempt_reset_waiting_not_recomputed"]
    # Requests 0 and 1 from the faulted step; request 2 from where it resumed.
    assert first_differences(base, run) == [(20, 20), (20, 20), (13, 13)]


# --- tensor parallel ----------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_prefix_cache_reuse_after_kv_loss_is_exact_at_tp2(tiny_model, tmp_path):
    """Two ranks (one thread each: no attention KV split). Rank 0's device reset loses every
    block, request 0's cached ones included; later rank 1's memory error hits the block request
    2 shares with the cache. Each loss is recomputed on both ranks, in the same passes."""
    faults = [PREFIX_RESET, dict(PREFIX_UCE, rank=1)]
    result = run_child(tiny_model, tmp_path, {}, [
        {"name": "baseline", "recovery": False, "workload": {**PREFIX, "tensor_parallel_size": 2}},
        {"name": "faults", "recovery": True, "faults": faults,
         "workload": {**PREFIX, "tensor_parallel_size": 2}},
    ])
    run = result["faults"]
    assert_identical(result["baseline"], run)
    for rank in (0, 1):
        # Request 1 after the reset, request 2's cached prefix before its hit, then request 2
        # (84 prompt + 2 output tokens) after the memory error.
        assert [(e["requests"], e["tokens"]) for e in run["kv"] if e["rank"] == rank] == \
            [(1, 29), (1, 64), (1, 86)], rank
