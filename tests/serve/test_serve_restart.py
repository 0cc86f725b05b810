"""A server with ``"max_restarts"`` survives SIGKILL of a worker and of its engine core: real
``openai`` streams (greedy, seeded sampling, a stop string, ``n = 2``, penalties, the chat API)
go on on their open connections, without an error, with the token ids, logprobs, text and
finish reasons of the same server's fault-free run. Once the restarts are used up (the crippled
variant) the next kill ends the streams with an error, as a server without ftkit does. With
``"standby": true`` a warm standby engine takes over.

Each kill comes once the engine runs every request in one batch (so every stream runs across
it: the server's log says it resumed each), and the stop string of the stop-string stream lies late in
its text (chosen from a fault-free run), so that the resumed request finds it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from typing import Any

import openai
import psutil
import pytest
from _server import SECRET, served_model, vllm_server

from ftkit import inject_live_fault

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: Streams (with ignore_eos) far longer than the ``KILL_AFTER_STEPS`` steps before the kill,
#: which is timed on the server's own steps (``kill_with_all_running``): every stream still
#: runs when the engine dies, and no token is produced while it is replaced.
MAX_TOKENS = 320
#: The standby test's streams: past its stop string (see there); its kill comes between runs.
STANDBY_MAX_TOKENS = 120
#: The tiny model's tokenizer has no chat template of its own.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "assistant:")
#: The requests: (API, request fields). Each is long enough to be running at the kill.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": "The quick brown fox", "temperature": 0}),
    ("completions", {"prompt": "Once upon a time", "temperature": 0.9, "seed": 11}),
    ("completions", {"prompt": "In the beginning", "temperature": 0.8, "seed": 5, "n": 2}),
    # Its greedy text has "road" about 55 tokens in (the standby test); the kill tests put a
    # string from late in the text in its place (``late_stop``).
    ("completions", {"prompt": "Once upon a time", "temperature": 0, "stop": ["road"]}),
    ("completions", {"prompt": "Hello world, my name is", "temperature": 0.7, "seed": 3,
                     "frequency_penalty": 0.8, "presence_penalty": 0.5}),
    ("chat", {"messages": [{"role": "user", "content": "Tell me a story"}],
              "temperature": 0.6, "seed": 9}),
]


def stream(base_url: str, key: str, api: str, fields: dict[str, Any],
           max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One streamed request: per completion its token ids, logprobs and finish reason, the
    time each token arrived, or the error that ended the stream."""
    model = served_model(base_url)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    got: dict[int, dict[str, Any]] = {}
    error = None
    try:
        if api == "chat":
            chunks = client.chat.completions.create(
                model=model, max_tokens=max_tokens, logprobs=True, stream=True,
                extra_headers={"X-Request-Id": key},
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, **fields)
        else:
            chunks = client.completions.create(
                model=model, max_tokens=max_tokens, logprobs=1, stream=True,
                extra_headers={"X-Request-Id": key},
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, **fields)
        for chunk in chunks:
            for choice in chunk.choices:
                seen = got.setdefault(choice.index, {"tokens": [], "logprobs": [], "text": "",
                                                     "finish": None, "times": []})
                if api == "chat":
                    entries = choice.logprobs.content if choice.logprobs else None
                    tokens = [e.token for e in entries or []]
                    logprobs = [e.logprob for e in entries or []]
                    seen["text"] += choice.delta.content or ""
                else:
                    tokens = choice.logprobs.tokens if choice.logprobs else []
                    logprobs = choice.logprobs.token_logprobs if choice.logprobs else []
                    seen["text"] += choice.text or ""
                seen["tokens"] += tokens
                seen["logprobs"] += logprobs
                seen["times"] += [time.monotonic()] * len(tokens)
                seen["finish"] = choice.finish_reason or seen["finish"]
    except openai.OpenAIError as exc:
        error = repr(exc) + (f" from {exc.__cause__!r}" if exc.__cause__ else "")
    return {"completions": got, "error": error}


def run_all(base_url: str, tag: str, requests: list[tuple[str, dict[str, Any]]] = REQUESTS,
            during: Any = None, max_tokens: int = MAX_TOKENS
            ) -> tuple[list[dict[str, Any]], float]:
    """Every request of ``requests`` streamed at once; ``during(tag)`` is called while they
    start. Returns the streams and when ``during`` returned."""
    out: dict[int, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, stream(base_url, f"{tag}-{i}", *requests[i], max_tokens)), daemon=True)
        for i in range(len(requests))]
    for thread in threads:
        thread.start()
    at = 0.0
    if during is not None:
        during(tag)
        at = time.monotonic()
    for thread in threads:
        thread.join(400)
    assert len(out) == len(requests), "a stream did not end"
    return [out[i] for i in range(len(requests))], at


def post(server: Any, path: str) -> None:
    request = urllib.request.Request(server.url + path, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200, path


#: Steps of the resumed batch that run before a planned kill (all streams run by then).
KILL_AFTER_STEPS = 20
#: What the server logs once it sees its engine dead (replaced or not).
DIED = "ftkit: the engine died"


def kill_with_all_running(server: Any, name: str, count: int) -> Any:
    """What ``run_all`` calls (with the engine paused before the streams start): once the
    server received all ``count`` requests, the engine resumes and runs them all in one batch,
    and ``name`` is SIGKILLed while it does. Under load vLLM's API server takes requests in and
    hands tokens out seconds late: neither the clients' view, nor the arrival order, nor the
    server's answers time the kill safely. The kill is timed on the server's own progress:
    ``process_kill`` planned through the injection route while the engine is paused, for the
    ``KILL_AFTER_STEPS``-th step after it resumes; there a worker SIGKILLs itself, or (the
    engine core) rank 0's worker SIGKILLs its engine core (``params.target: engine``). A
    process of the test's own that SIGKILLed the engine core a second after it logged that it
    resumed was seen to kill it 10 s late on a loaded machine, after a stream had ended."""

    healthy(server)  # (a replacement from the test before may still be starting)
    died = server.output().count(DIED)
    if name == ENGINE_CORE:
        fault = {"kind": "process_kill", "rank": 0, "params": {"target": "engine"}}
    else:
        assert name.startswith("Worker_TP"), name
        fault = {"kind": "process_kill", "rank": int(name.removeprefix("Worker_TP"))}
    victim = target(server, name)

    def during(tag: str) -> None:
        deadline = time.monotonic() + 180
        while True:
            received = [line for line in server.output().splitlines()
                        if "Received request" in line and f"-{tag}-" in line]
            if all(any(f"-{tag}-{i}" in line for line in received) for i in range(count)):
                break
            assert time.monotonic() < deadline, "the server did not receive every request"
            time.sleep(0.1)
        time.sleep(0.5)  # (each handed to the paused engine)
        planned = inject_live_fault(server.url, {**fault, "phase": "forward",
                                                 "after_steps": KILL_AFTER_STEPS}, SECRET)
        assert planned["planned"]["kind"] == "process_kill", planned
        # (the server's answer to /resume may come seconds late: not waited for)
        threading.Thread(target=post, args=(server, "/resume"), daemon=True).start()
        deadline = time.monotonic() + 150
        while server.output().count(DIED) == died:
            assert time.monotonic() < deadline, "the server did not see its engine die"
            time.sleep(0.1)
        assert f"ftkit: SIGKILL to pid {victim} " in server.output(), \
            f"{name} (pid {victim}) was not the process killed"

    post(server, "/pause?mode=keep")
    return during


def healthy(server: Any) -> None:
    deadline = time.monotonic() + 180
    while json.loads(server.get("/ftkit/health")[1]).get("status") != "healthy":
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.5)


def resumed(server: Any, tag: str, count: int) -> list[int]:
    """The requests of run ``tag`` that the server resumed on a new engine (its log)."""
    lines = [line for line in server.output().splitlines()
             if "ftkit: resuming request" in line]
    return [i for i in range(count) if any(f"-{tag}-{i}" in line for line in lines)]


def went_on(server: Any, tag: str, count: int) -> dict[int, float]:
    """Request of run ``tag`` -> seconds from its engine's death to its first output from the
    new engine, as the server logs it for each resumed request."""
    found: dict[int, float] = {}
    for line in server.output().splitlines():
        match = re.search(r"ftkit: request \S*-" + re.escape(tag) + r"-(\d+)\S* goes on: its "
                          r"first output from the new engine ([0-9.]+) s", line)
        if match:
            found[int(match.group(1))] = float(match.group(2))
    return found


ENGINE_CORE = "EngineCore"


def target(server: Any, name: str, serving: str = "newest") -> int:
    """The serving engine's process named ``name`` (vLLM names its processes): the newest of
    the name (a replaced engine's are gone), or with a standby started after the serving
    engine, the oldest."""
    if name == ENGINE_CORE:  # the serving engine's core: its workers' parent
        return psutil.Process(target(server, "Worker_TP1", serving)).ppid()
    named = [p for p in psutil.Process(server.process.pid).children(recursive=True)
             if name in p.name() and p.status() != psutil.STATUS_ZOMBIE]
    assert named, f"the server has no process {name}"
    pick = max if serving == "newest" else min
    return pick(named, key=lambda p: p.create_time()).pid


def kill(server: Any, name: str, serving: str = "newest") -> int:
    """SIGKILL ``target(server, name, serving)``."""
    pid = target(server, name, serving)
    os.kill(pid, signal.SIGKILL)
    return pid


def without_times(run: dict[str, Any]) -> dict[str, Any]:
    return {i: {k: v for k, v in c.items() if k != "times"}
            for i, c in run["completions"].items()}


def first_difference(run: dict[str, Any], ref: dict[str, Any]) -> str:
    """Where ``run``'s completions first differ from ``ref``'s, in words."""
    got, want = without_times(run), without_times(ref)
    if sorted(got) != sorted(want):
        return f"completions {sorted(got)} instead of {sorted(want)}"
    for index in sorted(want):
        for field in ("tokens", "logprobs", "text", "finish"):
            a, b = got[index][field], want[index][field]
            if a == b:
                continue
            if isinstance(a, (list, str)):
                at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                          min(len(a), len(b)))
                return (f"completion {index}: {field} differ from position {at} (lengths "
                        f"{len(a)} and {len(b)}): {a[at:at + 5]!r} instead of {b[at:at + 5]!r}")
            return f"completion {index}: {field} {a!r} instead of {b!r}"
    return "no difference"


def assert_exact(runs: list[dict[str, Any]], reference: list[dict[str, Any]],
                 server: Any = None) -> None:
    """Every stream of ``runs`` without an error and as ``reference``'s (on failure, with
    ``server``'s own lines of ftkit)."""
    context = "" if server is None else "\n" + ftkit_lines(server)
    for i, (run, ref) in enumerate(zip(runs, reference)):
        assert run["error"] is None, f"request {i}: {run['error']}{context}"
        assert without_times(run) == without_times(ref), \
            f"request {i} differs: {first_difference(run, ref)}{context}"


def ftkit_lines(server: Any, last: int = 40) -> str:
    """The server log's last ``last`` lines of ftkit and of vLLM's engine errors: what a
    failed kill test says about the replacement."""
    lines = [line for line in server.output().splitlines()
             if "ftkit:" in line or "ERROR" in line]
    return "server log (ftkit and errors):\n" + "\n".join(lines[-last:])


#: The stop-string request (index in ``REQUESTS``).
STOP = 3


def late_stop(text: str) -> str:
    """A short string that first appears about nine tenths into ``text``: a stop string that
    the request resumed after a kill finds, the request running about as long as the others.
    (Timed by a process of the test's own, a kill that a loaded machine delayed by 11 s once
    came after a stop string two thirds in, and the request was not resumed.)"""
    for begin in range(9 * len(text) // 10, len(text) - 4):
        for size in range(4, 13):
            candidate = text[begin:begin + size]
            if candidate.isascii() and candidate.isprintable() \
                    and text.find(candidate) == begin:
                return candidate
    raise AssertionError(f"no late stop string in {text!r}")


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("restart") / "server.log"
    # vLLM's development routes (/pause, /resume) and its log of each request received: the
    # test's means to start every stream in one batch before a kill.
    with vllm_server(tiny_model, log, fault_tolerance={"enabled": True, "max_restarts": 2,
                                                       "injection": True},
                     env={"VLLM_SERVER_DEV_MODE": "1", "FTKIT_INJECT_SECRET": SECRET},
                     extra_args=("--chat-template", CHAT_TEMPLATE, "--max-model-len", "2048",
                                 "--enable-log-requests")) as srv:
        yield srv


@pytest.fixture(scope="module")
def requests(server: Any) -> list[tuple[str, dict[str, Any]]]:
    """``REQUESTS`` with a stop string late in the stop-string request's text."""
    api, fields = REQUESTS[STOP]
    free = {k: v for k, v in fields.items() if k != "stop"}
    [run], _ = run_all(server.base_url, "text", [(api, free)])
    assert run["error"] is None, run
    changed = list(REQUESTS)
    changed[STOP] = (api, {**free, "stop": [late_stop(run["completions"][0]["text"])]})
    return changed


@pytest.fixture(scope="module")
def reference(server: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    runs, _ = run_all(server.base_url, "ref", requests)
    assert all(r["error"] is None for r in runs), [r["error"] for r in runs]
    assert len(runs[2]["completions"]) == 2  # n = 2
    stopped = runs[STOP]["completions"][0]
    assert stopped["finish"] == "stop" \
        and 8 * MAX_TOKENS // 10 < len(stopped["tokens"]) < MAX_TOKENS, stopped
    return runs


@pytest.mark.exhaustive  # test_inject_live's concurrent fault-free runs in the fast tier
def test_fault_free_runs_agree(server, requests, reference):
    """The oracle: the same server's fault-free run gives the same streams again."""
    runs, _ = run_all(server.base_url, "ref2", requests)
    assert_exact(runs, reference)


@pytest.mark.parametrize("name", ["Worker_TP1", ENGINE_CORE])
def test_a_killed_process_leaves_every_stream_exact(server, requests, reference, name):
    runs, _ = run_all(server.base_url, f"kill-{name}", requests,
                      kill_with_all_running(server, name, len(requests)))
    assert_exact(runs, reference, server)
    # Every stream ran across the kill: the server resumed each on the new engine.
    assert resumed(server, f"kill-{name}", len(runs)) == list(range(len(runs))), \
        ftkit_lines(server)
    # ... and says when each got its first output from the new engine.
    after = went_on(server, f"kill-{name}", len(runs))
    assert sorted(after) == list(range(len(runs))) and all(s > 0 for s in after.values()), \
        ftkit_lines(server)
    assert server.get("/health")[0] == 200
    assert "ftkit: the new engine serves after" in server.output()


def test_zz_once_the_restarts_are_used_up_a_kill_ends_the_streams(server, requests,
                                                                   reference):
    """The crippled variant (no restart left: what a server without ftkit does at the first
    kill). Last in the module: the server's engine is gone afterwards."""
    runs, _ = run_all(server.base_url, "used-up", requests,
                      kill_with_all_running(server, "Worker_TP1", len(requests)))
    assert all(r["error"] is not None for r in runs), runs
    assert "all 2 restart(s) are used up" in server.output()


def test_a_warm_standby_takes_over_a_killed_engine(tiny_model, tmp_path):
    """With ``"standby": true`` a second engine waits, started and idle. Its engine core is
    killed first: the server's watch sees it, ends it, says so in ``/ftkit/health`` and starts
    another (issue 39: the dead standby was kept as ready, took over at the next death and the
    streams failed with the restarts used up). Then a worker of the serving engine is killed:
    the new standby serves (the server's watch replaces an engine that dies between requests
    too), with the fault-free run's tokens. Streams that run across the replacement are
    resumed as above (the same code, tested with a new engine); the takeover time is read
    from the server's log, not asserted. (A standby that dies in the moment between the watch's
    looks and a takeover: tests/unit/test_restart_watch.py, where that moment can be made.)"""
    ready = "ftkit: the standby engine is ready (warmed up in "
    with vllm_server(tiny_model, tmp_path / "server.log",
                     fault_tolerance={"enabled": True, "max_restarts": 1, "standby": True},
                     extra_args=("--chat-template", CHAT_TEMPLATE,
                                 "--max-model-len", "2048")) as server:
        # (warmed up: its first steps, seconds of compiling, came before it took over)
        wait_for_line(server, ready)
        assert standby_of(server) == ("ready", 1)
        reference, _ = run_all(server.base_url, "ref", max_tokens=STANDBY_MAX_TOKENS)
        assert all(r["error"] is None for r in reference), reference
        assert len(reference[2]["completions"]) == 2  # n = 2
        stopped = reference[3]["completions"][0]
        assert stopped["finish"] == "stop" and 30 < len(stopped["tokens"]) < 67, stopped
        kill(server, ENGINE_CORE, serving="newest")  # the standby's
        wait_for_line(server, "it is ended, and the server has no standby until a new one")
        assert standby_of(server)[0] in ("none", "starting", "warming"), standby_of(server)
        deadline = time.monotonic() + 240
        while server.output().count(ready) < 2:
            assert time.monotonic() < deadline, "no new standby after the first one died"
            time.sleep(0.5)
        assert standby_of(server) == ("ready", 1)  # and no restart used
        kill(server, "Worker_TP1", serving="oldest")
        wait_for_line(server, "ftkit: the new engine serves after")
        runs, _ = run_all(server.base_url, "standby", max_tokens=STANDBY_MAX_TOKENS)
        assert_exact(runs, reference, server)
        assert "replacing it (restart 1 of 1, from the warm standby)" in server.output()
        assert standby_of(server) == ("none", 0)  # no restart left to back with a standby


def standby_of(server: Any) -> tuple[str, int]:
    """The standby's state and the restarts left, as ``/ftkit/health`` says."""
    view = json.loads(server.get("/ftkit/health")[1])
    return view["standby"], view["restarts_left"]


def wait_for_line(server: Any, line: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in server.output():
        assert time.monotonic() < deadline, f"the server did not log {line!r}"
        time.sleep(0.5)
