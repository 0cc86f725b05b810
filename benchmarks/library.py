"""Wall time of the bundled scenario library (``ftkit run scenarios/``) and what it is made of.

The command runs twice, as a user runs it: first with an empty cache (``FTKIT_CACHE_DIR`` set
to a fresh directory: the tiny model is built and every fault-free baseline computed), then
again with the cache that run left (baselines read from it). ``-v`` makes the command print
every progress event; each line is stamped on arrival, and the JSON report gives each
scenario's duration and verdict. From these:

* ``startup``: from launching the command until its first scenario event (imports, loading
  the scenarios, building the model on a cold cache);
* ``engine starts``: the sum of the "engine started in N s" the engine hosts report, and how
  many there were (``reused``: jobs that found their engine running);
* ``restarts``: engine restarts after a killed process, inside the faulty runs;
* ``other``: the rest of the scenarios' time (generation, baselines' generation, verdicts);
* ``shutdown``: from the last verdict until the command exited (engines closed and reaped).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, TERM_GRACE_S, end_session
from benchmarks.stats import markdown_table

#: Bound on one run of the whole library.
RUN_TIMEOUT_S = 2400.0
_STARTED = re.compile(r"engine started in ([0-9.]+) s")


def run_library(cache_dir: str, label: str, scenarios: str = "scenarios") -> dict[str, Any]:
    env = {**os.environ, "FTKIT_CACHE_DIR": cache_dir, "COLUMNS": "200"}
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-lib-") as folder:
        report = Path(folder) / "report.json"
        cmd = [str(REPO / ".venv" / "bin" / "ftkit"), "run", scenarios, "-v", "--json",
               str(report)]
        lines, started, rc = _run_stamped(cmd, env)
        ended = time.monotonic() - started
        data = json.loads(report.read_text()) if report.is_file() else {"scenarios": []}
    scenario_s = sum(s["duration_s"] for s in data["scenarios"])
    engine_starts = [float(m.group(1)) for _, line in lines if (m := _STARTED.search(line))]
    first_event = next((t for t, line in lines if "engine_" in line or "baseline" in line),
                       None)
    restarts = sum(r.get("restart_s") or 0.0 for s in data["scenarios"]
                   for r in s.get("faults", []))
    return {
        "label": label, "rc": rc, "wall_s": ended, "summary": data.get("summary"),
        "scenarios": len(data["scenarios"]),
        "startup_s": first_event,
        "scenario_s": scenario_s,
        "engine_starts": len(engine_starts), "engine_start_s": sum(engine_starts),
        "engine_reused": sum(1 for _, line in lines if "engine reused" in line),
        "baselines_run": sum(1 for _, line in lines if "fault-free reference run" in line),
        "baselines_cached": sum(1 for _, line in lines if "from cache" in line),
        "restart_s": restarts,
        "other_s": scenario_s - sum(engine_starts) - restarts,
        "shutdown_s": ended - (_last_verdict_at(lines) or ended),
        "per_scenario": [{"name": s["name"], "verdict": s["verdict"],
                          "duration_s": s["duration_s"],
                          "baseline_from_cache": s.get("baseline_from_cache")}
                         for s in data["scenarios"]],
    }


def _last_verdict_at(lines: list[tuple[float, str]]) -> float | None:
    """Time of the last verdict line (the command prints ``VERDICT name (N s)``)."""
    verdicts = [t for t, line in lines if re.search(r"\([0-9.]+ s\)\s*$", line)]
    return verdicts[-1] if verdicts else None


def _run_stamped(cmd: list[str], env: dict[str, str]) -> tuple[list[tuple[float, str]], float, int]:
    """Run ``cmd`` in a session of its own; every output line with its arrival time."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = started + RUN_TIMEOUT_S
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(cmd)} ran past {RUN_TIMEOUT_S:g} s")
            if not sel.select(timeout=1.0):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            lines.append((time.monotonic() - started, line.rstrip("\n")))
        rc = proc.wait(timeout=TERM_GRACE_S)
    finally:
        sel.close()
        if proc.poll() is None:
            end_session(proc)
    return lines, started, rc


def run(quick: bool = False) -> dict[str, Any]:
    # Quick mode runs one small scenario only; the library as a whole is the full run's job.
    target = "scenarios/link_break.yaml" if quick else "scenarios"
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-cache-") as cache:
        runs = [run_library(cache, "empty cache", target),
                run_library(cache, "warm cache", target)]
    return {"target": target, "runs": runs}


def table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["runs"]:
        summary = r.get("summary") or {}
        passed = f"{summary.get('pass', 0)}/{r['scenarios']}"
        rows.append([r["label"], f"{r['wall_s']:.0f}", passed, _s(r["startup_s"]),
                     f"{r['engine_start_s']:.0f} ({r['engine_starts']} starts, "
                     f"{r['engine_reused']} reused)",
                     f"{r['baselines_run']} run, {r['baselines_cached']} cached",
                     _s(r["restart_s"]), _s(r["other_s"]), _s(r["shutdown_s"])])
    return markdown_table(["cache", "wall s", "pass", "startup s", "engine starts s",
                           "baselines", "restarts s", "other s", "shutdown s"], rows)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    from benchmarks.suite import main

    sys.exit(main("library", run, sys.argv[1:], __doc__))
