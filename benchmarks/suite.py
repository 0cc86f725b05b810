"""Run one benchmark suite as a program: ``python -m benchmarks.<suite> [--quick] [--out F]``.

A suite's ``run(quick)`` returns a JSON-able dict; this writes it, wrapped with the machine's
facts before and after (the load average says whether something else ran meanwhile), to
``benchmarks/results/<suite>.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, load_average, machine


def main(name: str, run: Callable[[bool], dict[str, Any]], argv: list[str] | None,
         doc: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                 description=(doc or "").strip().splitlines()[0] if doc else None)
    ap.add_argument("--quick", action="store_true", help="few repeats, for a smoke run")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / f"{name}.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    before = machine()
    started = time.monotonic()
    result = run(args.quick)
    record = {"suite": name, "quick": args.quick, "machine": before,
              "load_avg_1m_after": load_average(), "wall_s": time.monotonic() - started,
              **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"{name}: {record['wall_s']:.0f} s, written to {args.out}")
    return 0


def main_with_parts(name: str, run: Callable[[bool, tuple[str, ...]], dict[str, Any]],
                    parts: tuple[str, ...], argv: list[str] | None, doc: str | None = None
                    ) -> int:
    """``main`` for a suite of ``parts``, with ``--part PART ...`` to run some of them (in
    ``parts``' order): such a run writes ``results/partial/<name>-<parts>.json`` unless
    ``--out`` says otherwise, so that it never stands in for the whole suite's results."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--part", nargs="+", choices=parts, default=list(parts))
    args, rest = ap.parse_known_args(argv)
    chosen = tuple(p for p in parts if p in args.part)
    if chosen != parts and "--out" not in rest:
        rest += ["--out", str(RESULTS_DIR / "partial" / f"{name}-{'+'.join(chosen)}.json")]
    return main(name, lambda quick: run(quick, chosen), rest, doc)
