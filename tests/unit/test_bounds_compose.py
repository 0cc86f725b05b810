"""How ftkit's bounds compose with vLLM's bound on one step (``ftkit.bounds.step_bound``): the
arithmetic against numbers worked out by hand, the timeout ftkit gives the engines it starts,
the timeout its plugin raises for an engine it did not start, and the validation of a scenario whose hang
outlasts the step's bound."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from ftkit.bounds import (
    DEFAULT_OP_TIMEOUT_S,
    VLLM_EXECUTE_TIMEOUT_ENV,
    step_bound,
    vllm_execute_timeout_s,
)
from ftkit.config import RecoveryConfig
from ftkit.errors import FtkitError
from ftkit.scenario import ScenarioErrors, load_scenario_text
from ftkit.vllm.environment import execute_timeout


# --- the arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("attempts, attempt_s, round_timeout_s, total_s, needed_s", [
    # 3 x (110 + 3 x 30) + 30: the hang of the issue, which vLLM's 300 s cut short
    (3, 110.0, 30.0, 630.0, 630),
    # the defaults: 3 x (120 + 3 x 30) + 30
    (3, None, 30.0, 660.0, 660),
    # no re-run: only the last attempt's room
    (0, 50.0, 30.0, 30.0, 30),
    # 2 x (7.5 + 3 x 2.5) + 30
    (2, 7.5, 2.5, 60.0, 60),
    # 1 x (0.2 + 3 x 0.1) + 30 = 30.5: vLLM reads whole seconds, so 31
    (1, 0.2, 0.1, 30.5, 31),
])
def test_a_steps_bound_is_its_failing_attempts_and_rounds_plus_the_last_attempt(
        attempts, attempt_s, round_timeout_s, total_s, needed_s):
    bound = step_bound(failing_attempts=attempts, attempt_s=attempt_s,
                       round_timeout_s=round_timeout_s)
    assert bound.total_s == pytest.approx(total_s)
    assert bound.needed_s == needed_s
    assert bound.fits(needed_s) and not bound.fits(needed_s - 1)


def test_the_bound_says_its_arithmetic():
    bound = step_bound(failing_attempts=3, attempt_s=110, round_timeout_s=30)
    assert bound.describe() == (
        "3 failing attempts x (110 s operator timeout + 90 s recovery round, 3 x "
        "round_timeout_s 30 s) + 30 s for the last attempt = 630 s")
    assert not bound.fits(300)


def test_the_recovery_settings_bound_a_step_with_the_default_operator_timeout():
    assert DEFAULT_OP_TIMEOUT_S == 120.0  # documented: README, docs/ascend.md
    assert RecoveryConfig().step_bound().needed_s == 660
    config = RecoveryConfig(max_reinference=2, round_timeout_s=10.0, op_timeout_s=5.0)
    assert config.step_bound().needed_s == 2 * (5 + 30) + 30


def test_vllms_timeout_is_read_as_vllm_reads_it():
    assert vllm_execute_timeout_s({}) == 300
    assert vllm_execute_timeout_s({VLLM_EXECUTE_TIMEOUT_ENV: "20"}) == 20
    with pytest.raises(FtkitError, match="VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='2.5' is not a "
                                         "whole number"):
        vllm_execute_timeout_s({VLLM_EXECUTE_TIMEOUT_ENV: "2.5"})


# --- the engines ftkit starts, and the others -------------------------------------------------

def test_an_engine_ftkit_starts_gets_the_timeout_its_recovery_needs():
    config = RecoveryConfig(enabled=True, round_timeout_s=20.0)
    timeout = execute_timeout(config, 2, {VLLM_EXECUTE_TIMEOUT_ENV: "20"})
    assert timeout is not None and timeout.short
    assert timeout.seconds == 3 * (120 + 60) + 30
    # A larger value in the environment is kept.
    timeout = execute_timeout(config, 2, {VLLM_EXECUTE_TIMEOUT_ENV: "1000"})
    assert timeout is not None and not timeout.short and timeout.seconds == 1000
    # One rank: vLLM runs the step in the engine core, with no timeout. No recovery: nothing.
    assert execute_timeout(config, 1, {}) is None
    assert execute_timeout(None, 2, {}) is None
    assert execute_timeout(config.replace(enabled=False), 2, {}) is None


def _served_config(world_size: int, recovery: dict | None = None) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the plugin reads, for an engine ftkit did not start."""
    additional = {} if recovery is None else {"fault_tolerance": recovery}
    return SimpleNamespace(additional_config=additional,
                           parallel_config=SimpleNamespace(world_size=world_size))


def test_a_served_engine_with_a_short_timeout_gets_it_raised_in_its_engine_core(
        monkeypatch, caplog):
    """The plugin's wrapper of the multi-process executor's start raises vLLM's timeout in
    the engine core's environment, where vLLM reads it at every step RPC, and says so."""
    from vllm import envs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from ftkit.vllm import plugin

    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "300")
    started = []
    monkeypatch.setattr(MultiprocExecutor, "_init_executor",
                        lambda self: started.append(envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS))
    envs.enable_envs_cache()  # as in an engine core that has started an engine before
    try:
        plugin._raise_execute_timeout_as_executors_start()
        executor = SimpleNamespace(vllm_config=_served_config(2, {"enabled": True}))
        with caplog.at_level(logging.WARNING, logger="ftkit"):
            MultiprocExecutor._init_executor(executor)
        # The executor started with the raised value, and reads it at every step.
        assert started == [660] and envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS == 660
    finally:
        envs.disable_envs_cache()
    [message] = [r.getMessage() for r in caplog.records if r.name == "ftkit"]
    assert "recovery may need up to 660 s for one step" in message
    assert "vLLM ends the engine when a step takes longer than 300 s" in message
    assert "raised VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS to 660 for this engine" in message


def test_a_served_engine_keeps_a_long_enough_timeout_and_one_without_recovery_its_own(
        monkeypatch, caplog):
    from ftkit.vllm.plugin import raise_execute_timeout_for

    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "660")
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        assert raise_execute_timeout_for(_served_config(2, {"enabled": True})) is None
    caplog.clear()
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "20")
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        assert raise_execute_timeout_for(_served_config(2)) is None
        assert raise_execute_timeout_for(_served_config(2, {"enabled": False})) is None
        assert raise_execute_timeout_for(_served_config(1, {"enabled": True})) is None
    assert [r for r in caplog.records if r.name == "ftkit"] == []
    assert os.environ[VLLM_EXECUTE_TIMEOUT_ENV] == "20"
    assert raise_execute_timeout_for(_served_config(2, {"enabled": True})) == 660


# --- validation -------------------------------------------------------------------------------

def hang_scenario(op_timeout_s: float, times: int, tp: int = 2, rank: str = "all") -> str:
    return f"""
name: long_hang
engine: {{model: tiny, tensor_parallel_size: {tp}}}
workload:
  prompts: ["a b c", "d e f"]
  max_tokens: 16
faults:
  - kind: hang
    rank: {rank}
    at: {{request: 1, token: 5}}
    times: {times}
    params: {{op_timeout_s: {op_timeout_s}}}
"""


def test_a_hang_that_outlasts_the_steps_bound_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.delenv(VLLM_EXECUTE_TIMEOUT_ENV, raising=False)
    with pytest.raises(ScenarioErrors) as raised:
        load_scenario_text(hang_scenario(150, 3), "long_hang.yaml")
    [error] = raised.value.errors
    assert error.field == "faults[0].params.op_timeout_s"
    assert error.line == 12
    # 3 x (150 + 90) + 30 = 750 > 3 x (120 + 90) + 30 = 660
    assert error.message.startswith(
        "3 failing attempts x (150 s operator timeout + 90 s recovery round, 3 x "
        "round_timeout_s 30 s) + 30 s for the last attempt = 750 s exceed the 660 s vLLM "
        "waits for one step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
    assert error.message.endswith("lower params.op_timeout_s or times, or set "
                                  "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=750 or more")


def test_a_hang_within_the_bound_ftkit_gives_its_engine_is_accepted(monkeypatch):
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "20")
    # 3 x (110 + 90) + 30 = 630 <= 660: vLLM's 20 s does not count, ftkit raises it.
    load_scenario_text(hang_scenario(110, 3))
    # The environment may give more than ftkit would: 750 s then fits.
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "750")
    load_scenario_text(hang_scenario(150, 3))
    # One rank: vLLM bounds no step.
    monkeypatch.delenv(VLLM_EXECUTE_TIMEOUT_ENV)
    load_scenario_text(hang_scenario(600, 3, tp=1, rank="0"))


def test_validation_names_a_malformed_timeout_in_the_environment(monkeypatch):
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "soon")
    with pytest.raises(ScenarioErrors, match="'soon' is not a whole number of seconds"):
        load_scenario_text(hang_scenario(1, 1))


def test_settings_recovery_cannot_handle_are_refused_as_the_executor_starts(monkeypatch):
    """More pipeline stages than recovery handles fail inside vLLM-CPU's executor start (its
    NUMA assertion) where the threads are not bound, before a worker, and the workers' own
    check, exists: the executor's start refuses them first."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from ftkit.vllm import plugin

    started = []
    monkeypatch.setattr(MultiprocExecutor, "_init_executor", lambda self: started.append(1))
    plugin._raise_execute_timeout_as_executors_start()
    config = _served_config(2, {"enabled": True})
    config.parallel_config = SimpleNamespace(world_size=3, pipeline_parallel_size=3,
                                             tensor_parallel_size=1)
    with pytest.raises(Exception, match="pipeline"):
        MultiprocExecutor._init_executor(SimpleNamespace(vllm_config=config))
    assert started == []
    # Without recovery the executor starts as vLLM's.
    MultiprocExecutor._init_executor(SimpleNamespace(vllm_config=_served_config(2, None)))
    assert started == [1]
