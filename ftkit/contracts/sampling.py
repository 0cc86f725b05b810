"""How the requests of a workload are sampled: ``SamplingSpec``, part of the engine job.

It lives apart from ``ftkit.contracts.job`` (which re-exports it) and imports nothing of ftkit,
so that the scenario format can build one (``Scenario.sampling_spec()``) and validate with it
while the job imports the scenario's ``EngineSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingSpec:
    """How the requests of a workload are sampled.

    ``max_tokens``, ``temperature``, ``top_p`` and ``seed`` are the scenario format's v1
    fields (``seed``: request *i* uses ``seed + i``). ``extra`` holds further fields of vLLM's
    ``SamplingParams`` for every request, by vLLM's own names (``repetition_penalty``,
    ``logprobs``, ``stop`` ...); ``requests`` holds, per request in order, the fields that
    request overrides (any ``SamplingParams`` field, the four above included; a request's own
    ``seed`` is used as given). Values are JSON types; ``for_request`` merges them.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    requests: tuple[dict[str, Any], ...] = ()

    def for_request(self, index: int) -> dict[str, Any]:
        """The keyword arguments of vLLM's ``SamplingParams`` for request ``index``.

        ftkit's workloads ignore the end-of-sequence token unless a field says otherwise
        (``ignore_eos: false``), so that every request runs to its ``max_tokens``.
        """
        kwargs: dict[str, Any] = {"max_tokens": self.max_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p,
                                  "ignore_eos": True}
        if self.seed is not None:
            kwargs["seed"] = self.seed + index
        kwargs.update(self.extra)
        if index < len(self.requests):
            kwargs.update(self.requests[index])
        if kwargs.get("logit_bias"):
            # JSON keys are strings (as the OpenAI API sends them); vLLM indexes logits by int.
            kwargs["logit_bias"] = {int(t): b for t, b in kwargs["logit_bias"].items()}
        return kwargs

    def to_mapping(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "extra": dict(self.extra),
                "requests": [dict(r) for r in self.requests]}

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> SamplingSpec:
        raw = dict(raw)
        raw["requests"] = tuple(dict(r) for r in raw.get("requests", ()))
        raw["extra"] = dict(raw.get("extra", {}))
        return cls(**raw)
