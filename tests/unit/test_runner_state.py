"""The rollback record of ``V1RunnerState`` on a stand-in for vLLM's V1 runner: what it keeps
(O(1) on a decode step that allocates no block, never the logits) and that rollback puts back
exactly what a step changes. ``tests/vllm/test_recovery_tp1.py`` pins the vLLM invariants it relies on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ftkit.errors import FtkitError
from ftkit.vllm.runner_state import V1RunnerState, check_supported


class Batch:
    """The parts of vLLM's InputBatch that the record touches."""

    def __init__(self, req_ids: list[str], num_tokens: list[int]) -> None:
        self.req_ids = list(req_ids)
        self.req_id_to_index = {r: i for i, r in enumerate(req_ids)}
        self.num_tokens_no_spec = np.zeros(8, dtype=np.int32)
        self.num_tokens_no_spec[:len(num_tokens)] = num_tokens
        self.generators: dict[int, torch.Generator] = {}
        self.random_reqs: set[str] = set()

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def request(prompt: int, output: list[int], blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt, output_token_ids=list(output),
                           block_ids=(list(blocks),))


def runner(requests: dict[str, Any], batch: Batch) -> SimpleNamespace:
    return SimpleNamespace(
        input_batch=batch, requests=requests, num_prompt_logprobs={},
        use_async_scheduling=False, speculative_config=None, device=torch.device("cpu"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        compilation_config=SimpleNamespace(cudagraph_mode=None), execute_model_state=None)


def scheduled(new: list[str] = (), cached: list[str] = (), new_blocks: list[Any] = (),
              resumed: set[str] = frozenset(), computed: list[int] = (),
              tokens: dict[str, int] | None = None,
              finished: set[str] = frozenset()) -> SimpleNamespace:
    """A scheduler output: ``computed`` tokens of each cached request before the step,
    ``tokens`` scheduled per request (one each by default)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=[], num_computed_tokens=0)
                            for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              new_block_ids=list(new_blocks),
                                              resumed_req_ids=set(resumed),
                                              num_computed_tokens=list(computed)),
        num_scheduled_tokens=tokens if tokens is not None else dict.fromkeys(
            [*new, *cached], 1),
        finished_req_ids=set(finished))


def decode_step(r: SimpleNamespace) -> SimpleNamespace:
    """The scheduler output of a decode step of every request (one token each)."""
    names = list(r.requests)
    return scheduled(cached=names, new_blocks=[None] * len(names),
                     computed=[s.num_prompt_tokens + len(s.output_token_ids) - 1
                               for s in r.requests.values()])


def make(**requests: Any) -> tuple[V1RunnerState, SimpleNamespace]:
    batch = Batch(list(requests), [r.num_prompt_tokens + len(r.output_token_ids)
                                   for r in requests.values()])
    r = runner(dict(requests), batch)
    state = V1RunnerState(r)
    state.reset_batch = lambda: None  # the stand-in batch has no rows to remove
    return state, r


def test_rollback_execute_takes_appended_blocks_off_in_place_and_forgets_new_requests():
    a, b, c = request(3, [7], [0]), request(4, [], [1, 2]), request(2, [5], [3])
    state, r = make(a=a, b=b, c=c)
    lists = a.block_ids[0], b.block_ids[0]
    so = scheduled(new=["n"], cached=["a", "b", "c"], new_blocks=[([9],), None, ([8],)],
                   resumed={"c"})
    # What _update_states does: register the new request, append blocks (not to "c", which
    # is resumed: its block ids are replaced wholesale).
    r.requests["n"] = request(2, [], [4])
    r.num_prompt_logprobs["n"] = 1
    a.block_ids[0].extend([9])
    c.block_ids = ([8],)
    state.rollback_execute(so)
    assert "n" not in r.requests and "n" not in r.num_prompt_logprobs
    assert a.block_ids[0] == [0] and b.block_ids[0] == [1, 2] and c.block_ids == ([8],)
    assert (a.block_ids[0], b.block_ids[0]) == lists and a.block_ids[0] is lists[0]
    # A failure before _update_states ran (or a second rollback): the lists stay as they are.
    state.rollback_execute(so)
    assert a.block_ids[0] == [0] and b.block_ids[0] == [1, 2]


def test_rollback_execute_takes_off_only_what_each_kv_group_got():
    # Two KV groups; the attempt failed after appending to the first group only.
    a = SimpleNamespace(num_prompt_tokens=3, output_token_ids=[7], block_ids=([0, 1], [5]))
    state, r = make(a=a)
    so = scheduled(cached=["a"], new_blocks=[([2, 3], [6])])
    a.block_ids[0].extend([2, 3])
    state.rollback_execute(so)
    assert a.block_ids == ([0, 1], [5])


def test_rollback_sample_derives_each_requests_output_count_from_the_scheduler_output():
    a, b = request(3, [7, 8], [0]), request(4, [], [1])
    state, r = make(a=a, b=b)
    so = decode_step(r)
    record = state.begin_sample(so)
    assert record.scheduled is so and record.generators == () and record.global_rng is None
    # What sample_tokens does: one token per request (completed: the step is undone the same
    # way whether its sampling failed or completed).
    a.output_token_ids.append(11)
    b.output_token_ids.append(12)
    state.rollback_sample(record)
    assert a.output_token_ids == [7, 8] and b.output_token_ids == []
    # The record stays valid: a second rollback after a second failure restores the same.
    a.output_token_ids.append(13)
    state.rollback_sample(record)
    assert a.output_token_ids == [7, 8]


def test_rollback_sample_leaves_a_prompt_chunk_that_samples_nothing_alone():
    a, b = request(10, [], [0]), request(3, [7], [1])
    state, r = make(a=a, b=b)
    # "a": 4 of its 10 prompt tokens computed, 4 more scheduled: no output token this step.
    record = state.begin_sample(scheduled(cached=["a", "b"], new_blocks=[None, None],
                                          computed=[4, 3], tokens={"a": 4, "b": 1}))
    b.output_token_ids.append(12)
    state.rollback_sample(record)
    assert a.output_token_ids == [] and b.output_token_ids == [7]


def test_rollback_sample_refuses_a_count_the_step_cannot_have_produced():
    a = request(3, [7], [0])
    state, r = make(a=a)
    # The scheduler says the step starts from 5 output tokens; the request has 1.
    record = state.begin_sample(scheduled(cached=["a"], new_blocks=[None], computed=[7]))
    with pytest.raises(FtkitError, match="output tokens"):
        state.rollback_sample(record)


def test_a_random_batch_keeps_every_generator_and_never_the_logits():
    state, r = make(a=request(3, [7], [0]))
    batch = r.input_batch
    batch.random_reqs = {"a"}
    gen = torch.Generator().manual_seed(5)
    batch.generators = {0: gen}
    logits = torch.arange(4.0)
    r.execute_model_state = SimpleNamespace(logits=logits)
    torch.manual_seed(3)
    record = state.begin_sample(decode_step(r))
    # Only generator states: the logits are neither copied nor referenced.
    assert not any(isinstance(v, torch.Tensor) and v.numel() == 4
                   for v in (record.scheduled, record.global_rng))
    assert [g for g, _ in record.generators] == [gen]
    drawn, drawn_global = torch.rand(3, generator=gen), torch.rand(3)
    state.rollback_sample(record)
    assert torch.equal(torch.rand(3, generator=gen), drawn)
    assert torch.equal(torch.rand(3), drawn_global)


def test_undoing_the_next_step_brings_back_the_requests_it_forgot_as_finished():
    """A rank that sampled step N and went into step N+1 undoes both when step N is re-run
    from its forward pass: N+1's ``_update_states`` forgot the requests that finished with N,
    and step N needs them back."""
    done, going = request(3, [7, 8], [0]), request(4, [5], [1])
    state, r = make(done=done, going=going)
    removed = []
    r._on_request_state_removed = lambda req_id, s: removed.append(req_id)
    state = V1RunnerState(r)
    state.reset_batch = lambda: None
    step_n = decode_step(r)
    record = state.begin_sample(step_n)
    done.output_token_ids.append(9)
    going.output_token_ids.append(6)
    step_next = scheduled(cached=["going"], new_blocks=[None], computed=[5],
                          finished={"done"})
    # What N+1's _update_states does to a finished request.
    r._on_request_state_removed("done", r.requests.pop("done"))
    assert removed == ["done"]  # vLLM's own hook still runs
    state.rollback_execute(step_next)
    assert r.requests["done"] is done
    state.rollback_sample(record)
    assert done.output_token_ids == [7, 8] and going.output_token_ids == [5]


def test_forgotten_requests_are_kept_only_until_the_next_sampling():
    done = request(3, [7], [0])
    state, r = make(done=done)
    r._on_request_state_removed = lambda req_id, s: None
    state = V1RunnerState(r)
    state.reset_batch = lambda: None
    r._on_request_state_removed("done", r.requests.pop("done"))
    state.begin_sample(scheduled())
    state.rollback_execute(scheduled(finished={"done"}))
    assert "done" not in r.requests


def test_completed_prompt_logprobs_bookkeeping_is_undone():
    a = request(10, [], [0])
    a.in_progress_prompt_logprobs_cpu = partial = object()
    state, r = make(a=a)
    r.num_prompt_logprobs["a"] = 2
    record = state.begin_sample(scheduled(cached=["a"], new_blocks=[None], computed=[6],
                                          tokens={"a": 4}))
    # The last chunk of the prompt completes its prompt logprobs, and samples a token.
    del r.num_prompt_logprobs["a"]
    a.in_progress_prompt_logprobs_cpu = None
    a.output_token_ids.append(3)
    state.rollback_sample(record)
    assert r.num_prompt_logprobs == {"a": 2} and a.in_progress_prompt_logprobs_cpu is partial
    assert a.output_token_ids == []


@pytest.mark.parametrize(("stages", "tp", "device", "refused"), [
    (2, 1, "cpu", None),
    (2, 2, "cpu", None),
    (3, 1, "cpu", "pipeline parallelism of 3 stages"),
    (2, 1, "cuda", "not on cuda yet"),
])
def test_pipeline_parallelism_is_refused_at_start_where_not_recovered(stages, tp, device,
                                                                      refused):
    r = runner({}, Batch([], []))
    r.parallel_config = SimpleNamespace(pipeline_parallel_size=stages, tensor_parallel_size=tp)
    r.device = SimpleNamespace(type=device)
    if refused is None:
        check_supported(r)
        return
    with pytest.raises(FtkitError, match=refused):
        check_supported(r)


@pytest.mark.parametrize(("tp", "mode", "refused"), [
    (2, "VLLM_COMPILE", True), (2, "NONE", False), (1, "VLLM_COMPILE", False)])
def test_a_compiled_model_is_refused_where_ranks_share_collectives(tp, mode, refused):
    """Measured under vllm serve (vLLM compiles the model by default): a rank blocked in a
    collective inside the compiled graph is never stopped, and a peer's device reset ends the
    engine after the round's timeout. One rank has no collective to block in."""
    r = runner({}, Batch([], []))
    r.parallel_config = SimpleNamespace(tensor_parallel_size=tp)
    r.compilation_config = SimpleNamespace(mode=SimpleNamespace(name=mode), cudagraph_mode=None)
    if refused:
        with pytest.raises(FtkitError, match="enforce_eager=True; vllm serve --enforce-eager"):
            check_supported(r)
    else:
        check_supported(r)
