"""What one step changes in vLLM's V1 model runner, and how to put it back.

``GPUModelRunner`` (the CPU runner inherits it) keeps two views of every request: the
``CachedRequestState`` in ``runner.requests`` and a row of the persistent ``input_batch``.
``_update_states`` is not idempotent: it appends the step's new KV block ids to the request
state and to the block table, and registers new requests. Re-running a failed step without
undoing that corrupts tokens silently, later, whenever the step allocated blocks.

No record is taken before ``execute_model``: its scheduler output says everything
``_update_states`` changes: the requests it introduces (``scheduled_new_reqs``) and, for each
request it gives new KV blocks (``new_block_ids`` not ``None``, not resumed), the block ids it
appends. Those are the only lists ``_update_states`` appends to on the last pipeline stage
(every rank without pipeline parallelism): only ``sample_tokens`` appends output tokens there
(a test pins this). An earlier stage appends the tokens the last one sampled, from the
scheduler output's ``new_token_ids``, in ``_update_states``; idempotently (it appends only
what the request does not have yet), so a re-run appends nothing, and the tokens stay
through a rollback: they are the previous steps'. The fault-free step therefore pays nothing
here. Rollback, from the failed step's scheduler output,


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

A step whose sampling failed is re-run from its forward pass on every rank (see
``ftkit.recovery.step_wrapper``): vLLM's sampler applies penalties, logit bias, temperature and
top-k/top-p masks to the logits *in place*, and the fault may have hit them, so the logits are
neither kept nor sampled again. The sampling record therefore holds what sampling changes and a
forward pass does not recompute: the state of every generator the batch samples with (seeded
requests) and of the global generator (rows sampled randomly without a seed), the step's
scheduler output (a reference), and, only while some request asks for prompt logprobs, their
bookkeeping. On a greedy batch it costs no per-row work. ``rollback_sample`` restores the
generators and takes the step's sampled token off each request's output tokens, whether the
sampling failed or completed (a rank that already sampled the step, or went on to the next,
undoes it too): each request's output-token count before sampling is derived from the
scheduler output (``output_token_indices``: the tokens computed before the step plus those it
schedules, less the prompt). The persistent batch is not touched: the step's
``rollback_execute`` follows and empties it. A count the step cannot have produced is refused
loudly. A request that finished with the step is forgotten by the next step's
``_update_states``; its state is kept (a reference, through the runner's
``_on_request_state_removed`` hook) until the next sampling, so that undoing that next step
brings it back.

Supported: the V1 runner without asynchronous scheduling or speculative decoding, with at most
two pipeline stages; ``check_supported`` says so at start rather than corrupting a run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ftkit.errors import FtkitError
from ftkit.vllm.kv_recompute import KvRecompute, RecomputeReport, ResumedPrefill, empty_batch
from ftkit.vllm.resume import fast_forward


@dataclass(slots=True)
class SampleRecord:
    """What one ``sample_tokens`` changes that its step's forward pass does not recompute."""

    #: The scheduler output of the step being sampled (what each request's count derives from).
    scheduled: Any
    #: Each generator the batch samples with (seeded requests) and its state before sampling.
    generators: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()
    #: The default generator's state, when a row samples randomly without a seed of its own.
    global_rng: Any = None
    #: While some request asks for prompt logprobs: ``num_prompt_logprobs`` and each such
    #: request's partial prompt logprobs (sampling completes them and forgets both).
    prompt_logprobs: tuple[dict[str, int], dict[str, Any]] | None = None


def check_supported(runner: Any) -> None:
    """Refuse, at start, configurations whose step state this module cannot restore or whose
    collectives ftkit cannot stop; every problem names the setting that removes it (the
    Python engine argument, then the ``vllm serve`` flag or the environment variable)."""
    problems = config_problems(runner)
    if not hasattr(runner, "input_batch") or not hasattr(runner, "requests"):
        kind = type(runner)
        problems.append(f"model runner {kind.__module__}.{kind.__qualname__} is not vLLM's V1 "
                        "runner (on GPU vLLM defaults to its V2 runner: set the environment "
                        "variable VLLM_USE_V2_MODEL_RUNNER=0)")
    _refuse(problems)


def check_config(vllm_config: Any) -> None:
    """``check_supported``'s checks that a ``VllmConfig`` answers, as the worker is created
    (before the engine loads the model): a server started with settings recovery cannot
    handle does not start."""
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    view = SimpleNamespace(
        use_async_scheduling=getattr(scheduler, "async_scheduling", False),
        parallel_config=getattr(vllm_config, "parallel_config", None),
        speculative_config=getattr(vllm_config, "speculative_config", None),
        compilation_config=getattr(vllm_config, "compilation_config", None),
        device=device if hasattr(device, "type") else None)
    _refuse(config_problems(view))


def _ray_problems(stages: int) -> list[str]:
    """What ftkit does not recover on vLLM's Ray executor."""
    from vllm import envs

    problems = []
    if not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:
        problems.append("vLLM's older Ray executor is chosen (unset "
                        "VLLM_USE_RAY_V2_EXECUTOR_BACKEND, or set it to 1): its compiled graph "
                        "calls the model runner directly, past ftkit's step wrapper")
    if stages > 1:
        problems.append("pipeline parallelism runs on vLLM's Ray executor (use the "
                        "multi-process executor: distributed_executor_backend mp, or leave it "
                        "out): ftkit has not been tested with stages on Ray yet")
    return problems


def config_problems(runner: Any) -> list[str]:
    """What ``check_supported`` refuses that the configuration says (``runner``: a model
    runner, or anything with its configuration attributes)."""
    problems = []
    scheduler = getattr(runner, "scheduler_config", None)
    if getattr(runner, "use_async_scheduling", getattr(scheduler, "async_scheduling", False)):
        problems.append("asynchronous scheduling is on (set async_scheduling=False; "
                        "vllm serve --no-async-scheduling)")
    parallel = getattr(runner, "parallel_config", None)
    stages = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if stages > 2:
        problems.append(f"pipeline parallelism of {stages} stages is on (set "
                        f"pipeline_parallel_size=2, or 1; vllm serve with "
                        f"--pipeline-parallel-size 2 or without it): ftkit transfers "
                        f"activations between two stages only, yet")
    device = getattr(runner, "device", None)
    if stages > 1 and getattr(device, "type", "cpu") != "cpu":
        problems.append(f"pipeline parallelism is on (set pipeline_parallel_size=1; vllm "
                        f"serve without --pipeline-parallel-size): ftkit stops a stage's "
                        f"send/recv on vLLM's CPU build only, not on {device.type} yet")
    if getattr(parallel, "distributed_executor_backend", None) == "ray":
        problems += _ray_problems(stages)
    if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1:
        # (vLLM runs each replica of a dense model as an engine of its own, of data-parallel
        # size 1, which ftkit recovers like any engine: only coupled replicas get here.)
        problems.append("data parallelism of an MoE model is on (set data_parallel_size=1; "
                        "vllm serve without --data-parallel-size): its coupled replicas need "
                        "an all_gatherv that vLLM-CPU's communicator lacks, and ftkit's "
                        "rounds span one replica")
    if getattr(parallel, "enable_expert_parallel", False) is True:
        problems.append("expert parallelism is on (set enable_expert_parallel=False; vllm "
                        "serve without --enable-expert-parallel): vLLM-CPU's fused MoE kernel "
                        "ignores the expert map; without it the experts are sharded by tensor "
                        "parallelism, which ftkit recovers")
    if getattr(runner, "speculative_config", None) is not None:
        problems.append("speculative decoding is on (leave speculative_config unset; "
                        "vllm serve without --speculative-config)")
    device = getattr(runner, "device", None)
    compilation = getattr(runner, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if getattr(device, "type", None) == "cuda" and mode is not None \
            and getattr(mode, "name", str(mode)) != "NONE":
        problems.append("CUDA graphs are on (set enforce_eager=True; vllm serve "
                        "--enforce-eager): ftkit waits for every collective on the host, "
                        "which a captured graph cannot do")
    compiled = getattr(compilation, "mode", None)
    if int(getattr(parallel, "tensor_parallel_size", 1) or 1) > 1 and compiled is not None \
            and getattr(compiled, "name", str(compiled)) != "NONE":
        problems.append("the model runs compiled by torch.compile (set enforce_eager=True; "
                        "vllm serve --enforce-eager): a rank blocked in a collective inside "
                        "the compiled graph cannot be stopped, so a peer's fault there is not "
                        "recovered")
    return problems


def _refuse(problems: list[str]) -> None:
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
        self.resumed = ResumedPrefill(runner)
        #: The last two steps ``prepare`` gave out, each with the positions its passes compute
        #: before every attempt of it (a resumed request's prefill): the step in flight and
        #: the one before, which a round may still run again.
        self._planned: collections.deque[tuple[Any, list[Any]]] = collections.deque(maxlen=2)
        self.on_kv_recomputed = on_kv_recomputed
        self._fast_forwarded: dict[str, Any] = {}
        #: Whether passes must run before an attempt (``StepState.repair_pending``): lost KV
        #: to recompute, or a step with planned positions.
        self.repair_pending = False
        #: Request states that ``_update_states`` forgot since the last sampling (finished
        #: requests), so that ``rollback_execute`` can bring them back.
        self._forgotten: dict[str, Any] = {}
        self._on_removed: Callable[[str, Any], None] | None = getattr(
            runner, "_on_request_state_removed", None)
        if self._on_removed is not None:
            runner._on_request_state_removed = self._keep_removed

    def _keep_removed(self, req_id: str, state: Any) -> None:
        """vLLM's hook after it forgets a request state (``_update_states``)."""
        if state is not None:
            self._forgotten[req_id] = state
        assert self._on_removed is not None
        self._on_removed(req_id, state)

    # --- execute_model ----------------------------------------------------------------------

    def prepare(self, scheduler_output: Any) -> Any:
        """The step to run for ``scheduler_output``: itself, or a resumed request's prefill
        rewritten to compute as its lost engine did (``ResumedPrefill``)."""
        step, work = self.resumed.rewrite(scheduler_output)
        self._planned.append((step, work))
        self._update_pending()
        return step

    def _update_pending(self) -> None:
        self.repair_pending = bool(self.kv.lost) or any(work for _, work in self._planned)

    def rollback_execute(self, scheduler_output: Any) -> None:
        """Undo what ``execute_model(scheduler_output)`` changed, whether or not the failed
        attempt got as far as ``_update_states``: bring back the finished requests it forgot,
        forget the requests it introduced, take the KV block ids it appended off the end of
        each request's lists (in place), empty the batch."""
        runner = self.runner
        runner.execute_model_state = None
        requests = runner.requests
        forgotten = self._forgotten
        for req_id in scheduler_output.finished_req_ids:
            state = forgotten.pop(req_id, None)
            if state is not None and req_id not in requests:
                requests[req_id] = state
        for new in scheduler_output.scheduled_new_reqs:
            req_id = new.req_id
            state = requests.pop(req_id, None)
            runner.num_prompt_logprobs.pop(req_id, None)
            if state is not None and self._on_removed is not None:
                self._on_removed(req_id, state)
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
        self._update_pending()

    def pending_kv(self) -> tuple[int, ...]:
        """The KV blocks still to recompute (reported to a round: every rank agrees on them)."""
        return tuple(sorted(self.kv.lost))

    def before_attempt(self, scheduler_output: Any, call: Callable[[Any], Any]) -> None:
        """Before an attempt of ``execute_model``: recompute the lost KV the step reads, and
        compute the positions planned for the step (every attempt, on every rank alike)."""
        planned = next((work for step, work in self._planned if step is scheduler_output), [])
        lost = bool(self.kv.lost)
        try:
            report = (self.kv.compute(scheduler_output, call, planned) if planned
                      else self.kv.run(scheduler_output, call))
        finally:
            self._update_pending()
        if lost and report is not None and self.on_kv_recomputed is not None:
            self.on_kv_recomputed(report)

    # --- sample_tokens ----------------------------------------------------------------------

    def begin_sample(self, scheduler_output: Any) -> SampleRecord:
        runner = self.runner
        batch = runner.input_batch
        if self._forgotten:
            self._forgotten.clear()  # the step that forgot them can no longer be undone
        record = SampleRecord(scheduler_output)
        if batch.generators:
            # A request resumed after an engine death continues its seeded stream.
            fast_forward(runner, self._fast_forwarded)
            # (vLLM gives only randomly sampled rows a generator; seeded rows have one each.)
            record.generators = tuple((gen, gen.get_state())
                                      for gen in batch.generators.values())
        # ``random_reqs``: the rows that sample randomly (``all_greedy`` is its emptiness).
        if batch.random_reqs:
            record.global_rng = self.rng.get_rng_state()
        if runner.num_prompt_logprobs:
            record.prompt_logprobs = (dict(runner.num_prompt_logprobs), {
                req_id: getattr(runner.requests.get(req_id),
                                "in_progress_prompt_logprobs_cpu", None)
                for req_id in runner.num_prompt_logprobs})
        return record

    def rollback_sample(self, record: SampleRecord) -> None:
        """Undo ``sample_tokens``, failed or completed: generators, prompt-logprob
        bookkeeping, and the step's token off each request's output tokens. The step's
        ``rollback_execute`` must follow (it empties the batch, whose rows this leaves)."""
        runner = self.runner
        for gen, state in record.generators:
            gen.set_state(state)
        if record.global_rng is not None:
            self.rng.set_rng_state(record.global_rng)
        requests = runner.requests
        if record.prompt_logprobs is not None:
            counts, partial = record.prompt_logprobs
            runner.num_prompt_logprobs.update(counts)
            for req_id, tensors in partial.items():
                state = requests.get(req_id)
                if state is not None:
                    state.in_progress_prompt_logprobs_cpu = tensors
        # Output tokens of each request before this step sampled (a prompt chunk that does
        # not reach the prompt's end samples nothing and is left out).
        for req_id, num_output in self.output_token_indices(record.scheduled).items():
            state = requests.get(req_id)
            if state is None:
                continue
            output = state.output_token_ids
            if not 0 <= num_output <= len(output):
                raise FtkitError(
                    f"ftkit: cannot restore request {req_id}: its step started from "
                    f"{num_output} output tokens, but it has {len(output)} now; sampling no "
                    f"longer appends to the request's output tokens as this rollback expects")
            del output[num_output:]

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
