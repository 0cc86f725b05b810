"""The scenario format, version 1.1, as strict pydantic models.

Field names, meanings and defaults are a contract that tools outside ftkit rely on; see
``scenarios/link_flap.yaml`` for a complete example. Version 1.1 adds the request features
(``workload.sampling``, ``workload.requests``, ``expect.logprob_tolerance``) and keeps every
version 1 field and meaning: a version 1 file is a valid version 1.1 file. What a caller may
rely on:

* Every model forbids unknown keys and validates strictly: no string-to-number coercion,
  and a bool is not a number (integers are accepted where a float is expected).
* A ``Scenario`` that exists has passed both the type checks and the semantic rules of
  ``ftkit.scenario.rules`` (a fault's rank exists, its token is computed, its kind is
  implemented ...). Constructing one that breaks a rule raises ``ScenarioErrors`` whose
  errors carry field paths; ``load_scenario`` adds the file and line numbers.
* ``Scenario.prompts()`` is the concrete prompt list and ``sampling_spec()`` how each
  request is sampled (the job's ``SamplingSpec``); ``engine_key()`` and ``workload_key()``
  are plain JSON-able dicts holding everything that decides the fault-free tokens, for cache
  keys (serialise them with ``sort_keys=True``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ftkit.contracts.sampling import SamplingSpec
from ftkit.errors import ScenarioError
from ftkit.faults import FaultKind
from ftkit.scenario import rules
from ftkit.scenario.errors import Loc, ScenarioErrors, format_loc, parse_field
from ftkit.scenario.prompts import random_prompts

#: The format's version, ``"major.minor"``: a file of an older minor version of the same
#: major version is valid in this one.
FORMAT_VERSION = "1.1"
NAME_PATTERN = r"^[a-z0-9_-]+$"

Phase = Literal["before", "forward", "sample"]
Outcome = Literal["recovered", "failed"]
TokenExpectation = Literal["identical", "prefix"]
#: The dtypes vLLM's ``--dtype`` accepts.
Dtype = Literal["auto", "float32", "float", "float16", "half", "bfloat16"]
#: How a scenario drives its engine: ``offline`` (vLLM's ``LLM`` in an engine host) or
#: ``serve`` (vLLM's OpenAI server with ftkit's plugin, driven by streaming clients).
EngineMode = Literal["offline", "serve"]
#: The OpenAI API a serve scenario's clients call.
ServeApi = Literal["completions", "chat"]


def _one_rank_error(value: Any, handler: Any) -> Any:
    # A union reports one error per member ("not an int", "not 'all'"): say it once.
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("rank", 'rank must be an integer >= 0 or "all"') from None


Rank = Annotated[
    Union[Annotated[int, Field(ge=0)], Literal["all"]],
    WrapValidator(_one_rank_error),
]
PromptText = Annotated[str, Field(min_length=1)]


def _one_stop_error(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("stop", "stop must be a string or a list of strings") from None


StopStrings = Annotated[Union[str, list[str]], WrapValidator(_one_stop_error)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EngineSpec(_Strict):
    """How the vLLM engine is built."""

    model: str = Field("tiny", min_length=1,
                       description='the model: "tiny" (the embedded test model, built by '
                                   '`ftkit model build`), "tiny-moe" (an embedded tiny '
                                   "Mixtral, 4 experts and 2 per token, built on first use) "
                                   "or the path of a local model directory")
    tensor_parallel_size: int = Field(1, ge=1, description="number of ranks (vLLM's "
                                                           "tensor parallel size)")
    dtype: Dtype = Field("float32", description="the dtype the model computes in (vLLM's "
                                                "`dtype`)")
    max_model_len: int = Field(512, ge=1, description="longest sequence, prompt and output "
                                                      "together, in tokens (vLLM's "
                                                      "`max_model_len`)")
    block_size: int = Field(32, gt=0, multiple_of=16,
                            description="KV cache block size in tokens (vLLM's `block_size`); "
                                        "vLLM's CPU backend needs a multiple of 32")
    seed: int = Field(0, description="the engine's random seed (vLLM's `seed`)")
    mode: EngineMode = Field("offline",
                             description="`offline`: the workload runs on vLLM's `LLM` in an "
                                         "engine host; `serve`: on vLLM's OpenAI server with "
                                         "ftkit's plugin, driven by streaming `openai` "
                                         "clients, faults planned through its injection "
                                         "route (format 1.1)")
    args: dict[str, JsonValue] = Field(default_factory=dict,
                                       description="further keyword arguments of vLLM's "
                                                   "`LLM`, passed through unchanged; they "
                                                   "override ftkit's own defaults (such as "
                                                   "`enforce_eager: true`). With recovery "
                                                   "on, `data_parallel_size` above 1 only "
                                                   "with `mode: serve` and a dense model "
                                                   "(its replicas are served, each "
                                                   "recovered on its own)")
    nodes: int = Field(1, ge=1,
                       description="the Ray nodes the engine's ranks spread over, with "
                                   "`args.distributed_executor_backend: ray`: ftkit starts a "
                                   "Ray cluster of one head and `nodes - 1` worker nodes on "
                                   "this host for the engine, every rank's node placed by "
                                   "Ray (the world size must divide evenly)")
    ray_address: str | None = Field(None, min_length=1,
                                    description="join this running Ray cluster (`HOST:PORT` of "
                                                "its head) instead of starting one, with "
                                                "`args.distributed_executor_backend: ray`; its "
                                                "nodes must offer the ranks' devices (on the "
                                                "CPU build, the `ftkit_cpu_rank` resource). "
                                                "ftkit does not start a lost node of it "
                                                "again: `node_loss` is refused")

    @property
    def uses_ray(self) -> bool:
        """The engine runs on vLLM's Ray executor (``distributed_executor_backend: ray``)."""
        return self.args.get("distributed_executor_backend") == "ray"

    @property
    def data_parallel_size(self) -> int:
        """The replicas ``args`` ask for (vLLM's ``data_parallel_size``; 1 when not given,
        or not a positive integer: validation says so)."""
        return self._size_arg("data_parallel_size")

    @property
    def pipeline_parallel_size(self) -> int:
        """The pipeline stages ``args`` ask for (vLLM's ``pipeline_parallel_size``; 1 when not
        given, or not a positive integer: validation says so)."""
        return self._size_arg("pipeline_parallel_size")

    def _size_arg(self, key: str) -> int:
        value = self.args.get(key, 1)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if ok else 1

    @property
    def world_size(self) -> int:
        """The ranks of one engine: a tensor-parallel group per pipeline stage (vLLM numbers
        rank ``t`` of stage ``s`` as ``s * tensor_parallel_size + t``)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def replicas(self) -> int:
        """The engines of a server's data parallelism (``data_parallel_size``); an offline
        engine runs one."""
        return self.data_parallel_size if self.mode == "serve" else 1

    @property
    def ranks(self) -> int:
        """Every rank a fault may name: an engine's ranks (``world_size``), times the
        replicas of a server (rank ``r`` of replica ``i`` is ``i * world_size + r``)."""
        return self.world_size * self.replicas


class RandomPrompts(_Strict):
    """Prompts drawn from ftkit's fixed English word list, the same on every machine."""

    count: int = Field(ge=1, description="number of prompts, one request each")
    min_words: int = Field(5, ge=1, description="fewest words in a prompt")
    max_words: int = Field(12, ge=1, description="most words in a prompt (at least "
                                                 "`min_words`)")
    seed: int = Field(0, description="seed of the draw: the same seed gives the same prompts")


#: The fields of ``SamplingFields`` that version 1 has in ``workload`` itself; they are set
#: there for every request, and only a request's own ``sampling`` may override them.
V1_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed")


def _unset(description: str) -> Any:
    # None means "not given": the v1 field or vLLM's default applies. It is not a value a
    # file may write (except for seed), so the field's type has no None in it.
    return Field(None, description=description)


class SamplingFields(_Strict):
    """Fields of vLLM's ``SamplingParams``, by vLLM's own names: those a client can send
    through vLLM's OpenAI-compatible API. Each field left out keeps the workload's value, or
    vLLM's default. Types are checked here; values are checked by vLLM's own
    ``SamplingParams`` when the scenario is validated (where vLLM is installed)."""

    max_tokens: int = Field(None, ge=1, description="output tokens of the request; only in a "
                                                    "request's `sampling` (for every request: "
                                                    "`workload.max_tokens`)")
    temperature: float = _unset("sampling temperature, 0 is greedy; only in a request's "
                                "`sampling` (for every request: `workload.temperature`)")
    top_p: float = _unset("nucleus sampling threshold; only in a request's `sampling` (for "
                          "every request: `workload.top_p`)")
    seed: int | None = _unset("the request's own sampling seed, used as given (null: "
                              "unseeded); only in a request's `sampling` (for every request: "
                              "`workload.seed`)")
    n: int = Field(None, ge=1, description="completions (samples) of the request; more than "
                                           "1 needs random sampling (temperature > 0)")
    presence_penalty: float = _unset("penalty on tokens that already appeared in the output, "
                                     "in [-2, 2]")
    frequency_penalty: float = _unset("penalty proportional to how often a token appeared in "
                                      "the output, in [-2, 2]")
    repetition_penalty: float = _unset("penalty on tokens of the prompt and the output; above "
                                       "1 discourages repeats, 1 is none")
    top_k: int = _unset("sample among the k most likely tokens; 0 or -1 keeps every token")
    min_p: float = _unset("drop tokens less likely than this fraction of the most likely one, "
                          "in [0, 1]")
    stop: StopStrings = _unset("string(s) that end the output when generated")
    stop_token_ids: list[int] = _unset("token ids that end the output when generated")
    include_stop_str_in_output: bool = _unset("keep the stop string in the finished text")
    ignore_eos: bool = _unset("carry on past the end-of-sequence token; ftkit's workloads "
                              "default to true, so that each request runs to its max_tokens")
    min_tokens: int = _unset("output tokens produced before an end-of-sequence token or a "
                             "stop token id may end the output")
    logprobs: int = _unset("the number of most likely tokens whose logprobs each output "
                           "position returns (-1: the whole vocabulary); the sampled token's "
                           "logprob is always recorded")
    prompt_logprobs: int = _unset("the same for every prompt position")
    logit_bias: dict[str, float] = _unset("token id -> bias in [-100, 100] added to its logit "
                                          "before sampling; keys are integers or strings of "
                                          "integers, as the OpenAI API takes them")
    allowed_token_ids: list[int] = _unset("sample only among these token ids")
    bad_words: list[str] = _unset("words that are never generated")
    skip_special_tokens: bool = _unset("leave special tokens out of the finished text")
    spaces_between_special_tokens: bool = _unset("put spaces between special tokens in the "
                                                 "finished text")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        # YAML gives integer keys for `{42: 5}` and string keys for `{"42": 5}`; the OpenAI
        # API takes strings of integers. One spelling (the string of the integer) keeps cache
        # keys equal; the job turns the keys into the ints vLLM indexes logits with.
        if not isinstance(value, dict):
            return value
        canonical: dict[str, Any] = {}
        for key, bias in value.items():
            text = str(key).strip() if isinstance(key, (int, str)) and \
                not isinstance(key, bool) else ""
            if not text.lstrip("-").isdigit() or int(text) < 0:
                raise PydanticCustomError("token_id", "logit_bias keys are token ids (integers "
                                                      ">= 0), not {key}", {"key": repr(key)})
            token = str(int(text))
            if token in canonical:
                raise PydanticCustomError("token_id", "logit_bias gives token {token} twice",
                                          {"token": int(token)})
            canonical[token] = bias
        return canonical

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float]) -> dict[str, float]:
        for token, bias in value.items():
            if not -100 <= bias <= 100:
                raise PydanticCustomError("bias", "logit_bias of token {token} is {bias}: a "
                                                  "bias is in [-100, 100]",
                                          {"token": token, "bias": bias})
        return value

    def given(self) -> dict[str, Any]:
        """The fields the file gives, as JSON types (an explicit ``seed: null`` included)."""
        return self.model_dump(mode="json", exclude_unset=True)


class RequestSpec(_Strict):
    """One request: its prompt and the sampling fields it sets for itself."""

    prompt: PromptText = Field(description="the prompt")
    sampling: SamplingFields = Field(default_factory=SamplingFields,
                                     description="fields of vLLM's `SamplingParams` for this "
                                                 "request only, over `workload.sampling` and "
                                                 "the v1 fields (`max_tokens`, "
                                                 "`temperature`, `top_p`, `seed`) of the "
                                                 "workload")


class WorkloadSpec(_Strict):
    """The requests: exactly one of ``prompts``, ``random_prompts`` and ``requests``, and how
    to sample them."""

    prompts: Annotated[list[PromptText], Field(min_length=1)] | None = Field(
        None, description="the requests, one prompt each: request *i* is the *i*-th prompt")
    random_prompts: RandomPrompts | None = Field(
        None, description="instead of `prompts`: prompts drawn from a fixed word list, the same "
                          "on every machine")
    max_tokens: int = Field(64, ge=1, description="output tokens per request")
    temperature: float = Field(0.0, ge=0, le=2, description="sampling temperature; 0 is "
                                                            "greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample among the most "
                                                      "likely tokens whose probabilities add "
                                                      "up to this; 1 keeps every token")
    seed: int | None = Field(None, description="per-request sampling seed, used when "
                                               "temperature > 0: request *i* uses seed + "
                                               "*i* (none: unseeded)")
    requests: Annotated[list[RequestSpec], Field(min_length=1)] | None = Field(
        None, description="instead of `prompts`: the requests, one entry each, with their "
                          "own sampling fields (format 1.1)")
    sampling: SamplingFields = Field(default_factory=SamplingFields,
                                     description="further fields of vLLM's `SamplingParams` "
                                                 "for every request (format 1.1); "
                                                 "`max_tokens`, `temperature`, `top_p` and "
                                                 "`seed` are the workload's own fields above")
    api: ServeApi = Field("completions",
                          description="with `engine.mode: serve`: the OpenAI API the clients "
                                      "call, `completions` (each prompt as the prompt) or "
                                      "`chat` (each prompt as one user message). vLLM streams "
                                      "`prompt_logprobs` only with `completions`, with `n` 1, "
                                      "and only 0 or as many as the request's `logprobs`")
    background_streams: int = Field(0, ge=0,
                                    description="with `engine.mode: serve`: extra streams "
                                                "sent beside the requests, as load; their "
                                                "outputs are not compared")

    def prompt_count(self) -> int:
        """How many requests the workload sends (0 only if no prompt source is set)."""
        if self.prompts is not None:
            return len(self.prompts)
        if self.random_prompts is not None:
            return self.random_prompts.count
        if self.requests is not None:
            return len(self.requests)
        return 0

    def prompt_texts(self) -> list[str]:
        """The concrete prompts, generated deterministically for ``random_prompts``."""
        if self.prompts is not None:
            return list(self.prompts)
        if self.random_prompts is not None:
            r = self.random_prompts
            return random_prompts(r.count, r.min_words, r.max_words, r.seed)
        if self.requests is not None:
            return [r.prompt for r in self.requests]
        return []

    def request_overrides(self) -> tuple[dict[str, Any], ...]:
        """Per request in order, the sampling fields it sets for itself (``()`` without
        ``requests``)."""
        return tuple(r.sampling.given() for r in self.requests or ())

    def sampling_spec(self) -> SamplingSpec:
        """How each request is sampled: the v1 fields, ``sampling`` and each request's own."""
        return SamplingSpec(max_tokens=self.max_tokens, temperature=self.temperature,
                            top_p=self.top_p, seed=self.seed, extra=self.sampling.given(),
                            requests=self.request_overrides())


class RecoverySpec(_Strict):
    """The recovery engine's settings for this run."""

    enabled: bool = Field(True, description="run with the recovery engine on (`true`) or off "
                                            "(`false`: a fault surfaces as vLLM's error)")
    max_reinference: int = Field(3, ge=0, description="re-runs of one step before the fault "
                                                      "is surfaced; 0 means no retry")


class FaultAt(_Strict):
    """The engine step that computes output token ``token`` (0 = prefill) of ``request``."""

    request: int = Field(ge=0, description="the request, as an index into the workload's "
                                           "requests (its prompts) in order, from 0")
    token: int = Field(ge=0, description="0-based output token index; 0 is the prefill step")


class FaultSpec(_Strict):
    """One injected fault."""

    # Enums need strict=False to accept their string values from YAML.
    kind: FaultKind = Field(strict=False, description="the fault kind (`ftkit list`); it "
                                                      "decides which `params` apply")
    rank: Rank = Field(description='the rank that fails (from 0, below '
                                   '`engine.tensor_parallel_size`), or "all" (every rank; '
                                   'the only choice under a data-parallel server, whose load '
                                   "balancer picks each request's replica: the fault fires "
                                   "on the ranks of the replica serving its request)")
    at: FaultAt = Field(description="The engine step that computes output token `token` (0 = "
                                    "prefill) of `request`.")
    phase: Phase = Field("forward", description="where inside the step the fault fires: "
                                                "`before` (before the model runner touches "
                                                "its state), `forward` (inside the model "
                                                "forward) or `sample` (after sampling, "
                                                "before the tokens are booked)")
    times: int = Field(1, ge=1, description="consecutive attempts of the step that fail (the "
                                            "first run, then re-runs)")
    params: dict[str, JsonValue] = Field(default_factory=dict,
                                         description="the kind's own settings (see the "
                                                     "params of each kind); unknown keys "
                                                     "are errors")


class ExpectSpec(_Strict):
    """What the run must show to pass."""

    outcome: Outcome = Field("recovered", description="`recovered`: the run must finish; "
                                                      "`failed`: the fault must surface as an "
                                                      "error")
    tokens: TokenExpectation = Field("identical", description="`identical`: every token must "
                                                              "match the fault-free run; "
                                                              "`prefix`: only the tokens "
                                                              "before the fault must match")
    max_recovery_s: float = Field(10.0, gt=0, description="upper bound on each recovery "
                                                          "round, in seconds")
    timeout_s: float = Field(300.0, gt=0, description="hard bound on the whole run, in "
                                                      "seconds")
    logprob_tolerance: float = Field(0.0, ge=0,
                                     description="largest absolute difference allowed between "
                                                 "a logprob of the run and the fault-free "
                                                 "run's; 0 (the default) asks for bit-identical "
                                                 "logprobs. Only for dtypes or platforms that "
                                                 "cannot be bit-exact (format 1.1)")


class Scenario(_Strict):
    """One scenario: an engine, a workload, the faults to inject and the expected verdict."""

    name: str = Field(pattern=NAME_PATTERN, description="identifier of the scenario, used in "
                                                         "reports and by `ftkit run -k`; "
                                                         "unique among the scenarios of a run")
    description: str = Field("", description="free text")
    engine: EngineSpec = Field(default_factory=EngineSpec,
                               description="How the vLLM engine is built; every key has a "
                                           "default.")
    workload: WorkloadSpec = Field(description="The requests: exactly one of `prompts`, "
                                               "`random_prompts` and `requests`, and how to "
                                               "sample them.")
    recovery: RecoverySpec = Field(default_factory=RecoverySpec,
                                   description="The recovery engine's settings for this run; "
                                               "every key has a default.")
    faults: list[FaultSpec] = Field(description="the faults to inject; may be empty: the run "
                                                "is then a determinism check")
    expect: ExpectSpec = Field(default_factory=ExpectSpec,
                               description="What the run must show to pass; every key has a "
                                           "default.")

    # Where the scenario came from; not part of the format.
    _source: str | None = PrivateAttr(None)
    _lines: dict[Loc, int] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_rules(self) -> Scenario:
        # ScenarioErrors is not a ValueError, so pydantic lets it through unwrapped.
        found = rules.problems(self)
        if found:
            raise ScenarioErrors(ScenarioError(message, field=format_loc(loc))
                                 for loc, message in found)
        return self

    @property
    def source(self) -> str | None:
        """The file this scenario was loaded from, or ``None``."""
        return self._source

    def line_of(self, field: str) -> int | None:
        """The line in ``source`` of a field path (or of its nearest written parent)."""
        loc = parse_field(field)
        while loc not in self._lines and loc:
            loc = loc[:-1]
        return self._lines.get(loc)

    def prompts(self) -> list[str]:
        """The concrete prompts, one per request, in request order."""
        return self.workload.prompt_texts()

    def sampling_spec(self) -> SamplingSpec:
        """How the requests are sampled, for the engine job (``SamplingSpec.for_request(i)``
        gives request *i*'s ``SamplingParams`` fields)."""
        return self.workload.sampling_spec()

    def engine_key(self) -> dict[str, Any]:
        """The engine settings that decide the fault-free tokens, as JSON types.

        ``model`` is the spec as written ("tiny" or a path); a cache should add what the
        spec resolves to (the tiny model's recipe digest, a directory's contents).
        """
        # An offline engine's key is what it was before `mode` existed (cached baselines stay).
        return self.engine.model_dump(mode="json",
                                      exclude={"mode"} if self.engine.mode == "offline" else None)

    def workload_key(self) -> dict[str, Any]:
        """The requests that decide the fault-free tokens, prompts generated, as JSON types.

        A workload without fields beyond version 1 has the same key as in version 1; one
        written with ``requests`` whose entries set no sampling field has the key of the same
        ``prompts``."""
        w = self.workload
        spec = self.sampling_spec()
        # vLLM ignores top_p and the workload's seed when every request samples greedily;
        # normalising them lets greedy workloads that differ only there share one run.
        greedy = all(spec.for_request(i)["temperature"] == 0 for i in range(w.prompt_count()))
        key: dict[str, Any] = {
            "prompts": self.prompts(),
            "max_tokens": w.max_tokens,
            "temperature": w.temperature,
            "top_p": 1.0 if greedy else w.top_p,
            "seed": None if greedy else w.seed,
        }
        if spec.extra:
            key["sampling"] = spec.extra
        if any(spec.requests):
            key["requests"] = list(spec.requests)
        return key


def scenario_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of the scenario format, for editors and outside tools.

    The same schema is published as ``ftkit/scenario/scenario.schema.json`` (built by
    ``ftkit.scenario.schema``). It covers keys and types, ``params`` per fault kind included;
    the semantic rules (``ftkit.scenario.rules``) are not in it.
    """
    from ftkit.scenario.schema import build  # it reads the models of this module

    return build()
