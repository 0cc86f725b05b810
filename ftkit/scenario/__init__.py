"""The scenario format, version 1.1: strict models, loading with line numbers, JSON Schema.

::

    from ftkit.scenario import load_scenario
    scenario = load_scenario("scenarios/link_flap.yaml")   # raises ScenarioErrors
    scenario.prompts(), scenario.sampling_spec(), scenario.workload_key()

Modules: ``model`` (the pydantic models), ``rules`` (semantic rules), ``load`` (files,
directories, globs), ``source`` (YAML with line marks), ``prompts`` (deterministic random
prompts), ``errors`` (``ScenarioErrors`` and field paths), ``overrides`` (fields set for a
whole run: ``ftkit run --set``).
"""

from ftkit.scenario.errors import ScenarioErrors, format_loc, parse_field
from ftkit.scenario.load import load_scenario, load_scenario_text, load_scenarios
from ftkit.scenario.model import (
    FORMAT_VERSION,
    EngineSpec,
    ExpectSpec,
    FaultAt,
    FaultSpec,
    Phase,
    RandomPrompts,
    RecoverySpec,
    Scenario,
    WorkloadSpec,
    scenario_json_schema,
)
from ftkit.scenario.overrides import Overrides, override_lines
from ftkit.scenario.prompts import random_prompts

__all__ = [
    "FORMAT_VERSION",
    "EngineSpec",
    "ExpectSpec",
    "FaultAt",
    "FaultSpec",
    "Overrides",
    "Phase",
    "RandomPrompts",
    "RecoverySpec",
    "Scenario",
    "ScenarioErrors",
    "WorkloadSpec",
    "format_loc",
    "load_scenario",
    "load_scenario_text",
    "load_scenarios",
    "override_lines",
    "parse_field",
    "random_prompts",
    "scenario_json_schema",
]
