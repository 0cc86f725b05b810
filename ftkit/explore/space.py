"""The space ``ftkit explore`` searches: scenarios as Hypothesis strategies.

A generated scenario is a plain JSON-able mapping in the scenario format (version 1.1), drawn
by ``scenarios(space)``: the tensor parallel size, the workload's requests and their sampling
features, the engine features, and one to three faults (kind, rank, phase, the token they hit,
the attempts they fail, the kind's params). Every choice is drawn so that Hypothesis shrinks
it towards the simpler scenario: fewer requests, fewer tokens, fewer faults, no feature
(greedy sampling on the default engine), the lower tensor parallel size, the cheaper kind,
rank 0, the forward phase, one failing attempt.

Features are named (``FEATURES``); a campaign may restrict them, the kinds, the phases and
the tensor parallel sizes (``ExploreSpace``). ``features_of`` reads the features back from a
mapping, for the coverage table and for a shrunk failure's report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from ftkit.errors import FtkitError
from ftkit.faults import FaultKind
from ftkit.scenario.prompts import WORDS, SplitMix64

#: The workload and engine features a generated scenario may turn on (a shrunk scenario
#: keeps only those its failure needs).
FEATURES: dict[str, str] = {
    "seeded": "random sampling (temperature, top_p, top_k, min_p) with a seed per request",
    "penalties": "repetition, frequency and presence penalties",
    "logit_bias": "a bias on a few token ids",
    "stop": "stop strings, stop token ids and min_tokens",
    "n": "two completions of every request (n = 2, seeded sampling)",
    "logprobs": "top-k logprobs of every output token, prompt logprobs",
    "lengths": "requests of different lengths (their own max_tokens)",
    "prefix": "requests that share a prefix longer than a KV block (prefix caching is on by "
              "default)",
    "chunked": "chunked prefill (on by default) with a budget of only 32 tokens a step; "
               "greedy only (vLLM's CPU build cannot chunk a seeded request's prefill)",
    "preempt": "a KV cache of 8 blocks, small enough that vLLM preempts requests",
    "compound": "two or three faults in one run, possibly at the same step",
}
#: The phases a fault fires in, simplest first.
PHASES: tuple[str, ...] = ("forward", "before", "sample")
#: Kinds with how often they are drawn, the cheapest first (a shrunk fault moves towards it).
#: Link faults need a peer (tensor parallel 2 or more); a killed process costs an engine
#: restart, a hang its operator timeout: they are drawn less often.
KIND_WEIGHTS: dict[FaultKind, int] = {
    FaultKind.OOM: 12,
    FaultKind.UCE: 16,
    FaultKind.DEVICE_RESET: 12,
    FaultKind.LINK_BREAK: 8,
    FaultKind.LINK_FLAP: 8,
    FaultKind.HANG: 3,
    # A kill costs an engine restart of about 20 s (and an engine with processes of its
    # own): one generated scenario in about fifty.
    FaultKind.PROCESS_KILL: 1,
}
#: Not drawn: they need vLLM's Ray executor, and the search's engines run the multi-process
#: one (a Ray cluster's start and a node's restart would cost each scenario half a minute).
NOT_SEARCHED: dict[FaultKind, str] = {
    FaultKind.RAY_WORKER_KILL: "needs vLLM's Ray executor",
    FaultKind.NODE_LOSS: "needs vLLM's Ray executor",
}
_NEEDS_A_PEER = {FaultKind.LINK_BREAK, FaultKind.LINK_FLAP}
#: The most requests and output tokens of a generated workload. Damage to a request's block
#: table shows only once it reaches its next KV block: 64 tokens span two blocks of 32.
MAX_REQUESTS = 4
MAX_TOKENS = 64
MIN_TOKENS = 4
#: Attempts one generated fault fails at most.
MAX_REINFERENCE = 3
#: Recovery's re-runs of a step in generated scenarios. Faults that hit one step fail its
#: attempts one after the other (two faults at one step are common: requests decode side by
#: side), so three faults may need three times three re-runs; every generated scenario
#: expects its faults to be recovered. One value for all: at tensor parallel 2 it is part of
#: the engine's configuration (vLLM's execute timeout is raised for it).
RECOVERY_REINFERENCE = 3 * MAX_REINFERENCE
#: The operator timeout of a generated hang: short, a hang costs it on every failing attempt.
HANG_TIMEOUT_S = 0.5
#: Short letter sequences that the tiny model's output contains now and then.
STOP_STRINGS = ("er", "an", "th", "in", "ou", "st")
#: The tiny model's vocabulary has about 512 tokens; ids drawn below this exist.
TOKEN_ID_LIMIT = 500
#: KV block size of generated engines (the scenario format's default).
BLOCK_SIZE = 32
#: KV cache blocks of a generated engine without the ``preempt`` feature.
KV_BLOCKS = 128
#: Words of a shared prefix: more than one KV block of 32 tokens (the tiny model's tokenizer
#: makes two or three tokens of a word).
PREFIX_WORDS = 16


@dataclass(frozen=True)
class ExploreSpace:
    """What a campaign may draw from. Each field keeps its order: the first entry is the one
    shrinking moves towards."""

    tp: tuple[int, ...] = (1,)
    kinds: tuple[FaultKind, ...] = tuple(KIND_WEIGHTS)
    features: tuple[str, ...] = tuple(FEATURES)
    phases: tuple[str, ...] = PHASES
    #: Drawn kinds keep their relative weights (``KIND_WEIGHTS``).
    weights: dict[FaultKind, int] = field(default_factory=lambda: dict(KIND_WEIGHTS))
    #: The number of tokens the model's tokenizer makes of a prompt (special tokens included),
    #: or None: with it, a third of the faults hit the step where their request starts a new
    #: KV block (``Campaign`` gives the model's).
    prompt_tokens: Callable[[str], int] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.tp or any(t < 1 for t in self.tp):
            raise FtkitError(f"--tp takes tensor parallel sizes of 1 or more, not {self.tp}")
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise FtkitError(f"unknown feature(s) {', '.join(unknown)}: the features are "
                             f"{', '.join(FEATURES)}")
        bad_phases = [p for p in self.phases if p not in PHASES]
        if bad_phases or not self.phases:
            raise FtkitError(f"unknown phase(s) {', '.join(bad_phases) or '(none given)'}: "
                             f"the phases are {', '.join(PHASES)}")
        if not self.kinds:
            raise FtkitError("no fault kind to explore")
        if max(self.tp) < 2 and set(self.kinds) <= _NEEDS_A_PEER:
            raise FtkitError(f"{', '.join(map(str, self.kinds))} need a peer rank: add "
                             f"--tp 2")
        object.__setattr__(self, "tp", tuple(sorted(set(self.tp))))
        object.__setattr__(self, "kinds", tuple(k for k in KIND_WEIGHTS if k in self.kinds))
        object.__setattr__(self, "features", tuple(f for f in FEATURES if f in self.features))

    def kinds_for(self, tp: int) -> list[FaultKind]:
        return [k for k in self.kinds if tp > 1 or k not in _NEEDS_A_PEER]

    def describe(self) -> dict[str, Any]:
        return {"tp": list(self.tp), "kinds": [str(k) for k in self.kinds],
                "features": list(self.features), "phases": list(self.phases)}


def parse_kinds(text: str | Sequence[str] | None) -> tuple[FaultKind, ...]:
    """``"uce,oom"`` (or a sequence of names) as kinds; every searched kind when empty."""
    names = _names(text)
    if not names:
        return tuple(KIND_WEIGHTS)
    kinds = []
    for name in names:
        try:
            kind = FaultKind(name)
        except ValueError:
            raise FtkitError(f"unknown fault kind {name!r}: the kinds are "
                             f"{', '.join(k.value for k in KIND_WEIGHTS)}") from None
        if kind in NOT_SEARCHED:
            raise FtkitError(f"fault kind {name!r} is not searched: it {NOT_SEARCHED[kind]}, "
                             f"and explore's engines run vLLM's multi-process executor; "
                             f"write a scenario for it (docs/faults.md)")
        kinds.append(kind)
    return tuple(kinds)


def parse_names(text: str | Sequence[str] | None, known: Sequence[str], what: str
                ) -> tuple[str, ...]:
    """``"a,b"`` as names among ``known``; all of them when empty."""
    names = _names(text)
    if not names:
        return tuple(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise FtkitError(f"unknown {what} {', '.join(unknown)}: the {what}s are "
                         f"{', '.join(known)}")
    return tuple(names)


def _names(text: str | Sequence[str] | None) -> list[str]:
    if text is None:
        return []
    parts = text.split(",") if isinstance(text, str) else list(text)
    return [p.strip() for p in parts if p.strip()]


def model_prompt_tokens(model: str = "tiny") -> Callable[[str], int]:
    """``ExploreSpace.prompt_tokens`` for ``model`` (generated scenarios run the tiny model):
    its tokenizer's count, special tokens included, as vLLM's tokenizer counts them."""
    from tokenizers import Tokenizer

    from ftkit.model.tiny import resolve_model

    tokenizer = Tokenizer.from_file(str(resolve_model(model) / "tokenizer.json"))
    return lambda prompt: len(tokenizer.encode(prompt).ids)


# --- the strategy ---------------------------------------------------------------------------

def _prompt(words: int, seed: int) -> str:
    rng = SplitMix64(seed)
    return " ".join(WORDS[rng.below(len(WORDS))] for _ in range(words))


@st.composite
def scenarios(draw: st.DrawFn, space: ExploreSpace) -> dict[str, Any]:
    """One scenario mapping (without its name) drawn from ``space``."""
    has = {f: f in space.features and _drawn(draw, f) for f in FEATURES}
    engine_features = [f for f in _ENGINE if f in space.features]
    if engine_features:
        pick = draw(st.integers(0, 3 + len(engine_features)))
        if pick >= 4:
            has[engine_features[pick - 4]] = True
    if has["chunked"]:
        # vLLM's CPU build fails a seeded request whose prefill is chunked, without ftkit
        # too ("CPU Generator does not use offset", in its sampler's bookkeeping of a
        # partial prefill): with chunked prefill, requests are sampled greedily.
        has["seeded"] = has["n"] = False
    tp = draw(st.sampled_from(space.tp))
    n_requests = draw(st.integers(1, MAX_REQUESTS))
    max_tokens = draw(st.integers(MIN_TOKENS, MAX_TOKENS))

    # The faults first: a fault's position is drawn before the prompts, so that shrinking the
    # workload does not move every choice of the faults.
    faults = [_fault(draw, space, tp, n_requests, max_tokens)]
    if has["compound"]:
        for _ in range(draw(st.integers(1, 2))):
            same_step = draw(st.booleans())
            faults.append(_fault(draw, space, tp, n_requests, max_tokens,
                                 at=faults[0]["at"] if same_step else None))
    kills = [f for f in faults if f["kind"] == FaultKind.PROCESS_KILL.value]
    if len(kills) > 1:  # one engine restart per run is enough to search; more cost time
        faults = [f for f in faults if f not in kills[1:]]

    workload = _workload(draw, has, n_requests, max_tokens)
    for fault in faults:
        request = workload["requests"][fault["at"]["request"]]
        length = request["sampling"].get("max_tokens", max_tokens)
        if fault["at"].pop("edge", False) and space.prompt_tokens is not None:
            edge = new_block_token(space.prompt_tokens(request["prompt"]))
            if edge < length:
                fault["at"]["token"] = edge
        # A request's own max_tokens may be below the token drawn for it.
        fault["at"]["token"] = min(fault["at"]["token"], length - 1)

    # vLLM turns prefix caching and chunked prefill on by default; the engine features are
    # a budget small enough to chunk prompts, and a small KV cache.
    # A KV cache of 128 blocks (4096 tokens) holds any generated workload: an engine then
    # needs about 1 GB less memory than with vLLM's CPU default of 1 GiB of KV cache, and a
    # campaign keeps more of them between scenarios.
    engine: dict[str, Any] = {"tensor_parallel_size": tp,
                              "args": {"num_gpu_blocks_override": KV_BLOCKS}}
    if has["chunked"]:
        engine["args"]["max_num_batched_tokens"] = 32
    if has["preempt"]:
        # 8 blocks of 32 tokens, 7 usable: a sequence (at most about 110 tokens here) fits,
        # several growing ones do not fit together.
        engine.update(max_model_len=192)
        engine["args"]["num_gpu_blocks_override"] = 8
    return {
        "engine": engine,
        "workload": workload,
        "recovery": {"enabled": True, "max_reinference": RECOVERY_REINFERENCE},
        "faults": faults,
        "expect": {"outcome": "recovered", "tokens": "identical",
                   "timeout_s": 240.0},
    }


#: Compound faults are drawn one time in four.
_RARE = {"compound"}
#: The engine features: each is an engine configuration of its own (two engines to start
#: and keep: plain and with ftkit, about 25 s each at tensor parallel 2), so a scenario has
#: at most one of them, one time in six each.
_ENGINE = ("chunked", "preempt")


def _drawn(draw: st.DrawFn, feature: str) -> bool:
    if feature in _ENGINE:
        return False  # drawn together, below
    if feature in _RARE:
        return draw(st.integers(0, 3)) == 3
    return draw(st.booleans())


def new_block_token(prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """The output token whose step first writes a request's next KV block: the step that
    computes output token *t* (from 1) writes the KV of position ``prompt_tokens + t - 1``."""
    return 1 + (-prompt_tokens) % block_size


def _fault(draw: st.DrawFn, space: ExploreSpace, tp: int, n_requests: int, max_tokens: int,
           at: dict[str, Any] | None = None) -> dict[str, Any]:
    kinds = space.kinds_for(tp)
    if not kinds:  # only link faults asked for, at tensor parallel 1: the simplest other kind
        kinds = [FaultKind.OOM]
    weights = [space.weights[k] for k in kinds]
    pick = draw(st.integers(0, sum(weights) - 1))
    for kind, weight in zip(kinds, weights):
        if pick < weight:
            break
        pick -= weight
    fault: dict[str, Any] = {"kind": kind.value}
    ranks: list[int | str] = list(range(tp)) + (["all"] if tp > 1 else [])
    fault["rank"] = draw(st.sampled_from(ranks))
    if at is None:
        at = {"request": draw(st.integers(0, n_requests - 1)),
              "token": draw(st.integers(0, max_tokens - 1))}
        if space.prompt_tokens is not None:
            # One fault in three at the step where its request starts a new KV block (the
            # step that changes the request's block table: its rollback matters). The token
            # is known once the prompt is.
            at["edge"] = draw(st.integers(0, 2)) == 2
    fault["at"] = dict(at)
    fault["phase"] = draw(st.sampled_from(space.phases))
    if kind is FaultKind.PROCESS_KILL:
        fault["times"] = 1
        fault["params"] = {"target": draw(st.sampled_from(["rank", "engine"]))}
    elif kind is FaultKind.LINK_FLAP:
        fault["times"] = draw(st.integers(2, MAX_REINFERENCE))
    else:
        fault["times"] = draw(st.integers(1, MAX_REINFERENCE))
    if kind is FaultKind.UCE:
        region = draw(st.sampled_from(["activation", "kv", "weights"]))
        fault["params"] = {"region": region}
        if region == "kv" and fault["phase"] == "before":
            fault["at"]["token"] = max(1, fault["at"]["token"])  # a KV block exists by then
    elif kind is FaultKind.HANG:
        fault["params"] = {"op_timeout_s": HANG_TIMEOUT_S}
    return fault


def _workload(draw: st.DrawFn, has: dict[str, bool], n_requests: int,
              max_tokens: int) -> dict[str, Any]:
    prompt_seed = draw(st.integers(0, 2**16))
    prefix = _prompt(PREFIX_WORDS, prompt_seed ^ 0x5EED) + " " if has["prefix"] else ""
    requests = []
    for i in range(n_requests):
        words = draw(st.integers(3, 12))
        requests.append({"prompt": prefix + _prompt(words, prompt_seed * 31 + i),
                         "sampling": {}})
    workload: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens,
                                "temperature": 0.0, "sampling": {}}
    sampling = workload["sampling"]
    if has["seeded"] or has["n"]:
        workload["temperature"] = draw(st.sampled_from([0.8, 1.0, 0.5]))
        workload["top_p"] = draw(st.sampled_from([1.0, 0.9]))
        workload["seed"] = draw(st.integers(0, 1000))
        if draw(st.booleans()):
            sampling["top_k"] = draw(st.integers(5, 50))
        if draw(st.booleans()):
            sampling["min_p"] = draw(st.sampled_from([0.05, 0.1]))
    if has["n"]:
        sampling["n"] = 2
    if has["penalties"]:
        sampling["repetition_penalty"] = draw(st.sampled_from([1.3, 1.1, 0.9]))
        sampling["frequency_penalty"] = draw(st.sampled_from([0.0, 0.5, -0.5]))
        sampling["presence_penalty"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    if has["logit_bias"]:
        tokens = draw(st.lists(st.integers(0, TOKEN_ID_LIMIT), min_size=1, max_size=3,
                               unique=True))
        sampling["logit_bias"] = {str(t): draw(st.sampled_from([5.0, -5.0, 2.0, -100.0]))
                                  for t in tokens}
    if has["stop"]:
        # On one request, so that the others run to their max_tokens beside it.
        target = requests[draw(st.integers(0, n_requests - 1))]["sampling"]
        target["stop"] = [draw(st.sampled_from(STOP_STRINGS))]
        target["include_stop_str_in_output"] = draw(st.booleans())
        if draw(st.booleans()):
            target["stop_token_ids"] = [draw(st.integers(0, TOKEN_ID_LIMIT))]
            target["min_tokens"] = draw(st.integers(0, 3))
    if has["logprobs"]:
        sampling["logprobs"] = draw(st.sampled_from([1, 2, 5]))
        if draw(st.booleans()):
            sampling["prompt_logprobs"] = draw(st.sampled_from([0, 1, 3]))
    if has["lengths"]:
        for request in requests:
            request["sampling"]["max_tokens"] = draw(st.integers(MIN_TOKENS, max_tokens))
    return workload


# --- reading a mapping back -----------------------------------------------------------------

def features_of(raw: dict[str, Any]) -> list[str]:
    """The features a scenario mapping turns on, in ``FEATURES`` order (a scenario written by
    hand is read the same way)."""
    workload, engine = raw.get("workload", {}), raw.get("engine", {})
    args = engine.get("args", {})
    requests = workload.get("requests") or []
    per_request = [r.get("sampling", {}) for r in requests]
    every = [dict(workload.get("sampling", {}), **own) for own in per_request] or \
        [workload.get("sampling", {})]
    prompts = [r.get("prompt", "") for r in requests]
    found = {
        "seeded": workload.get("temperature", 0) > 0 or any(
            s.get("temperature", 0) > 0 for s in per_request),
        "penalties": any(k in s for s in every for k in
                         ("repetition_penalty", "frequency_penalty", "presence_penalty")),
        "logit_bias": any(s.get("logit_bias") for s in every),
        "stop": any(s.get("stop") or s.get("stop_token_ids") for s in every),
        "n": any(s.get("n", 1) > 1 for s in every),
        "logprobs": any(s.get("logprobs") is not None or s.get("prompt_logprobs") is not None
                        for s in every),
        "lengths": any("max_tokens" in s for s in per_request),
        "prefix": len(prompts) > 1 and len(_common_prefix(prompts).split()) >= PREFIX_WORDS,
        "chunked": args.get("max_num_batched_tokens", 2048) <= 256,
        "preempt": args.get("num_gpu_blocks_override", KV_BLOCKS) < KV_BLOCKS,
        "compound": len(raw.get("faults", [])) > 1,
    }
    return [name for name in FEATURES if found[name]]


def _common_prefix(texts: list[str]) -> str:
    first, last = min(texts), max(texts)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]
