"""The process that owns in-process engines dies: nothing of its engines stays behind.

A ``pytest`` run or a script that uses ``EngineSession`` directly owns the engine's processes
(at tensor parallel 2 vLLM's engine core and two workers, children of the owner), the shared
memory they map (vLLM's CPU communicator segments and message queues) and the engine's
temporary folder. Killed with SIGKILL, the owner runs no clean-up: the engine's watchdog
process must kill those processes and remove those files within 15 s. The engine is caught in
the worst moment for that: one rank hangs in a step (a ``hang`` fault), the other waits for it
in a collective, so no process of the engine notices on its own that its owner is gone. With
the watchdog switched off, exactly that is what stays. Interrupted with Ctrl-C (SIGINT), a
``pytest`` run that owns an engine ends, and its engine with it, within 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ftkit import procs
from ftkit.contracts.eventlog import FaultFired, only, read_events

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The spec's bounds: after a SIGKILL of the owner, and after a Ctrl-C.
GONE_AFTER_KILL_S = 15.0
GONE_AFTER_CTRL_C_S = 10.0
#: Bound on an engine start, and on the fault firing once generation began.
START_S = 300.0

#: An owner: starts a tensor parallel 2 ftkit engine, writes its processes and files to a
#: file, and generates with one rank hung until it is killed.
OWNER = """\
import json, os, sys

from ftkit.config import RecoveryConfig
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.model import build_tiny_model
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession


def main(info, event_log, watchdog):
    engine = EngineSession(EngineSpec(model=str(build_tiny_model()), tensor_parallel_size=2),
                           recovery=RecoveryConfig(enabled=True, event_log_dir=event_log),
                           watchdog=watchdog == "on")
    engine.start()
    with open(info + ".part", "w") as out:
        json.dump({"pids": engine.pids, "leftovers": sorted(engine.leftovers),
                   "watchdog": engine.watchdog_pid}, out)
    os.rename(info + ".part", info)
    run_id = engine.new_run_id()
    hang = FaultSpec.model_validate({"kind": "hang", "rank": 1, "at": {"request": 0, "token": 3},
                                     "params": {"op_timeout_s": 600}})
    engine.set_fault_plan(FaultPlan.from_specs(run_id, [hang]))
    engine.generate(["the quick brown fox", "one two three"], SamplingSpec(max_tokens=64),
                    run_id=run_id)


if __name__ == "__main__":  # the engine's processes are spawned: they import this file
    main(*sys.argv[1:])
"""

#: A test module that owns an engine through a fixture and generates until interrupted.
INTERRUPTED_SUITE = """\
import json, os

import pytest

from ftkit.contracts.job import SamplingSpec
from ftkit.model import build_tiny_model
from ftkit.scenario import EngineSpec
from ftkit.vllm.engine import EngineSession


@pytest.fixture(scope="module")
def engine():
    with EngineSession(EngineSpec(model=str(build_tiny_model()), tensor_parallel_size=2)) as e:
        yield e


def test_generates_until_interrupted(engine):
    info = os.environ["OWNER_INFO"]
    with open(info + ".part", "w") as out:
        json.dump({"pids": engine.pids, "leftovers": sorted(engine.leftovers),
                   "watchdog": engine.watchdog_pid}, out)
    os.rename(info + ".part", info)
    while True:
        engine.generate(["the quick brown fox", "one two three"], SamplingSpec(max_tokens=400))
"""


def wait_for_file(path: Path, owner: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert owner.poll() is None, f"the owner ended early (exit {owner.returncode})"
        assert time.monotonic() < deadline, "the engine did not start"
        time.sleep(0.5)
    return json.loads(path.read_text())


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (p := procs.identify(pid)) is not None and procs.alive(p)]


def existing(paths: list[str]) -> list[str]:
    return [path for path in paths if os.path.exists(path)]


def wait_until_gone(pids: list[int], paths: list[str], timeout_s: float) -> float:
    """Seconds until no pid of ``pids`` lives and no path of ``paths`` exists, polled up to
    ``timeout_s`` (then returned as is)."""
    started = time.monotonic()
    while (alive(pids) or existing(paths)) and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    return time.monotonic() - started


def start_owner(tmp_path: Path, watchdog: str) -> tuple[subprocess.Popen, dict, Path]:
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    info, event_log = tmp_path / "info.json", tmp_path / "event-log"
    event_log.mkdir()
    log = open(tmp_path / "owner.log", "w")
    owner = procs.spawn([sys.executable, str(script), str(info), str(event_log), watchdog],
                        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    log.close()
    return owner, wait_for_file(info, owner, START_S), event_log


def wait_for_hang(event_log: Path, owner: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_S
    while not only(read_events(event_log), FaultFired):
        assert owner.poll() is None, f"the owner ended early (exit {owner.returncode})"
        assert time.monotonic() < deadline, "the hang did not fire"
        time.sleep(0.2)
    time.sleep(1)  # the peer is now blocked in its collective with the hung rank


def kill_by_pid(pids: list[int]) -> None:
    """What the owner started, killed by pid and start time (a crippled run's clean-up)."""
    procs.wait_gone(procs.kill(p for pid in pids if (p := procs.identify(pid)) is not None))


def engine_files(info: dict) -> list[str]:
    """The engine's temporary folder and CPU communicator segments (checked by name: they
    are what a killed engine leaves for good)."""
    files = [p for p in info["leftovers"] if "cpushm" in p or os.path.isdir(p)]
    assert sum("cpushm" in p for p in files) == 2 and any(os.path.isdir(p) for p in files), \
        info["leftovers"]
    return files


def test_sigkill_of_the_owner_leaves_no_engine_process_and_no_file(tmp_path):
    owner, info, event_log = start_owner(tmp_path, "on")
    try:
        assert len(info["pids"]) == 3 and info["watchdog"] not in info["pids"]
        files = engine_files(info)
        wait_for_hang(event_log, owner)
        owner.kill()
        owner.wait(10)
        took = wait_until_gone(info["pids"] + [info["watchdog"]], info["leftovers"],
                               GONE_AFTER_KILL_S)
        assert alive(info["pids"]) == [], f"engine processes outlived their owner by {took:.0f} s"
        assert existing(info["leftovers"]) == [], "files outlived their owner"
        assert alive([info["watchdog"]]) == [], "the watchdog did not end"
        assert existing(files) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        kill_by_pid(info["pids"])
        procs.remove_files(info["leftovers"])


def test_without_the_watchdog_a_killed_owner_leaves_its_engine_behind(tmp_path):
    """The crippled variant: the same kill with the watchdog off. The hung engine's three
    processes live on, and its temporary folder and communicator segments stay."""
    owner, info, event_log = start_owner(tmp_path, "off")
    try:
        assert info["watchdog"] is None
        files = engine_files(info)
        wait_for_hang(event_log, owner)
        owner.kill()
        owner.wait(10)
        wait_until_gone(info["pids"], info["leftovers"], GONE_AFTER_KILL_S)
        assert sorted(alive(info["pids"])) == sorted(info["pids"])
        assert existing(files) == files
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        kill_by_pid(info["pids"])
        procs.remove_files(info["leftovers"])


@pytest.mark.exhaustive  # Ctrl-C of ftkit run in the fast tier: test_run_e2e
def test_ctrl_c_ends_the_engine_of_a_pytest_run_within_10_s(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the run's whole process group (pytest, the engine core
    and its workers; the watchdog has a session of its own). The engine is gone within 10 s;
    pytest itself ends a few seconds later (its own plugins' summaries and collections)."""
    (tmp_path / "test_owner.py").write_text(INTERRUPTED_SUITE)
    info_path, output = tmp_path / "info.json", tmp_path / "pytest.log"
    env = dict(os.environ, OWNER_INFO=str(info_path))
    env.pop("CI", None)  # the inner run is no CI run (the suite's CI gate)
    with open(output, "w") as out:
        pytest_run = procs.spawn(
            # As a terminal's foreground job runs it: SIGINT raises KeyboardInterrupt (a job
            # started in the background of a non-interactive shell, as a CI runner may start
            # the suite, inherits it ignored, and Python leaves an ignored SIGINT ignored).
            [sys.executable, "-c", "import signal, sys, pytest; signal.signal(signal.SIGINT, "
             "signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))",
             "-q", "-p", "no:cacheprovider", "test_owner.py"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    info = {"pids": [], "leftovers": []}
    try:
        info = wait_for_file(info_path, pytest_run, START_S)
        time.sleep(2)  # generating
        os.killpg(pytest_run.pid, signal.SIGINT)
        gone_s = wait_until_gone(info["pids"] + [info["watchdog"]], info["leftovers"],
                                 GONE_AFTER_CTRL_C_S)
        assert alive(info["pids"]) == [], f"engine processes alive {gone_s:.1f} s after Ctrl-C"
        assert existing(info["leftovers"]) == [], f"files left {gone_s:.1f} s after Ctrl-C"
        assert alive([info["watchdog"]]) == []
        assert pytest_run.wait(60) == 2, output.read_text()[-3000:]  # pytest: interrupted
        assert "KeyboardInterrupt" in output.read_text()
    finally:
        if pytest_run.poll() is None:
            pytest_run.kill()
            pytest_run.wait(10)
        kill_by_pid(info["pids"])
        procs.remove_files(info["leftovers"])
