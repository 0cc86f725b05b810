"""The requests of one ``EngineSession.generate`` call: what was submitted, what each produced.

A ``Workload`` submits its requests to a vLLM ``LLMEngine`` (all at once, or staggered by
engine steps), takes each step's outputs into per-request token streams with their times, and,
after an engine restart, submits every unfinished request again from where it stopped
(``ftkit.vllm.resume`` says why that continues the stream exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftkit.contracts.job import EngineRestart, SamplingSpec
from ftkit.contracts.requests import parse_request_id, request_id
from ftkit.results import RequestOutput


@dataclass
class GenerateResult:
    requests: list[RequestOutput]
    error: str | None
    generate_s: float
    #: ``time.time()`` when the workload was submitted (token times count from here).
    started_at: float | None = None
    #: One entry per engine restart after one of the engine's processes died.
    restarts: list[EngineRestart] = field(default_factory=list)


class Workload:
    """The requests of one run ``run_id``, and what each of their completions has produced."""

    def __init__(self, run_id: str, prompts: list[str], sampling: SamplingSpec,
                 submit_after_steps: list[int] | None) -> None:
        self.run_id = run_id
        self.prompts = prompts
        self.sampling = sampling
        #: vLLM's ``SamplingParams`` keyword arguments of each request.
        self.request_params = [sampling.for_request(i) for i in range(len(prompts))]
        #: One output per completion: request ``i`` has ``n`` of them (samples 0 .. n-1).
        self.outputs = [RequestOutput(i, [], sample=j)
                        for i, kw in enumerate(self.request_params)
                        for j in range(int(kw.get("n") or 1))]
        self._by_key = {o.key: o for o in self.outputs}
        self.arrivals = list(submit_after_steps or [0] * len(prompts))
        if len(self.arrivals) != len(prompts):
            raise ValueError("submit_after_steps needs one entry per prompt")
        self.waiting = sorted(range(len(prompts)), key=lambda i: self.arrivals[i])
        self.prompt_token_ids: dict[int, list[int]] = {}
        #: For each resumed completion, the detokenizer its original request would have had,
        #: fed the whole stream (``_Shadow``): the text and the stop strings of the joined
        #: stream, as a request that was never resumed gets them.
        self._shadows: dict[tuple[int, int], _Shadow] = {}
        #: Engine request ids to abort after this step's outputs (a resumed request whose
        #: joined stream reached a stop string).
        self.to_abort: list[str] = []
        self.finished: set[int] = set()
        #: Engine steps run for this workload, and output tokens taken (of ``total``).
        self.steps = 0
        self.done = 0
        self.total = sum(int(kw["max_tokens"]) * int(kw.get("n") or 1)
                         for kw in self.request_params)

    def params(self, index: int, produced: int = 0, sample: int | None = None) -> Any:
        """vLLM's ``SamplingParams`` of request ``index``; for a request resumed after
        ``produced`` output tokens, the budgets that count output tokens (``max_tokens``,
        ``min_tokens``) count what is left, no prompt logprobs are asked for, and its stop
        strings are left to its ``_Shadow``. With ``sample``, those of that one completion
        alone, as vLLM gives each completion of a request with ``n > 1`` (its seed, if any,
        plus ``sample``). The sampled tokens' logprobs are always asked for: the oracle
        compares them."""
        from vllm import SamplingParams

        kwargs = dict(self.request_params[index])
        if sample is not None:
            kwargs["n"] = 1
            if kwargs.get("seed") is not None:
                kwargs["seed"] = int(kwargs["seed"]) + sample
        if produced:
            kwargs["max_tokens"] = int(kwargs["max_tokens"]) - produced
            if kwargs.get("min_tokens"):
                kwargs["min_tokens"] = max(0, int(kwargs["min_tokens"]) - produced)
            # Its prompt's logprobs were taken before the restart (and its prompt now ends
            # with what it produced).
            kwargs.pop("prompt_logprobs", None)
            # vLLM would look for them only in the text produced after the resume.
            kwargs.pop("stop", None)
        if kwargs.get("logprobs") is None:
            kwargs["logprobs"] = 0
        return SamplingParams(**kwargs)

    def submit_due(self, engine: Any) -> None:
        """Submit the requests whose arrival step has come (or all, if the engine idles)."""
        while self.waiting and (self.arrivals[self.waiting[0]] <= self.steps
                                or not engine.has_unfinished_requests()):
            i = self.waiting.pop(0)
            engine.add_request(request_id(self.run_id, i), self.prompts[i], self.params(i))

    def take(self, out: Any, now: float) -> None:
        """Take one request output of an engine step (``now``: seconds since submission)."""
        ref = parse_request_id(out.request_id)
        if ref is None or ref.run_id != self.run_id:
            return
        if ref.offset == 0 and out.prompt_token_ids is not None:
            self.prompt_token_ids.setdefault(ref.index, list(out.prompt_token_ids))
        finished = bool(out.finished)
        for completion in out.outputs:
            # (A resumed completion of a request with n > 1 is a request of its own.)
            req = self._by_key[(ref.index, ref.sample + completion.index)]
            if ref.offset == 0 and req.prompt_logprobs is None \
                    and getattr(out, "prompt_logprobs", None) is not None:
                req.prompt_logprobs = [None if p is None else _position(p)
                                       for p in out.prompt_logprobs]
            # A resumed request counts its tokens from where it resumed.
            start = len(req.token_ids) - ref.offset
            new = list(completion.token_ids[start:])
            finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
            text = completion.text
            shadow = self._shadows.get(req.key)
            if shadow is not None:
                stopped_at = shadow.take(new, finish_reason, stop_reason)
                if stopped_at is not None:
                    # The joined stream ends with a stop string: where the original request
                    # would have stopped.
                    new = new[:stopped_at]
                    finish_reason, stop_reason = "stop", shadow.stop_string
                    if not finished:
                        self.to_abort.append(out.request_id)
                        finished = True
                text = shadow.text()
            req.token_ids.extend(new)
            req.token_times.extend([now] * len(new))
            self._take_logprobs(req, completion.logprobs, start, len(new))
            self.done += len(new)
            if finished or finish_reason is not None:
                req.finish_reason = finish_reason
                req.stop_reason = stop_reason
                req.text = text
        if finished:
            samples = self.samples(ref.index)
            if len(samples) == 1 or all(o.finish_reason is not None for o in samples):
                self.finished.add(ref.index)

    def samples(self, index: int) -> list[RequestOutput]:
        """The completions of request ``index`` (``n`` of them)."""
        return [o for o in self.outputs if o.index == index]

    def _take_logprobs(self, req: RequestOutput, logprobs: Any, start: int, count: int) -> None:
        if logprobs is None or count == 0:
            return
        wanted = int(self.request_params[req.index].get("logprobs") or 0)
        positions = [_position(p) for p in logprobs[start:start + count]]
        sampled = req.token_ids[len(req.token_ids) - count:]
        if req.logprobs is None:
            req.logprobs = []
        req.logprobs.extend(_logprob_of(p, token) for p, token in zip(positions, sampled))
        if wanted > 0:
            if req.top_logprobs is None:
                req.top_logprobs = []
            req.top_logprobs.extend(positions)

    def resume(self, engine: Any) -> list[int]:
        """Submit every started, unfinished request again from where it stopped; return
        their indices. Each unfinished completion of a request with ``n > 1`` goes on as a
        request of its own, as vLLM runs each completion (``<sample>_<id>``)."""
        resumed = []
        waiting = set(self.waiting)
        for i in range(len(self.prompts)):
            if i in self.finished or i in waiting:
                continue
            samples = self.samples(i)
            if all(not o.token_ids for o in samples) or i not in self.prompt_token_ids:
                # Nothing produced yet: the request starts again as it was.
                engine.add_request(request_id(self.run_id, i), self.prompts[i], self.params(i))
                resumed.append(i)
                continue
            going_on = False
            for req in samples:
                if req.finish_reason is None:
                    going_on |= self._resume_sample(engine, req, len(samples) > 1)
            if going_on:
                resumed.append(i)
            else:
                self.finished.add(i)
        return resumed

    def _resume_sample(self, engine: Any, req: RequestOutput, several: bool) -> bool:
        """Submit completion ``req`` again from its tokens so far; ``False`` if it had none
        left to produce."""
        from vllm.inputs import TokensPrompt

        i, produced = req.index, len(req.token_ids)
        if int(self.request_params[i]["max_tokens"]) - produced <= 0:
            return False
        sample = req.sample if several else None
        rid = request_id(self.run_id, i, offset=produced, sample=sample)
        prompt_ids = self.prompt_token_ids[i]
        if produced:
            self._shadows[req.key] = _Shadow(engine.get_tokenizer(), prompt_ids,
                                             self.params(i, sample=sample), req.token_ids)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids + req.token_ids),
                           self.params(i, produced, sample))
        return True


class _Shadow:
    """The detokenizer a resumed request's original request would have had.

    vLLM's front end detokenizes each request incrementally from its prompt and looks for its
    stop strings in the text as it grows. A resumed request's own detokenizer starts from a
    prompt that ends with the tokens already produced: its text covers only what follows
    the resume, and a stop string that straddles the restart is never seen. The shadow is
    vLLM's own detokenizer for the original prompt and sampling parameters, fed the tokens
    produced before the restart and then each new one: its text and its stop strings are
    those of a request that never died.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: Any,
                 produced: list[int]) -> None:
        from types import SimpleNamespace

        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        request = SimpleNamespace(request_id="ftkit-shadow", prompt_token_ids=list(prompt_ids),
                                  prompt_embeds=None, sampling_params=params)
        self._detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        # Those tokens reached no stop string before the restart (the request went on).
        self._detokenizer.update(list(produced), False)
        self.stop_string: str | None = None

    def take(self, new: list[int], finish_reason: str | None,
             stop_reason: int | str | None) -> int | None:
        """Feed the resumed request's new tokens; returns how many of them the original
        request keeps when they complete a stop string (``None`` otherwise)."""
        before = self._detokenizer.num_output_tokens()
        # A stop token (or end of sequence) ended the engine's request: vLLM leaves it out of
        # the text, as for any request.
        stop_terminated = finish_reason == "stop" and not isinstance(stop_reason, str)
        self.stop_string = self._detokenizer.update(new, stop_terminated)
        if self.stop_string is None:
            return None
        return self._detokenizer.num_output_tokens() - before

    def text(self) -> str:
        return self._detokenizer.get_next_output_text(finished=True, delta=False)

    def visible_text(self, finished: bool) -> str:
        """The text a streaming client of the original request has been sent by now: all of
        it once finished, else without the end that could still begin a stop string."""
        return self._detokenizer.get_next_output_text(finished=finished, delta=False)


def _position(logprobs: Any) -> list[list[Any]]:
    """One position's ``{token id: Logprob}`` as ``[token id, logprob]`` pairs, in vLLM's
    order."""
    return [[int(token), float(lp.logprob)] for token, lp in logprobs.items()]


def _logprob_of(position: list[list[Any]], token: int) -> float:
    for tok, logprob in position:
        if tok == token:
            return logprob
    raise ValueError(f"vLLM returned no logprob for the sampled token {token}")
