"""Recompute KV cache blocks a fault destroyed, inside the worker, before the step re-runs.

After a device reset every KV block of the reset rank is lost; after a UCE in the KV cache,
the hit blocks are. The scheduler does not know: it goes on scheduling decodes that attend to
that KV. ``KvRecompute`` keeps the set of lost block ids (the same on every rank: it comes from
the round's decision) and, before each attempt of a step, finds the requests the step
schedules whose already-computed tokens lie in a lost block. For those it runs extra forward
passes that compute their tokens again from position 0, writing every KV slot anew, and drops
the passes' logits: the prompt as a prefill (chunked to the runner's token and request
budgets), then each position the request had decoded in a pass of one token per request, as
its decode steps computed it (see ``_plan``). ``ResumedPrefill`` uses the same passes for a
resumed request's prefill. The passes
reshape vLLM's persistent batch; its rows are then put back in the order vLLM had them
(``lay_out``), and the real step runs on them as it would have without the fault: the order
of the rows is part of what a step computes (see ``lay_out``).

The passes are forward steps like any other: on every tensor-parallel rank, with the same
synthesized scheduler outputs in the same order, so the ranks' collectives stay paired. A fault
during a pass fails the attempt like a fault in the step itself; the lost set is only cleared
once the passes succeeded.

Blocks become valid again when a request that owns them is recomputed, or when a request that
needed no recompute is scheduled with them (blocks allocated after the loss are written before
they are read). Blocks nobody owns stay marked: a request that later hits them through the
prefix cache (a new request, or one resumed after preemption) is recomputed too. The
fault-free path pays one emptiness check per step.

Exactness: on vLLM's CPU backend the attention of a query of several tokens (a prefill) does
not depend on the rest of the batch, so KV first written by prefills is recomputed bit for
bit, and so is the KV of a decode, by a one-token pass, as long as its attention was not split:
with ``VLLM_CPU_ATTN_SPLIT_KV`` on (vLLM's default) and more than one thread, the attention of
a one-token query is split between threads according to the rows of its batch, which changes
its rounding, and the passes do not have the decode's batch; the logprobs that follow drift in
their last bits. With the split off the recompute is exact.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ftkit.contracts.requests import resumed_offset


@dataclass
class _Work:
    req_id: str
    #: Tokens whose KV must be written: positions [start, tokens).
    tokens: int
    #: The leading positions the request's first computation prefilled (its prompt, less the
    #: tokens a resumed request had produced); the others were each decoded alone.
    prefilled: int
    start: int = 0
    #: The scheduler's request data when the request is new in the step (a prefix-cache hit).
    new: Any = None
    #: Block ids that replace the request's, when it resumes from preemption in this step.
    resumed_blocks: Any = None
    #: Block ids the step appends to the request's (a later chunk of its prefill): the first
    #: pass appends them, and they are taken off again after the passes, for the step.
    added_blocks: Any = None


@dataclass
class RecomputeReport:
    requests: int
    tokens: int
    passes: int
    seconds: float


class KvRecompute:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.lost: set[int] = set()

    # --- what is lost -----------------------------------------------------------------------

    def mark_lost(self, blocks: Iterable[int] = (), *, all_blocks: bool = False) -> None:
        if all_blocks:
            self.lost = set(range(int(self.runner.kv_cache_config.num_blocks)))
        else:
            self.lost.update(blocks)

    def _block_sizes(self) -> list[int]:
        groups = self.runner.kv_cache_config.kv_cache_groups
        return [int(g.kv_cache_spec.block_size) for g in groups]

    def _hit(self, block_ids: Any, tokens: int) -> bool:
        for ids, size in zip(block_ids, self._block_sizes()):
            if any(b in self.lost for b in ids[: math.ceil(tokens / size)]):
                return True
        return False

    # --- before an attempt ------------------------------------------------------------------

    def run(self, scheduler_output: Any, call: Callable[[Any], Any]) -> RecomputeReport | None:
        """Recompute the lost KV of the step's requests; ``None`` when nothing was lost."""
        return self.compute(scheduler_output, call, [])

    def compute(self, scheduler_output: Any, call: Callable[[Any], Any],
                planned: list[_Work]) -> RecomputeReport | None:
        """Recompute the lost KV of the step's requests, and compute the ``planned``
        positions (``ResumedPrefill``); ``None`` when there was nothing to compute."""
        if not self.lost and not planned:
            return None
        started = time.monotonic()
        work, seen = self._find_work(scheduler_output) if self.lost else ([], [])
        if planned:  # a planned request that also lost KV is computed from position 0
            lost_ids = {w.req_id for w in work}
            planned_ids = {p.req_id for p in planned}
            work = [w for w in work if w.req_id not in planned_ids] + [
                dataclasses.replace(p, start=0) if p.req_id in lost_ids else p
                for p in planned]
        passes = self._plan(work)
        rows = list(self.runner.input_batch.req_ids)
        for chunk in passes:
            call(self._synthesize(scheduler_output, chunk, work))
            self.runner.execute_model_state = None  # the passes' logits are not sampled
        if work:
            self._forget_new_requests(work)
            self._take_off_added_blocks(work)
            lay_out(self.runner, rows)
        for block_ids in seen:
            for ids in block_ids:
                self.lost.difference_update(ids)
        if not work:
            return None
        return RecomputeReport(len(work), sum(w.tokens - w.start for w in work), len(passes),
                               time.monotonic() - started)

    def _find_work(self, so: Any) -> tuple[list[_Work], list[Any]]:
        work: list[_Work] = []
        seen: list[Any] = []  # block id lists that are valid once this step runs
        for new in so.scheduled_new_reqs:
            seen.append(new.block_ids)
            if new.num_computed_tokens and self._hit(new.block_ids, new.num_computed_tokens):
                work.append(_Work(new.req_id, new.num_computed_tokens,
                                  _prefilled(new.req_id, new.prompt_token_ids,
                                             new.prompt_embeds), new=new))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.runner.requests.get(req_id)
            if state is None:
                continue
            computed = cached.num_computed_tokens[i]
            resumed = req_id in cached.resumed_req_ids
            blocks = cached.new_block_ids[i] if resumed else state.block_ids
            seen.append(blocks)
            if not resumed and cached.new_block_ids[i] is not None:
                seen.append(cached.new_block_ids[i])
            if computed and self._hit(blocks, computed):
                work.append(_Work(req_id, computed,
                                  _prefilled(req_id, state.prompt_token_ids, state.prompt_embeds),
                                  resumed_blocks=blocks if resumed else None))
        return work, seen

    def _plan(self, work: list[_Work]) -> list[dict[str, tuple[int, int]]]:
        """The passes, each req_id -> (start, n): first the positions each request's first
        computation prefilled, in passes of at most the runner's token and request budgets;
        then the positions it decoded, one token per request and pass, as its decode steps
        computed them. The attention of a query sums the softmax over the context in tiles
        whose size depends on the query's rows (vLLM's CPU attention, past about a thousand
        tokens of context): a prefill of a decoded position would compute its KV in other
        bits than the decode step did."""
        budget = int(self.runner.max_num_tokens)
        max_reqs = int(self.runner.max_num_reqs)
        passes: list[dict[str, tuple[int, int]]] = []
        current: dict[str, tuple[int, int]] = {}
        room = budget
        for w in work:
            start, end = w.start, min(w.tokens, w.prefilled)
            while start < end:
                if room == 0 or len(current) == max_reqs:
                    passes.append(current)
                    current, room = {}, budget
                n = min(room, end - start)
                current[w.req_id] = (start, n)
                start += n
                room -= n
        if current:
            passes.append(current)
        first_decoded = {w.req_id: max(w.start, w.prefilled) for w in work}
        decoded = [w for w in work if w.tokens > first_decoded[w.req_id]]
        width = min(budget, max_reqs)
        for step in range(max((w.tokens - first_decoded[w.req_id] for w in decoded), default=0)):
            rows = [w for w in decoded if first_decoded[w.req_id] + step < w.tokens]
            for first in range(0, len(rows), width):
                passes.append({w.req_id: (first_decoded[w.req_id] + step, 1)
                               for w in rows[first:first + width]})
        return passes

    def _synthesize(self, so: Any, chunk: dict[str, tuple[int, int]], work: list[_Work]) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        by_id = {w.req_id: w for w in work}
        new_reqs, cached = [], CachedRequestData.make_empty()
        for req_id, (start, n) in chunk.items():
            w = by_id[req_id]
            if w.new is not None and start == w.start:
                new_reqs.append(dataclasses.replace(w.new, num_computed_tokens=start))
                continue
            state = self.runner.requests[req_id]
            first = start == w.start
            resumes = w.resumed_blocks is not None and first
            cached.req_ids.append(req_id)
            if resumes:
                cached.resumed_req_ids.add(req_id)
            cached.new_block_ids.append(w.resumed_blocks if resumes
                                        else w.added_blocks if first else None)
            cached.num_computed_tokens.append(start)
            cached.num_output_tokens.append(len(state.output_token_ids))
        groups = len(self.runner.kv_cache_config.kv_cache_groups)
        return dataclasses.replace(
            so,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={req_id: n for req_id, (_, n) in chunk.items()},
            total_num_scheduled_tokens=sum(n for _, n in chunk.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
            preempted_req_ids=set(),
            num_common_prefix_blocks=[0] * groups,
            new_block_ids_to_zero=None,
            kv_cache_block_copies=None,
            has_structured_output_requests=False,
            pending_structured_output_tokens=False,
        )

    def _take_off_added_blocks(self, work: list[_Work]) -> None:
        # The step appends them itself (``_update_states``), as the scheduler sent it.
        for w in work:
            state = self.runner.requests.get(w.req_id)
            if w.added_blocks is None or state is None:
                continue
            for ids, added in zip(state.block_ids, w.added_blocks):
                if added:
                    del ids[-len(added):]

    def _forget_new_requests(self, work: list[_Work]) -> None:
        # The step itself introduces them; it must find them unknown, as the scheduler sent it.
        runner = self.runner
        for w in work:
            if w.new is None:
                continue
            state = runner.requests.pop(w.req_id, None)
            runner.num_prompt_logprobs.pop(w.req_id, None)
            if state is not None and hasattr(runner, "_on_request_state_removed"):
                runner._on_request_state_removed(w.req_id, state)


class ResumedPrefill:
    """A resumed request's prefill, computed the way its first engine computed those tokens.

    A request resumed after an engine death (``ftkit.vllm.resume``) comes back with the tokens
    it had produced at the end of its prompt, and vLLM prefills them. Its lost engine had
    decoded them, one query token per step. vLLM's CPU attention sums a query's softmax over
    the context in tiles whose size depends on the query's rows: past about a thousand tokens
    of context, a prefill computes those positions' KV, and the logprobs after them, in other
    bits than the decodes did (measured: a kill at token 1500 drifted in the last bits).

    ``rewrite`` changes a step that prefills more than one position at or after a resumed
    request's first decoded one: the step computes only the last scheduled position, a
    one-token query as the decode that would have followed, and ``work`` says which positions
    ``KvRecompute.compute`` computes before it, in passes of its own: the rest of the prompt as a
    prefill, each decoded position alone. The scheduler is not told: the step computes the
    tokens it scheduled, and samples where it would have.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        #: Resumed requests whose prefill is chunked and not finished: id -> prefilled.
        self._prefilling: dict[str, int] = {}

    def rewrite(self, so: Any) -> tuple[Any, list[_Work]]:
        """The step to run instead of ``so``, and the positions to compute before it."""
        work: list[_Work] = []
        counts = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            offset = resumed_offset(new.req_id)
            if offset:
                length = _prompt_length(new.prompt_token_ids, new.prompt_embeds)
                item = self._plan(new.req_id, new.num_computed_tokens, counts[new.req_id],
                                  length - offset, length)
                if item is not None:
                    work.append(dataclasses.replace(item, new=new))
        cached = so.scheduled_cached_reqs
        if self._prefilling:
            for req_id in so.finished_req_ids:
                self._prefilling.pop(req_id, None)
            for i, req_id in enumerate(cached.req_ids):
                prefilled = self._prefilling.get(req_id)
                state = self.runner.requests.get(req_id)
                if prefilled is None or state is None:
                    continue
                length = _prompt_length(state.prompt_token_ids, state.prompt_embeds)
                item = self._plan(req_id, cached.num_computed_tokens[i], counts[req_id],
                                  prefilled, length)
                if item is not None:
                    work.append(dataclasses.replace(item, added_blocks=cached.new_block_ids[i]))
        if not work:
            return so, work
        last = {w.req_id: w.tokens for w in work}  # the position each one's step computes
        counts = {req_id: 1 if req_id in last else n for req_id, n in counts.items()}
        return dataclasses.replace(
            so,
            scheduled_new_reqs=[
                dataclasses.replace(new, num_computed_tokens=last[new.req_id])
                if new.req_id in last else new for new in so.scheduled_new_reqs],
            scheduled_cached_reqs=dataclasses.replace(cached, num_computed_tokens=[
                last.get(req_id, n) for req_id, n in zip(cached.req_ids,
                                                         cached.num_computed_tokens)]),
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values())), work

    def _plan(self, req_id: str, computed: int, scheduled: int, prefilled: int,
              length: int) -> _Work | None:
        end = computed + scheduled
        if end < length:
            self._prefilling[req_id] = prefilled
        else:
            self._prefilling.pop(req_id, None)
        if scheduled < 2 or end <= prefilled:
            return None  # one query token, or only prompt positions: as the first engine did
        return _Work(req_id, end - 1, prefilled, start=computed)


def _prompt_length(prompt_token_ids: Any, prompt_embeds: Any) -> int:
    return len(prompt_token_ids) if prompt_token_ids is not None else len(prompt_embeds)


def _prefilled(req_id: str, prompt_token_ids: Any, prompt_embeds: Any) -> int:
    return _prompt_length(prompt_token_ids, prompt_embeds) - resumed_offset(req_id)


def empty_batch(batch: Any) -> None:
    """Remove every row of vLLM's persistent input batch (request states stay)."""
    for req_id in list(batch.req_id_to_index):
        batch.remove_request(req_id)
    batch.condense()


def lay_out(runner: Any, req_ids: Iterable[str]) -> None:
    """Rebuild the persistent batch with one row per request, in the order of ``req_ids``,
    from the request states.

    The order of the rows is part of what a step computes: vLLM's CPU attention splits a
    decode row's KV between threads according to the rows of the batch
    (``VLLM_CPU_ATTN_SPLIT_KV``), which changes the row's rounding. A step that finds the rows
    where vLLM left them computes the bits the fault-free run computed; rows re-added in the
    scheduler's order may not."""
    batch = runner.input_batch
    empty_batch(batch)
    for req_id in req_ids:
        batch.add_request(runner.requests[req_id])
    # Hand the changes to the logits processors and start the step's bookkeeping afresh, as
    # vLLM does after each ``_update_states``: the step then removes the rows it does not
    # schedule (vLLM refuses a removal after it read the step's removals).
    batch.refresh_metadata()
