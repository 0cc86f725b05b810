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
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common import LEGACY_KEY, legacy_plugin_installed, open_sessions, prompts, settle
from benchmarks.common import tiny_model
from benchmarks.stats import Summary, fmt_summary, markdown_table, paired_ratios, rotations
from benchmarks.stats import summarize
from benchmarks import own_time
from ftkit import EngineSession, EngineSpec, RecoveryConfig, SamplingSpec, build_wide_model

VARIANTS = ("off", "ftkit", "legacy")


@dataclass(frozen=True)
class Plan:
    tps: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 7
    max_tokens: int = 128
    max_model_len: int = 32768
    max_num_seqs: int = 256
    #: The wide model (``ftkit.model.wide``): off and ftkit side by side at TP 1.
    wide_batches: tuple[int, ...] = (8,)
    wide_repeats: int = 5
    wide_max_tokens: int = 32


QUICK = Plan(tps=(2,), batches=(8,), repeats=3, max_tokens=64, wide_batches=(8,),
             wide_repeats=3, wide_max_tokens=16)
#: What ``--part`` selects: the three-engine comparison on the tiny model, ftkit's own time
#: per step with its breakdown, the on/off comparison on the wide model.
PARTS = ("engines", "own-time", "wide")


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
        "ftkit": EngineSession(spec, multiprocess=True, recovery=RecoveryConfig(enabled=True)),
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


def measure_wide(plan: Plan) -> dict[str, Any]:
    """The wide model at TP 1: ``off`` and ``ftkit`` side by side (started once, repeats in
    rotating order after ``SETTLE_S``), tokens per second and their per-repeat ratio."""
    spec = EngineSpec(model=str(build_wide_model()), max_model_len=2048,
                      args={"max_num_seqs": plan.max_num_seqs})
    sessions = {"off": EngineSession(spec, multiprocess=True),
                "ftkit": EngineSession(spec, multiprocess=True,
                                       recovery=RecoveryConfig(enabled=True))}
    sampling = SamplingSpec(max_tokens=plan.wide_max_tokens)
    rows = []
    with open_sessions(sessions):
        for batch in plan.wide_batches:
            workload = prompts(batch)
            row = Row(1, batch, {v: [] for v in sessions})
            tokens: dict[str, list[list[int]]] = {}
            for name in sessions:  # warm-up
                settle()
                _check(name, sessions[name].generate(workload, sampling))
            for order in rotations(tuple(sessions), plan.wide_repeats):
                for name in order:
                    settle()
                    out = _check(name, sessions[name].generate(workload, sampling))
                    total = sum(len(r.token_ids) for r in out.requests)
                    row.tokens_per_s[name].append(total / out.generate_s)
                    tokens[name] = [r.token_ids for r in out.requests]
            row.identical = {name: tokens[name] == tokens["off"] for name in sessions}
            rows.append(asdict(row))
    return {"tp": 1, "model": "wide", "rows": rows}


def run(quick: bool = False, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    plan = QUICK if quick else Plan()
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    result: dict[str, Any] = {"plan": asdict(plan), "parts": list(parts)}
    if "engines" in parts:
        if not legacy_plugin_installed():
            raise RuntimeError("the legacy-cost plugin is not installed: run `make bench` (it "
                               "installs benchmarks/legacy_plugin into .venv)")
        result["results"] = [measure_tp(tp, plan) for tp in plan.tps]
    if "own-time" in parts:
        result["own_time"] = own_time.measure_own_time(
            plan.batches, plan.repeats, plan.max_tokens, plan.max_model_len, plan.max_num_seqs)
    if "wide" in parts:
        result["wide"] = measure_wide(plan)
    return result


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
    """ftkit's own time per step and where it goes (``benchmarks.own_time``), then the wide
    model's end-to-end ratio when the run measured it."""
    text = own_time.own_time_table(result["own_time"])
    if result.get("wide"):
        text += ("\n\nThe same comparison on the wide model (``ftkit.model.wide``: the layer "
                 "widths of a 7B-class Llama, two layers), whose step is long enough for a "
                 "per-step cost to show in tokens per second:\n\n" + wide_table(result))
    return text


def wide_table(result: dict[str, Any]) -> str:
    """The wide model's tokens per second, off and ftkit, and their per-repeat ratio."""
    rows = []
    for raw in result["wide"]["rows"]:
        row = Row(raw["tp"], raw["batch"], raw["tokens_per_s"], raw["identical"])
        rows.append([row.tp, row.batch, fmt_summary(row.summary("off"), 1),
                     fmt_summary(row.summary("ftkit"), 1), fmt_summary(row.ratio("ftkit"), 3),
                     "yes" if all(row.identical.values()) else "NO"])
    return markdown_table(["TP", "batch", "off tok/s (wide)", "ftkit tok/s (wide)",
                           "ftkit/off", "tokens identical"], rows)


def legacy_note(result: dict[str, Any]) -> str:
    """What the legacy plugin did (proof that its costs were paid)."""
    parts = []
    for per_tp in result["results"]:
        stats = per_tp["legacy_stats"][0]
        per_copy = stats["copied_bytes"] / max(1, stats["copies"]) / 2**20
        parts.append(f"TP {per_tp['tp']}: {stats['copies']} table copies of {per_copy:.0f} MiB, "
                     f"{stats['gathers']} all-gathers, {stats['polls']} monitor polls (rank 0)")
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    """``python -m benchmarks.overhead [--part PART ...] [--quick] [--out F]``
    (``benchmarks.suite.main_with_parts``)."""
    from benchmarks.suite import main_with_parts

    return main_with_parts("overhead", run, PARTS, argv, __doc__)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
