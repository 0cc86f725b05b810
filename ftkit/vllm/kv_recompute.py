"""Recompute KV cache blocks a fault destroyed, inside the worker, before the step re-runs.

After a device reset every KV block of the reset rank is lost; after a UCE in the KV cache,
the hit blocks are. The scheduler does not know: it goes on scheduling decodes that attend to
that KV. ``KvRecompute`` keeps the set of lost block ids (the same on every rank: it comes from
the round's decision) and, before each attempt of a step, finds the requests the step
schedules whose already-computed tokens lie in a lost block. For those it runs extra forward
passes that prefill their tokens again from position 0 (chunked to the runner's token and
request budgets), writing every KV slot anew, and drops the passes' logits. The passes
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
bit. A query of one token (a decode) is different: with
``VLLM_CPU_ATTN_SPLIT_KV`` on (vLLM's default) and more than one thread, the attention of a
one-token query is split between threads according to the rows of its batch, which changes its
rounding; the KV of tokens whose decode was split cannot be reproduced by a prefill, and the
logprobs that follow drift in their last bits. With the split off the recompute is exact.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Work:
    req_id: str
    #: Tokens whose KV must be written again: positions [0, tokens).
    tokens: int
    #: The scheduler's request data when the request is new in the step (a prefix-cache hit).
    new: Any = None
    #: Block ids that replace the request's, when it resumes from preemption in this step.
    resumed_blocks: Any = None


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
        if not self.lost:
            return None
        started = time.monotonic()
        work, seen = self._find_work(scheduler_output)
        passes = self._plan(work)
        rows = list(self.runner.input_batch.req_ids)
        for chunk in passes:
            call(self._synthesize(scheduler_output, chunk, work))
            self.runner.execute_model_state = None  # the passes' logits are not sampled
        if work:
            self._forget_new_requests(work)
            lay_out(self.runner, rows)
        for block_ids in seen:
            for ids in block_ids:
                self.lost.difference_update(ids)
        if not work:
            return None
        return RecomputeReport(len(work), sum(w.tokens for w in work), len(passes),
                               time.monotonic() - started)

    def _find_work(self, so: Any) -> tuple[list[_Work], list[Any]]:
        work: list[_Work] = []
        seen: list[Any] = []  # block id lists that are valid once this step runs
        for new in so.scheduled_new_reqs:
            seen.append(new.block_ids)
            if new.num_computed_tokens and self._hit(new.block_ids, new.num_computed_tokens):
                work.append(_Work(new.req_id, new.num_computed_tokens, new=new))
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
                work.append(_Work(req_id, computed, resumed_blocks=blocks if resumed else None))
        return work, seen

    def _plan(self, work: list[_Work]) -> list[dict[str, tuple[int, int]]]:
        """Passes of at most the runner's token and request budgets: req_id -> (start, n)."""
        budget = int(self.runner.max_num_tokens)
        max_reqs = int(self.runner.max_num_reqs)
        passes: list[dict[str, tuple[int, int]]] = []
        current: dict[str, tuple[int, int]] = {}
        room = budget
        for w in work:
            start = 0
            while start < w.tokens:
                if room == 0 or len(current) == max_reqs:
                    passes.append(current)
                    current, room = {}, budget
                n = min(room, w.tokens - start)
                current[w.req_id] = (start, n)
                start += n
                room -= n
        if current:
            passes.append(current)
        return passes

    def _synthesize(self, so: Any, chunk: dict[str, tuple[int, int]], work: list[_Work]) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        by_id = {w.req_id: w for w in work}
        new_reqs, cached = [], CachedRequestData.make_empty()
        for req_id, (start, n) in chunk.items():
            w = by_id[req_id]
            if w.new is not None and start == 0:
                new_reqs.append(dataclasses.replace(w.new, num_computed_tokens=0))
                continue
            state = self.runner.requests[req_id]
            resumes = w.resumed_blocks is not None and start == 0
            cached.req_ids.append(req_id)
            if resumes:
                cached.resumed_req_ids.add(req_id)
            cached.new_block_ids.append(w.resumed_blocks if resumes else None)
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
