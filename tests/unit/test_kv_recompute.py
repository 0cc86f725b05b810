"""Which requests lost KV and how their recompute is cut into passes (``KvRecompute``),
on stand-in runner state: the forward passes themselves run in tests/vllm."""

from __future__ import annotations

from types import SimpleNamespace

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
