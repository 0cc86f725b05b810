"""A live fault planned before an engine died still fires on its replacement, at its token:
``scenarios/serve_process_kill.yaml`` (TP 2; rank 1's worker SIGKILLed at request 1's output
token 12) with a device reset planned for the same request's token 24, which comes only on
the new engine. The injection route gives the new engine the faults that had not fired
(``Control.replan``), and the workers count a resumed request's tokens from where its client
was (its id carries them). Crippled, before either: the reset never fired and the scenario's
verdict was not applied (one run by hand); the unit tests hold each part's crippled variant
(tests/unit/test_serve_control.py, tests/unit/test_restart_watch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_serve_scenario import run

from ftkit.results import Verdict
from ftkit.scenario import load_scenario_text

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(600)]

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "serve_process_kill.yaml"


def test_a_fault_planned_before_the_engine_died_fires_on_the_new_engine(tiny_model):
    data = yaml.safe_load(SCENARIO.read_text())
    data["faults"].append({"kind": "device_reset", "rank": 0, "phase": "forward",
                           "at": {"request": 1, "token": 24}})
    scenario = load_scenario_text(yaml.safe_dump(data), file=str(SCENARIO))
    result = run(scenario, SCENARIO)
    assert result.verdict == Verdict.PASS, (result.reason, result.error)
    kill, reset = result.faults
    assert (kill.fired, kill.recovered) == (True, True)
    assert (reset.fired, reset.recovered, reset.attempts) == (True, True, 1)
    assert reset.fired_at is not None and reset.fired_at.token == 24
    # It fired once the new engine served: after the kill and the replacement.
    assert kill.at_s is not None and kill.restart_s is not None and reset.at_s is not None
    assert reset.at_s > kill.at_s + kill.restart_s
    assert result.client is not None and result.client.failed_requests == 0
