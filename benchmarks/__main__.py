"""``make bench``: run every benchmark suite, then write the results and the performance page.

    .venv/bin/python -m benchmarks                  # all suites, docs/performance.md updated
    .venv/bin/python -m benchmarks --quick          # few repeats, no library: results/quick/
    .venv/bin/python -m benchmarks --only recovery  # some suites (the others' results stay)
    .venv/bin/python -m benchmarks --report-only    # tables again from the saved results

Each suite runs as a program of its own (``python -m benchmarks.<suite>``), in a session of its
own with a time bound: an in-process engine or a killed one cannot affect the next suite, and a
suite that runs out of time is ended with every process below it. Results: one JSON file per
suite and ``RESULTS.md`` (all tables) in ``benchmarks/results/`` (``results/quick/`` for
``--quick``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import report
from benchmarks.common import REPO, RESULTS_DIR, end_session

#: Suites in the order they run, with the bound on each (seconds; full mode).
SUITES = {"snapshot": 600, "overhead": 1500, "recovery": 1500, "library": 2700, "explore": 1500,
          "serve": 1500}
#: Suites that ``--quick`` leaves out unless named in ``--only`` (the library runs every
#: scenario twice, whatever the mode).
FULL_ONLY = {"library"}


def run_suite(name: str, quick: bool, out_dir: str) -> int:
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--out", f"{out_dir}/{name}.json"]
    if quick:
        cmd.append("--quick")
    print(f"== {name}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=SUITES[name])
    except subprocess.TimeoutExpired:
        print(f"{name}: ran past {SUITES[name]} s; ending it", flush=True)
        end_session(proc)
        rc = 124
    except KeyboardInterrupt:
        end_session(proc)
        raise
    print(f"== {name}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
    return rc


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description="Run ftkit's benchmark suites.")
    ap.add_argument("--quick", action="store_true",
                    help="few repeats and faults, no library run; results in results/quick/, "
                         "docs/performance.md untouched")
    ap.add_argument("--only", nargs="+", choices=list(SUITES), metavar="SUITE",
                    help=f"run only these suites ({', '.join(SUITES)})")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing; write the tables from the saved results")
    args = ap.parse_args(argv)
    out_dir = RESULTS_DIR / "quick" if args.quick else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        for name in args.only or [s for s in SUITES if not (args.quick and s in FULL_ONLY)]:
            if run_suite(name, args.quick, str(out_dir)) != 0:
                failed.append(name)
    markdown = report.write(out_dir, page=None if args.quick else REPO / report.PAGE)
    print(markdown)
    if failed:
        print(f"suites that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
