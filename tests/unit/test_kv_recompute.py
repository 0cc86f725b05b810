"""Which requests lost KV and how their recompute is cut into passes (``KvRecompute``), on
stand-in runner state, and where the passes leave the rows of vLLM's own persistent batch:
the forward passes themselves run in tests/vllm."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from ftkit.contracts.requests import request_id
from ftkit.vllm import kv_recompute
from ftkit.vllm.kv_recompute import KvRecompute, ResumedPrefill

#: Prompts of the stand-in requests: long enough that every position in the tests below that
#: does not say otherwise was prefilled.
PROMPT = [7] * 16


def runner(requests: dict[str, list[int]], *, max_tokens: int = 64, max_reqs: int = 8,
           prompts: dict[str, list[int]] | None = None):
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))
    prompts = prompts or {}
    return SimpleNamespace(
        requests={rid: SimpleNamespace(block_ids=(list(blocks),), output_token_ids=[1, 2],
                                       prompt_token_ids=prompts.get(rid, PROMPT),
                                       prompt_embeds=None)
                  for rid, blocks in requests.items()},
        kv_cache_config=SimpleNamespace(num_blocks=32, kv_cache_groups=[group]),
        max_num_tokens=max_tokens, max_num_reqs=max_reqs)


# The scheduler output's parts that the recompute reads, as vLLM's dataclasses (the rewrite
# replaces fields of them).
@dataclass
class NewRequest:
    req_id: str
    block_ids: Any
    num_computed_tokens: int
    prompt_token_ids: list[int]
    prompt_embeds: Any = None


@dataclass
class CachedRequests:
    req_ids: list[str]
    num_computed_tokens: list[int]
    new_block_ids: list[Any]
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class Step:
    scheduled_new_reqs: list[NewRequest]
    scheduled_cached_reqs: CachedRequests
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)


def step(cached: dict[str, int], new: list[tuple[str, list[int], int]] = (),
         new_blocks: dict[str, list[int]] | None = None, *,
         scheduled: dict[str, int] | None = None, prompts: dict[str, list[int]] | None = None):
    new_blocks = new_blocks or {}
    prompts = prompts or {}
    scheduled = scheduled or {r: 1 for r in [*cached, *(n[0] for n in new)]}
    return Step(
        scheduled_new_reqs=[NewRequest(r, (b,), c, prompts.get(r, PROMPT)) for r, b, c in new],
        scheduled_cached_reqs=CachedRequests(
            req_ids=list(cached), num_computed_tokens=list(cached.values()),
            new_block_ids=[(new_blocks[r],) if r in new_blocks else None for r in cached]),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))


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


def test_positions_a_request_decoded_are_recomputed_one_token_per_pass():
    # a: a 4-token prompt and 3 decoded tokens; b: resumed after 5 output tokens, so the last
    # 5 of its 8 prompt tokens were decoded by its first engine, and 2 more since.
    b = request_id("r", 1, offset=5)
    kv = KvRecompute(runner({"a": [1, 2], b: [3, 4, 5]}, max_reqs=8,
                            prompts={"a": [7] * 4, b: [7] * 8}))
    kv.mark_lost({1, 3})
    work, _ = kv._find_work(step({"a": 7, b: 10}))
    assert [(w.req_id, w.tokens, w.prefilled) for w in work] == [("a", 7, 4), (b, 10, 3)]
    assert kv._plan(work) == [
        {"a": (0, 4), b: (0, 3)},  # the prompts, as prefills
        {"a": (4, 1), b: (3, 1)}, {"a": (5, 1), b: (4, 1)}, {"a": (6, 1), b: (5, 1)},
        {b: (6, 1)}, {b: (7, 1)}, {b: (8, 1)}, {b: (9, 1)}]


def test_one_token_passes_keep_to_the_request_budget():
    kv = KvRecompute(runner({"a": [1], "b": [2], "c": [3]}, max_reqs=2,
                            prompts={r: [7] for r in "abc"}))
    kv.mark_lost({1, 2, 3})
    work, _ = kv._find_work(step({"a": 2, "b": 2, "c": 2}))
    assert kv._plan(work) == [{"a": (0, 1), "b": (0, 1)}, {"c": (0, 1)},
                              {"a": (1, 1), "b": (1, 1)}, {"c": (1, 1)}]


# --- a resumed request's prefill -----------------------------------------------------------

RESUMED = request_id("r", 0, offset=6)  # its prompt: 4 tokens of the original, 6 decoded


def test_a_resumed_prefill_computes_only_its_last_position_in_the_step():
    plain = step({}, new=[("p", [1, 2, 3], 0)], scheduled={"p": 10})
    assert ResumedPrefill(runner({})).rewrite(plain) == (plain, [])  # not resumed
    so = step({"a": 20}, new=[(RESUMED, [4, 5, 6], 0)], scheduled={"a": 1, RESUMED: 10},
              prompts={RESUMED: [7] * 10})
    rewritten, work = ResumedPrefill(runner({"a": [1]})).rewrite(so)
    new = rewritten.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, rewritten.num_scheduled_tokens) == (9, {"a": 1, RESUMED: 1})
    assert rewritten.total_num_scheduled_tokens == 2
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # the scheduler's output stays
    [w] = work
    assert (w.req_id, w.start, w.tokens, w.prefilled, w.new) == (
        RESUMED, 0, 9, 4, so.scheduled_new_reqs[0])
    assert KvRecompute(runner({}))._plan(work) == [
        {RESUMED: (0, 4)}, *({RESUMED: (p, 1)} for p in range(4, 9))]


def test_a_resumed_prefill_in_chunks_is_rewritten_from_its_first_decoded_position():
    state = ResumedPrefill(runner({}))
    # Chunk 1: 3 prompt tokens only, as the first engine prefilled them.
    first = step({}, new=[(RESUMED, [4], 0)], scheduled={RESUMED: 3},
                 prompts={RESUMED: [7] * 10})
    assert state.rewrite(first) == (first, [])
    # Chunk 2 (positions 3 to 7) reaches the decoded ones: the step computes position 7.
    r = runner({RESUMED: [4]}, prompts={RESUMED: [7] * 10})
    state.runner = r
    second = step({RESUMED: 3}, new_blocks={RESUMED: [5]}, scheduled={RESUMED: 5})
    rewritten, [w] = state.rewrite(second)
    assert rewritten.scheduled_cached_reqs.num_computed_tokens == [7]
    assert (w.start, w.tokens, w.prefilled, w.added_blocks) == (3, 7, 4, ([5],))
    assert KvRecompute(r)._plan([w]) == [{RESUMED: (3, 1)}, *({RESUMED: (p, 1)}
                                                               for p in range(4, 7))]
    # The first pass appends the step's new block; it is taken off again for the step.
    r.requests[RESUMED].block_ids[0].append(5)
    KvRecompute(r)._take_off_added_blocks([w])
    assert r.requests[RESUMED].block_ids == ([4],)
    # The last chunk: one position left, computed as it is.
    last = step({RESUMED: 8}, scheduled={RESUMED: 2})
    rewritten, [w] = state.rewrite(last)
    assert (w.start, w.tokens) == (8, 9)
    assert state.rewrite(step({RESUMED: 10})) == (step({RESUMED: 10}), [])  # decoding


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
