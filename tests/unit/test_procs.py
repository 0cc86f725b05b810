"""The process toolkit on real child processes (sleepers): spawn in a new session, the one
liveness check, kill a tree, reap (terminate, then kill), the death watch, and that a pid now
held by another process is never signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ftkit import procs

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
#: A sleeper that ignores SIGTERM (like a rank spinning in a collective).
STUBBORN = [sys.executable, "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]
#: A sleeper with a sleeping child of its own; prints the child's pid.
PARENT = [sys.executable, "-c",
          "import subprocess, sys, time; "
          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
          "print(c.pid, flush=True); time.sleep(60)"]

#: A sleeper whose child starts a sleeper of its own and exits: that grandchild is reparented
#: away (to init), out of the tree but still in the sleeper's session. Prints its pid.
ORPHANER = [sys.executable, "-c",
            "import subprocess, sys, time; "
            "middle = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, \\'-c\\', \\'import time; time.sleep(60)\\']); "
            "print(p.pid, flush=True)'], stdout=subprocess.PIPE, text=True); "
            "orphan = middle.stdout.readline(); middle.wait(); "
            "print(orphan, end='', flush=True); time.sleep(60)"]


@pytest.fixture
def started():
    """Spawn children for a test; whatever is left of them is killed afterwards."""
    children: list[subprocess.Popen] = []

    def start(argv, **kw):
        child = procs.spawn(argv, **kw)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


def test_spawn_starts_the_child_in_a_session_of_its_own(started):
    child = started(SLEEP)
    assert os.getsid(child.pid) == child.pid != os.getsid(0)


def test_alive_is_false_once_the_process_exited_even_before_it_is_reaped(started):
    child = started(SLEEP)
    proc = procs.identify(child.pid)
    assert proc is not None and procs.alive(proc)
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while procs.alive(proc) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not procs.alive(proc)  # a zombie: exited, not yet waited for
    assert procs.wait_gone([proc], timeout_s=5) == []  # now reaped
    assert not psutil.pid_exists(child.pid)


def test_identify_a_pid_that_no_process_has():
    child = subprocess.Popen(SLEEP)
    child.kill()
    child.wait()
    assert procs.identify(child.pid) is None


def test_kill_tree_kills_the_process_and_everything_below_it(started):
    parent = started(PARENT, stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    root = procs.identify(parent.pid)
    assert root is not None
    assert grandchild in [p.pid for p in procs.descendants(root)]
    left = procs.kill_tree(root)
    assert left == []
    assert parent.poll() is not None
    assert not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_kill_tree_also_kills_processes_seen_below_it_before(started):
    root_child = started(SLEEP)
    other = started(SLEEP)
    root, seen = procs.identify(root_child.pid), procs.identify(other.pid)
    assert procs.kill_tree(root, also={seen}) == []
    assert root_child.poll() is not None and other.poll() is not None


def _orphan_of(started) -> tuple[psutil.Process, psutil.Process]:
    parent = started(ORPHANER, stdout=subprocess.PIPE, text=True)
    orphan = procs.identify(int(parent.stdout.readline()))
    root = procs.identify(parent.pid)
    assert root is not None and orphan is not None
    assert orphan not in procs.descendants(root)  # reparented away: not below the tree
    assert os.getsid(orphan.pid) == parent.pid  # but in its session
    return root, orphan


def test_kill_tree_kills_what_left_the_tree_but_stayed_in_its_session(started):
    """A process forked while the tree is killed (an engine starting its workers when Ctrl-C
    comes) escapes the tree, not the session that ``spawn`` gave its root."""
    root, orphan = _orphan_of(started)
    assert procs.kill_tree(root) == []
    assert not procs.alive(orphan)


def test_without_the_session_sweep_such_a_process_survives(started, monkeypatch):
    """The crippled variant: looking only below the root leaves the orphan running."""
    root, orphan = _orphan_of(started)
    monkeypatch.setattr(procs, "SESSION_SWEEPS", 0)
    try:
        assert procs.kill_tree(root) == []
        time.sleep(0.2)
        assert procs.alive(orphan)
    finally:
        orphan.kill()


def test_reap_terminates_and_kills_only_what_ignores_the_terminate(started):
    polite = started(SLEEP)
    stubborn = started(STUBBORN, stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # its handler is in place
    handles = [procs.identify(polite.pid), procs.identify(stubborn.pid)]
    killed = procs.reap(handles, grace_s=0.5)
    assert killed == [stubborn.pid]  # the polite one ended on the terminate
    # Both are gone and reaped (by procs: their exit codes are not Popen's to see).
    assert not psutil.pid_exists(polite.pid) and not psutil.pid_exists(stubborn.pid)


def test_a_pid_now_held_by_another_process_is_never_signalled(started):
    child = started(SLEEP)
    stale = psutil.Process(child.pid)
    # What a handle looks like once its process died and the kernel gave the pid to a new
    # process: the same pid, another start time. (Forcing the kernel to reuse a pid is not
    # possible from a test; the handle's identity is what psutil and procs check.)
    stale._ident = (child.pid, stale._ident[1] - 1000.0)
    assert not procs.alive(stale)
    procs.kill([stale])
    assert procs.reap([stale], grace_s=0.2) == []
    assert procs.kill_tree(stale) == []
    time.sleep(0.1)
    assert child.poll() is None  # the process that holds the pid now was left alone
    assert procs.alive(procs.identify(child.pid))


def test_death_watch_kills_the_others_and_reports_the_first_death(started):
    first, second = started(SLEEP), started(SLEEP)
    handles = [procs.identify(first.pid), procs.identify(second.pid)]
    deaths: list[int] = []
    with procs.DeathWatch(handles, on_death=deaths.append):
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.01)
    assert deaths == [first.pid]
    assert second.wait(timeout=10) == -signal.SIGKILL


def test_death_watch_without_processes_does_nothing():
    deaths: list[int] = []
    with procs.DeathWatch([], on_death=deaths.append):
        time.sleep(0.1)
    assert deaths == []


def test_the_resource_tracker_is_a_helper_not_an_engine_process(started):
    child = started(SLEEP)
    assert not procs.is_process_helper(procs.identify(child.pid))


# --- what killed processes leave in shared memory ---------------------------------------------

#: Maps a new shared memory segment (as shm_open + mmap do; no resource tracker), prints its
#: path, sleeps.
SEGMENT_HOLDER = [sys.executable, "-c",
                  "import mmap, os, sys, time; path = sys.argv[1]; "
                  "fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096); "
                  "m = mmap.mmap(fd, 4096); os.close(fd); m[:5] = b'ftkit'; "
                  "print(path, flush=True); time.sleep(60)"]


@pytest.fixture
def segment_path():
    path = f"{procs.SHM_DIR}ftkit-test-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.skipif(not os.path.isdir(procs.SHM_DIR), reason="no /dev/shm on this system")
def test_a_killed_processs_segment_is_found_while_it_lives_and_removed_once_reaped(
        started, segment_path):
    holder = started([*SEGMENT_HOLDER, segment_path], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == segment_path
    bystander = started(SLEEP)
    held = procs.identify(holder.pid)
    assert segment_path in procs.shared_memory_files([held])
    assert segment_path not in procs.shared_memory_files([procs.identify(bystander.pid)])
    holder.kill()
    holder.wait(timeout=10)
    assert os.path.exists(segment_path)  # SIGKILL ran no clean-up: the segment stays
    assert procs.remove_files([segment_path, segment_path + "-never-made"]) == [segment_path]
    assert not os.path.exists(segment_path)
    assert procs.shared_memory_files([held]) == set()  # a gone process holds nothing


def test_listening_names_each_listening_socket_with_its_address_as_ipv4():
    import socket

    me = psutil.Process()
    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack
        v6.bind(("::ffff:127.0.0.1", 0))
        v6.listen()
        with socket.create_connection(v4.getsockname()) as connected:  # not listening
            found = procs.listening([me])
            v4_port, v6_port = v4.getsockname()[1], v6.getsockname()[1]
            client_port = connected.getsockname()[1]
    ports = {port: ip for ip, port, _ in found}
    assert ports[v4_port] == "127.0.0.1"
    assert ports[v6_port] == "127.0.0.1"  # ::ffff:127.0.0.1 given as IPv4
    assert client_port not in ports
    assert {name for _, _, name in found} == {me.name()}
    assert procs.unmapped("::1") == "::1" and procs.unmapped("not an address") == "not an address"


def test_loopback_hosts_are_told_from_others():
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]", "::ffff:127.0.0.1"):
        assert procs.is_loopback(host), host
    for host in ("10.0.0.5", "192.0.2.2", "example.org", "::ffff:10.0.0.5", ""):
        assert not procs.is_loopback(host), host
