"""A scenario against a real server (``engine.mode: serve``), through the scenario runner:
``scenarios/serve_link_flap.yaml`` (TP 2, a link flap and a device reset mid-stream, four
compared streams beside two background ones), with request 1 sampling two completions with
top-2 logprobs and requests 2 and 3 asking for top-k and prompt logprobs, passes with both
faults fired and recovered, every completion, top-k and prompt logprob compared; so does its
flap with the chat API and request 1's two samples; the same
flap with ``max_reinference`` below its failing attempts fails. One server start per test."""

from __future__ import annotations

import math
from pathlib import Path

import psutil
import pytest
import yaml

from ftkit.results import Verdict
from ftkit.runner import ScenarioRunner, serve
from ftkit.scenario import load_scenario, load_scenario_text
from ftkit.scenario.model import RecoverySpec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "serve_link_flap.yaml"


def run(scenario, file: Path = SCENARIO):
    """``scenario``'s result, run as the file ``file``; nothing of its server left after."""
    before = set(psutil.Process().children(recursive=True))  # earlier tests' helpers
    with ScenarioRunner(use_cache=False) as runner:
        result = runner.run(scenario, file=str(file))
    # The server was this process's child; it is reaped, and nothing it started is left.
    assert set(psutil.Process().children(recursive=True)) - before == set()
    return result


#: Request 1: two seeded completions with top-2 logprobs; request 2 (its KV cache lost to the
#: device reset): top-1 and prompt logprobs 0; request 3: top-2 and prompt logprobs 2 (both
#: streamed by the echo).
SAMPLING = {1: {"n": 2, "temperature": 0.8, "seed": 7, "logprobs": 2},
            2: {"logprobs": 1, "prompt_logprobs": 0},
            3: {"logprobs": 2, "prompt_logprobs": 2}}


def with_samples_and_logprobs() -> object:
    """The bundled scenario with ``SAMPLING``, validated as a file would be."""
    data = yaml.safe_load(SCENARIO.read_text())
    prompts = data["workload"].pop("prompts")
    data["workload"]["requests"] = [{"prompt": p, **({"sampling": SAMPLING[i]} if i in SAMPLING
                                                     else {})} for i, p in enumerate(prompts)]
    return load_scenario_text(yaml.safe_dump(data), file=str(SCENARIO))


def test_the_serve_scenario_passes_with_its_faults_fired_and_recovered(tiny_model,
                                                                       monkeypatch):
    compared = []

    def verify_and_keep(scenario, baseline, run, **kwargs):
        compared.append((baseline, run))
        return verify(scenario, baseline, run, **kwargs)

    verify = serve.verify
    monkeypatch.setattr(serve, "verify", verify_and_keep)
    scenario = with_samples_and_logprobs()
    result = run(scenario)
    assert result.verdict == Verdict.PASS, (result.reason, result.error)
    flap, reset = result.faults
    assert (flap.kind, flap.fired, flap.attempts, flap.recovered) == ("link_flap", True, 2, True)
    assert (reset.kind, reset.fired, reset.attempts, reset.recovered) == \
        ("device_reset", True, 1, True)
    assert result.reinferences == 3
    # Every compared completion ran to max_tokens and matched the fault-free run, token for
    # token (request 1's two samples apart).
    assert [r.key for r in result.requests] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]
    assert [len(r.actual) for r in result.requests] == [32] * 5
    assert all(r.matches for r in result.requests)
    # What was compared: the top-k at every position and the prompt logprobs (the first
    # prompt position has none), as the offline mode records them.
    [(baseline, faulted)] = compared
    outputs = {o.key: o for o in faulted.requests}
    for key, k, p in [((1, 0), 2, None), ((1, 1), 2, None), ((2, 0), 1, 0), ((3, 0), 2, 2)]:
        output = outputs[key]
        assert len(output.top_logprobs) == 32, key
        assert all(k <= len(top) <= k + 1 and top[0][0] == token
                   for top, token in zip(output.top_logprobs, output.token_ids)), key
        if p is None:
            assert output.prompt_logprobs is None, key
            continue
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) > 1, key
        assert all(max(1, p) <= len(top) <= p + 1 for top in output.prompt_logprobs[1:]), key
    assert outputs[(1, 0)].token_ids != outputs[(1, 1)].token_ids  # two samples, seeded apart
    assert outputs[(0, 0)].top_logprobs is None and outputs[(0, 0)].prompt_logprobs is None
    # The crippled variant: one top-k logprob of sample 1, one ulp off, fails the verdict.
    outputs[(1, 1)].top_logprobs[20][1][1] = math.nextafter(
        outputs[(1, 1)].top_logprobs[20][1][1], 0.0)
    crippled = verify(scenario, baseline, faulted, file=str(SCENARIO), duration_s=1.0)
    assert crippled.verdict == Verdict.FAIL
    assert (crippled.first_mismatch.key, crippled.first_mismatch.diverged_field,
            crippled.first_mismatch.position) == ((1, 1), "top_logprobs", 20)
    client = result.client
    assert client is not None and client.api == "completions"
    assert len(client.run) == 6 and sum(s.background for s in client.run) == 2
    assert client.failed_requests == 0
    # Request 1's stream carries its two completions (a background stream may be request 1).
    assert all(s.tokens == 32 * (2 if s.request == 1 else 1) and s.ttft_s is not None
               for s in client.run)
    # The recovery rounds show as the largest gap between two tokens of a stream.
    assert client.max_gap_s is not None and client.max_ttft_s is not None
    assert result.to_dict()["client"]["failed_requests"] == 0


@pytest.mark.exhaustive
def test_a_chat_serve_scenario_compares_each_sample_and_its_top_logprobs(tiny_model,
                                                                         monkeypatch):
    """The chat API on the default model (its chat template is the tiny model's own): request
    1 samples two completions with top-2 logprobs, through the link flap; the chat API is asked for 3 (it leaves out rank k when the sampled token is outside
    the top k), and every position carries the 3 it returns, the sampled token first."""
    compared = []

    def verify_and_keep(scenario, baseline, run, **kwargs):
        compared.append(run)
        return verify(scenario, baseline, run, **kwargs)

    verify = serve.verify
    monkeypatch.setattr(serve, "verify", verify_and_keep)
    data = yaml.safe_load(SCENARIO.read_text())
    data["workload"].update(api="chat", background_streams=0, requests=[
        {"prompt": p, **({"sampling": SAMPLING[1]} if i == 1 else {})}
        for i, p in enumerate(data["workload"].pop("prompts"))])
    data["faults"] = data["faults"][:1]
    result = run(load_scenario_text(yaml.safe_dump(data), file=str(SCENARIO)))
    assert result.verdict == Verdict.PASS, (result.reason, result.error)
    assert (result.faults[0].fired, result.faults[0].recovered) == (True, True)
    assert [r.key for r in result.requests] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]
    assert all(r.matches and len(r.actual) == 32 for r in result.requests)
    outputs = {o.key: o for o in compared[0].requests}
    for key in [(1, 0), (1, 1)]:
        assert [len(top) for top in outputs[key].top_logprobs] == [3] * 32, key
        assert all(top[0][0] == token for top, token in zip(outputs[key].top_logprobs,
                                                             outputs[key].token_ids)), key
    assert outputs[(1, 0)].token_ids != outputs[(1, 1)].token_ids
    assert result.client is not None and result.client.api == "chat"


@pytest.mark.exhaustive
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
