"""A real vLLM OpenAI server for the serving tests (``vllm_server``): started the way the
README says on CPU (the module form, with the engine environment ftkit's own engines use), on
loopback, in a session of its own, killed and reaped with its whole tree however the test
ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from ftkit import procs
from ftkit.vllm.environment import effective_engine_env

#: A TP 2 server of the tiny model starts in 20-40 s on two cores; beside other tests, more.
START_TIMEOUT_S = 240.0
#: How often the server's shared memory segments are looked for while a test runs.
SEGMENTS_EVERY_S = 1.0
#: The fault-tolerance settings of the serving tests' server (injection on).
SECRET = "serving-tests-secret-0123456789"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    url: str
    process: Any
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@contextmanager
def vllm_server(model: str, log: Path, *, tp: int = 2,
                fault_tolerance: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None,
                extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """A ``vllm.entrypoints.openai.api_server`` of ``model`` with ``fault_tolerance`` in its
    ``additional_config``; its output goes to ``log``."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--tensor-parallel-size", str(tp), "--dtype", "float32", "--no-async-scheduling",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
            "--disable-uvicorn-access-log", "--enforce-eager", *extra_args]
    if fault_tolerance is not None:
        argv += ["--additional-config", json.dumps({"fault_tolerance": dict(fault_tolerance)})]
    environ = {**os.environ, **effective_engine_env(), "VLLM_PLUGINS": "ftkit",
               "PYTHONUNBUFFERED": "1"}
    if tp > 1:
        environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                           "|".join(str(c % (os.cpu_count() or 1)) for c in range(tp)))
    environ.update(env or {})
    with open(log, "wb") as out:
        process = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=environ)
    root = psutil.Process(process.pid)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    # The shared memory segments the server's processes map (every engine's, the killed
    # ones' too): none may be left once the server has ended.
    segments: set[str] = set()

    def look() -> None:
        tree = [root, *procs.descendants(root)] if procs.alive(root) else []
        segments.update(procs.shared_memory_files(tree, semaphores=False))

    served = False
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode} while starting:\n"
                            f"{server.output()[-4000:]}")
            try:
                if server.get("/health", timeout_s=2.0)[0] == 200:
                    break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health within {START_TIMEOUT_S:.0f} "
                            f"s:\n{server.output()[-4000:]}")
            time.sleep(0.5)
        with procs.polling(SEGMENTS_EVERY_S, look):
            yield server
        served = True
    finally:
        if process.poll() is None:
            look()
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - killed below
                pass
        ended_itself = process.poll() is not None
        procs.kill_tree(root, session=process.pid)
        process.wait(timeout=10)
        left = procs.remove_files(segments)
    if served and ended_itself and left:
        pytest.fail(f"the server left shared memory segments behind: {left}")


def served_model(base_url: str) -> str:
    """The server's model, asked on a connection of its own: a stream that reused the
    connection of this request could meet the server closing it (vLLM keeps an idle
    connection 5 s, and a loaded API server answers seconds late) and fail with "Server
    disconnected without sending a response" before the server saw it."""
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60) as client:
        return client.models.list().data[0].id
