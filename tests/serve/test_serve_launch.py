"""``ftkit serve`` for real: a TP 2 server of the tiny model with recovery on, started from a
bare environment (no ``VLLM_PLUGINS``, no engine variables, no thread binding: on this CPU
build a TP 2 engine does not start without the binding ftkit serve sets), answers a completion
through the OpenAI client, and exits on SIGTERM. The process started is the server itself
(``ftkit serve`` replaced itself with it), so the signal reaches it directly. Nothing is left
in the temporary folder once it ended (on SIGTERM here; on SIGKILL in the exhaustive tier):
vLLM's sockets and stores went into a folder of the server's own, which a watchdog removes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from ftkit import procs
from ftkit.model.tiny import resolve_model
from ftkit.serve.launch import FALLBACK_TEMP

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

FTKIT = [sys.executable, "-c", "from ftkit_cli.main import main; main()"]
#: A TP 2 server of the tiny model starts in 20-40 s on two cores; beside other tests, more.
START_TIMEOUT_S = 240.0
#: Bound on the server's exit once it got SIGTERM.
EXIT_TIMEOUT_S = 60.0
#: How long a process of the server's session may outlive the server, finishing its exit.
STRAY_GRACE_S = 10.0
#: Bound on one HTTP request to the server.
REQUEST_TIMEOUT_S = 60.0
HEALTH_POLL_S = 0.5
#: What ftkit serve sets itself: the test's environment must not.
SET_BY_FTKIT_SERVE = ("VLLM_PLUGINS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                      "VLLM_USE_V2_MODEL_RUNNER", "VLLM_CPU_ATTN_SPLIT_KV", "TORCH_COMPILE_DISABLE",
                      "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    """Until GET /health answers 200, at most ``START_TIMEOUT_S``; fails with the server's
    output if it exits or the bound passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}) before it was healthy:\n"
                        + log.read_text(errors="replace")[-6000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=HEALTH_POLL_S * 4) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(HEALTH_POLL_S)
    pytest.fail(f"no healthy server after {START_TIMEOUT_S:g} s:\n"
                + log.read_text(errors="replace")[-6000:])


def test_ftkit_serve_runs_a_tp2_server_with_recovery_that_stops_on_sigterm(tmp_path,
                                                                         short_temp):
    model = str(resolve_model("tiny"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_FTKIT_SERVE}
    temp = short_temp
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(temp))
    argv = [*FTKIT, "serve", model, "--tensor-parallel-size", "2", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port),
            "--additional-config", json.dumps({"fault_tolerance": {"enabled": True}})]
    with log.open("wb") as out:
        server = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    root = psutil.Process(server.pid)
    try:
        wait_healthy(url, server, log)
        # ftkit serve became the server: the same process, now vLLM's module.
        assert "vllm.entrypoints.openai.api_server" in root.cmdline()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=REQUEST_TIMEOUT_S,
                               max_retries=0)
        completion = client.completions.create(model=model, prompt="the quick brown fox",
                                               max_tokens=8, temperature=0)
        assert completion.usage.completion_tokens == 8
        assert completion.choices[0].finish_reason == "length"
        output = log.read_text(errors="replace")
        assert "ftkit serve: added --no-async-scheduling" in output
        # VLLM_PLUGINS as ftkit serve set it lets vLLM load ftkit's routes, and recovery runs
        # on both ranks.
        assert "Loaded endpoint plugin ftkit" in output
        for rank in (0, 1):
            assert f"ftkit: recovery on on rank {rank} of 2" in output
        server.send_signal(signal.SIGTERM)
        try:
            status = server.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {EXIT_TIMEOUT_S:g} s of SIGTERM")
        assert status == 0  # a clean shutdown
        # Its engine processes went with it: nothing of its session is left to kill once the
        # last of them (a process that notices its parent's end, as Python's resource tracker
        # does) had a moment to finish.
        strays = procs.wait_gone(procs.session_members(server.pid, since=root), STRAY_GRACE_S)
    finally:
        left = procs.kill_tree(root, session=server.pid)
        server.wait(timeout=EXIT_TIMEOUT_S)
    assert not strays and not left, f"processes left after the server: {strays or left}"
    assert_emptied(temp)


@pytest.fixture
def short_temp() -> Iterator[Path]:
    """An empty folder for the server's ``TMPDIR``, short enough for vLLM's socket paths in
    ``ftkit serve``'s folder inside it (pytest's ``tmp_path`` is too deep), removed after."""
    temp = Path(tempfile.mkdtemp(prefix="fs-", dir=FALLBACK_TEMP))
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def assert_emptied(temp: Path) -> None:
    """``temp``, the server's ``TMPDIR``, is empty within the watchdog's bound: the folder of
    the server's own in it, with vLLM's sockets and stores, removed."""
    deadline = time.monotonic() + STRAY_GRACE_S
    while left_in(temp):
        assert time.monotonic() < deadline, f"left in the temporary folder: " \
            f"{sorted(str(p.relative_to(temp)) for p in temp.rglob('*'))[:20]}"
        time.sleep(0.1)


def left_in(temp: Path) -> list[str]:
    """What is in ``temp``, less torch's compile cache (``torchinductor_<user>``: a cache
    that outlives servers by design, made there by ``ftkit serve`` as it reads the platform,
    before it becomes the server)."""
    return [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.exhaustive
def test_nothing_of_a_sigkilled_ftkit_serve_is_left_in_the_temporary_folder(tmp_path,
                                                                           short_temp):
    """SIGKILL of the server, which runs no clean-up of its own: the watchdog ``ftkit serve``
    started ends the server's engine core and workers (vLLM's go on running, measured: still
    there 60 s after the kill without it) and removes the server's temporary folder (without
    a folder of its own, vLLM's ``vllm_dist_*`` store and IPC sockets stayed in ``TMPDIR``)."""
    model = str(resolve_model("tiny"))
    port = free_port()
    log = tmp_path / "server.log"
    temp = short_temp
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_FTKIT_SERVE}
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(temp))
    argv = [*FTKIT, "serve", model, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port),
            "--additional-config", json.dumps({"fault_tolerance": {"enabled": True}})]
    with log.open("wb") as out:
        server = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    root = psutil.Process(server.pid)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, log)
        [own] = left_in(temp)
        assert own.startswith("ftkit-serve-") and list((temp / own).iterdir())
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=EXIT_TIMEOUT_S)
        # Its engine core and workers are ended by the watchdog (orphaned, they may stay
        # zombies of a parent that is not the test's: dead, not running).
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while running := [p for p in procs.session_members(server.pid, since=root)
                          if procs.alive(p)]:
            assert time.monotonic() < deadline, f"still running after the server: {running}"
            time.sleep(0.2)
    finally:
        procs.kill_tree(root, session=server.pid)
    assert_emptied(temp)
