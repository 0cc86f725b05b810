"""The scenario format, version 1, as strict pydantic models.

Field names, meanings and defaults are a contract that tools outside ftkit rely on; see
``scenarios/link_flap.yaml`` for a complete example. What a caller may rely on:

* Every model forbids unknown keys and validates strictly: no string-to-number coercion,
  and a bool is not a number (integers are accepted where a float is expected).
* A ``Scenario`` that exists has passed both the type checks and the semantic rules of
  ``ftkit.scenario.rules`` (a fault's rank exists, its token is computed, its kind is
  implemented ...). Constructing one that breaks a rule raises ``ScenarioErrors`` whose
  errors carry field paths; ``load_scenario`` adds the file and line numbers.
* ``Scenario.prompts()`` is the concrete prompt list; ``engine_key()`` and
  ``workload_key()`` are plain JSON-able dicts holding everything that decides the
  fault-free tokens, for cache keys (serialise them with ``sort_keys=True``).
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
    model_validator,
)
from pydantic_core import PydanticCustomError

from ftkit.errors import ScenarioError
from ftkit.faults import FaultKind
from ftkit.scenario import rules
from ftkit.scenario.errors import Loc, ScenarioErrors, format_loc, parse_field
from ftkit.scenario.prompts import random_prompts

FORMAT_VERSION = 1
NAME_PATTERN = r"^[a-z0-9_-]+$"

Phase = Literal["before", "forward", "sample"]
Outcome = Literal["recovered", "failed"]
TokenExpectation = Literal["identical", "prefix"]
#: The dtypes vLLM's ``--dtype`` accepts.
Dtype = Literal["auto", "float32", "float", "float16", "half", "bfloat16"]


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EngineSpec(_Strict):
    """How the vLLM engine is built."""

    model: str = Field("tiny", min_length=1,
                       description='the model: "tiny" (the embedded test model, built by '
                                   "`ftkit model build`) or the path of a local model "
                                   "directory")
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
    args: dict[str, JsonValue] = Field(default_factory=dict,
                                       description="further keyword arguments of vLLM's "
                                                   "`LLM`, passed through unchanged; they "
                                                   "override ftkit's own defaults (such as "
                                                   "`enforce_eager: true`)")


class RandomPrompts(_Strict):
    """Prompts drawn from ftkit's fixed English word list, the same on every machine."""

    count: int = Field(ge=1, description="number of prompts, one request each")
    min_words: int = Field(5, ge=1, description="fewest words in a prompt")
    max_words: int = Field(12, ge=1, description="most words in a prompt (at least "
                                                 "`min_words`)")
    seed: int = Field(0, description="seed of the draw: the same seed gives the same prompts")


class WorkloadSpec(_Strict):
    """The requests: exactly one of ``prompts`` and ``random_prompts``, and how to sample."""

    prompts: Annotated[list[PromptText], Field(min_length=1)] | None = Field(
        None, description="the requests, one prompt each: request *i* is the *i*-th prompt")
    random_prompts: RandomPrompts | None = Field(
        None, description="instead of `prompts`: prompts drawn from a fixed word list, the same "
                          "on every machine")
    max_tokens: int = Field(64, ge=1, description="output tokens per request")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample among the most "
                                                      "likely tokens whose probabilities add "
                                                      "up to this; 1 keeps every token")
    seed: int | None = Field(None, description="per-request sampling seed, used when "
                                               "temperature > 0 (none: unseeded)")

    def prompt_count(self) -> int:
        """How many requests the workload sends (0 only if neither prompt source is set)."""
        if self.prompts is not None:
            return len(self.prompts)
        if self.random_prompts is not None:
            return self.random_prompts.count
        return 0

    def prompt_texts(self) -> list[str]:
        """The concrete prompts, generated deterministically for ``random_prompts``."""
        if self.prompts is not None:
            return list(self.prompts)
        if self.random_prompts is not None:
            r = self.random_prompts
            return random_prompts(r.count, r.min_words, r.max_words, r.seed)
        return []


class RecoverySpec(_Strict):
    """The recovery engine's settings for this run."""

    enabled: bool = Field(True, description="run with the recovery engine on (`true`) or off "
                                            "(`false`: a fault surfaces as vLLM's error)")
    max_reinference: int = Field(3, ge=0, description="re-runs of one step before the fault "
                                                      "is surfaced; 0 means no retry")


class FaultAt(_Strict):
    """The engine step that computes output token ``token`` (0 = prefill) of ``request``."""

    request: int = Field(ge=0, description="the request, as an index into the workload's "
                                           "prompts (from 0)")
    token: int = Field(ge=0, description="0-based output token index; 0 is the prefill step")


class FaultSpec(_Strict):
    """One injected fault."""

    # Enums need strict=False to accept their string values from YAML.
    kind: FaultKind = Field(strict=False, description="the fault kind (`ftkit list`); it "
                                                      "decides which `params` apply")
    rank: Rank = Field(description='the rank that fails (from 0, below '
                                   '`engine.tensor_parallel_size`), or "all"')
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


class Scenario(_Strict):
    """One scenario: an engine, a workload, the faults to inject and the expected verdict."""

    name: str = Field(pattern=NAME_PATTERN, description="identifier of the scenario, used in "
                                                         "reports and by `ftkit run -k`; "
                                                         "unique among the scenarios of a run")
    description: str = Field("", description="free text")
    engine: EngineSpec = Field(default_factory=EngineSpec,
                               description="How the vLLM engine is built; every key has a "
                                           "default.")
    workload: WorkloadSpec = Field(description="The requests: exactly one of `prompts` and "
                                               "`random_prompts`, and how to sample.")
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

    def engine_key(self) -> dict[str, Any]:
        """The engine settings that decide the fault-free tokens, as JSON types.

        ``model`` is the spec as written ("tiny" or a path); a cache should add what the
        spec resolves to (the tiny model's recipe digest, a directory's contents).
        """
        return self.engine.model_dump(mode="json")

    def workload_key(self) -> dict[str, Any]:
        """The requests that decide the fault-free tokens, prompts generated, as JSON types."""
        w = self.workload
        greedy = w.temperature == 0
        return {
            "prompts": self.prompts(),
            "max_tokens": w.max_tokens,
            "temperature": w.temperature,
            # vLLM ignores top_p and the seed when sampling greedily; normalising them lets
            # greedy workloads that differ only there share one fault-free run.
            "top_p": 1.0 if greedy else w.top_p,
            "seed": None if greedy else w.seed,
        }


def scenario_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of the scenario format, for editors and outside tools.

    The same schema is published as ``ftkit/scenario/scenario.schema.json`` (built by
    ``ftkit.scenario.schema``). It covers keys and types, ``params`` per fault kind included;
    the semantic rules (``ftkit.scenario.rules``) are not in it.
    """
    from ftkit.scenario.schema import build  # it reads the models of this module

    return build()
