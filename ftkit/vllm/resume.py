"""Request resumption after an engine death: no token lost, none duplicated.

A killed worker or engine core cannot take part in a recovery round: nothing of the engine is
left to roll back. ``EngineSession.generate`` then starts a new engine and submits every
unfinished request again as a *resumed request*: its prompt is the original prompt's token ids
followed by the tokens it had already produced, its budget the tokens still to produce, and its
id ``ftkit:<run>:<index>+<offset>`` says how many tokens it had (``offset``). Greedy requests
then continue exactly: the workers compute the re-prefill's decoded positions one token per
pass, as the lost engine's decode steps did (``ftkit.vllm.kv_recompute.ResumedPrefill``), and
its last step computes the logits the lost decode step would have.
What counts output tokens is adjusted (``max_tokens`` and ``min_tokens`` count what is left),
and the front end detokenizes the joined stream with the original request's detokenizer
(``ftkit.vllm.workload``): the finished text and the stop strings, one straddling the kill
included, are those of a request that never died. Features a resumed request cannot continue
exactly yet are refused at validation (``ftkit.scenario.rules``).

Seeded sampling continues the same random stream too. vLLM gives a seeded request a generator
seeded with its seed, and sampling advances it by the same draws for every token. The host
keeps what is needed to rebuild it (the seed, in the sampling params, and the offset, in the
request id); the worker fast-forwards a resumed request's new generator by replaying the
sampler's draws for ``offset`` tokens before it samples the request's first resumed token
(``fast_forward``). Replaying the sampler itself, rather than a copy of its arithmetic, keeps
this right for whichever sampling path the platform uses.

Frequency and presence penalties count a token only among a request's output tokens, and a
multi-token bad word is matched against its output tokens: a resumed request's earlier tokens
are prompt tokens on the new engine, so vLLM would miss them. ftkit's engines show the sampler
each resumed row's output as the lost engine had it, its earlier tokens (the end of its prompt)
followed by the new ones (``show_earlier_outputs``). The repetition penalty counts prompt and
output tokens alike, so the view changes nothing for it.

A resumed prompt is longer than the original one, and may no longer fit the step's token
budget: its prefill is then chunked, and vLLM samples a token for each partial chunk too, to
discard it. For a seeded request vLLM then rewinds the request's generator by its offset,
which only CUDA's generators have: on a CPU generator that raises and ends the engine. ftkit's
engines take such rows' generators out of the batch while the step samples
(``park_discarded_generators``): their draws come from the global generator, as for an
unseeded row, the discarded token does not matter, and the request's own stream advances only
for the tokens it keeps, which is what rewinding achieves on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ftkit.contracts.requests import resumed_offset

log = logging.getLogger("ftkit")


def fast_forward(runner: Any, done: dict[str, Any]) -> list[str]:
    """Advance the generator of every resumed, seeded request in the batch to where the lost
    engine had left it. ``done`` maps request ids to the generator object already advanced
    (a re-run of the resumed request's first step creates a new one). Returns the ids
    advanced now."""
    batch = runner.input_batch
    for req_id in [r for r in done if r not in runner.requests]:
        del done[req_id]  # finished: its generator is gone
    advanced = []
    for index, req_id in enumerate(batch.req_ids):
        gen = batch.generators.get(index)
        if gen is None or done.get(req_id) is gen:
            continue
        offset = _resumed_offset(req_id)
        if offset == 0:
            continue
        _replay_draws(runner, gen, offset)
        done[req_id] = gen
        advanced.append(req_id)
    return advanced


def show_earlier_outputs(runner: Any) -> None:
    """Make ``runner``'s sampler see, for every resumed row, the output tokens the lost engine
    had produced before its own: vLLM's penalties and bad words then act as on a request that
    was never resumed. Rows of requests never resumed, and steps with neither penalties nor
    bad words, are left as vLLM has them."""
    sampler = getattr(runner, "sampler", None)
    inner = getattr(sampler, "apply_logits_processors", None)
    if inner is None:
        log.warning("ftkit: this runner's sampler has no apply_logits_processors; a request "
                    "resumed after an engine death is penalised for its new tokens only")
        return

    def apply_logits_processors(logits: Any, sampling_metadata: Any, *args: Any,
                                **kwargs: Any) -> Any:
        if not sampling_metadata.no_penalties or sampling_metadata.bad_words_token_ids:
            outputs = earlier_outputs(runner, sampling_metadata.output_token_ids)
            if outputs is not None:
                sampling_metadata = dataclasses.replace(sampling_metadata,
                                                        output_token_ids=outputs)
        return inner(logits, sampling_metadata, *args, **kwargs)

    sampler.apply_logits_processors = apply_logits_processors


def earlier_outputs(runner: Any, outputs: list[list[int]]) -> list[list[int]] | None:
    """``outputs`` (each batch row's output tokens) with each resumed row's earlier tokens in
    front; ``None`` when the batch has no resumed row."""
    view = None
    for row, req_id in enumerate(runner.input_batch.req_ids):
        offset = _resumed_offset(req_id)
        request = runner.requests.get(req_id) if offset else None
        if request is None or row >= len(outputs):
            continue
        if view is None:
            view = list(outputs)
        view[row] = list(request.prompt_token_ids[-offset:]) + list(outputs[row])
    return view


@functools.lru_cache(maxsize=4096)
def _resumed_offset(req_id: str) -> int:
    return resumed_offset(req_id)


def park_discarded_generators(runner: Any) -> dict[int, Any] | None:
    """Before a step samples: take out of the batch the generators of the rows whose sampled
    token vLLM discards (a partial prefill chunk), so that vLLM neither draws from them nor
    rewinds them; ``None`` when there are none. ``restore_generators`` puts them back."""
    batch = getattr(runner, "input_batch", None)  # (not yet, or not a V1 runner)
    generators = getattr(batch, "generators", None)
    if not generators or next(iter(generators.values())).device.type != "cpu":
        return None  # (CUDA's generators can be rewound)
    mask = getattr(runner, "discard_request_mask", None)
    if mask is None:
        return None
    discarded = mask.np[:batch.num_reqs]
    parked = {index: generators.pop(index) for index in list(generators)
              if index < len(discarded) and discarded[index]}
    return parked or None


def restore_generators(runner: Any, parked: dict[int, Any] | None) -> None:
    """Put back the generators ``park_discarded_generators`` took out."""
    if parked:
        runner.input_batch.generators.update(parked)


def parking_discarded_generators(runner: Any, sample: Callable[[Any], Any]
                                 ) -> Callable[[Any], Any]:
    """``sample`` (the worker's ``sample_tokens``) with the generators of the rows whose token
    is discarded parked while it runs."""
    def sample_tokens(grammar_output: Any) -> Any:
        parked = park_discarded_generators(runner)
        try:
            return sample(grammar_output)
        finally:
            restore_generators(runner, parked)

    return sample_tokens


def _replay_draws(runner: Any, gen: torch.Generator, tokens: int) -> None:
    vocab = int(runner.model_config.get_vocab_size())
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=runner.device)
    sampler = runner.sampler.topk_topp_sampler
    # The sampler may also draw from the global generator (for unseeded rows): leave it as
    # it was, so that fast-forwarding changes nothing but this request's stream.
    saved = torch.get_rng_state()
    try:
        for _ in range(tokens):
            sampler(logits.clone(), {0: gen}, None, None)
    finally:
        torch.set_rng_state(saved)
