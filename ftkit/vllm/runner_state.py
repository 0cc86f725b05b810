"""What one step changes in vLLM's V1 model runner, and how to put it back.

``GPUModelRunner`` (the CPU runner inherits it) keeps two views of every request: the
``CachedRequestState`` in ``runner.requests`` and a row of the persistent ``input_batch``.
``_update_states`` is not idempotent: it appends the step's new KV block ids to the request
state and to the block table, and registers new requests. Re-running a failed step without
undoing that corrupts tokens silently, later, whenever the step allocated blocks.

No record is taken before ``execute_model``: its scheduler output says everything
``_update_states`` changes: the requests it introduces (``scheduled_new_reqs``) and, for each
request it gives new KV blocks (``new_block_ids`` not ``None``, not resumed), the block ids it
appends. Those are the only lists ``_update_states`` appends to on the last pipeline stage,
which is every rank ftkit supports (``check_supported`` refuses pipeline parallelism): it
appends output tokens only on earlier stages, and only ``sample_tokens`` appends them otherwise
(a test pins this). The fault-free step therefore pays nothing here. Rollback, from the failed
step's scheduler output,


* takes the step's block ids off the end of those lists *in place* (vLLM shares them between
  views: identity must survive), where the attempt appended them: blocks given to a request
  are new to it, so its list ends with them exactly when they were appended,
* forgets requests the step introduced,
* empties the persistent batch (``reset_batch``), so that the re-run's ``_update_states``
  re-adds every request from the restored request states, the same path vLLM takes for a
  request that was not scheduled for a step. The batch rows are rebuilt from the request
  states (prompt + output tokens, block ids, generator), which are the source of truth.
  Every rank empties its batch before its first step after a recovery round, whether it
  rolled a step back or not, so that all ranks lay the batch out the same way.

For sampling, the record holds the step's ``execute_model_state`` (``sample_tokens`` clears it
before it samples), the state of every generator the batch samples with (seeded requests) and
of the global generator, the batch's row map and the step's scheduler output (references, no
copies: on a greedy batch the record costs no per-row work), so that a re-sample draws the same
tokens. Each request's output-token count before sampling is derived from the scheduler output
at rollback (``output_token_indices``: the tokens computed before the step plus those it
schedules, less the prompt), and its row's ``num_tokens_no_spec`` restored to prompt + output
tokens. vLLM keeps its rows in place while it samples and keeps ``num_tokens_no_spec = prompt
+ output tokens`` before it samples; a test pins both on real steps, and rollback refuses
loudly a row map that was replaced or a count the step cannot have produced.
When any request samples randomly, the logits are copied too: the sampler divides them by the
temperature and masks them for top-k/top-p *in place*, so a re-sample from the same tensor would
draw from a different distribution. Greedy batches need no copy (argmax is unaffected).

Supported: the V1 runner without asynchronous scheduling, speculative decoding or pipeline
parallelism; ``check_supported`` says so at start rather than corrupting a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ftkit.errors import FtkitError
from ftkit.vllm.kv_recompute import KvRecompute, RecomputeReport, empty_batch
from ftkit.vllm.resume import fast_forward


@dataclass(slots=True)
class SampleRecord:
    execute_model_state: Any
    #: The batch's rows: request id -> row (``req_id_to_index`` itself; sampling does not
    #: change it).
    rows: dict[str, int]
    #: The scheduler output of the step being sampled (what each row's count derives from).
    scheduled: Any
    #: What random sampling needs to draw the same tokens again (``None`` when greedy).
    random: _RandomState | None = None


@dataclass(slots=True)
class _RandomState:
    #: A pristine copy of the logits.
    logits: torch.Tensor | None
    generator_states: dict[int, torch.Tensor]
    global_rng: torch.Tensor | None


def check_supported(runner: Any) -> None:
    """Refuse, at start, configurations whose step state this module cannot restore or whose
    collectives ftkit cannot stop; every problem names the setting that removes it (the
    Python engine argument, then the ``vllm serve`` flag or the environment variable)."""
    problems = []
    scheduler = getattr(runner, "scheduler_config", None)
    if getattr(runner, "use_async_scheduling", getattr(scheduler, "async_scheduling", False)):
        problems.append("asynchronous scheduling is on (set async_scheduling=False; "
                        "vllm serve --no-async-scheduling)")
    parallel = getattr(runner, "parallel_config", None)
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
        problems.append("pipeline parallelism is on (set pipeline_parallel_size=1; "
                        "vllm serve without --pipeline-parallel-size)")
    if getattr(runner, "speculative_config", None) is not None:
        problems.append("speculative decoding is on (leave speculative_config unset; "
                        "vllm serve without --speculative-config)")
    if not hasattr(runner, "input_batch") or not hasattr(runner, "requests"):
        kind = type(runner)
        problems.append(f"model runner {kind.__module__}.{kind.__qualname__} is not vLLM's V1 "
                        "runner (on GPU vLLM defaults to its V2 runner: set the environment "
                        "variable VLLM_USE_V2_MODEL_RUNNER=0)")
    device = getattr(runner, "device", None)
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    if getattr(device, "type", None) == "cuda" and mode is not None \
            and getattr(mode, "name", str(mode)) != "NONE":
        problems.append("CUDA graphs are on (set enforce_eager=True; vllm serve "
                        "--enforce-eager): ftkit waits for every collective on the host, "
                        "which a captured graph cannot do")
    if problems:
        raise FtkitError("ftkit recovery does not support this vLLM configuration: "
                         + "; ".join(problems))


class _HostRng:
    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)


class V1RunnerState:
    """``StepState`` for vLLM's V1 ``GPUModelRunner`` and its subclasses.

    ``rng``: where the default generator of the runner's device lives (the backend's
    ``get_rng_state`` / ``set_rng_state``); the host generator when not given.
    """

    def __init__(self, runner: Any, rng: Any = None,
                 on_kv_recomputed: Callable[[RecomputeReport], None] | None = None) -> None:
        check_supported(runner)
        self.runner = runner
        self.rng = rng or _HostRng()
        self.kv = KvRecompute(runner)
        self.on_kv_recomputed = on_kv_recomputed
        self._fast_forwarded: dict[str, Any] = {}
        #: Whether lost KV waits to be recomputed (``StepState.repair_pending``).
        self.repair_pending = False

    # --- execute_model ----------------------------------------------------------------------

    def rollback_execute(self, scheduler_output: Any) -> None:
        """Undo what ``execute_model(scheduler_output)`` changed, whether or not the failed
        attempt got as far as ``_update_states``: forget the requests it introduced, take the
        KV block ids it appended off the end of each request's lists (in place), empty the
        batch."""
        runner = self.runner
        runner.execute_model_state = None
        requests = runner.requests
        for new in scheduler_output.scheduled_new_reqs:
            req_id = new.req_id
            state = requests.pop(req_id, None)
            runner.num_prompt_logprobs.pop(req_id, None)
            if state is not None and hasattr(runner, "_on_request_state_removed"):
                runner._on_request_state_removed(req_id, state)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            # A resumed request's block ids are replaced wholesale (by the re-run too).
            if new_block_ids is None or req_id in resumed:
                continue
            state = requests.get(req_id)
            if state is None:
                continue
            for ids, added in zip(state.block_ids, new_block_ids):
                # Blocks given to a request are new to it: its list ends with them exactly
                # when the attempt appended them.
                n = len(added)
                if n and ids[-n:] == list(added):
                    del ids[-n:]
        self.reset_batch()

    def reset_batch(self) -> None:
        """Empty the persistent batch; the next step re-adds its rows from the request states.

        Tensor-parallel ranks must lay their batches out identically: the flattened tokens
        of a step are summed position by position in every all-reduce. A rank that rolled a
        step back and one that did not reach it would otherwise order their rows differently
        (vLLM fills the holes a step leaves in the order of its own history). From an empty
        batch, ``_update_states`` adds the step's requests in the order of the scheduler
        output, which is the same on every rank. Cost: one re-add of each running request,
        once per recovery.
        """
        empty_batch(self.runner.input_batch)

    # --- device state a fault destroyed -----------------------------------------------------

    def mark_kv_lost(self, blocks: Iterable[int] = (), *, all_blocks: bool = False) -> None:
        """Record KV blocks whose contents are gone (every block after a device reset)."""
        self.kv.mark_lost(blocks, all_blocks=all_blocks)
        self.repair_pending = bool(self.kv.lost)

    def before_attempt(self, scheduler_output: Any, call: Callable[[Any], Any]) -> None:
        """Before an attempt of ``execute_model``: recompute the lost KV the step reads."""
        if not self.kv.lost:
            self.repair_pending = False
            return
        try:
            report = self.kv.run(scheduler_output, call)
        finally:
            self.repair_pending = bool(self.kv.lost)
        if report is not None and self.on_kv_recomputed is not None:
            self.on_kv_recomputed(report)

    # --- sample_tokens ----------------------------------------------------------------------

    def begin_sample(self, scheduler_output: Any) -> SampleRecord:
        runner = self.runner
        batch = runner.input_batch
        if batch.generators:
            # A request resumed after an engine death continues its seeded stream.
            fast_forward(runner, self._fast_forwarded)
        state = runner.execute_model_state
        record = SampleRecord(state, batch.req_id_to_index, scheduler_output)
        # ``random_reqs``: the rows that sample randomly (``all_greedy`` is its emptiness).
        sampled_randomly = bool(batch.random_reqs)
        # (vLLM gives only randomly sampled rows a generator; seeded rows have one each.)
        if sampled_randomly or batch.generators:
            logits = getattr(state, "logits", None) if sampled_randomly and state is not None \
                else None
            record.random = _RandomState(
                logits.clone() if logits is not None else None,
                {index: gen.get_state() for index, gen in batch.generators.items()},
                self.rng.get_rng_state() if sampled_randomly else None)
        return record

    def rollback_sample(self, record: SampleRecord) -> None:
        runner = self.runner
        batch = runner.input_batch
        state = record.execute_model_state
        random = record.random
        if random is not None:
            if random.logits is not None and state is not None:
                # Hand out a copy: the saved one must stay pristine for a further retry.
                state = state._replace(logits=random.logits.clone())
            for index, gen_state in random.generator_states.items():
                batch.generators[index].set_state(gen_state)
            if random.global_rng is not None:
                self.rng.set_rng_state(random.global_rng)
        runner.execute_model_state = state
        if batch.req_id_to_index is not record.rows:
            raise FtkitError("ftkit: cannot restore the sampled tokens: the batch's rows "
                             "changed during sampling (vLLM no longer keeps them in place)")
        # Output tokens of each request before this step sampled (a prompt chunk that does
        # not reach the prompt's end samples nothing and is left out).
        before = self.output_token_indices(record.scheduled)
        requests = runner.requests
        for req_id, index in record.rows.items():
            num_output = before.get(req_id)
            state = requests.get(req_id)
            if num_output is None or state is None:
                continue
            output = state.output_token_ids
            if not 0 <= num_output <= len(output):
                raise FtkitError(
                    f"ftkit: cannot restore request {req_id}: its step started from "
                    f"{num_output} output tokens, but it has {len(output)} now; sampling no "
                    f"longer appends to the request's output tokens as this rollback expects")
            del output[num_output:]
            batch.num_tokens_no_spec[index] = state.num_prompt_tokens + num_output

    # --- what a step computes ---------------------------------------------------------------

    def output_token_indices(self, scheduler_output: Any) -> dict[str, int]:
        """For each request this step completes a token of: the index of that output token.

        Index 0 is the token sampled after the prompt (prefill). A chunk of a prompt that does
        not reach its end computes no output token and is left out.
        """
        result: dict[str, int] = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids or ())
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            if done >= prompt:
                result[new.req_id] = done - prompt
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.runner.requests.get(req_id)
            if state is None:
                continue
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            if done >= state.num_prompt_tokens:
                result[req_id] = done - state.num_prompt_tokens
        return result
