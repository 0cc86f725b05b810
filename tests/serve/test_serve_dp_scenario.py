"""The crippled variant of ``scenarios/serve_data_parallel.yaml`` (two replicas of the tiny
model at TP 1; a device reset, then a SIGKILL of a worker, in the replica serving request 1),
through the scenario runner: the reset with no re-run allowed fails. The scenario itself
passes in ``tests/cli/test_run_e2e.py`` (the bundled library), with both faults fired, the
reset recovered in its replica, the kill by one engine replacement."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_serve_scenario import run

from ftkit.results import Verdict
from ftkit.scenario import load_scenario
from ftkit.scenario.model import RecoverySpec

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(600)]

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "serve_data_parallel.yaml"


def test_the_reset_without_a_rerun_fails_the_data_parallel_serve_scenario(tiny_model):
    """The crippled variant: the reset alone with no re-run allowed (``model_copy`` skips
    the rule that refuses expecting recovery then) ends its replica's engine, and with no
    restart planned the streams end with errors: the verdict is fail, not pass."""
    scenario = load_scenario(SCENARIO)
    crippled = scenario.model_copy(update={"recovery": RecoverySpec(max_reinference=0),
                                           "faults": scenario.faults[:1]})
    result = run(crippled, SCENARIO)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.faults[0].fired and not result.faults[0].recovered
    assert result.client is not None and result.client.failed_requests > 0
