"""Resume after a process kill, for the request features a resumed request must continue
exactly: the finished text, and a stop string that straddles the kill.

A resumed request's prompt ends with the tokens it had produced, so vLLM's own detokenizer of
it starts after them: its text covers only what follows the resume, and it looks for stop
strings only there. The front end feeds the original request's detokenizer the whole stream
instead (``ftkit.vllm.workload._Shadow``). Every run is in one child process
(``_feature_run.py``), on a TP 1 engine whose core runs in a process of its own (the kill's
target), and is compared with a plain engine's run of the same workload.
"""

from __future__ import annotations

import pytest

from ftkit.contracts.job import SamplingSpec

from conftest import ENGINE_STARTS, FEATURE_PROMPTS, PLAIN_RUNS, feature_run
from conftest import RESUME_PROMPTS as PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The engine core is killed in the step of request 1's token ``KILL_AT``.
KILL_AT = 14


def _stop_runs(tiny_model: str, baseline) -> tuple[list[dict], str]:
    """The stop-string workload's runs, and its stop string."""
    # A stop string around the end of the text of request 1's first KILL_AT tokens: it is
    # completed by a token the resumed request produces. (The plain run: the session's
    # baseline engine, conftest.PLAIN_RUNS.)
    from transformers import AutoTokenizer

    assert PLAIN_RUNS["resume_stop"][1].max_tokens == 30
    plain = baseline.plain_runs["resume_stop"]
    text = plain[1]["text"]
    cut = len(AutoTokenizer.from_pretrained(tiny_model).decode(plain[1]["tokens"][:KILL_AT]))
    stop = text[cut - 2:cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2, (text, cut)
    kill = {"kind": "process_kill", "rank": 0, "at": {"request": 1, "token": KILL_AT},
            "phase": "forward", "params": {"target": "engine"}}
    workload = {"prompts": PROMPTS,
                "sampling": {"max_tokens": 30, "requests": [{}, {"stop": [stop]}]}}
    resumed = {"recovery": True, "faults": [kill], "max_restarts": 1, "workload": workload}
    return [{"name": "baseline", "recovery": False, "workload": workload},
            {"name": "resumed", **resumed},
            {"name": "crippled", **resumed, "cripple": "shadow"}], stop


@pytest.fixture(scope="module")
def runs(both):
    result, stop, _, _ = both
    return result, stop


def test_a_stop_string_straddling_the_kill_ends_the_request_where_it_would_have(runs):
    result, stop = runs
    baseline, resumed = result["baseline"], result["resumed"]
    assert resumed["error"] is None and resumed["restarts"] == 1
    stopped = baseline["outputs"][1]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert len(stopped["tokens"]) > KILL_AT  # the token completing it came after the kill
    # Every completion, text, finish and stop reason included, as the plain engine's.
    assert resumed["outputs"] == baseline["outputs"]


def test_without_the_original_detokenizer_the_stop_is_missed_and_the_text_is_wrong(runs):
    result, stop = runs
    baseline, crippled = result["baseline"], result["crippled"]
    assert crippled["error"] is None and crippled["restarts"] == 1
    want, got = baseline["outputs"][1], crippled["outputs"][1]
    # The request runs on to its max_tokens: the stop string was never seen.
    assert (got["finish_reason"], got["stop_reason"]) == ("length", None)
    assert len(got["tokens"]) == 30 and got["tokens"][:len(want["tokens"])] == want["tokens"]
    # Request 0, never stopped, still has only the text produced after the resume.
    assert crippled["outputs"][0]["tokens"] == baseline["outputs"][0]["tokens"]
    assert baseline["outputs"][0]["text"].endswith(crippled["outputs"][0]["text"])
    assert crippled["outputs"][0]["text"] != baseline["outputs"][0]["text"]


# --- the features whose state is the tokens so far: penalties, bad words, n > 1 ------------

FEATURE_TOKENS = 28
#: Request 1: greedy, with penalties counted over output tokens only.
PENALTIES = {"frequency_penalty": 0.8, "presence_penalty": 0.8}
#: Request 2: two seeded completions (vLLM seeds completion j with seed + j).
SAMPLES = {"n": 2, "temperature": 0.8, "seed": 7}


def _bad_word_at_the_kill(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """A kill position K and a bad word of two tokens, ``tokens[K-1:K+1]``, that tokenizes
    back to them and appears nowhere earlier: its first token is produced before the kill,
    the token it forbids is the first one the resumed request produces."""
    for kill in range(8, len(tokens) - 4):
        pair = tokens[kill - 1:kill + 1]
        word = tokenizer.decode(pair)
        earlier = {tuple(tokens[j:j + 2]) for j in range(kill - 1)}
        # (vLLM encodes a bad word without its leading spaces.)
        if word == word.lstrip() and tokenizer.encode(word, add_special_tokens=False) == pair \
                and tuple(pair) not in earlier:
            return kill, word
    raise AssertionError(f"no two tokens of {tokens} make a bad word")


def _feature_runs(tiny_model: str, baseline) -> tuple[list[dict], list[dict], int]:
    """The features' workload's runs, its fault-free run without the bad word and the kill's
    position."""
    from transformers import AutoTokenizer

    requests = [{}, dict(PENALTIES), dict(SAMPLES)]
    sampling = {"max_tokens": FEATURE_TOKENS, "requests": requests}
    # The plain run of this workload (the session's baseline engine, conftest.PLAIN_RUNS).
    assert PLAIN_RUNS["resume_features"][1].to_mapping() == \
        SamplingSpec.from_mapping(sampling).to_mapping()
    plain = baseline.plain_runs["resume_features"]
    kill_at, word = _bad_word_at_the_kill(AutoTokenizer.from_pretrained(tiny_model),
                                          plain[0]["tokens"])
    requests[0] = {"bad_words": [word]}
    kill = {"kind": "process_kill", "rank": 0, "at": {"request": 0, "token": kill_at},
            "phase": "forward", "params": {"target": "engine"}}
    workload = {"prompts": FEATURE_PROMPTS, "sampling": sampling}
    resumed = {"recovery": True, "faults": [kill], "max_restarts": 1, "workload": workload}
    return [{"name": "features_baseline", "recovery": False, "workload": workload},
            {"name": "features_resumed", **resumed},
            {"name": "no_earlier_outputs", **resumed, "cripple": "earlier_outputs"},
            {"name": "one_seed", **resumed, "cripple": "child_seed"}], plain, kill_at


@pytest.fixture(scope="module")
def both(tiny_model, baseline, tmp_path_factory):
    """Both workloads' runs in one child: the plain runs first, on one plain engine, then
    ftkit's, on one engine and the engines that replace it after each kill."""
    stop_runs, stop = _stop_runs(tiny_model, baseline)
    feature_runs, plain, kill_at = _feature_runs(tiny_model, baseline)
    runs = stop_runs + feature_runs
    result = feature_run({"model": tiny_model, "multiprocess": True,
                          "event_log_dir": str(tmp_path_factory.mktemp("events")),
                          "runs": [r for r in runs if not r["recovery"]]
                          + [r for r in runs if r["recovery"]]}, timeout_s=540)
    # One plain engine, one of ftkit's, and one more after each of the five kills.
    assert result[ENGINE_STARTS] == 2 + 5
    return result, stop, plain, kill_at


@pytest.fixture(scope="module")
def feature_runs(both):
    result, _, plain, kill_at = both
    renamed = {"features_baseline": "baseline", "features_resumed": "resumed"}
    return {renamed.get(name, name): run for name, run in result.items()}, plain, kill_at


def _by_key(run: dict) -> dict[tuple, dict]:
    return {tuple(o["key"]): o for o in run["outputs"]}


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def test_penalties_bad_words_and_samples_continue_exactly_after_the_kill(feature_runs):
    result, plain, kill_at = feature_runs
    baseline, resumed = result["baseline"], result["resumed"]
    assert resumed["error"] is None and resumed["restarts"] == 1
    # The bad word acts at the kill: the fault-free run without it had its last token there.
    assert _first_difference(baseline["outputs"][0]["tokens"], plain[0]["tokens"]) == kill_at
    assert sorted(_by_key(baseline)) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    # Tokens, logprobs, finish and stop reasons, text: all as the plain engine's.
    assert resumed["outputs"] == baseline["outputs"]


def test_without_the_earlier_outputs_penalties_and_bad_words_go_wrong_after_the_kill(
        feature_runs):
    result, _, kill_at = feature_runs
    want, got = _by_key(result["baseline"]), _by_key(result["no_earlier_outputs"])
    assert result["no_earlier_outputs"]["restarts"] == 1
    # The bad word is not seen: the resumed request's first token is the forbidden one.
    assert _first_difference(got[(0, 0)]["tokens"], want[(0, 0)]["tokens"]) == kill_at
    # The penalties forget the tokens before the kill: the stream changes after it.
    assert (_first_difference(got[(1, 0)]["tokens"], want[(1, 0)]["tokens"]) or -1) >= kill_at
    # The samples of request 2 use neither: they are exact.
    assert got[(2, 0)] == want[(2, 0)] and got[(2, 1)] == want[(2, 1)]


def test_with_one_seed_for_both_samples_the_second_sample_goes_wrong_after_the_kill(
        feature_runs):
    result, _, kill_at = feature_runs
    want, got = _by_key(result["baseline"]), _by_key(result["one_seed"])
    assert result["one_seed"]["restarts"] == 1
    assert got[(2, 0)] == want[(2, 0)]  # its seed is the request's own
    first = _first_difference(got[(2, 1)]["tokens"], want[(2, 1)]["tokens"])
    assert first is not None and first >= kill_at - 1
    for key in [(0, 0), (1, 0)]:
        assert got[key] == want[key]
