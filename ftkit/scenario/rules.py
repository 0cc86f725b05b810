"""The semantic rules a well-typed scenario must also follow.

``problems(scenario)`` returns every broken rule as ``(loc, message)``, the loc pointing at
the field to change. It only reads the scenario; ``Scenario`` runs it when it is built, so
a ``Scenario`` object never breaks these rules.

The rules, in order: exactly one prompt source, ``min_words <= max_words``; for each fault:
its kind is implemented, its rank exists, its request exists, its token is computed
(``< max_tokens``), its ``params`` fit its kind (``ftkit.scenario.params``), and its kind's own
rules (``KindSpec.rules`` in ``ftkit.kinds``: a link fault has a peer, a flap repeats, a process
is killed once, a KV UCE hits a request that holds KV, ...); an expected recovery is possible
(recovery enabled and ``times <= max_reinference``); and expected identical tokens can be
reproduced (random sampling has a seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ftkit.kinds import kind_spec
from ftkit.scenario.errors import Loc
from ftkit.scenario.params import params_model, parse_params

if TYPE_CHECKING:
    from ftkit.scenario.model import FaultSpec, Scenario, WorkloadSpec

Problem = tuple[Loc, str]


def problems(scenario: Scenario) -> list[Problem]:
    """Every semantic rule the scenario breaks; ``[]`` when it is sound."""
    found = _workload_problems(scenario.workload)
    for index, fault in enumerate(scenario.faults):
        found += _fault_problems(scenario, ("faults", index), fault)
    found += _expectation_problems(scenario)
    found += _reproducibility_problems(scenario)
    return found


def _workload_problems(workload: WorkloadSpec) -> list[Problem]:
    found: list[Problem] = []
    if workload.prompts is None and workload.random_prompts is None:
        found.append((("workload",), "give the requests: either prompts or random_prompts"))
    if workload.prompts is not None and workload.random_prompts is not None:
        found.append((("workload", "random_prompts"),
                      "give either prompts or random_prompts, not both"))
    bounds = workload.random_prompts
    if bounds is not None and bounds.min_words > bounds.max_words:
        found.append((("workload", "random_prompts", "max_words"),
                      f"max_words ({bounds.max_words}) is below min_words ({bounds.min_words})"))
    return found


def _fault_problems(scenario: Scenario, at: Loc, fault: FaultSpec) -> list[Problem]:
    found: list[Problem] = []
    world_size = scenario.engine.tensor_parallel_size
    n_requests = scenario.workload.prompt_count()
    max_tokens = scenario.workload.max_tokens
    spec = kind_spec(fault.kind)

    # A scenario must never look as if it tested a fault that the injector would skip.
    if not spec.implemented:
        found.append((at + ("kind",), f"fault kind '{fault.kind}' is not implemented yet"))
    if isinstance(fault.rank, int) and fault.rank >= world_size:
        found.append((at + ("rank",), f"rank {fault.rank} does not exist: the world size "
                                      f"(engine.tensor_parallel_size) is {world_size}"))
    # With no prompt source the workload rule already speaks; don't pile on.
    if n_requests and fault.at.request >= n_requests:
        found.append((at + ("at", "request"),
                      f"request {fault.at.request} does not exist: the workload has "
                      f"{n_requests} prompt(s), numbered from 0"))
    if fault.at.token >= max_tokens:
        found.append((at + ("at", "token"),
                      f"token {fault.at.token} is never computed: workload.max_tokens is "
                      f"{max_tokens}, tokens are numbered from 0"))
    params, params_problems = _params(at, fault)
    found += params_problems
    for rule in spec.rules:
        found += rule(at, fault, params, scenario)
    return found


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
    workload = scenario.workload
    if workload.temperature == 0 or workload.seed is not None \
            or scenario.expect.tokens != "identical":
        return []
    return [(("workload", "seed"),
             f"temperature {workload.temperature:g} without a seed draws different tokens on "
             f"every run, so they cannot be identical to the fault-free run: give "
             f"workload.seed, or expect tokens 'prefix'")]
