"""How often a server's fault-free run differs from itself under concurrent clients.

    .venv/bin/python -m benchmarks.serve_batch_invariance [--runs 20] [--scenario FILE]
                     [--out results.json]

Starts one server of a serve scenario (default ``scenarios/serve_link_flap.yaml``; its faults
are not planned) and sends the scenario's workload (its requests and background streams, all
at once, each on its own connection) ``--runs`` times, comparing each run with the first as a
serve scenario's oracle does (``ftkit.measure_serve_oracle``: token ids, the sampled tokens'
logprobs bit for bit, finish reasons). Prints (and writes, with ``--out``) how many runs differ
from the first: the oracle (the same server's fault-free run) is sound only where that is 0.
Not part of ``make bench``: it measures the oracle, not ftkit's speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import ftkit

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = REPO / "scenarios" / "serve_link_flap.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2")
    scenario = ftkit.load_scenario(args.scenario)
    measured = ftkit.measure_serve_oracle(
        scenario, args.runs, model_dir=str(ftkit.resolve_model(scenario.engine.model)))
    print(f"{measured.differing_runs} of {measured.runs - 1} runs differ from the first "
          f"({measured.streams_per_run} concurrent streams, {measured.compared_per_run} "
          f"compared, {measured.tokens_per_run} compared tokens per run; "
          f"{measured.seconds} s)")
    for index, found in measured.differences.items():
        print(f"  run {index}: {'; '.join(found)}")
    if args.out is not None:
        args.out.write_text(json.dumps({**measured.to_dict(), "machine": platform.platform()},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
