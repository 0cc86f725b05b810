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
    """The requests of one run ``run_id``, and what each has produced so far."""

    def __init__(self, run_id: str, prompts: list[str], sampling: SamplingSpec,
                 submit_after_steps: list[int] | None) -> None:
        self.run_id = run_id
        self.prompts = prompts
        self.sampling = sampling
        self.outputs = [RequestOutput(i, []) for i in range(len(prompts))]
        self.arrivals = list(submit_after_steps or [0] * len(prompts))
        if len(self.arrivals) != len(prompts):
            raise ValueError("submit_after_steps needs one entry per prompt")
        self.waiting = sorted(range(len(prompts)), key=lambda i: self.arrivals[i])
        self.prompt_token_ids: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        #: Engine steps run for this workload, and output tokens taken (of ``total``).
        self.steps = 0
        self.done = 0
        self.total = len(prompts) * sampling.max_tokens

    def params(self, index: int, max_tokens: int) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, ignore_eos=True,
            # One stream per request: the workload seed offset by the request index.
            seed=None if s.seed is None else s.seed + index)

    def submit_due(self, engine: Any) -> None:
        """Submit the requests whose arrival step has come (or all, if the engine idles)."""
        while self.waiting and (self.arrivals[self.waiting[0]] <= self.steps
                                or not engine.has_unfinished_requests()):
            i = self.waiting.pop(0)
            engine.add_request(request_id(self.run_id, i), self.prompts[i],
                               self.params(i, self.sampling.max_tokens))

    def take(self, out: Any, now: float) -> None:
        """Take one request output of an engine step (``now``: seconds since submission)."""
        ref = parse_request_id(out.request_id)
        if ref is None or ref.run_id != self.run_id:
            return
        req = self.outputs[ref.index]
        if ref.offset == 0 and out.prompt_token_ids is not None:
            self.prompt_token_ids.setdefault(ref.index, list(out.prompt_token_ids))
        completion = out.outputs[0]
        # A resumed request counts its tokens from where it resumed.
        new = list(completion.token_ids[len(req.token_ids) - ref.offset:])
        req.token_ids.extend(new)
        req.token_times.extend([now] * len(new))
        self.done += len(new)
        if out.finished:
            req.finish_reason = completion.finish_reason
            self.finished.add(ref.index)

    def resume(self, engine: Any) -> list[int]:
        """Submit every started, unfinished request again from where it stopped; return
        their indices."""
        from vllm.inputs import TokensPrompt

        resumed = []
        waiting = set(self.waiting)
        for req in self.outputs:
            i = req.index
            if i in self.finished or i in waiting:
                continue
            produced = len(req.token_ids)
            left = self.sampling.max_tokens - produced
            if left <= 0:
                self.finished.add(i)
                continue
            prompt_ids = self.prompt_token_ids.get(i)
            if produced == 0 or prompt_ids is None:
                engine.add_request(request_id(self.run_id, i), self.prompts[i],
                                   self.params(i, self.sampling.max_tokens))
            else:
                prompt = TokensPrompt(prompt_token_ids=prompt_ids + req.token_ids)
                engine.add_request(request_id(self.run_id, i, offset=produced), prompt,
                                   self.params(i, left))
            resumed.append(i)
        return resumed
