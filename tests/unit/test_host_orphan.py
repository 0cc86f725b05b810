"""An engine host whose parent dies (the ``ftkit`` front end killed with SIGKILL) cleans up
what the parent would have: it closes its engine and removes the parent's folder for it. A
host asked to exit by a living parent leaves that folder to the parent."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from ftkit import procs
from ftkit.contracts.job import HostRequest

#: A parent that starts an engine host on a folder, prints the host's pid, and waits to be
#: killed.
PARENT = [sys.executable, "-c",
          "import os, subprocess, sys, time; "
          "host = subprocess.Popen([sys.executable, '-m', 'ftkit.vllm.host', '--work', "
          "sys.argv[1], '--parent', str(os.getpid())], stdin=subprocess.PIPE, "
          "stdout=subprocess.PIPE, "
          "start_new_session=True); "
          "print(host.pid, flush=True); time.sleep(120)"]


def _poll(proc: psutil.Process, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not procs.alive(proc):
            return True
        time.sleep(0.05)
    return not procs.alive(proc)


def test_a_host_whose_parent_was_killed_removes_the_parents_folder_and_exits(tmp_path):
    work = tmp_path / "ftkit-host-x"
    (work / "job1").mkdir(parents=True)
    parent = procs.spawn([*PARENT, str(work)], stdout=subprocess.PIPE, text=True)
    host = None
    try:
        host = procs.identify(int(parent.stdout.readline()))
        assert host is not None
        parent.kill()  # SIGKILL (maybe before the host even started): nothing cleaned up
        parent.wait(timeout=10)
        assert _poll(host, 60), "the orphaned host did not exit"
        assert not work.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
        if host is not None:
            procs.reap([host], 1)


def test_a_host_asked_to_exit_leaves_the_folder_to_its_parent(tmp_path):
    work = tmp_path / "ftkit-host-y"
    work.mkdir()
    host = procs.spawn([sys.executable, "-m", "ftkit.vllm.host", "--work", str(work)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = host.communicate(HostRequest().to_json() + "\n", timeout=60)
        assert host.returncode == 0 and '"exit"' in out
        assert work.is_dir()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=10)
