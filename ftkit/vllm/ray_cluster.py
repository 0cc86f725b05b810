"""A Ray cluster on this host for vLLM's Ray executor: one head and N-1 worker nodes, every
Ray process listening on 127.0.0.1 only.

Each node is a process of ftkit's that owns the node's Ray processes (its GCS on the head, its
raylet, agents and the workers the raylet starts): the head is ``ray start --head --block``,
a worker node ``python -m ftkit.vllm.ray_node`` (Ray's command refuses worker nodes that keep
a loopback address: see that module). A SIGTERM to it shuts the node down; when one of the
node's processes ends it ends the rest and exits (a lost node); when it dies otherwise, Ray's
reaper kills the node's processes. Each node advertises one ``RAY_CPU_DEVICE`` per rank it
may hold (the CPU build's device resource, ``ftkit.vllm.ray_cpu``), no CPUs (vLLM's actors
ask for none, and a node without CPUs starts no idle workers), no dashboard and a small object
store (vLLM passes its steps through its own queues, not Ray's).

Binding: ``ray start`` replaces a loopback node address with the host's reachable one (where
multi-node clusters are enabled, as on Linux), and its GCS, raylets, agents and autoscaler
monitor then listen on the host's interfaces (measured on Ray 2.60). Every node here runs with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``LOCAL_ONLY_ENV``), Ray's switch that keeps the node
address 127.0.0.1, and so every listener on it; an engine joins with the same switch
(``joining_environment``), else its driver would look for the cluster at the host's address.

What ``close`` (and, if this process dies first, the cluster's watchdog) removes: every
process of every node, found by pid and start time, and the cluster's temporary folder
(Ray's session folder: logs, sockets).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftkit import procs
from ftkit.bounds import RAY_PLACEMENT_TIMEOUT_ENV, RAY_PLACEMENT_TIMEOUT_S, REAP_GRACE_S
from ftkit.errors import EngineError
from ftkit.vllm.ray_cpu import RAY_CPU_DEVICE
from ftkit.vllm.ray_node import LOCAL_ONLY_ENV, LOCALHOST, READY_LINE

log = logging.getLogger("ftkit")

#: A node's start: ``ray start`` says it blocks once its processes run.
RAY_NODE_START_S = 90.0
#: The line ``ray start --block`` prints once the head is up.
_HEAD_READY_LINE = "This command will now block forever"
#: Each node's object store (Ray's minimum is 75 MiB).
OBJECT_STORE_BYTES = 80 * 1024 * 1024
#: Where the cluster's address reaches the engine (vLLM's Ray executor joins it).
RAY_ADDRESS_ENV = "RAY_ADDRESS"


@dataclass
class RayNode:
    """One node: its ``ray start`` process and the processes seen below it."""

    index: int
    proc: psutil.Process
    log_path: str
    seen: list[psutil.Process] = field(default_factory=list)

    def look(self) -> list[psutil.Process]:
        """Note the processes below the node's root now; the new ones."""
        new = [p for p in procs.descendants(self.proc) if p not in self.seen]
        self.seen += new
        return new


class RayCluster:
    """A head and ``nodes - 1`` worker nodes on this host, ``ranks_per_node`` ranks each."""

    def __init__(self, nodes: int, ranks_per_node: int) -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError("a Ray cluster needs at least one node of one rank")
        self.node_count = nodes
        self.ranks_per_node = ranks_per_node
        self.nodes: list[RayNode] = []
        self.address: str | None = None
        self.tmp_dir: str | None = None
        self._watchdog: procs.Watchdog | None = None
        self._popens: list[subprocess.Popen[Any]] = []

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> RayCluster:
        # Short: Ray's socket paths go below it, and a Unix socket path has 107 bytes.
        self.tmp_dir = tempfile.mkdtemp(prefix="ftkit-ray-", dir="/tmp")
        self._watchdog = procs.Watchdog(os.path.join(self.tmp_dir, "ftkit-watch-record")).start()
        self._watchdog.note_paths([self.tmp_dir])
        try:
            port = _free_port()
            self.address = f"{LOCALHOST}:{port}"
            self._start_node(0)
            for index in range(1, self.node_count):
                self._start_node(index)
        except BaseException:
            self.close()
            raise
        log.info("ftkit: Ray cluster of %d node(s) at %s", self.node_count, self.address)
        return self

    def _node_command(self, index: int) -> tuple[list[str], str]:
        """Node ``index``'s command line, and the line it prints once its node runs."""
        assert self.address is not None and self.tmp_dir is not None
        resources = {RAY_CPU_DEVICE: self.ranks_per_node}
        if index == 0:
            port = self.address.rpartition(":")[2]
            return [_ray_command(), "start", "--head", "--block",
                    f"--node-ip-address={LOCALHOST}", f"--port={port}",
                    f"--temp-dir={self.tmp_dir}", "--num-cpus=0",
                    f"--resources={json.dumps(resources)}",
                    f"--object-store-memory={OBJECT_STORE_BYTES}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                    f"--ray-client-server-port={_free_port()}",
                    "--include-dashboard=false", "--disable-usage-stats"], _HEAD_READY_LINE
        spec = {"address": self.address, "resources": resources,
                "object_store_bytes": OBJECT_STORE_BYTES, "agent_port": _free_port()}
        return [sys.executable, "-m", "ftkit.vllm.ray_node", json.dumps(spec)], READY_LINE

    def _start_node(self, index: int) -> RayNode:
        """Start node ``index`` (a new one, or one in place of a lost one) and wait until it
        runs."""
        assert self._watchdog is not None
        argv, ready = self._node_command(index)
        log_path = os.path.join(self.tmp_dir, f"node-{index}.log")
        with open(log_path, "wb") as out:
            popen = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **LOCAL_ONLY_ENV})
        node = RayNode(index, psutil.Process(popen.pid), log_path)
        if index == len(self.nodes):
            self._popens.append(popen)
            self.nodes.append(node)
        else:
            self._popens[index] = popen
            self.nodes[index] = node
        self._watchdog.note_processes([node.proc])
        deadline = time.monotonic() + RAY_NODE_START_S
        while ready not in _read(log_path):
            self._watchdog.note_processes(node.look())
            if popen.poll() is not None:
                raise EngineError(f"Ray node {index} did not start (its command exited with "
                                  f"{popen.returncode}):\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise EngineError(f"Ray node {index} did not start within "
                                  f"{RAY_NODE_START_S:g} s:\n{_tail(log_path)}")
            time.sleep(0.2)
        self._watchdog.note_processes(node.look())
        return node

    def look(self) -> None:
        """Note the processes the nodes started since (the workers of an engine)."""
        for node in self.nodes:
            new = node.look()
            if new and self._watchdog is not None:
                self._watchdog.note_processes(new)

    def listening(self) -> list[tuple[str, int, str]]:
        """Every TCP socket the cluster's processes listen on now (``procs.listening``)."""
        self.look()
        return procs.listening(p for node in self.nodes for p in [node.proc, *node.seen])

    def dead_nodes(self) -> list[int]:
        """The nodes whose own process has ended (a lost node's does: it kills what is left
        of its node and exits)."""
        return [node.index for node in self.nodes if not procs.alive(node.proc)]

    def revive(self) -> list[int]:
        """Start the lost nodes again, before an engine is started on the cluster; the
        nodes started. A lost head took the cluster with it (its GCS): the whole cluster is
        started afresh, at a new address."""
        dead = self.dead_nodes()
        if not dead:
            return []
        if 0 in dead:
            log.warning("ftkit: the Ray cluster's head node is gone; starting a new cluster")
            self.close()
            self.start()
            return list(range(self.node_count))
        log.warning("ftkit: Ray node(s) %s gone; starting them again", dead)
        for index in dead:
            node = self.nodes[index]
            node.look()
            procs.wait_gone(procs.kill(p for p in node.seen if procs.alive(p)))
            self._reap(index)
            self._start_node(index)
        return dead

    def _reap(self, index: int) -> None:
        popen = self._popens[index]
        try:
            popen.wait(timeout=REAP_GRACE_S)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=REAP_GRACE_S)

    def close(self) -> None:
        """Shut every node down (the worker nodes first), kill what is left, remove the
        cluster's folder."""
        for node in self.nodes:
            node.look()
        for node in reversed(self.nodes):
            procs.reap([node.proc], REAP_GRACE_S)
        left = [p for node in self.nodes for p in node.seen if procs.alive(p)]
        procs.wait_gone(procs.kill(left))
        for index in range(len(self._popens)):
            self._reap(index)  # ours: waited for
        self.nodes = []
        self._popens.clear()
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def __enter__(self) -> RayCluster:
        return self.start() if self.address is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def joining_environment(address: str) -> dict[str, str]:
    """What an engine's environment needs to join the Ray cluster at ``address``: the address,
    a bound on the wait for the ranks' places (the environment's, if it has one) and, for an
    address on 127.0.0.1 (a cluster of this host, such as ftkit's), Ray's switch that keeps
    the driver there (``LOCAL_ONLY_ENV``; without it Ray looks for the cluster at the host's
    address, where a cluster of ftkit's does not listen)."""
    env = {RAY_ADDRESS_ENV: address,
           RAY_PLACEMENT_TIMEOUT_ENV: os.environ.get(RAY_PLACEMENT_TIMEOUT_ENV,
                                                     f"{RAY_PLACEMENT_TIMEOUT_S:g}")}
    if procs.is_loopback(address.rpartition(":")[0]):
        env.update(LOCAL_ONLY_ENV)
    return env


def _ray_command() -> str:
    """The ``ray`` command of this Python environment."""
    found = os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.exists(found):
        raise EngineError("Ray is not installed here: install ftkit with its `ray` extra "
                          "(pip install 'ftkit[ray]'; make setup does)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, lines: int = 20) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])
