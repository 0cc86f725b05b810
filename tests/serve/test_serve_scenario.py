"""A scenario against a real server (``engine.mode: serve``), through the scenario runner:
``scenarios/serve_link_flap.yaml`` (TP 2, a link flap and a device reset mid-stream, four
compared streams beside two background ones) passes with both faults fired and recovered;
the same flap with ``max_reinference`` below its failing attempts fails. One server start
per test."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ftkit.results import Verdict
from ftkit.runner import ScenarioRunner
from ftkit.scenario import load_scenario
from ftkit.scenario.model import RecoverySpec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "serve_link_flap.yaml"


def run(scenario):
    before = set(psutil.Process().children(recursive=True))  # earlier tests' helpers
    with ScenarioRunner(use_cache=False) as runner:
        result = runner.run(scenario, file=str(SCENARIO))
    # The server was this process's child; it is reaped, and nothing it started is left.
    assert set(psutil.Process().children(recursive=True)) - before == set()
    return result


def test_the_serve_scenario_passes_with_its_faults_fired_and_recovered(tiny_model):
    scenario = load_scenario(SCENARIO)
    result = run(scenario)
    assert result.verdict == Verdict.PASS, (result.reason, result.error)
    flap, reset = result.faults
    assert (flap.kind, flap.fired, flap.attempts, flap.recovered) == ("link_flap", True, 2, True)
    assert (reset.kind, reset.fired, reset.attempts, reset.recovered) == \
        ("device_reset", True, 1, True)
    assert result.reinferences == 3
    # Every compared stream ran to max_tokens and matched the fault-free run, token for token.
    assert [len(r.actual) for r in result.requests] == [32] * 4
    assert all(r.matches for r in result.requests)
    client = result.client
    assert client is not None and client.api == "completions"
    assert len(client.run) == 6 and sum(s.background for s in client.run) == 2
    assert client.failed_requests == 0
    assert all(s.tokens == 32 and s.ttft_s is not None for s in client.run)
    # The recovery rounds show as the largest gap between two tokens of a stream.
    assert client.max_gap_s is not None and client.max_ttft_s is not None
    assert result.to_dict()["client"]["failed_requests"] == 0


def test_a_flap_beyond_max_reinference_fails_the_serve_scenario(tiny_model):
    """The crippled variant: the same flap with one re-run for its two failing attempts
    (``model_copy`` skips the rule that refuses expecting recovery then) ends the engine:
    the faulted streams end with errors and the verdict is fail, not pass."""
    scenario = load_scenario(SCENARIO)
    crippled = scenario.model_copy(update={"recovery": RecoverySpec(max_reinference=1),
                                           "faults": scenario.faults[:1]})
    result = run(crippled)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.reason.startswith("expected recovery, but the run failed")
    assert result.faults[0].fired
    assert result.client is not None and result.client.failed_requests > 0
