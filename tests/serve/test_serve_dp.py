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
  server replaces its engine
  (both replicas: vLLM's client of the replicas dies with one of them) and resumes every
  stream, each exactly the fault-free run's, on its open connection.
* The crippled variant: with the one restart used up, the next kill ends the killed
  replica's streams with an error.

One server (TP 1, two replicas) for the module.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Any

import pytest
from _server import vllm_server
from test_serve_restart import assert_exact, ftkit_lines, resumed, run_all

from ftkit import inject_live_fault
from ftkit.vllm.environment import cpu_threads_bind

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

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


def test_a_killed_replica_is_replaced_and_its_streams_resumed_exactly(server, long_reference):
    kill_at(server, "kill-1", LONG_TOKENS // 3)
    runs, _ = run_all(server.base_url, "kill", REQUESTS, max_tokens=LONG_TOKENS)
    assert_exact(runs, long_reference, server)
    # The stream whose replica was killed went on from its tokens on the new engine, and
    # so did every other stream still running then, on either replica (both replicas end
    # with vLLM's client of them). (The server's log lines may reach its log after the
    # streams ended.)
    deadline = time.monotonic() + LOG_WAIT_S
    while 1 not in resumed(server, "kill", len(REQUESTS)):
        assert time.monotonic() < deadline, ftkit_lines(server)
        time.sleep(0.2)
    assert "ftkit: the new engine serves after" in server.output(), ftkit_lines(server)
    assert "ftkit: injecting process_kill" in server.output()
    assert server.get("/health")[0] == 200


def test_zz_once_the_restart_is_used_a_kill_ends_the_streams(server, long_reference):
    """The crippled variant (no restart left: what a server without ftkit does at the first
    kill). Last in the module: the server's engine is gone afterwards."""
    kill_at(server, "used-up-2", LONG_TOKENS // 3)
    runs, _ = run_all(server.base_url, "used-up", REQUESTS, max_tokens=LONG_TOKENS)
    # The killed replica's stream ends with an error (so does any other still running
    # then), and none goes on.
    assert runs[2]["error"] is not None, runs[2]
    assert resumed(server, "used-up", len(REQUESTS)) == []
    deadline = time.monotonic() + LOG_WAIT_S
    while "all 1 restart(s) are used up" not in server.output():
        assert time.monotonic() < deadline, ftkit_lines(server)
        time.sleep(0.2)
