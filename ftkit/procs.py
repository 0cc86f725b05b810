"""The one process toolkit: spawn, watch for a death, kill a tree, reap.

Used by the scenario runner (its engine hosts), the engine session (the engine's processes)
and the pytest plugin (through the engine session). What a caller may rely on:

* A process is named by a ``psutil.Process``, which remembers the process's start time: a pid
  that now belongs to another process (another start time) is never signalled nor waited
  for. ``identify(pid)`` pins a pid to the process that has it now.
* ``alive`` is the one liveness check: the process exists, is the same process, and has not
  exited (a zombie has exited).
* Every function that signals goes through one kill loop (``_signal``) and every wait is
  bounded (``ftkit.bounds``); a child of this process that has exited is waited for (reaped),
  so no zombie of ours is left behind.
* What killed processes leave in shared memory is found while they live
  (``shared_memory_files``) and removed once they are reaped (``remove_files``): a process
  killed with SIGKILL runs no clean-up of its own.
* An owner that may itself be killed with SIGKILL (a ``pytest`` or script process that runs
  engines in-process) starts a ``Watchdog``: a small process of its own that, when the owner
  dies, kills the processes the owner noted (by pid and start time, no others) and removes
  the files it noted. ``python -m ftkit.procs`` is that process.
* A process that has imported vLLM spends about 2 s of CPU at its exit tearing its heap down
  (torch, transformers, vLLM's modules: Python's last collections and deallocations), and a
  multi-process engine's close waits for its workers' and then its engine core's: vLLM gives
  the engine core 5 s and then kills it. ``exit_quickly`` ends a process as Python's exit does
  but without that teardown; ftkit's own engine-owning processes end with it, and the
  processes vLLM spawns for the engines ftkit starts do (``QUICK_EXIT_ENV``).
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import psutil

from ftkit.bounds import DEATH_WATCH_POLL_S, OWNER_WATCH_POLL_S, PROCESS_POLL_S, REAP_GRACE_S

log = logging.getLogger("ftkit")

#: Where POSIX shared memory segments live (``shm_open``) on Linux.
SHM_DIR = "/dev/shm/"
#: How often ``kill_tree`` looks again for processes left in a killed root's session.
SESSION_SWEEPS = 20
#: ``1``: the processes vLLM spawns (engine core, workers) end with ``exit_quickly`` (ftkit
#: sets it for the engines it starts, offline and served). ``0``: every process keeps
#: Python's full exit, ftkit's own too.
QUICK_EXIT_ENV = "FTKIT_QUICK_EXIT"


def spawn(argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` in a new session (so a Ctrl-C to the terminal reaches only its owner,
    which then kills the whole tree); ``popen``: further ``subprocess.Popen`` arguments."""
    return subprocess.Popen(list(argv), start_new_session=True, **popen)


def exit_quickly(code: int | None) -> NoReturn:
    """End this process with ``code`` (None: 0) as Python's own exit would, less its last
    step: non-daemon threads are joined, ``atexit`` callbacks run and the standard streams
    are flushed; the heap is not torn down (the process's memory goes with it). Call it from
    the main thread, where the process would return from its main function.
    ``QUICK_EXIT_ENV`` ``0``: a plain ``sys.exit``."""
    if os.environ.get(QUICK_EXIT_ENV) == "0" \
            or threading.current_thread() is not threading.main_thread():
        sys.exit(code)
    shutdown = getattr(threading, "_shutdown", None)  # what Python's exit joins threads with
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say
            pass
    os._exit(0 if code is None else code)


def quick_exit_of_spawned_process() -> None:
    """In a process that ``multiprocessing`` spawned (vLLM's engine core and workers) and
    whose environment sets ``QUICK_EXIT_ENV`` to ``1``: its final ``sys.exit`` (the one
    ``multiprocessing.spawn.spawn_main`` calls once the process's target returned) becomes
    ``exit_quickly``; every other ``sys.exit`` stays as it was. Idempotent."""
    import multiprocessing.spawn

    if os.environ.get(QUICK_EXIT_ENV) != "1" or getattr(sys.exit, "__ftkit_quick__", False):
        return
    final_call = multiprocessing.spawn.spawn_main.__code__
    plain_exit = sys.exit

    def exit(status: Any = None) -> NoReturn:
        caller = sys._getframe(1)
        if caller.f_code is final_call and (status is None or isinstance(status, int)):
            exit_quickly(status)
        plain_exit(status)

    exit.__ftkit_quick__ = True  # type: ignore[attr-defined]
    sys.exit = exit


def identify(pid: int) -> psutil.Process | None:
    """The process that has ``pid`` now (pinned by its start time), or None if none has."""
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def process_identity(pid: int | None = None) -> str:
    """``pid`` (default: this process) with its start time, ``"<pid>:<start time>"``, to name
    it to another process: a pid that another process has taken since does not match it
    (``identified_process``)."""
    proc = psutil.Process(pid)
    return f"{proc.pid}:{proc.create_time()!r}"


def identified_process(identity: str) -> psutil.Process | None:
    """The process a ``process_identity`` names, if it still runs on this host; ``None`` for a
    process that is gone, one whose pid another process has taken, or one on another host."""
    pid, _, started = identity.partition(":")
    try:
        proc = identify(int(pid))
        return proc if proc is not None and repr(proc.create_time()) == started else None
    except (ValueError, psutil.Error):
        return None


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    """Every process below ``proc`` now; empty if ``proc`` is gone or is not itself any more."""
    if not alive(proc):
        return []
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def shared_memory_files(processes: Iterable[psutil.Process], semaphores: bool = True
                        ) -> set[str]:
    """The shared memory segments (files under ``SHM_DIR``) that ``processes`` have mapped or
    open now: what they would leave behind if they were killed. ``semaphores=False`` leaves
    out Python's named semaphores (``sem.*``): those are the resource tracker's of the process
    that made them, which may be one that is not going away."""
    found: set[str] = set()
    for proc in processes:
        try:
            found.update(_mapped_shared_memory(proc))
            found.update(f.path for f in proc.open_files() if f.path.startswith(SHM_DIR))
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read: it holds nothing we can name
    if not semaphores:
        found = {path for path in found if not path.startswith(SHM_DIR + "sem.")}
    return found


def _mapped_shared_memory(proc: psutil.Process) -> set[str]:
    """The files under ``SHM_DIR`` that ``proc`` maps, from ``/proc/PID/maps`` (psutil's
    ``memory_maps`` reads ``smaps`` and its page counts, tens of times slower on an engine
    process; this is looked at while an engine starts)."""
    found = set()
    with open(f"/proc/{proc.pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if path.startswith(SHM_DIR) and not path.endswith(" (deleted)"):
                found.add(path)
    return found


def listening(processes: Iterable[psutil.Process]) -> list[tuple[str, int, str]]:
    """Every TCP socket ``processes`` listen on now: (address, port, process name), sorted;
    an IPv4 address mapped into IPv6 (``::ffff:127.0.0.1``) is given as IPv4. Processes gone
    meanwhile are left out."""
    found = []
    for proc in processes:
        try:
            conns = proc.net_connections(kind="tcp")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        found += [(unmapped(c.laddr.ip), c.laddr.port, name) for c in conns
                  if c.status == psutil.CONN_LISTEN]
    return sorted(found)


def unmapped(host: str) -> str:
    """``host``, or the IPv4 address it maps into IPv6 (``::ffff:127.0.0.1`` gives
    ``127.0.0.1``)."""
    try:
        inner = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    mapped = getattr(inner, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, bracketed IPv6 too, or ``localhost``) is this host's
    loopback, an IPv4 loopback mapped into IPv6 included."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(unmapped(host)).is_loopback
    except ValueError:
        return False


def remove_files(paths: Iterable[str]) -> list[str]:
    """Remove the files and folders ``paths`` that still exist (segments or temporary folders
    of processes that are reaped); returns those removed. Call it only once the processes that
    used them are gone."""
    removed = []
    for path in sorted(set(paths)):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("ftkit: could not remove %s: %s", path, exc)
            continue
        removed.append(path)
    return removed


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs: it exists, it is the same process (start time), and it has
    not exited."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each of ``procs`` that is alive, without waiting; return all of them, for
    ``wait_gone`` (or ``reap``) later."""
    procs = list(procs)
    _signal(procs, signal.SIGKILL)
    return procs


def wait_gone(procs: Iterable[psutil.Process], timeout_s: float = REAP_GRACE_S
              ) -> list[psutil.Process]:
    """Wait until each of ``procs`` has exited (and, if it is a child of this process, has
    been reaped), at most ``timeout_s``; return those that have not."""
    left = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in left if not _gone(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(PROCESS_POLL_S)


def kill_tree(root: psutil.Process, also: Iterable[psutil.Process] = (),
              timeout_s: float = REAP_GRACE_S, session: int | None = None
              ) -> list[psutil.Process]:
    """Kill ``root``, every process below it and the processes ``also`` (for instance ones
    seen below it earlier and since reparented away), and wait for them; return those still
    there after ``timeout_s``.

    ``session``: the session ``root`` was started to lead (``spawn``), known to the caller
    even once ``root`` is gone; by default the session ``root`` leads now, if it does. The
    root takes its whole session with it: a process forked below the tree while it was being
    killed (an engine starting its workers) is reparented away before it could be seen below
    ``root``, but stays in the session. After the kill, every process of that session
    started since ``root`` is killed too, until none is left (a process killed by SIGKILL
    forks no more)."""
    procs = [root, *descendants(root)]
    procs += [p for p in also if p not in procs]
    if session is None:
        session = _session_of(root)
    # Python's resource tracker unlinks the named semaphores it tracks (/dev/shm/sem.*) when
    # the process that started it is gone: it is waited for, and killed only if it lingers.
    helpers = [p for p in procs if is_process_helper(p)]
    killed = kill([p for p in procs if p not in helpers])
    for _ in range(SESSION_SWEEPS if session is not None else 0):
        strays = [p for p in session_members(session, since=root)
                  if p not in killed and p not in helpers]
        if not strays:
            break
        helpers += [p for p in strays if is_process_helper(p)]
        killed += kill(p for p in strays if p not in helpers)
    left = wait_gone(killed, timeout_s)
    return left + wait_gone(kill(wait_gone(helpers, timeout_s)), timeout_s)


def _session_of(proc: psutil.Process) -> int | None:
    """The session ``proc`` leads (its pid), or None if it leads none or is gone."""
    try:
        return proc.pid if alive(proc) and os.getsid(proc.pid) == proc.pid else None
    except OSError:
        return None


def session_members(session: int, since: psutil.Process) -> list[psutil.Process]:
    """The live processes in session ``session`` now that started no earlier than ``since``
    (the session's leader: its processes are younger)."""
    try:
        earliest = since.create_time()
    except psutil.Error:
        return []  # the leader's start is unknown: nothing can be told apart as its own
    members = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == session:
                proc = psutil.Process(pid)
                if proc.create_time() >= earliest and alive(proc):
                    members.append(proc)
        except (OSError, psutil.Error):
            continue  # gone meanwhile
    return members


def reap(procs: Iterable[psutil.Process], grace_s: float = REAP_GRACE_S) -> list[int]:
    """Ask each of ``procs`` to terminate, kill those still there after ``grace_s``, and wait
    for them (about ``2 * grace_s`` at most); return the pids that had to be killed."""
    procs = [p for p in procs if not _gone(p)]
    _signal(procs, signal.SIGTERM)
    left = wait_gone(procs, grace_s)
    wait_gone(kill(left), grace_s)
    return [p.pid for p in left]


def is_process_helper(proc: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker: one per process, started by the first
    engine that needs it, not owned by any engine. It ignores SIGTERM and exits by itself when
    the process that started it exits, so it is neither an engine process nor an orphan."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    """The kill loop: send ``sig`` to each of ``procs`` that is alive (psutil refuses a pid
    that another process has taken since)."""
    for p in procs:
        if alive(p):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass


def _gone(proc: psutil.Process) -> bool:
    """``proc`` has exited and needs no wait: a child of this process is reaped here; a zombie
    of another parent is dead, and only that parent (init, for an orphaned worker) can reap
    it, in its own time."""
    try:
        mine = proc.is_running() and proc.ppid() == os.getpid()
    except psutil.Error:
        return True
    if mine:
        try:
            proc.wait(timeout=0)
        except psutil.TimeoutExpired:
            return False
        except psutil.Error:
            pass
        return True
    return not alive(proc)


class DeathWatch:
    """While it is entered: notices the death of any of ``procs``, kills the others (only
    these), and calls ``on_death(pid)`` once, from its own thread."""

    def __init__(self, procs: Iterable[psutil.Process],
                 on_death: Callable[[int], None] | None = None) -> None:
        self._procs = list(procs)
        self._on_death = on_death
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DeathWatch:
        if self._procs:
            self._thread = threading.Thread(target=self._watch, name="ftkit-death-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DEATH_WATCH_POLL_S * 20)

    def _watch(self) -> None:
        while not self._stop.wait(DEATH_WATCH_POLL_S):
            dead = next((p for p in self._procs if not alive(p)), None)
            if dead is None:
                continue
            log.warning("ftkit: process %d died; stopping the processes it worked with",
                        dead.pid)
            kill(p for p in self._procs if p is not dead)
            if self._on_death is not None:
                self._on_death(dead.pid)
            return


@contextmanager
def polling(every_s: float, look: Callable[[], None]) -> Iterator[None]:
    """Call ``look()`` every ``every_s`` seconds from a thread of its own while the block runs
    (the block's thread must leave alone what ``look`` changes until the block ends)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            look()

    thread = threading.Thread(target=loop, name="ftkit-polling", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Watchdog:
    """A process that cleans up after its owner (the process that starts it) when the owner
    dies without cleaning up: killed with SIGKILL, or by a signal that runs no clean-up.

    The owner notes the processes (``note_processes``: pid and start time) and the files or
    folders (``note_paths``) to clean up in a record file, one JSON object a line. The
    watchdog reads nothing while its owner lives; once the owner is gone (this process's
    parent changed) it kills those of the noted processes that are still the same process,
    waits for them, removes the noted paths and the record, and exits. An owner that cleans
    up itself calls ``stop()`` once it has. The watchdog runs in a session of its own, so a
    Ctrl-C at the owner's terminal does not reach it.

    ``descendants``: the watchdog also looks at the owner's descendants while it lives (every
    ``OWNER_WATCH_POLL_S``) and kills those it last saw when the owner is gone: for an owner
    that becomes another program (``os.execve``: ``ftkit serve`` becoming vLLM's server),
    which notes nothing."""

    def __init__(self, record: str, *, descendants: bool = False) -> None:
        self.record = record
        self.descendants = descendants
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Watchdog:
        with open(self.record, "a"):
            pass
        # Standard output is not passed on: a caller may be waiting for its end (a pipe).
        self._proc = spawn([sys.executable, "-m", "ftkit.procs", "--record", self.record,
                            "--owner", str(os.getpid()),
                            *(["--descendants"] if self.descendants else [])],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return self

    def note_processes(self, procs: Iterable[psutil.Process]) -> None:
        lines = []
        for p in procs:
            try:
                lines.append({"pid": p.pid, "started": p.create_time()})
            except psutil.Error:
                continue  # gone already: nothing to kill
        self._append(lines)

    def note_paths(self, paths: Iterable[str]) -> None:
        self._append({"path": path} for path in paths)

    def _append(self, records: Iterable[dict[str, Any]]) -> None:
        with open(self.record, "a") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)

    def stop(self) -> None:
        """End the watchdog (the owner has cleaned up) and remove its record."""
        proc, self._proc = self._proc, None
        if proc is not None:
            watchdog = identify(proc.pid)
            if watchdog is not None:
                reap([watchdog])
            proc.wait(timeout=REAP_GRACE_S)
        remove_files([self.record])


def read_watch_record(record: str) -> tuple[list[psutil.Process], list[str]]:
    """The processes of a ``Watchdog`` record that are still the processes noted (same pid
    and start time) and the paths it lists; nothing for a record that is gone."""
    processes: list[psutil.Process] = []
    paths: list[str] = []
    try:
        with open(record) as lines:
            text = lines.read()
    except FileNotFoundError:
        return [], []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # the last line of an owner killed while it wrote it
        if "path" in entry:
            paths.append(entry["path"])
            continue
        proc = identify(entry["pid"])
        try:
            # psutil's start time of a process is the same float in every process.
            if proc is not None and abs(proc.create_time() - entry["started"]) < 0.01:
                processes.append(proc)
        except psutil.Error:
            continue
    return processes, paths


def watch_owner(record: str, owner_pid: int, descendants: bool = False) -> int:
    """The watchdog process: wait until the owner ``owner_pid`` (this process's parent) is
    gone, then clean up what ``record`` lists (``descendants``: and the owner's descendants
    last seen, but this process)."""
    seen: list[psutil.Process] = []
    while os.getppid() == owner_pid:
        if descendants:
            try:
                seen = [p for p in psutil.Process(owner_pid).children(recursive=True)
                        if p.pid != os.getpid()]
            except psutil.Error:
                pass  # gone: the last look stands
        time.sleep(OWNER_WATCH_POLL_S)
    processes, paths = read_watch_record(record)
    # (psutil's Process checks, at each signal, that its pid is still the process seen.)
    processes += [p for p in seen if p not in processes]
    left = wait_gone(kill(processes))
    if left:
        log.warning("ftkit: processes %s of a dead owner did not end", [p.pid for p in left])
    remove_files([*paths, record])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftkit.procs",
                                     description="An engine owner's watchdog (see Watchdog).")
    parser.add_argument("--record", required=True, help="the owner's record file")
    parser.add_argument("--owner", type=int, required=True, help="the owner's pid (the parent)")
    parser.add_argument("--descendants", action="store_true",
                        help="kill the owner's descendants last seen, too")
    args = parser.parse_args(argv)
    return watch_owner(args.record, args.owner, args.descendants)


if __name__ == "__main__":
    sys.exit(main())
