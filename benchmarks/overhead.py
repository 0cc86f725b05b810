"""Fault-free cost of the recovery engine: tokens per second with recovery off and on.

Both engines are measured in one run, on the same workload, in alternating repeats after a
warm-up, so that drift of the machine affects both alike. Prints a Markdown table and writes
JSON to ``--out``.

    .venv/bin/python benchmarks/overhead.py --tp 1 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ftkit.model import build_tiny_model
from ftkit.scenario.prompts import random_prompts
from ftkit.vllm.engine import EngineSession, EngineSpec, SamplingSpec


def measure(tp: int, batch: int, max_tokens: int, repeats: int) -> dict:
    model = str(build_tiny_model())
    prompts = random_prompts(batch, 5, 12, seed=7)
    sampling = SamplingSpec(max_tokens=max_tokens)
    spec = EngineSpec(model=model, tensor_parallel_size=tp)
    sessions = {
        "off": EngineSession(spec, multiprocess=True),
        "on": EngineSession(spec, multiprocess=True, recovery={"enabled": True}),
    }
    rates: dict[str, list[float]] = {"off": [], "on": []}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for s in sessions.values():
            s.start()
            s.generate(prompts, sampling)  # warm-up
        for _ in range(repeats):
            for name, s in sessions.items():
                out = s.generate(prompts, sampling)
                if out.error:
                    raise RuntimeError(f"{name}: {out.error}")
                total = sum(len(r.token_ids) for r in out.requests)
                rates[name].append(total / out.generate_s)
                tokens[name] = [r.token_ids for r in out.requests]
    finally:
        for s in sessions.values():
            s.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"tp": tp, "batch": batch, "max_tokens": max_tokens, "repeats": repeats,
            "tokens_per_s": rates, "median": med,
            "spread": {k: (min(v), max(v)) for k, v in rates.items()},
            "ratio_on_off": med["on"] / med["off"], "identical": tokens["on"] == tokens["off"]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead.json"))
    args = ap.parse_args(argv)
    results = [measure(tp, b, args.max_tokens, args.repeats)
               for tp in args.tp for b in args.batch]
    print("| TP | batch | off tok/s (min-max) | on tok/s (min-max) | on/off | tokens identical |")
    print("|---|---|---|---|---|---|")
    for r in results:
        off, on = r["median"]["off"], r["median"]["on"]
        so, sn = r["spread"]["off"], r["spread"]["on"]
        print(f"| {r['tp']} | {r['batch']} | {off:.0f} ({so[0]:.0f}-{so[1]:.0f}) | "
              f"{on:.0f} ({sn[0]:.0f}-{sn[1]:.0f}) | {r['ratio_on_off']:.3f} | {r['identical']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
