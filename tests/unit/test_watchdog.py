"""``procs.Watchdog``'s ``descendants``: an owner killed with SIGKILL, whose descendants the
watchdog only saw (an owner that became another program notes nothing: ``ftkit serve``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ftkit import procs

#: An owner: starts its watchdog, notes a folder, starts a child of its own, and sleeps.
OWNER = r"""
import subprocess, sys, time
from ftkit import procs
watchdog = procs.Watchdog(sys.argv[1], descendants=sys.argv[3] == "1").start()
watchdog.note_paths([sys.argv[2]])
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(kid.pid, watchdog.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("descendants", [True, False])
def test_the_watchdog_ends_the_descendants_it_saw_of_a_killed_owner(tmp_path, descendants):
    """With ``descendants``, the owner's child, which the owner never noted, is killed once
    the owner is gone, and the noted folder removed; without (the crippled variant), the
    folder is removed and the child runs on."""
    folder = tmp_path / "own"
    folder.mkdir()
    owner = procs.spawn([sys.executable, "-c", OWNER, str(tmp_path / "record"), str(folder),
                         "1" if descendants else "0"], stdout=subprocess.PIPE, text=True)
    kid = watchdog = None
    try:
        kid_pid, watchdog_pid = (int(p) for p in owner.stdout.readline().split())
        kid, watchdog = psutil.Process(kid_pid), psutil.Process(watchdog_pid)
        time.sleep(4 * procs.OWNER_WATCH_POLL_S)  # (it looked at the owner's children)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert not procs.wait_gone([watchdog], 10), "the watchdog did not end"
        assert not folder.exists()
        assert procs.wait_gone([kid], 5 if descendants else 1) == ([] if descendants else [kid])
    finally:
        for proc in (kid, watchdog):
            if proc is not None and procs.alive(proc):
                proc.kill()
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()
