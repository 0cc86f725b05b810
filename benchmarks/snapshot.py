"""Cost of the per-step rollback record as the batch, ``max_model_len`` and ``max_num_seqs``
grow, next to the earlier design's full copies of the token-id table.

``execute_model`` takes no record (its rollback is derived from its scheduler output); the
record is the one ``sample_tokens`` takes. Measured on real runner state: an in-process engine
(tensor parallel 1, recovery on), so that the worker and its ``V1RunnerState`` live in this
process. After a warm-up the state's ``begin_sample`` is replaced, on that instance only, by a
wrapper that times the real call (``perf_counter_ns``) and then sizes the record it returned.
Only steady decode steps count: steps that schedule exactly the workload's requests, one token
each.

Bytes are what the record allocates: its containers (``sys.getsizeof``) and the arrays and
tensors it copies (generator states, ``nbytes``). What it only refers to (the step's
scheduler output, which vLLM keeps anyway) is not counted.

The legacy column times ``input_batch.token_ids_cpu_tensor.clone()`` on the same runner, the
copy the earlier design made twice per step, and gives the bytes of the two copies.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.common import open_sessions, prompts, tiny_model, worker_of
from benchmarks.stats import fmt, fmt_summary, markdown_table, summarize
from ftkit import EngineSession, EngineSpec, RecoveryConfig, SamplingSpec

GREEDY = SamplingSpec(max_tokens=24)
SEEDED = SamplingSpec(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
LEGACY_COPIES_PER_STEP = 2
#: Fields of the record that refer to what vLLM keeps anyway (the step's scheduler output): not
#: allocated by the record.
REFERENCED = frozenset({"scheduled"})
LEGACY_TIMING_REPEATS = 15


@dataclass(frozen=True)
class Plan:
    #: (max_model_len, max_num_seqs) of each engine.
    configs: tuple[tuple[int, int], ...] = ((2048, 64), (2048, 256), (8192, 256),
                                             (32768, 256), (32768, 1024))
    batches: tuple[int, ...] = (1, 4, 16, 64)


QUICK = Plan(configs=((2048, 64), (32768, 256)), batches=(1, 64))


def record_bytes(obj: Any, _seen: set[int] | None = None) -> int:
    """Bytes a record allocates (see the module docstring)."""
    seen = _seen if _seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, bytes):
        return sys.getsizeof(obj)
    if is_dataclass(obj):
        return sys.getsizeof(obj) + sum(
            record_bytes(getattr(obj, f.name), seen) for f in fields(obj)
            if f.name not in REFERENCED)
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(record_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sys.getsizeof(obj) + sum(record_bytes(v, seen) for v in obj)
    return 0  # ids, counts: shared or interned, not allocated by the record


class Probe:
    """Times the runner state's ``begin_sample`` of one worker."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.samples: list[dict[str, Any]] = []
        self._sample = state.begin_sample
        state.begin_sample = self.begin_sample

    def begin_sample(self, scheduler_output: Any) -> Any:
        started = time.perf_counter_ns()
        record = self._sample(scheduler_output)
        ns = time.perf_counter_ns() - started
        scheduled = scheduler_output.num_scheduled_tokens
        decode = scheduler_output.total_num_scheduled_tokens == len(scheduled)
        self.samples.append({"rpc": "sample", "requests": len(scheduled), "decode": decode,
                             "ns": ns, "bytes": record_bytes(record)})
        return record

    def take(self) -> list[dict[str, Any]]:
        samples, self.samples = self.samples, []
        return samples


def steady(samples: list[dict[str, Any]], rpc: str, requests: int) -> dict[str, Any]:
    rows = [s for s in samples if s["rpc"] == rpc and s["decode"] and s["requests"] == requests]
    if not rows:
        return {"n": 0}
    return {"n": len(rows), "us": summarize(s["ns"] / 1000 for s in rows).to_dict(),
            "bytes": statistics.median(s["bytes"] for s in rows)}


def legacy_copy(runner: Any) -> dict[str, Any]:
    table = runner.input_batch.token_ids_cpu_tensor
    times = []
    for _ in range(LEGACY_TIMING_REPEATS):
        started = time.perf_counter_ns()
        copy = table.clone()
        times.append((time.perf_counter_ns() - started) / 1000)
        del copy
    per_copy = summarize(times)
    return {"bytes_per_step": LEGACY_COPIES_PER_STEP * table.numel() * table.element_size(),
            "us_per_step": {k: v * LEGACY_COPIES_PER_STEP if k != "n" else v
                            for k, v in per_copy.to_dict().items()}}


def measure_config(max_model_len: int, max_num_seqs: int, plan: Plan) -> dict[str, Any]:
    spec = EngineSpec(model=tiny_model(), max_model_len=max_model_len,
                      args={"max_num_seqs": max_num_seqs})
    session = EngineSession(spec, multiprocess=False, recovery=RecoveryConfig(enabled=True))
    rows = []
    with open_sessions({"ftkit": session}):
        session.generate(prompts(2), GREEDY)  # builds the recovery engine at its first step
        worker = worker_of(session)
        probe = Probe(worker._ftkit.step_wrapper.state)
        runner = worker.model_runner
        workloads = [("greedy", b, GREEDY) for b in plan.batches if b <= max_num_seqs]
        workloads.append(("seeded", workloads[-1][1], SEEDED))
        for sampling_name, batch, sampling in workloads:
            out = session.generate(prompts(batch, seed=batch), sampling)
            if out.error:
                raise RuntimeError(out.error)
            samples = probe.take()
            rows.append({"sampling": sampling_name, "batch": batch,
                         "sample": steady(samples, "sample", batch)})
        legacy = legacy_copy(runner)
    return {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "rows": rows,
            "legacy": legacy}


def run(quick: bool = False) -> dict[str, Any]:
    plan = QUICK if quick else Plan()
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return {"plan": asdict(plan),
            "results": [measure_config(n, s, plan) for n, s in plan.configs]}


# --- the table ----------------------------------------------------------------------------------

def table(result: dict[str, Any]) -> str:
    rows = []
    for config in result["results"]:
        legacy = config["legacy"]
        for row in config["rows"]:
            sa = row["sample"]
            rows.append([
                config["max_model_len"], config["max_num_seqs"], row["batch"], row["sampling"],
                _us(sa), fmt(sa.get("bytes")),
                fmt(legacy["us_per_step"]["median"]), f"{legacy['bytes_per_step'] / 2**20:.1f} MiB",
            ])
    return markdown_table(["max_model_len", "max_num_seqs", "batch", "sampling",
                           "sample record us", "sample bytes", "legacy copies us/step", "legacy bytes/step"], rows)


def _us(stats: dict[str, Any]) -> str:
    if not stats.get("n"):
        return "-"
    from benchmarks.stats import Summary

    return fmt_summary(Summary.from_dict(stats["us"]), 1)


if __name__ == "__main__":
    from benchmarks.suite import main

    sys.exit(main("snapshot", run, sys.argv[1:], __doc__))
