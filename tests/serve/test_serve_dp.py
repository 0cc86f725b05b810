"""Data-parallel serving: a server of two replicas of a dense model with recovery on, its
streams on both replicas.

vLLM runs each replica of a dense model as an engine of its own (one engine core, its own
world of ranks from 0); ftkit recovers each like any engine, and numbers the server's ranks
across replicas (rank ``r`` of replica ``i`` is ``i * world_size + r``): the health view lists
every replica's ranks, and a fault planned for a request fires in the replica that serves it.

* A device reset planned for one request (on every rank: the load balancer, not the client,
  picks the replica) is recovered in that replica, and every stream on both replicas is
  exactly the fault-free run's.
* SIGKILL of one replica's worker while streams run on both (planned through the injection
  route for one request's token: a real SIGKILL, timed on the server's own progress): the
  server replaces that replica alone (``ftkit.vllm.replicas``: a client per replica) and
  resumes its streams, each exactly the fault-free run's, on its open connection; the other
  replica's streams get tokens while it is replaced.
* The crippled variant: with that replica's one restart used up, the next kill there ends
  its streams with an error, while the other replica's streams end exactly and the server
  serves on with it.

The clients' requests reach the server seconds apart on two cores, so which replica serves
which request is the balancer's choice at each arrival: the tests ask only what holds
whatever it chose.

One server (TP 1, two replicas) for the module.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from typing import Any

import pytest
from _server import vllm_server
from test_serve_restart import assert_exact, ftkit_lines, resumed, run_all

from ftkit import inject_live_fault
from ftkit.vllm.environment import cpu_threads_bind

pytestmark = [pytest.mark.vllm, pytest.mark.exhaustive, pytest.mark.timeout(900)]

SECRET = "a-secret-of-24-characters"
#: Greedy and seeded, two of each: four streams, spread over the two replicas.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": "The quick brown fox", "temperature": 0}),
    ("completions", {"prompt": "Once upon a time", "temperature": 0.9, "seed": 11}),
    ("completions", {"prompt": "In the beginning", "temperature": 0}),
    ("completions", {"prompt": "Hello world, my name is", "temperature": 0.7, "seed": 3}),
]
#: Bound on a server's log line reaching its log once the streams it concerns ended.
LOG_WAIT_S = 30.0
SHORT_TOKENS = 48
#: Long enough that every stream still runs when the kill comes (a third of the way in).
LONG_TOKENS = 1200


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    settings = {"enabled": True, "max_restarts": 1, "injection": True}
    env = {"FTKIT_INJECT_SECRET": SECRET,
           "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(2, os.sched_getaffinity(0))}
    with vllm_server(tiny_model, log, tp=1, fault_tolerance=settings, env=env,
                     extra_args=("--data-parallel-size", "2", "--max-model-len", "2048")) as srv:
        yield srv


@pytest.fixture(scope="module")
def short_reference(server: Any) -> list[dict[str, Any]]:
    runs, _ = run_all(server.base_url, "ref-short", REQUESTS, max_tokens=SHORT_TOKENS)
    assert all(r["error"] is None for r in runs), [r["error"] for r in runs]
    return runs


@pytest.fixture(scope="module")
def long_reference(server: Any) -> list[dict[str, Any]]:
    runs, _ = run_all(server.base_url, "ref-long", REQUESTS, max_tokens=LONG_TOKENS)
    assert all(r["error"] is None for r in runs), [r["error"] for r in runs]
    return runs


def health(server: Any) -> dict[str, Any]:
    return json.loads(server.get("/ftkit/health")[1])


def generated_by_engine(server: Any) -> dict[str, float]:
    """vLLM's count of tokens the server generated, by engine (replica): its ``/metrics``."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(None, 1)[1])
    return counts


def kill_at(server: Any, request_id: str, token: int) -> None:
    """Plan a SIGKILL of the worker that serves ``request_id``, as that request's ``token``
    is computed (``process_kill`` through the injection route: the load balancer, not the
    client, picks the replica, and the server's own progress, not what the clients have
    read, times the kill)."""
    planned = inject_live_fault(server.url, {
        "kind": "process_kill", "rank": "all", "phase": "forward", "request_id": request_id,
        "token": token}, SECRET)
    assert planned["planned"]["kind"] == "process_kill"


def test_a_fault_in_one_replica_is_recovered_there(server, short_reference):
    planned = inject_live_fault(server.url, {
        "kind": "device_reset", "rank": "all", "phase": "forward", "request_id": "flt-1",
        "token": 10}, SECRET)
    assert planned["planned"]["request_id"] == "flt-1"
    before = generated_by_engine(server)
    runs, _ = run_all(server.base_url, "flt", REQUESTS, max_tokens=SHORT_TOKENS)
    assert_exact(runs, short_reference, server)
    # The streams ran on both replicas; the fault fired on the rank of the one that served
    # request 1, and on no rank of the other.
    after = generated_by_engine(server)
    assert sorted(after) == ["0", "1"] and all(after[e] > before.get(e, 0) for e in after), \
        (before, after)
    ranks = health(server)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]  # replica 0's rank 0, replica 1's rank 0
    assert sorted(r["faults"].get("device_reset", 0) for r in ranks) == [0, 1], ranks
    assert sorted(r["rounds"].get("recompute", 0) for r in ranks) == [0, 1], ranks


def replaced_replicas(server: Any) -> list[int]:
    """The replicas the server replaced so far, in order (its log)."""
    return [int(m) for m in re.findall(r"ftkit: the new engine of replica (\d+) serves",
                                       server.output())]


def gap(run: dict[str, Any]) -> tuple[float, float]:
    """The longest wait between two tokens of ``run``'s stream: (last before, first after)."""
    times = run["completions"][0]["times"]
    i = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
    return times[i - 1], times[i]


def test_a_killed_replica_is_replaced_and_its_streams_resumed_exactly(server, long_reference):
    kill_at(server, "kill-1", LONG_TOKENS // 3)
    runs, _ = run_all(server.base_url, "kill", REQUESTS, max_tokens=LONG_TOKENS)
    assert_exact(runs, long_reference, server)
    # Request 1 went on from its tokens on a new engine. (The server's log lines may reach
    # its log after the streams ended.)
    deadline = time.monotonic() + LOG_WAIT_S
    while 1 not in resumed(server, "kill", len(REQUESTS)):
        assert time.monotonic() < deadline, ftkit_lines(server)
        time.sleep(0.2)
    # The other replica served on meanwhile: while request 1's stream waited for the new
    # engine, a stream that was not resumed had tokens. (With vLLM's one client of every
    # replica, every stream waited for the replacement of both: checked once by hand with
    # the replicas' clients switched off.)
    down_from, down_to = gap(runs[1])
    assert down_to - down_from > 5, (down_from, down_to)  # an engine start
    served_on = [i for i, run in enumerate(runs)
                 if i not in resumed(server, "kill", len(REQUESTS))
                 and any(down_from < t < down_to for t in run["completions"][0]["times"])]
    assert served_on, ftkit_lines(server)
    # Request 1's replica alone was replaced.
    deadline = time.monotonic() + LOG_WAIT_S
    while not replaced_replicas(server):
        assert time.monotonic() < deadline, ftkit_lines(server)
        time.sleep(0.2)
    assert len(replaced_replicas(server)) == 1, ftkit_lines(server)
    assert "ftkit: injecting process_kill" in server.output()
    assert server.get("/health")[0] == 200


def test_zz_once_its_restart_is_used_a_kill_ends_that_replicas_streams_only(
        server, long_reference):
    """The crippled variant (no restart left for the replica: what a server without ftkit
    does at the first kill). A kill is planned on the used-up replica's rank for every
    request: it fires in whichever of them that replica serves. Last in the module: that
    replica is gone afterwards."""
    [used] = replaced_replicas(server)  # its one restart is used (the test above)
    for i in range(len(REQUESTS)):
        planned = inject_live_fault(server.url, {
            "kind": "process_kill", "rank": used, "phase": "forward",
            "request_id": f"used-up-{i}", "token": LONG_TOKENS // 3}, SECRET)
        assert planned["planned"]["kind"] == "process_kill"
    runs, _ = run_all(server.base_url, "used-up", REQUESTS, max_tokens=LONG_TOKENS)
    # That replica's streams end with an error and none goes on; the other replica's end
    # exactly as the fault-free run's.
    failed = [i for i, run in enumerate(runs) if run["error"] is not None]
    assert 0 < len(failed) < len(REQUESTS), [run["error"] for run in runs]
    assert_exact([runs[i] for i in range(len(runs)) if i not in failed],
                 [long_reference[i] for i in range(len(runs)) if i not in failed], server)
    assert resumed(server, "used-up", len(REQUESTS)) == []
    deadline = time.monotonic() + LOG_WAIT_S
    while f"replica {used} died and all 1 restart(s) are used up" not in server.output():
        assert time.monotonic() < deadline, ftkit_lines(server)
        time.sleep(0.2)
    # The server serves on with the other replica.
    assert server.get("/health")[0] == 200
    again, _ = run_all(server.base_url, "after", REQUESTS[:1], max_tokens=SHORT_TOKENS)
    assert again[0]["error"] is None, again[0]["error"]
