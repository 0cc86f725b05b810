"""ftkit: fault tolerance and chaos testing for LLM inference on vLLM and vLLM-Ascend.

The names below are ftkit's public surface: the ``ftkit`` command, the benchmarks and the
examples use nothing else, and they keep their meaning across releases. Every other module
is internal by convention and may change::

    import ftkit

    scenario = ftkit.load_scenario("scenarios/link_flap.yaml")
    with ftkit.ScenarioRunner() as runner:
        result = runner.run(scenario, file="scenarios/link_flap.yaml")
    print(result.verdict, result.reason)

Names are imported when first used, so ``import ftkit`` stays cheap (it imports neither vLLM
nor torch): it runs in every vLLM process, where ftkit's plugin is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # errors
    "FtkitError": "ftkit.errors", "ScenarioError": "ftkit.errors",
    "EngineError": "ftkit.errors", "RecoveryError": "ftkit.errors",
    "ReinferenceExhausted": "ftkit.errors", "RecoveryInconsistent": "ftkit.errors",
    "InjectionError": "ftkit.errors", "RunTimeout": "ftkit.errors",
    # scenarios
    "Scenario": "ftkit.scenario", "FaultSpec": "ftkit.scenario", "EngineSpec": "ftkit.scenario",
    "ScenarioErrors": "ftkit.scenario", "FORMAT_VERSION": "ftkit.scenario",
    "load_scenario": "ftkit.scenario", "load_scenarios": "ftkit.scenario",
    "load_scenario_text": "ftkit.scenario", "scenario_json_schema": "ftkit.scenario",
    "random_prompts": "ftkit.scenario", "Overrides": "ftkit.scenario",
    "override_lines": "ftkit.scenario",
    # fault kinds
    "FaultKind": "ftkit.faults", "KIND_SPECS": "ftkit.kinds", "kind_spec": "ftkit.kinds",
    # running scenarios
    "ScenarioRunner": "ftkit.runner", "run_scenario": "ftkit.runner",
    "measure_serve_oracle": "ftkit.runner.serve",
    # a scenario's server and its streaming clients (engine.mode serve)
    "ScenarioServer": "ftkit.runner.serve", "Stream": "ftkit.runner.serve",
    "StreamedCompletion": "ftkit.runner.serve",
    "server_options": "ftkit.runner.serve", "stream_one": "ftkit.runner.serve",
    "ProgressEvent": "ftkit.progress", "EventSink": "ftkit.progress",
    # results and reports
    "ScenarioResult": "ftkit.results", "Verdict": "ftkit.results",
    "planned_faults": "ftkit.verify",
    "SkippedScenario": "ftkit.report", "write_json_report": "ftkit.report",
    "write_junit_report": "ftkit.report", "write_html_report": "ftkit.report",
    "read_json_report": "ftkit.report", "results_from_report": "ftkit.report",
    "skipped_from_report": "ftkit.report", "TABLE_COLUMNS": "ftkit.report",
    "overrides_from_report": "ftkit.report",
    "table_cells": "ftkit.report", "verdict_label": "ftkit.report",
    "client_summary": "ftkit.report",
    # chaos search (ftkit explore)
    "Budget": "ftkit.explore", "Campaign": "ftkit.explore", "CampaignEvent": "ftkit.explore",
    "CampaignResult": "ftkit.explore", "ExploreOptions": "ftkit.explore",
    "ExploreSpace": "ftkit.explore", "parse_kinds": "ftkit.explore",
    "parse_names": "ftkit.explore", "idle_hosts": "ftkit.explore",
    "model_prompt_tokens": "ftkit.explore", "coverage_by_fault": "ftkit.report.campaign_html",
    "coverage_by_feature": "ftkit.report.campaign_html",
    "write_campaign_html": "ftkit.report.campaign_html",
    # engines, recovery settings, fault plans and the ranks' event log
    "EngineSession": "ftkit.vllm.engine", "SamplingSpec": "ftkit.contracts.job",
    "RecoveryConfig": "ftkit.config", "CONFIG_KEY": "ftkit.config",
    "FaultPlan": "ftkit.contracts.plan",
    "read_events": "ftkit.contracts.eventlog", "only": "ftkit.contracts.eventlog",
    "Event": "ftkit.contracts.eventlog", "FaultFired": "ftkit.contracts.eventlog",
    "StepRecovered": "ftkit.contracts.eventlog", "RecoveryRound": "ftkit.contracts.eventlog",
    "KvRecomputed": "ftkit.contracts.eventlog", "ParamsReloaded": "ftkit.contracts.eventlog",
    "EngineReplaced": "ftkit.contracts.eventlog", "RequestResumed": "ftkit.contracts.eventlog",
    # a running server (ftkit inject)
    "inject_live_fault": "ftkit.serve.client", "InjectRefused": "ftkit.serve.client",
    "INJECT_SECRET_ENV": "ftkit.serve.client",
    # starting a server (ftkit serve)
    "plan_serve": "ftkit.serve.launch", "ServeLaunch": "ftkit.serve.launch",
    # this machine, models
    "diagnose": "ftkit.doctor", "Diagnosis": "ftkit.doctor", "REAL": "ftkit.doctor",
    "TINY": "ftkit.model", "build_tiny_model": "ftkit.model", "resolve_model": "ftkit.model",
    "build_wide_model": "ftkit.model", "TINY_MOE": "ftkit.model",
    "build_tiny_moe_model": "ftkit.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ftkit' has no attribute {name!r}")
    # Not cached here: the name always reflects its module (which tests may replace).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from ftkit.config import CONFIG_KEY, RecoveryConfig
    from ftkit.contracts.eventlog import (EngineReplaced, Event, FaultFired, KvRecomputed,
                                          ParamsReloaded, RecoveryRound, RequestResumed,
                                          StepRecovered, only, read_events)
    from ftkit.contracts.job import SamplingSpec
    from ftkit.contracts.plan import FaultPlan
    from ftkit.doctor import REAL, Diagnosis, diagnose
    from ftkit.errors import (EngineError, FtkitError, InjectionError, RecoveryError,
                              RecoveryInconsistent, ReinferenceExhausted, RunTimeout,
                              ScenarioError)
    from ftkit.explore import (Budget, Campaign, CampaignEvent, CampaignResult,
                               ExploreOptions, ExploreSpace, idle_hosts, model_prompt_tokens,
                               parse_kinds, parse_names)
    from ftkit.faults import FaultKind
    from ftkit.kinds import KIND_SPECS, kind_spec
    from ftkit.model import (TINY, TINY_MOE, build_tiny_model, build_tiny_moe_model,
                             build_wide_model, resolve_model)
    from ftkit.progress import EventSink, ProgressEvent
    from ftkit.report import (TABLE_COLUMNS, SkippedScenario, client_summary,
                              overrides_from_report,
                              read_json_report, results_from_report, skipped_from_report,
                              table_cells, verdict_label, write_html_report,
                              write_json_report, write_junit_report)
    from ftkit.report.campaign_html import (coverage_by_fault, coverage_by_feature,
                                            write_campaign_html)
    from ftkit.results import ScenarioResult, Verdict
    from ftkit.runner import ScenarioRunner, run_scenario
    from ftkit.runner.serve import (ScenarioServer, Stream, measure_serve_oracle,
                                    server_options, stream_one)
    from ftkit.scenario import (FORMAT_VERSION, EngineSpec, FaultSpec, Overrides, Scenario,
                                ScenarioErrors, load_scenario, load_scenario_text,
                                load_scenarios, override_lines, random_prompts,
                                scenario_json_schema)
    from ftkit.verify import planned_faults
    from ftkit.vllm.engine import EngineSession
