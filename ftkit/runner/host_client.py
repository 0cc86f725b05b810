"""The parent's side of one engine host process (``ftkit.vllm.host``).

``HostClient`` starts the host in a new session, sends it ``EngineJob``s, forwards its progress
lines and the ranks' fault and recovery events (read from the host's event log) to the front
end, and reads each ``JobResult`` back. It owns the host and every process below it: ``close``
(also after a timeout, on Ctrl-C or on failure) kills whatever of the tree survives, by pid and
start time, including processes that were seen below the host once and reparented since. A
host interrupted during a job (Ctrl-C) is killed at once: it reads no request before its job
ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from ftkit import procs
from ftkit.bounds import EVENT_POLL_S, HOST_EXIT_GRACE_S, HOST_READER_JOIN_S
from ftkit.contracts.eventlog import Event, read_events
from ftkit.contracts.job import (
    LEFTOVERS_FILE,
    SHOWN_STAGES,
    EngineJob,
    HostMessage,
    HostRequest,
    JobResult,
    Stage,
)
from ftkit.errors import FtkitError
from ftkit.progress import EventSink, ProgressEvent
from ftkit.results import RequestOutput, RunOutput
from ftkit.runner.events import collect_events, events_of_run, progress_line
from ftkit.scenario.model import FaultSpec

#: How much of the end of the host's log an error shows.
LOG_TAIL_LINES = 15
#: How much of an engine's error a run output keeps.
ERROR_CHARS = 2000


class HostClient:
    """One engine host process: its jobs, its progress stream, its event log (for ftkit
    engines) and every process below it."""

    def __init__(self, key: str, *, event_log: bool) -> None:
        self.key = key
        self.work = Path(tempfile.mkdtemp(prefix="ftkit-host-"))
        self.event_log_dir = self.work / "event-log" if event_log else None
        if self.event_log_dir is not None:
            self.event_log_dir.mkdir()
        self.log_path = self.work / "engine.log"
        self.proc: subprocess.Popen[str] | None = None
        self._root: psutil.Process | None = None
        self._reader: threading.Thread | None = None
        self._jobs = 0
        self._done = threading.Event()
        self._sink: tuple[str, EventSink] | None = None
        self._seen_events = 0
        #: Every process seen below the host: one that the host left behind is reparented
        #: away from it, and is still found and killed by its pid and start time.
        self._descendants: set[psutil.Process] = set()
        #: The shared memory the host and the processes below it map (the host's own
        #: semaphores among them), removed once they are killed: a killed host's resource
        #: tracker, killed with it, unlinks nothing.
        self._shared_memory: set[str] = set()
        self._asked_exit = False
        #: A job was sent and its end not yet seen.
        self._in_job = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        self._asked_exit = False
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "a") as log:
            self.proc = procs.spawn(
                [sys.executable, "-m", "ftkit.vllm.host", "--work", str(self.work),
                 "--parent", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self._root = procs.identify(self.proc.pid)
        self._reader = threading.Thread(target=self._read_progress, daemon=True)
        self._reader.start()

    def run(self, job: EngineJob, name: str, on_event: EventSink, timeout_s: float,
            planned: Sequence[FaultSpec]) -> RunOutput:
        """Run one job (``planned``: its scenario faults); the result, or a timed-out run
        (the host is then killed)."""
        self._jobs += 1
        job_dir = self.work / f"job{self._jobs}"
        job_dir.mkdir()
        result_path = job_dir / "result.json"
        if job.recovery is not None:
            assert self.event_log_dir is not None
            job = job.replace(recovery=job.recovery.replace(
                event_log_dir=str(self.event_log_dir)))
        job = job.replace(result_path=str(result_path))
        job_path = job_dir / "job.json"
        job_path.write_text(job.to_json())
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self._sink = (name, on_event)
        self._done.clear()
        self._seen_events = len(self._events())
        since = time.time()
        self._in_job = True
        self.proc.stdin.write(HostRequest(str(job_path)).to_json() + "\n")
        self.proc.stdin.flush()
        timed_out = not self._wait(time.monotonic() + timeout_s)
        # A job that timed out runs on in the host: ``close`` then kills it at once.
        self._in_job = timed_out
        finished = result_path.is_file()
        if timed_out:
            self.close()  # nothing the host started survives a job it did not finish
        out = self._result(result_path, len(job.prompts))
        out.timed_out = timed_out
        if timed_out:
            out.error = (out.error or "") + f"run stopped after its timeout of {timeout_s:.0f} s"
        if self.event_log_dir is not None and self.event_log_dir.is_dir():
            # The event log is the host's; this job's part is what came after it started
            # (and, for fired faults, what carries its run id).
            events = events_of_run(self._events(), out.run_id, since)
            out.faults, out.recoveries = collect_events(
                events, planned, origin=out.started_at, restarts=out.restarts)
        if not finished:
            self.close()
        return out

    def _wait(self, deadline: float) -> bool:
        """Wait until the job is done (True), the host died or the deadline passed (False)."""
        assert self.proc is not None
        try:
            while not self._done.wait(EVENT_POLL_S):
                self._forward_events()
                self._note_descendants()
                if self.proc.poll() is not None:
                    return True  # died: the missing result says why
                if time.monotonic() > deadline:
                    return False
        finally:
            self._forward_events()
        self._note_descendants()
        return True

    def ask_exit(self) -> None:
        """Tell the host to close its engine and exit (``close`` waits for it)."""
        proc = self.proc
        if proc is None or self._asked_exit or self._in_job:
            return
        self._asked_exit = True
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(HostRequest().to_json() + "\n")
                proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self, deadline: float | None = None) -> None:
        """Ask the host to exit, wait for it until ``deadline`` (``HOST_EXIT_GRACE_S`` from
        now by default), then make sure nothing it started survives. A host in the middle of
        a job is not waited for."""
        proc = self.proc
        if proc is None:
            return
        if deadline is None:
            deadline = time.monotonic() + HOST_EXIT_GRACE_S
        if self._in_job:
            deadline = time.monotonic()
        try:
            self.ask_exit()
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            # On a clean exit this reaps stragglers; on a timeout, Ctrl-C or any failure it
            # makes sure nothing the host started survives.
            self._note_descendants()
            if self._root is not None:
                # The host leads a session of its own (``procs.spawn``).
                procs.kill_tree(self._root, also=self._descendants, session=self._root.pid)
            else:
                procs.wait_gone(procs.kill(self._descendants))
            if self._reader is not None:
                self._reader.join(timeout=HOST_READER_JOIN_S)
            # What the host's engines held in shared memory, if the host could not remove it
            # (killed above, or died): every process that used it is gone now.
            listed = self.work / LEFTOVERS_FILE
            if listed.is_file():
                procs.remove_files(listed.read_text().splitlines())
            procs.remove_files(self._shared_memory)
            self._shared_memory = set()
            shutil.rmtree(self.work, ignore_errors=True)
            self._in_job = False

    def _note_descendants(self) -> None:
        if self._root is not None:
            self._descendants.update(procs.descendants(self._root))
            self._shared_memory |= procs.shared_memory_files(
                [self._root, *(p for p in self._descendants if procs.alive(p))])

    def _read_progress(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = HostMessage.from_json(line)
            except (ValueError, TypeError, KeyError, FtkitError):
                continue  # not a host message (a library printing to stdout)
            if msg.stage is Stage.JOB_DONE:
                self._done.set()
            elif msg.stage in SHOWN_STAGES and self._sink:
                name, sink = self._sink
                sink(ProgressEvent(name, msg.stage.value, msg.message, msg.tokens_done,
                                   msg.tokens_total))

    def _events(self) -> list[Event]:
        return read_events(self.event_log_dir) if self.event_log_dir is not None else []

    def _forward_events(self) -> None:
        """Show the events written since the last look (fired faults, recovery rounds)."""
        if self.event_log_dir is None or self._sink is None:
            return
        name, sink = self._sink
        events = self._events()
        for e in events[self._seen_events:]:
            line = progress_line(e)
            if line is not None:
                sink(ProgressEvent(name, *line))
        self._seen_events = len(events)

    def _result(self, path: Path, n_requests: int) -> RunOutput:
        if not path.is_file():
            return RunOutput(requests=[RequestOutput(i, []) for i in range(n_requests)],
                             error="the engine host ended without a result: "
                                   + _tail(self.log_path))
        result = JobResult.from_json(path.read_text())
        return RunOutput(requests=list(result.requests),
                         error=result.error[:ERROR_CHARS] if result.error else result.error,
                         engine_start_s=result.engine_start_s, generate_s=result.generate_s,
                         started_at=result.started_at, run_id=result.run_id, restarts=list(result.restarts))


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
