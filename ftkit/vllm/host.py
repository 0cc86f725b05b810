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
Ctrl-C or on failure it kills the whole tree, so a hung engine can never outlive a run.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import IO

from ftkit.bounds import PROGRESS_EVERY_S
from ftkit.contracts.job import EngineJob, HostMessage, HostRequest, JobResult, Stage
from ftkit.vllm.engine import EngineSession


def _say(message: HostMessage) -> None:
    sys.stdout.write(message.to_json() + "\n")
    sys.stdout.flush()


class Host:
    """The engine of this process, and the jobs run on it."""

    def __init__(self) -> None:
        self.session: EngineSession | None = None
        self.key: str | None = None

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

            out = session.generate(list(job.prompts), job.sampling, run_id=run_id,
                                   on_tokens=on_tokens, max_restarts=job.max_restarts)
            result = result.replace(error=out.error, generate_s=out.generate_s,
                                    started_at=out.started_at, restarts=tuple(out.restarts),
                                    requests=tuple(out.requests))
        except Exception as exc:  # noqa: BLE001 - the parent turns it into a verdict
            result = result.replace(error=f"{type(exc).__name__}: {exc}")
        return result

    def _engine_for(self, job: EngineJob) -> tuple[EngineSession, bool]:
        """The engine for ``job``: the current one if it fits and lives, else a new one."""
        key = job.engine_key()
        if self.session is not None and self.key == key and self.session.dead is None:
            self.session.reset_prefix_cache()
            return self.session, False
        self.close()
        _say(HostMessage(Stage.ENGINE_START,
                         f"tensor parallel {job.engine.tensor_parallel_size}"))
        self.session = EngineSession(job.engine, recovery=job.recovery,
                                     multiprocess=job.multiprocess)
        self.key = key
        self.session.start()
        return self.session, True

    def close(self) -> None:
        session, self.session, self.key = self.session, None, None
        if session is not None:
            _say(HostMessage(Stage.CLOSING))
            session.close()


def serve(stdin: IO[str]) -> int:
    host = Host()
    try:
        for line in stdin:
            if not line.strip():
                continue
            request = HostRequest.from_json(line)
            if request.job_path is None:
                break
            job = EngineJob.from_json(Path(request.job_path).read_text())
            result = host.run_job(job)
            assert job.result_path is not None
            # Written before anything else can fail: what was produced is never lost.
            Path(job.result_path).write_text(result.to_json())
            _say(HostMessage(Stage.JOB_DONE, request.job_path))
    finally:
        host.close()
        _say(HostMessage(Stage.EXIT))
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.stdin))
