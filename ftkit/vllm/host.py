"""The engine host: one child process that runs jobs on a real vLLM engine, one at a time.

``python -m ftkit.vllm.host`` reads ``HostRequest`` lines on standard input
(``ftkit.contracts.job``): one names a file holding an ``EngineJob``, which the host runs; it
writes the ``JobResult`` to the job's ``result_path`` and then says ``job_done``. A request
without a job (or the end of input) closes the engine and exits. Progress goes to standard
output as ``HostMessage`` lines.

The engine is kept between jobs with the same ``EngineJob.engine_key()``, so a library of
scenarios pays one engine start per configuration instead of one per scenario. Each job starts
from an empty prefix cache; an engine that a job left dead (an expected failure, a killed
process) is replaced before the next job runs.

The parent (``ftkit.runner``) owns this process and everything below it: on a timeout, on
Ctrl-C or on failure it kills the whole tree, so a hung engine can never outlive a run. The
files the engines' processes hold in shared memory are listed in ``WORK/leftovers`` (``--work
WORK``, the parent's folder for this host) for the parent to remove after such a kill. When
the parent itself dies (killed with SIGKILL: nobody is left to clean up), the host cleans up
what the parent would have: between jobs, standard input ends without an exit request and the
host closes its engine, which removes those files; during a job, a thread that watches the
parent kills the engine's processes and removes their files. Either way it then removes the
parent's folder and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import IO

from ftkit import procs
import psutil

from ftkit.bounds import ORPHAN_CHECK_S, OWNER_WATCH_POLL_S, PROGRESS_EVERY_S
from ftkit.contracts.job import (
    LEFTOVERS_FILE,
    EngineJob,
    HostMessage,
    HostRequest,
    JobResult,
    Stage,
)
from ftkit.vllm.engine import EngineSession


def _say(message: HostMessage) -> None:
    try:
        sys.stdout.write(message.to_json() + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass  # the parent is gone (or closed its end): nobody to tell, the work goes on


class Host:
    """The engine of this process, and the jobs run on it."""

    def __init__(self, work: Path | None = None) -> None:
        self.session: EngineSession | None = None
        self.key: str | None = None
        #: The parent's folder for this host (``LEFTOVERS_FILE`` goes there), if given.
        self.work = work
        #: Held while the engine is closed: an orphaned host's watch thread waits for it.
        self._closing = threading.Lock()

    def run_job(self, job: EngineJob) -> JobResult:
        """Run ``job``; an error of any kind is in the result, never raised."""
        result = JobResult()
        try:
            session, started = self._engine_for(job)
            result = result.replace(engine_start_s=session.start_s if started else 0.0)
            _say(HostMessage(Stage.ENGINE_READY, f"engine started in {session.start_s:.1f} s"
                             if started else "engine reused"))
            run_id = session.new_run_id()
            result = result.replace(run_id=run_id)
            if job.recovery is not None:
                session.set_fault_plan(dataclasses.replace(job.plan, run_id=run_id))
            last = [0.0]

            def on_tokens(done: int, total: int) -> None:
                now = time.monotonic()
                if now - last[0] >= PROGRESS_EVERY_S or done == total:
                    last[0] = now
                    _say(HostMessage(Stage.TOKENS, tokens_done=done, tokens_total=total))

            out = session.generate(
                list(job.prompts), job.sampling, run_id=run_id, on_tokens=on_tokens,
                max_restarts=job.max_restarts,
                on_restart=lambda r: _say(HostMessage(Stage.RECOVERED, r.describe())))
            result = result.replace(error=out.error, generate_s=out.generate_s,
                                    started_at=out.started_at, restarts=tuple(out.restarts),
                                    requests=tuple(out.requests))
        except Exception as exc:  # noqa: BLE001 - the parent turns it into a verdict
            result = result.replace(error=f"{type(exc).__name__}: {exc}")
        return result

    def _engine_for(self, job: EngineJob) -> tuple[EngineSession, bool]:
        """The engine for ``job``: the current one if it fits and lives, else a new one."""
        key = job.engine_key()
        if self.session is not None and self.key == key and self.session.dead is None \
                and not job.fresh_engine:
            self.session.reset_prefix_cache()
            return self.session, False
        self.close()
        stages = job.engine.pipeline_parallel_size
        _say(HostMessage(Stage.ENGINE_START,
                         f"tensor parallel {job.engine.tensor_parallel_size}"
                         + (f", {stages} pipeline stages" if stages > 1 else "")
                         + (f", Ray executor on {job.engine.nodes} node(s)"
                            if job.engine.uses_ray else "")))
        leftovers = str(self.work / LEFTOVERS_FILE) if self.work is not None else None
        self.session = EngineSession(job.engine, recovery=job.recovery,
                                     multiprocess=job.multiprocess, leftovers_file=leftovers)
        self.key = key
        self.session.start()
        return self.session, True

    def close(self) -> None:
        with self._closing:
            session, self.session, self.key = self.session, None, None
            if session is not None:
                _say(HostMessage(Stage.CLOSING))
                session.close()

    def end_with(self, parent: psutil.Process | None) -> None:
        """Watch ``parent`` (from a thread of its own); once it is gone, kill the engine,
        remove the parent's folder and end this process: a job that runs on reads no input
        and would keep the engine busy for as long as it lasts."""
        while parent is not None and procs.alive(parent):
            time.sleep(OWNER_WATCH_POLL_S)
        with self._closing:  # an engine that is being closed is closed first
            if self.session is not None:
                self.session.kill()
            if self.work is not None:
                shutil.rmtree(self.work, ignore_errors=True)
            os._exit(0)


def serve(stdin: IO[str], work: Path | None = None, parent_pid: int | None = None) -> int:
    """Run the jobs requested on ``stdin`` until an exit request or the end of input.

    ``work``: the parent's folder for this host, removed here when the input ends because the
    parent (``parent_pid``, this process's parent by default) died: it is then this process's
    to clean up."""
    host = Host(work)
    # Pinned now (pid and start time); a parent that died before this line is gone already.
    parent = procs.identify(parent_pid if parent_pid is not None else os.getppid())
    threading.Thread(target=host.end_with, args=(parent,), name="ftkit-parent-watch",
                     daemon=True).start()
    asked_to_exit = False
    try:
        for line in stdin:
            if not line.strip():
                continue
            request = HostRequest.from_json(line)
            if request.job_path is None:
                asked_to_exit = True
                break
            job = EngineJob.from_json(Path(request.job_path).read_text())
            result = host.run_job(job)
            assert job.result_path is not None
            # Written before anything else can fail: what was produced is never lost.
            Path(job.result_path).write_text(result.to_json())
            _say(HostMessage(Stage.JOB_DONE, request.job_path))
    finally:
        host.close()
        orphaned = not asked_to_exit and (
            parent is None or procs.wait_gone([parent], ORPHAN_CHECK_S) == [])
        if orphaned and work is not None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(HostMessage(Stage.EXIT))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftkit.vllm.host")
    parser.add_argument("--work", type=Path, default=None,
                        help="the parent's folder for this host (see the module docstring)")
    parser.add_argument("--parent", type=int, default=None,
                        help="the parent's pid (given, it survives the parent dying while "
                             "this process starts)")
    args = parser.parse_args(argv)
    return serve(sys.stdin, args.work, args.parent)


if __name__ == "__main__":
    procs.exit_quickly(main())  # the heap of vLLM's modules is not torn down (2 s)
