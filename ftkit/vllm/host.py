"""The engine host: one child process that runs one job on a real vLLM engine.

``python -m ftkit.vllm.host JOB.json`` reads the job (engine, workload, recovery, faults),
runs it, writes ``result.json`` beside the job file and reports progress as JSON lines on
standard output. The parent (``ftkit.runner``) owns this process and everything below it: on a
timeout, on Ctrl-C or on failure it kills the whole tree by pid, so a hung engine can never
outlive a run.
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


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from ftkit.vllm.engine import EngineSession, EngineSpec, SamplingSpec

    spec = EngineSpec(**job["engine"])
    sampling = SamplingSpec(**job["sampling"])
    result: dict[str, Any] = {"error": None, "engine_start_s": 0.0, "generate_s": 0.0,
                              "requests": [], "pids": []}
    _say("engine_start", message=f"tensor parallel {spec.tensor_parallel_size}")
    session = EngineSession(spec, recovery=job.get("recovery"),
                            multiprocess=job.get("multiprocess"))
    try:
        session.start()
        result["engine_start_s"] = session.start_s
        result["pids"] = list(session.pids)
        _say("engine_ready", message=f"engine started in {session.start_s:.1f} s")
        run_id = session.new_run_id()
        if job.get("faults"):
            session.set_fault_plan(run_id, job["faults"])
        last = [0.0]

        def on_tokens(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done == total:
                last[0] = now
                _say("tokens", tokens_done=done, tokens_total=total)

        out = session.generate(job["prompts"], sampling, run_id=run_id, on_tokens=on_tokens,
                               max_restarts=int(job.get("max_restarts", 0)))
        result["error"] = out.error
        result["restarts"] = out.restarts
        result["generate_s"] = out.generate_s
        result["started_at"] = out.started_at
        result["requests"] = [asdict(r) for r in out.requests]
    except Exception as exc:  # noqa: BLE001 - the parent turns it into a verdict
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["pids"] = list(session.pids)
        # Write before closing: a close that hangs must not lose what was produced.
        Path(job["result_path"]).write_text(json.dumps(result))
        _say("closing")
        session.close()
    return result


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[1]).read_text())
    run_job(job)
    _say("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
