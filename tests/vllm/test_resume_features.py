"""Resume after a process kill, for the request features a resumed request must continue
exactly: the finished text, and a stop string that straddles the kill.

A resumed request's prompt ends with the tokens it had produced, so vLLM's own detokenizer of
it starts after them: its text covers only what follows the resume, and it looks for stop
strings only there. The front end feeds the original request's detokenizer the whole stream
instead (``ftkit.vllm.workload._Shadow``). Each run is in a child process
(``_feature_run.py``), on a TP 1 engine whose core runs in a process of its own (the kill's
target), and is compared with a plain engine's run of the same workload.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["A small boat crossed the quiet lake at night.",
           "Write a short story about a river and a mountain."]
#: The engine core is killed in the step of request 1's token ``KILL_AT``.
KILL_AT = 14


def _child(config: dict) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_feature_run.py")),
                           json.dumps(config)], capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    base = {"model": tiny_model, "multiprocess": True, "prompts": PROMPTS,
            "event_log_dir": str(tmp_path_factory.mktemp("events"))}
    # A stop string around the end of the text of request 1's first KILL_AT tokens: it is
    # completed by a token the resumed request produces.
    from transformers import AutoTokenizer

    plain = _child({**base, "sampling": {"max_tokens": 30},
                    "runs": [{"name": "plain", "recovery": False}]})["plain"]
    text = plain["outputs"][1]["text"]
    cut = len(AutoTokenizer.from_pretrained(tiny_model).decode(
        plain["outputs"][1]["tokens"][:KILL_AT]))
    stop = text[cut - 2:cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2, (text, cut)
    kill = {"kind": "process_kill", "rank": 0, "at": {"request": 1, "token": KILL_AT},
            "phase": "forward", "params": {"target": "engine"}}
    resumed = {"recovery": True, "faults": [kill], "max_restarts": 1}
    return _child({**base, "sampling": {"max_tokens": 30, "requests": [{}, {"stop": [stop]}]},
                   "runs": [{"name": "baseline", "recovery": False},
                            {"name": "resumed", **resumed},
                            {"name": "crippled", **resumed, "cripple": "shadow"}]}), stop


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
