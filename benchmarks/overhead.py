"""Fault-free cost: tokens per second with recovery off, with ftkit's recovery on, and with the
earlier design's per-step costs (the ``legacy`` plugin in ``benchmarks/legacy_plugin``).

For each tensor-parallel size the three engines run side by side in one process: started once,
warmed up once per batch size, then measured in repeats whose order rotates (each engine is
first as often as the others), each run after ``SETTLE_S`` so that no engine shares the cores
with another's idle-spinning workers. Ratios are taken per repeat (engine / off in the same
repeat) and summarised by their median and range.

Every engine has the same settings: ``max_num_seqs`` 256 and ``max_model_len`` 32768, the size
at which the earlier design's copy of the token-id table is 32 MiB (the tiny model's own limit
is 2048 positions; the workload never goes near it, ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` lets vLLM
size its tables for the longer context).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import LEGACY_KEY, legacy_plugin_installed, open_sessions, prompts, settle
from benchmarks.common import tiny_model, worker_of
from benchmarks.stats import Summary, fmt_summary, markdown_table, paired_ratios, rotations
from benchmarks.stats import summarize
from ftkit.vllm.engine import EngineSession, EngineSpec, SamplingSpec

VARIANTS = ("off", "ftkit", "legacy")


@dataclass(frozen=True)
class Plan:
    tps: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 7
    max_tokens: int = 128
    max_model_len: int = 32768
    max_num_seqs: int = 256


QUICK = Plan(tps=(2,), batches=(8,), repeats=3, max_tokens=64)


@dataclass
class Row:
    tp: int
    batch: int
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    identical: dict[str, bool] = field(default_factory=dict)

    def summary(self, variant: str) -> Summary:
        return summarize(self.tokens_per_s[variant])

    def ratio(self, variant: str) -> Summary:
        return summarize(paired_ratios(self.tokens_per_s[variant], self.tokens_per_s["off"]))


def sessions_for(tp: int, plan: Plan) -> dict[str, EngineSession]:
    model = tiny_model()
    args = {"max_num_seqs": plan.max_num_seqs}
    spec = EngineSpec(model=model, tensor_parallel_size=tp, max_model_len=plan.max_model_len,
                      args=args)
    legacy = EngineSpec(model=model, tensor_parallel_size=tp, max_model_len=plan.max_model_len,
                        args={**args, "additional_config": {LEGACY_KEY: {"poll_s": 1.0}}})
    return {
        "off": EngineSession(spec, multiprocess=True),
        "ftkit": EngineSession(spec, multiprocess=True, recovery={"enabled": True}),
        "legacy": EngineSession(legacy, multiprocess=True),
    }


def measure_tp(tp: int, plan: Plan) -> dict[str, Any]:
    sampling = SamplingSpec(max_tokens=plan.max_tokens)
    rows: list[Row] = []
    with open_sessions(sessions_for(tp, plan)) as sessions:
        start_s = {name: s.start_s for name, s in sessions.items()}
        for batch in plan.batches:
            workload = prompts(batch)
            row = Row(tp, batch, {v: [] for v in VARIANTS})
            reference: list[list[int]] | None = None
            tokens: dict[str, list[list[int]]] = {}
            for name in VARIANTS:  # warm-up
                settle()
                _check(name, sessions[name].generate(workload, sampling))
            for order in rotations(VARIANTS, plan.repeats):
                for name in order:
                    settle()
                    out = _check(name, sessions[name].generate(workload, sampling))
                    total = sum(len(r.token_ids) for r in out.requests)
                    row.tokens_per_s[name].append(total / out.generate_s)
                    tokens[name] = [r.token_ids for r in out.requests]
            reference = tokens["off"]
            row.identical = {name: tokens[name] == reference for name in VARIANTS}
            rows.append(row)
        legacy_stats = sessions["legacy"].llm.collective_rpc("ftkit_bench_legacy_stats")
    return {"tp": tp, "engine_start_s": start_s, "rows": [asdict(r) for r in rows],
            "legacy_stats": legacy_stats}


def _check(name: str, out: Any) -> Any:
    if out.error:
        raise RuntimeError(f"{name}: {out.error}")
    return out


def run(quick: bool = False) -> dict[str, Any]:
    if not legacy_plugin_installed():
        raise RuntimeError("the legacy-cost plugin is not installed: run `make bench` (it "
                           "installs benchmarks/legacy_plugin into .venv)")
    plan = QUICK if quick else Plan()
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return {"plan": asdict(plan), "results": [measure_tp(tp, plan) for tp in plan.tps],
            "own_time": measure_own_time(plan)}


# --- ftkit's own time per step, measured where it is spent ---------------------------------------

class OwnTime:
    """Wraps one worker's ``FaultTolerance.execute_model`` / ``sample_tokens`` (on that
    instance): the whole call and the model runner's call inside it are timed
    (``perf_counter_ns``); ftkit's own time is the difference."""

    def __init__(self, tolerance: Any) -> None:
        self.samples: list[tuple[int, int]] = []  # (whole ns, runner ns) per RPC
        for name in ("execute_model", "sample_tokens"):
            setattr(tolerance, name, self._wrap(getattr(tolerance, name)))

    def _wrap(self, method: Any) -> Any:
        def timed(call: Any, arg: Any) -> Any:
            inner = [0]

            def runner_call(a: Any) -> Any:
                started = time.perf_counter_ns()
                try:
                    return call(a)
                finally:
                    inner[0] += time.perf_counter_ns() - started

            started = time.perf_counter_ns()
            out = method(runner_call, arg)
            self.samples.append((time.perf_counter_ns() - started, inner[0]))
            return out
        return timed

    def take(self) -> list[tuple[int, int]]:
        samples, self.samples = self.samples, []
        return samples


def measure_own_time(plan: Plan) -> dict[str, Any]:
    """At tensor parallel 1, in process (the worker lives here): per step (an execute and a
    sample RPC), the runner's time and ftkit's own time around it, for each batch size."""
    spec = EngineSpec(model=tiny_model(), max_model_len=plan.max_model_len,
                      args={"max_num_seqs": plan.max_num_seqs})
    session = EngineSession(spec, multiprocess=False, recovery={"enabled": True})
    sampling = SamplingSpec(max_tokens=plan.max_tokens)
    rows = []
    with open_sessions({"ftkit": session}):
        session.generate(prompts(2), sampling)  # builds the recovery engine at its first step
        probe = OwnTime(worker_of(session)._ftkit.tolerance)
        for batch in plan.batches:
            steps: list[tuple[float, float]] = []
            for _ in range(plan.repeats):
                _check("ftkit", session.generate(prompts(batch), sampling))
                samples = probe.take()
                # Pairs of RPCs: (execute, sample) of one step.
                for ex, sa in zip(samples[0::2], samples[1::2]):
                    runner_ns = ex[1] + sa[1]
                    steps.append((runner_ns / 1000, (ex[0] + sa[0] - runner_ns) / 1000))
            rows.append({"batch": batch, "steps": len(steps),
                         "runner_us": summarize(r for r, _ in steps).to_dict(),
                         "ftkit_us": summarize(f for _, f in steps).to_dict(),
                         "share": summarize(f / r for r, f in steps if r > 0).to_dict()})
    return {"tp": 1, "rows": rows}


# --- the table ----------------------------------------------------------------------------------

def table(result: dict[str, Any]) -> str:
    rows = []
    for per_tp in result["results"]:
        for raw in per_tp["rows"]:
            row = Row(raw["tp"], raw["batch"], raw["tokens_per_s"], raw["identical"])
            rows.append([row.tp, row.batch,
                         fmt_summary(row.summary("off")), fmt_summary(row.summary("ftkit")),
                         fmt_summary(row.summary("legacy")),
                         fmt_summary(row.ratio("ftkit"), 3), fmt_summary(row.ratio("legacy"), 3),
                         "yes" if all(row.identical.values()) else "NO"])
    return markdown_table(["TP", "batch", "off tok/s", "ftkit tok/s", "legacy tok/s",
                           "ftkit/off", "legacy/off", "tokens identical"], rows)


def own_time_table(result: dict[str, Any]) -> str:
    rows = []
    for row in result["own_time"]["rows"]:
        share = Summary.from_dict(row["share"])
        rows.append([result["own_time"]["tp"], row["batch"], row["steps"],
                     fmt_summary(Summary.from_dict(row["runner_us"]), 0),
                     fmt_summary(Summary.from_dict(row["ftkit_us"]), 1),
                     f"{share.median * 100:.2f} % ({share.low * 100:.2f}-{share.high * 100:.2f})"])
    return markdown_table(["TP", "batch", "steps", "runner us/step", "ftkit us/step",
                           "ftkit / runner"], rows)


def legacy_note(result: dict[str, Any]) -> str:
    """What the legacy plugin did (proof that its costs were paid)."""
    parts = []
    for per_tp in result["results"]:
        stats = per_tp["legacy_stats"][0]
        per_copy = stats["copied_bytes"] / max(1, stats["copies"]) / 2**20
        parts.append(f"TP {per_tp['tp']}: {stats['copies']} table copies of {per_copy:.0f} MiB, "
                     f"{stats['gathers']} all-gathers, {stats['polls']} monitor polls (rank 0)")
    return "; ".join(parts)


if __name__ == "__main__":
    import sys

    from benchmarks.suite import main

    sys.exit(main("overhead", run, sys.argv[1:], __doc__))
