"""Which requests lost KV and how their recompute is cut into passes (``KvRecompute``), on
stand-in runner state, and where the passes leave the rows of vLLM's own persistent batch:
the forward passes themselves run in tests/vllm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ftkit.vllm import kv_recompute
from ftkit.vllm.kv_recompute import KvRecompute


def runner(requests: dict[str, list[int]], *, max_tokens: int = 64, max_reqs: int = 8):
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))
    return SimpleNamespace(
        requests={rid: SimpleNamespace(block_ids=(blocks,), output_token_ids=[1, 2])
                  for rid, blocks in requests.items()},
        kv_cache_config=SimpleNamespace(num_blocks=32, kv_cache_groups=[group]),
        max_num_tokens=max_tokens, max_num_reqs=max_reqs)


def step(cached: dict[str, int], new: list[tuple[str, list[int], int]] = (),
         new_blocks: dict[str, list[int]] | None = None):
    new_blocks = new_blocks or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                            for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(),
            num_computed_tokens=list(cached.values()),
            new_block_ids=[(new_blocks[r],) if r in new_blocks else None for r in cached]))


def test_only_requests_whose_computed_tokens_lie_in_lost_blocks_are_recomputed():
    kv = KvRecompute(runner({"a": [1, 2, 3], "b": [4, 5], "c": [6]}))
    kv.mark_lost({2, 6})
    # a has 6 computed tokens (blocks 1 and 2: block 2 lost); b none lost; c's block 6 holds
    # no computed token yet (0 computed).
    work, _ = kv._find_work(step({"a": 6, "b": 7, "c": 0}))
    assert [(w.req_id, w.tokens) for w in work] == [("a", 6)]


def test_a_prefix_cache_hit_on_a_lost_block_is_recomputed_too():
    kv = KvRecompute(runner({}))
    kv.mark_lost(all_blocks=True)
    work, _ = kv._find_work(step({}, new=[("n", [9, 10], 5), ("m", [11], 0)]))
    assert [(w.req_id, w.tokens, w.new is not None) for w in work] == [("n", 5, True)]


def test_passes_keep_to_the_token_and_request_budgets():
    kv = KvRecompute(runner({"a": [1], "b": [2], "c": [3]}, max_tokens=10, max_reqs=2))
    kv.mark_lost({1, 2, 3})
    work, _ = kv._find_work(step({"a": 4, "b": 12, "c": 3}))
    passes = kv._plan(work)
    assert passes == [{"a": (0, 4), "b": (0, 6)}, {"b": (6, 6), "c": (0, 3)}]
    # Every token of every request is scheduled exactly once, in order.
    for w in work:
        spans = [p[w.req_id] for p in passes if w.req_id in p]
        assert sum(n for _, n in spans) == w.tokens
        assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    assert all(sum(n for _, n in p.values()) <= 10 and len(p) <= 2 for p in passes)


def test_nothing_lost_costs_nothing():
    kv = KvRecompute(runner({"a": [1]}))
    calls = []
    assert kv.run(step({"a": 3}), calls.append) is None
    assert calls == []


# --- the persistent batch's rows, on vLLM's own InputBatch -------------------------------------

def input_batch():
    torch = pytest.importorskip("torch")
    gpu_input_batch = pytest.importorskip("vllm.v1.worker.gpu_input_batch")
    from vllm import SamplingParams

    batch = gpu_input_batch.InputBatch(
        max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64,
        device=torch.device("cpu"), vocab_size=32, block_sizes=[4],
        max_num_blocks_per_req=[16])

    def state(req_id: str, block: int, computed: int = 4):
        return gpu_input_batch.CachedRequestState(
            req_id=req_id, prompt_token_ids=[1, 2, 3, 4], mm_features=[],
            sampling_params=SamplingParams(temperature=0), generator=None,
            block_ids=([block],), num_computed_tokens=computed, output_token_ids=[])

    return batch, state


def vllm_runner(rows: str, more: str = ""):
    """A runner whose batch holds ``rows`` in that order, the way vLLM got there: ``rows``
    and ``more`` added, ``more`` finished (the last rows move into the holes)."""
    batch, state = input_batch()
    requests = {rid: state(rid, i + 1) for i, rid in enumerate(rows + more)}
    order = sorted(requests, key=lambda r: (r not in more, rows.find(r)))
    for rid in order[len(more):] + order[:len(more)]:
        batch.add_request(requests[rid])
    batch.condense()
    batch.refresh_metadata()
    for rid in more:
        batch.remove_request(rid)
        del requests[rid]
    batch.condense()
    batch.refresh_metadata()
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))
    return SimpleNamespace(
        input_batch=batch, requests=requests, num_prompt_logprobs={},
        kv_cache_config=SimpleNamespace(num_blocks=32, kv_cache_groups=[group]),
        max_num_tokens=64, max_num_reqs=8, execute_model_state=None)


def test_lay_out_puts_the_rows_back_in_their_order_for_the_next_step():
    runner = vllm_runner("cab")
    assert runner.input_batch.req_ids == ["c", "a", "b"]
    # What a pass of request a alone leaves (``_update_states`` ends so).
    kv_recompute.empty_batch(runner.input_batch)
    runner.input_batch.add_request(runner.requests["a"])
    runner.input_batch.refresh_metadata()
    kv_recompute.lay_out(runner, ["c", "a", "b"])
    assert runner.input_batch.req_ids == ["c", "a", "b"]
    assert runner.input_batch.req_id_to_index == {"c": 0, "a": 1, "b": 2}
    # The step that follows removes a row it does not schedule and fills the hole, as vLLM
    # does (vLLM refuses a removal once a step's removals were read and not handed on).
    runner.input_batch.remove_request("a")
    runner.input_batch.condense()
    runner.input_batch.refresh_metadata()
    assert runner.input_batch.req_ids == ["c", "b"]


def test_recompute_passes_leave_the_rows_where_vllm_had_them(monkeypatch):
    # vLLM's order after request d finished: b moved into d's row.
    runner = vllm_runner("bac", more="d")
    before = list(runner.input_batch.req_ids)
    assert before == ["b", "a", "c"]
    kv = KvRecompute(runner)
    kv.mark_lost(all_blocks=True)
    monkeypatch.setattr(KvRecompute, "_synthesize", lambda self, so, chunk, work: chunk)
    passes = []

    def forward(chunk):
        # What ``_update_states`` does to the rows: only the pass's requests stay.
        batch = runner.input_batch
        for rid in list(batch.req_id_to_index):
            if rid not in chunk:
                batch.remove_request(rid)
        for rid in chunk:
            if rid not in batch.req_id_to_index:
                batch.add_request(runner.requests[rid])
        batch.condense()
        batch.refresh_metadata()
        passes.append(list(batch.req_ids))

    report = kv.run(step({"c": 4, "a": 4}), forward)
    assert report is not None and passes == [["c", "a"]]
    assert runner.input_batch.req_ids == before
