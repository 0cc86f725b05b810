"""The engine host: one child process that runs jobs on a real vLLM engine, one at a time.

``python -m ftkit.vllm.host`` reads job requests from standard input, one JSON line each:
``{"job": "PATH/job.json"}`` runs that job (engine, workload, recovery, faults), writes its
``result.json`` to the job's ``result_path`` and says ``job_done``; ``{"op": "exit"}`` (or the
end of input) closes the engine and exits. Progress goes to standard output as JSON lines.

The engine is kept between jobs whose engine settings are the same (``engine_key``), so a
library of scenarios pays one engine start per configuration instead of one per scenario. Each
job starts from an empty prefix cache; an engine that a job left dead (an expected failure, a
killed process) is replaced before the next job runs.

The parent (``ftkit.runner``) owns this process and everything below it: on a timeout, on
Ctrl-C or on failure it kills the whole tree by pid, so a hung engine can never outlive a run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

PROGRESS_EVERY_S = 0.2


def _say(stage: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"stage": stage, **fields}) + "\n")
    sys.stdout.flush()


def engine_key(job: dict[str, Any]) -> str:
    """What decides the engine a job needs. ``max_reinference`` is not in it: it is set per
    run through the fault plan."""
    recovery = job.get("recovery")
    if recovery is not None:
        recovery = {k: v for k, v in recovery.items() if k != "max_reinference"}
    return json.dumps({"engine": job["engine"], "recovery": recovery,
                       "multiprocess": job.get("multiprocess")}, sort_keys=True)


class Host:
    """The engine of this process, and the jobs run on it."""

    def __init__(self) -> None:
        self.session: Any = None
        self.key: str | None = None

    def run_job(self, job: dict[str, Any]) -> dict[str, Any]:
        from ftkit.vllm.engine import SamplingSpec

        result: dict[str, Any] = {"error": None, "engine_start_s": 0.0, "generate_s": 0.0,
                                  "requests": [], "pids": [], "engine_reused": False}
        try:
            session, started = self._engine_for(job)
            result["engine_start_s"] = session.start_s if started else 0.0
            result["engine_reused"] = not started
            _say("engine_ready", message=(f"engine started in {session.start_s:.1f} s"
                                          if started else "engine reused"))
            run_id = session.new_run_id()
            result["run_id"] = run_id
            if job.get("recovery") is not None:
                session.set_fault_plan(run_id, job.get("faults") or [],
                                       max_reinference=job["recovery"].get("max_reinference"))
            last = [0.0]

            def on_tokens(done: int, total: int) -> None:
                now = time.monotonic()
                if now - last[0] >= PROGRESS_EVERY_S or done == total:
                    last[0] = now
                    _say("tokens", tokens_done=done, tokens_total=total)

            out = session.generate(job["prompts"], SamplingSpec(**job["sampling"]),
                                   run_id=run_id, on_tokens=on_tokens,
                                   max_restarts=int(job.get("max_restarts", 0)))
            result.update(error=out.error, generate_s=out.generate_s,
                          started_at=out.started_at, restarts=out.restarts,
                          requests=[asdict(r) for r in out.requests])
        except Exception as exc:  # noqa: BLE001 - the parent turns it into a verdict
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if self.session is not None:
                result["pids"] = list(self.session.pids)
        return result

    def _engine_for(self, job: dict[str, Any]) -> tuple[Any, bool]:
        """The engine for ``job``: the current one if it fits and lives, else a new one."""
        from ftkit.vllm.engine import EngineSession, EngineSpec

        key = engine_key(job)
        if self.session is not None and self.key == key and self.session.dead is None:
            self.session.reset_prefix_cache()
            return self.session, False
        self.close()
        spec = EngineSpec(**job["engine"])
        _say("engine_start", message=f"tensor parallel {spec.tensor_parallel_size}")
        self.session = EngineSession(spec, recovery=job.get("recovery"),
                                     multiprocess=job.get("multiprocess"))
        self.key = key
        self.session.start()
        return self.session, True

    def close(self) -> None:
        session, self.session, self.key = self.session, None, None
        if session is not None:
            _say("closing")
            session.close()


def serve(stdin: Any) -> int:
    host = Host()
    try:
        for line in stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("op") == "exit":
                break
            job = json.loads(Path(request["job"]).read_text())
            result = host.run_job(job)
            # Written before anything else can fail: what was produced is never lost.
            Path(job["result_path"]).write_text(json.dumps(result))
            _say("job_done", job=request["job"])
    finally:
        host.close()
        _say("exit")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.stdin))
