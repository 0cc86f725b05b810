"""vLLM's Ray executor in scenarios and engines, without an engine: ``engine.nodes``, the Ray
fault kinds and what ftkit refuses on Ray (``ftkit.scenario.rules._ray_problems``,
``ftkit.vllm.runner_state``); the workers' way to the engine core
(``ftkit.procs.process_identity``); the shared-memory transport only between
ranks on one host (``CpuBackend._one_host``); a lost node's processes
(``ftkit.kinds.ray_kill.node_processes``); the environment an engine joins a cluster with
(``ftkit.vllm.ray_cluster.joining_environment``). The engines themselves:
``tests/vllm/test_ray.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from ftkit.backends import shm
from ftkit.backends.cpu import CpuBackend
from ftkit.errors import InjectionError
from ftkit.kinds.ray_kill import node_processes
from ftkit.scenario import ScenarioErrors, load_scenario, load_scenario_text
from ftkit.procs import identified_process, process_identity
from ftkit.vllm.ray_cluster import RAY_ADDRESS_ENV, joining_environment

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_ENGINE = """\
name: r
engine:
  tensor_parallel_size: 2
  nodes: 2
  args:
    distributed_executor_backend: ray
workload:
  prompts: [the first request]
  max_tokens: 8
faults:
  - kind: node_loss
    rank: 1
    at: {request: 0, token: 3}
"""


def load(text: str):
    return load_scenario_text(textwrap.dedent(text), file="s.yaml")


def errors(text: str) -> list[tuple[str | None, str]]:
    with pytest.raises(ScenarioErrors) as info:
        load(text)
    return [(e.field, e.message) for e in info.value.errors]


def test_a_ray_engine_over_two_nodes_validates():
    scenario = load(RAY_ENGINE)
    assert scenario.engine.uses_ray and scenario.engine.nodes == 2
    load(RAY_ENGINE.replace("node_loss", "ray_worker_kill"))


@pytest.mark.parametrize("change, field, says", [
    (("    distributed_executor_backend: ray", "    distributed_executor_backend: mp"),
     "engine.nodes", "add `distributed_executor_backend: ray`"),
    (("  nodes: 2", "  nodes: 3"), "engine.nodes", "do not spread evenly over 3 nodes"),
    (("  nodes: 2", "  nodes: 2\n  mode: serve"), "engine.args.distributed_executor_backend",
     "serving mode does not start a Ray cluster"),
    (("  nodes: 2", "  nodes: 1\n  args:\n    pipeline_parallel_size: 2"), None, None),
])
def test_what_ftkit_does_not_run_on_ray_is_refused(change, field, says):
    text = RAY_ENGINE.replace(*change)
    if field is None:  # two stages on Ray, with recovery on
        text = RAY_ENGINE.replace("  args:\n", "  args:\n    pipeline_parallel_size: 2\n")
        field, says = ("engine.args.distributed_executor_backend",
                       "does not run pipeline stages on vLLM's Ray executor")
    found = errors(text)
    assert any(f == field and says in m for f, m in found), found


@pytest.mark.parametrize("kind", ["node_loss", "ray_worker_kill"])
def test_the_ray_kinds_need_the_ray_executor_and_kill_once(kind):
    text = RAY_ENGINE.replace("node_loss", kind)
    mp = text.replace("  nodes: 2\n", "").replace("    distributed_executor_backend: ray\n",
                                                  "    enforce_eager: true\n")
    [(field, message)] = errors(mp)
    assert field == "faults[0].kind" and "needs vLLM's Ray executor" in message
    [(field, message)] = errors(text + "    times: 2\n")
    assert field == "faults[0].times"


def test_the_bundled_ray_scenarios_validate():
    files = sorted((REPO_ROOT / "scenarios" / "ray").glob("*.yaml"))
    assert files
    for path in files:
        assert load_scenario(path).engine.uses_ray


def test_refused_on_the_ray_executor_as_the_engine_starts(monkeypatch):
    pytest.importorskip("vllm")
    from vllm import envs

    from ftkit.vllm.runner_state import config_problems

    ray = SimpleNamespace(distributed_executor_backend="ray", pipeline_parallel_size=1)
    assert config_problems(SimpleNamespace(parallel_config=ray)) == []
    stages = SimpleNamespace(distributed_executor_backend="ray", pipeline_parallel_size=2)
    [problem] = config_problems(SimpleNamespace(parallel_config=stages))
    assert "pipeline parallelism runs on vLLM's Ray executor" in problem
    monkeypatch.setattr(envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", False, raising=False)
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    [problem] = config_problems(SimpleNamespace(parallel_config=ray))
    assert "older Ray executor" in problem


def test_a_process_identity_names_that_process_only():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        identity = process_identity(child.pid)
        assert identified_process(identity).pid == child.pid
        pid, _, started = identity.partition(":")
        # Another start time: a pid another process has taken since.
        assert identified_process(f"{pid}:{float(started) - 1.0!r}") is None
    finally:
        child.kill()
        child.wait()
    assert identified_process(identity) is None
    assert identified_process("not a process") is None


class _Store:
    """The store's ``set``/``wait``/``get``, as every rank's entries stand once written."""

    def __init__(self, entries: dict[str, str]) -> None:
        self.entries = {k: v.encode() for k, v in entries.items()}

    def set(self, key: str, value: str) -> None:
        self.entries[key] = value.encode()

    def wait(self, keys, timeout) -> None:
        missing = [k for k in keys if k not in self.entries]
        assert not missing, missing

    def get(self, key: str) -> bytes:
        return self.entries[key]


@pytest.mark.parametrize("peer_host, shared", [("node-a", True), ("node-b", False)])
def test_shared_memory_only_between_ranks_on_one_host(monkeypatch, peer_host, shared):
    monkeypatch.setattr(shm, "host_identity", lambda: "node-a")
    backend = CpuBackend(0, _Store({"ftkit/host/1": peer_host}))
    backend._groups = [SimpleNamespace(ranks=[0, 1])]
    assert backend._one_host([0, 1]) is shared
    assert backend._store.entries["ftkit/host/0"] == b"node-a"


def test_a_host_is_its_ray_node_in_a_ray_worker(monkeypatch):
    node = SimpleNamespace(get_node_id=lambda: "abc")
    fake_ray = SimpleNamespace(is_initialized=lambda: True,
                               get_runtime_context=lambda: node)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert shm.host_identity() == "ray-node:abc"
    monkeypatch.delitem(sys.modules, "ray")
    assert shm.host_identity().startswith("host:")


def test_a_node_is_only_lost_from_a_worker_below_a_raylet():
    with pytest.raises(InjectionError, match="not a raylet"):
        node_processes(psutil.Process())


def test_a_running_cluster_is_joined_by_address_but_none_of_its_nodes_is_lost():
    joined = RAY_ENGINE.replace("  nodes: 2\n", "  ray_address: 127.0.0.1:6379\n")
    load(joined.replace("node_loss", "ray_worker_kill"))
    [(field, message)] = errors(joined)
    assert field == "faults[0].kind" and "cannot start a lost node" in message
    [(field, message)] = errors(RAY_ENGINE.replace("  nodes: 2\n",
                                                   "  nodes: 2\n  ray_address: h:1\n")
                                .replace("node_loss", "ray_worker_kill"))
    assert field == "engine.nodes" and "leave engine.nodes out" in message
    mp = joined.replace("distributed_executor_backend: ray", "enforce_eager: true")
    found = errors(mp.replace("node_loss", "oom"))
    assert ("engine.ray_address", "a Ray cluster is joined by vLLM's Ray executor only: add "
            "`distributed_executor_backend: ray` to engine.args") in found


def test_an_engine_joins_a_cluster_on_127_0_0_1_with_rays_local_switch():
    # A cluster of this host (ftkit's listens on 127.0.0.1 only): Ray must not look for it
    # at the host's address. A cluster elsewhere is joined as Ray joins it.
    for address in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379"):
        env = joining_environment(address)
        assert env[RAY_ADDRESS_ENV] == address
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", address
    env = joining_environment("10.0.0.5:6379")
    assert env[RAY_ADDRESS_ENV] == "10.0.0.5:6379"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
