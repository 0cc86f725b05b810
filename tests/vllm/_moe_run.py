"""Run in a child process by ``test_moe.py``: several workloads one after the other on ONE
engine (so that a fault-free run and the faulted runs share its start), optionally after a
plain engine's fault-free run.

Usage: ``_moe_run.py CONFIG_JSON``. CONFIG keys: model, tensor_parallel_size, multiprocess,
prompts, sampling (``SamplingSpec.to_mapping()``), event_log_dir, plain (bool: first a plain
engine's fault-free run, under the name ``plain``), and runs: a list of ``{"name", "faults"
(``FaultSpec`` dicts), "max_restarts" (default 0), "cripple" (optional: ``"kv"``, lost KV not
recomputed during this run; reaches the worker only of an engine in this process)}`` on
ftkit's engine. Prints one ``RESULT <json>`` line: per run name (``{"refused": ERROR}`` for a
plan the workers refused), every request's tokens and logprobs, the error, the engine
restarts, the faults that fired (index, kind, attempt), the lost KV recomputed and the
weights reloaded.
"""

import json
import sys
import time

from ftkit import procs
from ftkit.config import RecoveryConfig
from ftkit.contracts.eventlog import (
    FaultFired,
    KvRecomputed,
    ParamsReloaded,
    only,
    read_events,
)
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession
from ftkit.vllm.kv_recompute import KvRecompute


def _no_kv_recompute():
    saved = KvRecompute.__dict__["run"]
    KvRecompute.run = lambda self, scheduler_output, call: None
    return lambda: setattr(KvRecompute, "run", saved)


CRIPPLES = {"kv": _no_kv_recompute}


def _outputs(out) -> dict:
    return {"error": out.error, "restarts": len(out.restarts),
            "outputs": [{"tokens": r.token_ids, "logprobs": list(r.logprobs)}
                        for r in out.requests]}


def _run(engine: EngineSession, config: dict, plan: dict, sampling: SamplingSpec) -> dict:
    run_id = engine.new_run_id()
    try:
        engine.set_fault_plan(FaultPlan.from_specs(
            run_id, [FaultSpec.model_validate(f) for f in plan.get("faults", [])]))
    except Exception as exc:  # noqa: BLE001 - a plan the workers refused: nothing ran
        return {"refused": f"{type(exc).__name__}: {exc}"}
    undo = CRIPPLES[plan["cripple"]]() if plan.get("cripple") else None
    started = time.time()
    try:
        out = engine.generate(config["prompts"], sampling, run_id=run_id,
                              deadline=time.monotonic() + 300,
                              max_restarts=plan.get("max_restarts", 0))
    finally:
        if undo is not None:
            undo()
    events = [e for e in read_events(config["event_log_dir"]) if e.time >= started]
    result = _outputs(out)
    result["fired"] = sorted({(e.index, e.kind, e.attempt) for e in only(events, FaultFired)
                              if e.run_id == run_id})
    result["kv"] = [{"rank": e.rank, "requests": e.requests}
                    for e in only(events, KvRecomputed)]
    result["reloaded"] = sorted({p for e in only(events, ParamsReloaded) for p in e.params})
    return result


def main() -> None:
    config = json.loads(sys.argv[1])
    sampling = SamplingSpec.from_mapping(config["sampling"])
    spec = EngineSpec(model=config["model"],
                      tensor_parallel_size=config.get("tensor_parallel_size", 1))
    results = {}
    if config.get("plain"):
        with EngineSession(spec, multiprocess=config.get("multiprocess")) as engine:
            results["plain"] = _outputs(engine.generate(config["prompts"], sampling))
    recovery = RecoveryConfig(enabled=True, max_reinference=3,
                              event_log_dir=config["event_log_dir"])
    with EngineSession(spec, recovery=recovery,
                       multiprocess=config.get("multiprocess")) as engine:
        for plan in config["runs"]:
            results[plan["name"]] = _run(engine, config, plan, sampling)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
    procs.exit_quickly(0)  # as ftkit's engine hosts end: vLLM's heap is not torn down (2 s)
