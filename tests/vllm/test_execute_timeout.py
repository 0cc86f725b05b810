"""A step whose recovery outlasts vLLM's own bound on one step RPC, on a real TP 2 engine.

vLLM's multi-process executor ends the engine when one ``execute_model`` RPC takes longer than
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, and every re-run of a step happens inside that RPC. To
keep the test short the environment gives vLLM 20 s (its default is 300 s) and the fault is a
hang of three attempts of 8 s: 24 s of hanging alone. ftkit raises the timeout of the engines
it starts to what their recovery settings need (``ftkit.bounds.step_bound``), and its plugin
raises it in the engine core of an engine ftkit did not start (``vllm serve``), where vLLM reads
it; without either (crippled) the engine dies at the faulted step.
"""

from __future__ import annotations

import pytest

from conftest import GREEDY, fault, recovery_config, run_with_faults
from ftkit.bounds import VLLM_EXECUTE_TIMEOUT_ENV
from ftkit.scenario import EngineSpec
from ftkit.vllm import environment
from ftkit.vllm.engine import EngineSession

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Request 3's output token 9: its step hangs on rank 1 three times, 8 s each.
REQUEST, TOKEN = 3, 9
HANG = fault("hang", 1, REQUEST, TOKEN, times=3, op_timeout_s=8.0)


def hang_run(tiny_model: str, event_log: str):
    engine = EngineSession(EngineSpec(model=tiny_model, tensor_parallel_size=2),
                           recovery=recovery_config(event_log))
    with engine:
        return engine.execute_timeout, run_with_faults(engine, GREEDY, [HANG], timeout_s=180)


@pytest.mark.exhaustive  # the plugin's raise, and the negative of both, in the fast tier
def test_ftkit_raises_vllms_timeout_and_the_long_hang_is_recovered(
        tiny_model, baseline, tmp_path, monkeypatch):
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "20")
    timeout, run = hang_run(tiny_model, str(tmp_path))
    # max_reinference 3 x (120 s operator timeout + 3 x 20 s round) + 30 s = 570 s
    assert timeout is not None and timeout.short
    assert (timeout.vllm_s, timeout.seconds) == (20, 570)
    assert run.error is None, run.error
    assert [e.attempt for e in run.fired] == [1, 2, 3]
    assert [r.failures for r in run.recovered] == [3, 3]  # both ranks, after three failures
    assert run.tokens == baseline.tokens["greedy"]


def test_an_engine_ftkit_did_not_raise_it_for_gets_it_raised_by_the_plugin(
        tiny_model, baseline, tmp_path, monkeypatch, capfd):
    """As under ``vllm serve``: the engine's starter leaves the timeout at 20 s, and ftkit's
    plugin raises it in the engine core as the executor starts."""
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "20")
    monkeypatch.setattr(environment, "execute_timeout", lambda *args, **kwargs: None)
    timeout, run = hang_run(tiny_model, str(tmp_path))
    assert timeout is None  # the session raised nothing
    assert run.error is None, run.error
    captured = capfd.readouterr()
    assert "raised VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS to 570 for this engine" \
        in captured.out + captured.err
    assert [e.attempt for e in run.fired] == [1, 2, 3]
    assert [r.failures for r in run.recovered] == [3, 3]
    assert run.tokens == baseline.tokens["greedy"]


#: Loaded by the engine's processes (``sitecustomize``): the plugin raises nothing either.
NO_RAISE = """\
from ftkit.vllm import environment
environment.execute_timeout = lambda *args, **kwargs: None
"""


def test_without_the_raised_timeout_vllm_ends_the_engine_at_the_hung_step(
        tiny_model, baseline, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(VLLM_EXECUTE_TIMEOUT_ENV, "20")
    monkeypatch.setattr(environment, "execute_timeout", lambda *args, **kwargs: None)
    patch = tmp_path / "cripple"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(NO_RAISE)
    monkeypatch.setenv("PYTHONPATH", str(patch))
    (tmp_path / "events").mkdir()
    timeout, run = hang_run(tiny_model, str(tmp_path / "events"))
    assert timeout is None
    assert run.error is not None
    # The engine core gave up on the step's RPC after 20 s, in the third hung attempt ...
    captured = capfd.readouterr()
    assert "RPC call to execute_model timed out" in captured.out + captured.err
    assert "raised VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in captured.out + captured.err
    assert [e.attempt for e in run.fired] == [1, 2, 3] and run.recovered == []
    # ... so request 3 ends with the tokens before its hung step, and no request got further
    # than the fault-free run's tokens up to that step.
    expected = baseline.tokens["greedy"]
    assert run.tokens[REQUEST] == expected[REQUEST][:TOKEN]
    for tokens, full in zip(run.tokens, expected):
        assert tokens == full[:len(tokens)] and len(tokens) < len(full)
