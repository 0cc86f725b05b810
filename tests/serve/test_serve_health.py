"""ftkit's health view and Prometheus series on a real ``vllm serve`` (TP 2, the module form):
before any fault, after a fault recovered (planned through ``POST /ftkit/inject``), ftkit's log
lines in the server's output formatted as vLLM's, and the state directory gone once the server
exits cleanly.

The server runs with its own temporary folder, so that the state directory it makes (and
removes) is the only one there.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _server import SECRET, Server, vllm_server

from ftkit.serve.control import SECRET_ENV, SECRET_HEADER
from ftkit.serve.state import OWNER_FILE
from ftkit.vllm.environment import _inductor_cache_dir

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(400)]

PROMPT = "The quick brown fox"
MAX_TOKENS = 16
#: Bound on waiting for the ranks' files to show a finished round, and for the server's exit.
SETTLE_S = 20.0
EXIT_S = 60.0


def post(server: Server, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> dict[str, Any]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None


def completion(server: Server) -> list[int]:
    """The greedy completion of ``PROMPT``, as token ids."""
    model = json.loads(server.get("/v1/models")[1])["data"][0]["id"]
    answer = post(server, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 1, "return_tokens_as_token_ids": True})
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metrics(server: Server) -> dict[str, float]:
    """ftkit's samples in the server's /metrics, as {name{labels}: value}."""
    status, text = server.get("/metrics")
    assert status == 200
    return {m[1]: float(m[2]) for m in re.finditer(r"^(ftkit_\w+(?:\{[^}]*\})?) (\S+)$",
                                                   text, re.M)}


def ranks_written(state: Path) -> list[str]:
    """What the workers wrote in the state directory (its owner file is the server's)."""
    return sorted(p.name for p in state.iterdir() if p.name != OWNER_FILE)


def health(server: Server) -> tuple[int, dict[str, Any]]:
    status, body = server.get("/ftkit/health")
    return status, json.loads(body)


def test_health_and_metrics_before_and_after_a_recovered_fault(tiny_model: str,
                                                                tmp_path: Path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {SECRET_ENV: SECRET, "TMPDIR": str(temp),
           # The compiled kernels stay where every other server finds them.
           "TORCHINDUCTOR_CACHE_DIR": _inductor_cache_dir()}
    with vllm_server(tiny_model, tmp_path / "server.log", env=env,
                     fault_tolerance={"enabled": True, "injection": True}) as server:
        [state] = temp.glob("ftkit-serve-*")  # made by the API server for its workers

        # Before any fault: healthy, every series at 0, and a fault-free request writes nothing.
        assert server.get("/health")[0] == 200
        reference = completion(server)
        assert len(reference) == MAX_TOKENS
        status, body = health(server)
        assert status == 200
        assert body == {"status": "healthy", "recovering_since": None, "ranks": [
            {"rank": r, "recovering_since": None, "faults": {}, "rounds": {}, "updated": None}
            for r in (0, 1)]}
        before = metrics(server)
        assert before['ftkit_faults_total{kind="link_break"}'] == 0
        assert before['ftkit_recovery_rounds_total{outcome="recompute"}'] == 0
        assert before["ftkit_recovery_duration_seconds_count"] == 0
        assert before["ftkit_engine_restarts_total"] == 0
        assert ranks_written(state) == []

        # A link break on rank 1, two steps into the next request: recovered, same tokens.
        post(server, "/ftkit/inject", {"kind": "link_break", "rank": 1, "after_steps": 2},
             headers={SECRET_HEADER: SECRET})
        assert completion(server) == reference
        deadline = time.monotonic() + SETTLE_S
        while True:
            after = metrics(server)
            status, body = health(server)
            if all(r["rounds"] for r in body["ranks"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert after['ftkit_faults_total{kind="link_break"}'] == 1
        assert after['ftkit_recovery_rounds_total{outcome="recompute"}'] == 1
        assert after['ftkit_recovery_rounds_total{outcome="raise"}'] == 0
        assert after["ftkit_recovery_duration_seconds_count"] == 1
        assert after["ftkit_reinferences_total"] >= 1
        assert after["ftkit_exhausted_steps_total"] == 0
        assert status == 200 and body["status"] == "healthy"
        assert body["recovering_since"] is None
        assert [r["faults"] for r in body["ranks"]] == [{}, {"link_break": 1}]
        assert [r["rounds"] for r in body["ranks"]] == [{"recompute": 1}] * 2
        assert ranks_written(state) == ["rank0.json", "rank1.json"]

        # ftkit's lines are formatted by vLLM's handler, a worker's with its process name.
        output = server.output()
        injected = [line for line in output.splitlines()
                    if "ftkit: injecting link_break on rank 1" in line]
        assert len(injected) == 1, injected
        assert re.search(r"\(Worker\S* pid=\d+\) WARNING ", injected[0]), injected[0]
        assert re.search(r"\(Worker\S* pid=\d+\) INFO .*ftkit: recovery \w+ on rank 0 of 2",
                         output)

        # A clean shutdown removes the state directory.
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=EXIT_S)
    assert not state.exists()
    assert list(temp.glob("ftkit-serve-*")) == []


def test_an_unrecovered_fault_shows_as_dead_and_the_state_still_goes(tiny_model: str,
                                                                    tmp_path: Path):
    """``max_reinference: 0``: the first fault is surfaced to vLLM, whose engine dies. Both
    health views say so (503), the series count the step ftkit surfaced, and the server's
    exit after that still removes the state directory. (vLLM's server ends itself once its
    engine died, unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` keeps it answering.)"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {SECRET_ENV: SECRET, "TMPDIR": str(temp),
           "TORCHINDUCTOR_CACHE_DIR": _inductor_cache_dir(),
           "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    with vllm_server(tiny_model, tmp_path / "server.log", env=env,
                     fault_tolerance={"enabled": True, "injection": True,
                                      "max_reinference": 0}) as server:
        [state] = temp.glob("ftkit-serve-*")
        post(server, "/ftkit/inject", {"kind": "link_break", "rank": 1, "after_steps": 2},
             headers={SECRET_HEADER: SECRET})
        with pytest.raises(AssertionError, match="HTTP 5"):
            completion(server)
        deadline = time.monotonic() + SETTLE_S
        while health(server)[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = health(server)
        assert (status, body["status"]) == (503, "dead")
        assert server.get("/health")[0] == 503
        after = metrics(server)
        assert after['ftkit_faults_total{kind="link_break"}'] == 1
        assert after['ftkit_recovery_rounds_total{outcome="raise"}'] == 1
        assert after["ftkit_exhausted_steps_total"] == 1
        assert after["ftkit_reinferences_total"] == 0

        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=EXIT_S)
    assert not state.exists()
