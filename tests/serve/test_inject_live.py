"""``ftkit inject`` against a real ``vllm serve`` (TP 2, the module form the README gives for
CPU) while real ``openai`` clients stream: link, device and memory faults planned for a
client's ``X-Request-Id`` (before the request arrives) or a number of steps ahead (while the
streams run) are recovered, and every stream ends with the token ids, logprobs and finish
reason of the same server's fault-free run. Refused injections (wrong or missing secret, bad
faults) change nothing. Last, a fault that outlasts ``max_reinference`` ends the engine: the
faults are real, and an unrecovered one shows in the streams.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from _server import SECRET, served_model, vllm_server

from ftkit import INJECT_SECRET_ENV as SECRET_ENV
from ftkit import inject_live_fault

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

FTKIT = str(Path(sys.executable).with_name("ftkit"))
PROMPTS = ("The quick brown fox", "Once upon a time", "In the beginning",
           "Hello world, my name is")
MAX_TOKENS = 24


def stream(base_url: str, key: str, prompt: str, max_tokens: int = MAX_TOKENS,
           first_token: threading.Event | None = None) -> dict[str, Any]:
    """One streamed completion with ``X-Request-Id: key``: its token ids, logprobs, finish
    reason, or the error that ended it."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=180)
    tokens: list[str] = []
    logprobs: list[float] = []
    finish = None
    try:
        chunks = client.completions.create(
            model=served_model(base_url), prompt=prompt, max_tokens=max_tokens,
            temperature=0, logprobs=1, stream=True, extra_headers={"X-Request-Id": key},
            extra_body={"return_tokens_as_token_ids": True})
        for chunk in chunks:
            choice = chunk.choices[0]
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                if first_token is not None:
                    first_token.set()
            finish = choice.finish_reason or finish
    except openai.OpenAIError as exc:
        return {"tokens": tokens, "logprobs": logprobs, "finish": finish, "error": repr(exc)}
    return {"tokens": tokens, "logprobs": logprobs, "finish": finish, "error": None}


def streams(base_url: str, tag: str, max_tokens: int = MAX_TOKENS,
            while_running: Any = None) -> list[dict[str, Any]]:
    """Every prompt streamed at once, each on its own connection, as ``<tag>-<i>``;
    ``while_running()`` is called once the first token arrived."""
    out: dict[int, dict[str, Any]] = {}
    first = threading.Event()

    def one(i: int) -> None:
        out[i] = stream(base_url, f"{tag}-{i}", PROMPTS[i], max_tokens, first)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    if while_running is not None:
        assert first.wait(120), "no stream delivered a token"
        while_running()
    for thread in threads:
        thread.join(240)
    assert len(out) == len(PROMPTS), "a stream did not end"
    return [out[i] for i in range(len(PROMPTS))]


def ftkit_inject(url: str, *args: str, secret: str | None = SECRET
                 ) -> subprocess.CompletedProcess[str]:
    env_secret = [] if secret is None else ["--secret", secret]
    return subprocess.run([FTKIT, "inject", "--url", url, *args, *env_secret],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != SECRET_ENV})


def fired(server: Any) -> list[str]:
    """The server's log lines of faults that fired."""
    return re.findall(r"ftkit: injecting (\w+) on rank (\d+)", server.output())


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with vllm_server(tiny_model, log, env={"FTKIT_INJECT_SECRET": SECRET},
                     fault_tolerance={"enabled": True, "injection": True,
                                      "max_reinference": 3}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(server: Any) -> list[dict[str, Any]]:
    runs = streams(server.base_url, "ref")
    assert all(r["error"] is None and r["finish"] == "length" for r in runs), runs
    assert all(len(r["tokens"]) == MAX_TOKENS for r in runs)
    return runs


def assert_exact(runs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    for i, (run, ref) in enumerate(zip(runs, reference)):
        assert run["error"] is None, f"stream {i}: {run['error']}"
        assert run["tokens"] == ref["tokens"], f"stream {i}: tokens differ"
        assert run["logprobs"] == ref["logprobs"], f"stream {i}: logprobs differ"
        assert run["finish"] == ref["finish"]


def test_concurrent_fault_free_runs_of_the_server_agree(server, reference):
    """The oracle: the same server's fault-free run. Concurrent streams make each step's batch
    depend on arrival times; on CPU float32 the tiny model's logprobs do not depend on the
    batch, which this measures (a second fault-free run, started at once again)."""
    assert_exact(streams(server.base_url, "ref2"), reference)


@pytest.mark.parametrize(("kind", "rank", "extra"), [
    ("link_flap", "1", ("--times", "2")),
    ("device_reset", "0", ()),
    ("uce", "1", ("--params", '{"region": "kv"}')),
])
def test_a_fault_planned_for_a_clients_request_is_recovered_exactly(
        server, reference, kind, rank, extra):
    before = len(fired(server))
    tag = f"{kind}-run"
    result = ftkit_inject(server.url, "--kind", kind, "--rank", rank, "--request-id",
                          f"{tag}-2", "--token", "7", *extra)
    assert result.returncode == 0, result.stderr
    assert f"request '{tag}-2', token 7" in result.stdout
    assert_exact(streams(server.base_url, tag), reference)
    times = 2 if kind == "link_flap" else 1
    assert fired(server)[before:] == [(kind, rank)] * times


def test_a_fault_planned_steps_ahead_hits_the_running_streams(server):
    """Planned while the streams run, through the client's library call (the command takes
    seconds to start beside four streams on two cores, longer than they run). In two of about
    six runs the fault landed only after the streams had ended (it fired in the next test's),
    each time when this test ran right after ``test_a_fault_fires_on_exactly_the_request_named``
    (its single stream through a device reset); that test now runs after this one. Cause not
    found: see the issue 39 note."""
    long = 320
    reference = streams(server.base_url, "ahead-ref", max_tokens=long)
    before = len(fired(server))
    answers: list[dict[str, Any]] = []

    def plan() -> None:
        answers.append(inject_live_fault(server.url, {"kind": "link_break", "rank": 0,
                                                      "after_steps": 3}, SECRET))

    runs = streams(server.base_url, "ahead", max_tokens=long, while_running=plan)
    assert answers[0]["planned"]["after_steps"] == 3
    assert fired(server)[before:] == [("link_break", "0")]
    assert max(len(r["tokens"]) for r in reference) == long
    assert_exact(runs, reference)


def test_a_fault_fires_on_exactly_the_request_named(server, reference):
    """Issue 39: a fault planned for ``X-Request-Id: user`` fired on ``user-2`` (a prefix
    match). Planned for ``pfx``, it lets ``pfx-0`` ... ``pfx-3`` run untouched, and fires on
    the request named ``pfx`` itself."""
    before = len(fired(server))
    result = ftkit_inject(server.url, "--kind", "device_reset", "--rank", "0",
                          "--request-id", "pfx", "--token", "7")
    assert result.returncode == 0, result.stderr
    assert_exact(streams(server.base_url, "pfx"), reference)
    assert fired(server)[before:] == []
    assert_exact([stream(server.base_url, "pfx", PROMPTS[0])], reference[:1])
    assert fired(server)[before:] == [("device_reset", "0")]


@pytest.mark.parametrize(("secret", "why"), [
    (None, "wrong or missing secret"),
    ("not-the-secret-of-this-server", "wrong or missing secret"),
])
def test_an_injection_without_the_secret_is_refused_and_changes_nothing(
        server, reference, secret, why):
    before = len(fired(server))
    result = ftkit_inject(server.url, "--kind", "link_break", "--rank", "1", "--request-id",
                          "refused-1", "--token", "3", secret=secret)
    assert result.returncode == 1
    assert "HTTP 403" in result.stderr and why in result.stderr
    assert_exact(streams(server.base_url, "refused"), reference)
    assert fired(server)[before:] == []


@pytest.mark.parametrize(("args", "message"), [
    (("--kind", "link_break", "--rank", "2", "--after-steps", "0"), "not a rank of this server"),
    (("--kind", "no_such_kind", "--rank", "0", "--after-steps", "0"), "kind"),
    (("--kind", "uce", "--rank", "0", "--after-steps", "0"), "request_id and token"),
    (("--kind", "hang", "--rank", "0", "--after-steps", "0", "--params", '{"bogus": 1}'),
     "bogus"),
    # The kinds' own rules, as ftkit validate has them (issue 39: these were accepted, and
    # one of them ended the engine at fire time).
    (("--kind", "uce", "--rank", "0", "--phase", "before", "--request-id", "bad-1",
      "--token", "0", "--params", '{"region": "kv"}'), "before its prefill"),
    (("--kind", "process_kill", "--rank", "0", "--times", "3", "--after-steps", "0"),
     "times must be 1"),
    (("--kind", "oom", "--rank", "0", "--request-id", "bad-1", "--token", "9999"),
     "max_model_len"),
])
def test_a_bad_fault_is_refused_with_the_reason(server, args, message):
    before = len(fired(server))
    result = ftkit_inject(server.url, *args)
    assert result.returncode == 2, result.stderr
    assert "HTTP 422" in result.stderr and message in result.stderr
    time.sleep(0.5)
    assert fired(server)[before:] == []


def test_an_unreachable_server_is_a_clear_failure():
    result = ftkit_inject("http://127.0.0.1:9", "--kind", "link_break", "--rank", "0",
                          "--after-steps", "0")
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr


def test_zz_a_fault_beyond_max_reinference_ends_the_engine(server, reference):
    """The crippled variant: the same kind of fault, failing more attempts than the server
    re-runs, is not recovered: the faulted stream ends with an error (no engine restart under
    a server yet). Last in the module: the engine is gone afterwards."""
    result = ftkit_inject(server.url, "--kind", "link_flap", "--rank", "1", "--times", "4",
                          "--request-id", "beyond-1", "--token", "5")
    assert result.returncode == 0, result.stderr
    runs = streams(server.base_url, "beyond")
    assert runs[1]["error"] is not None
    assert runs[1]["tokens"] == reference[1]["tokens"][:len(runs[1]["tokens"])]
    assert len(runs[1]["tokens"]) < MAX_TOKENS
