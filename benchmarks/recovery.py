"""Recovery latency per fault kind, broken into the phases of a recovery round.

Real faults on real engines: for each kind, one workload (8 requests, 64 greedy tokens) carries
a fault every few steps (``FAULT_TOKENS``: each a different step, request and, at tensor
parallel 2, rank in turn), so that ten faults cost one engine start; the process kills come
last, on the same engine. Every rank writes its events to the engine's event log; each fault
is then laid out on the wall clock of the machine (all ranks share it), from the ``FaultFired``
event (``t0``) on:

* ``detect``: until every rank knew: the failing rank when its step raised and it joined the
  round; a peer when its monitor saw the announcement and stopped its step;
* ``stop``: until every rank had joined the round (a peer's blocked collective abandoned);
* ``agree``: until every rank's report had arrived;
* ``device``, ``comms``, ``repair``: the rebuild on the slowest rank: device recovery,
  communicator rebuild, repairs (weights reloaded, lost KV marked);
* ``restore``: rollback of the step's record, plus the recompute of lost KV;
* ``rerun``: the re-run of the step itself;
* ``total``: until the step's re-run had returned on every rank (generation runs again).

A process kill takes no part in a round: its row is the engine session's restart, from the
kill (``FaultFired``) to the requests resumed on a new engine (``GenerateResult.restarts``):
``death seen`` when the session's death watch handed the death to the front end (timed around
``EngineSession._unblock_front_end``), ``detect`` when the session began the restart, ``close``
the shut-down of the dead engine's front end (``EngineSession._shut_down``; its processes,
already killed, are waited for after the new engine is up) and ``start`` of the new engine
(``EngineSession.start``), ``resume``
(faults planned again, requests resubmitted), ``first token`` the new engine's first token
after that; ``death to resumed`` from the session's restart to the requests resumed, and
``total`` from the kill; the target's margin is ``total`` less ``start``.

Every workload's tokens are compared with a fault-free run of it on the same engine.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import open_sessions, prompts, settle, tiny_model
from benchmarks.stats import Summary, fmt_summary, markdown_table, summarize
from ftkit import (
    EngineSession,
    EngineSpec,
    Event,
    FaultFired,
    FaultPlan,
    FaultSpec,
    KvRecomputed,
    RecoveryConfig,
    RecoveryRound,
    SamplingSpec,
    StepRecovered,
    only,
    read_events,
)

#: The output tokens (of successive requests) at which a workload's faults fire.
FAULT_TOKENS = (4, 10, 16, 22, 28, 34, 40, 46, 52, 58)
WORKLOAD_REQUESTS = 8
SAMPLING = SamplingSpec(max_tokens=64)
PHASES = ("detect", "stop", "agree", "device", "comms", "repair", "restore", "rerun", "total")


@dataclass(frozen=True)
class Case:
    """One row: a fault kind (with params) at a tensor-parallel size."""

    name: str
    kind: str
    params: dict[str, Any]


CASES = (
    Case("link_break", "link_break", {}),
    Case("device_reset", "device_reset", {}),
    Case("uce kv", "uce", {"region": "kv"}),
    Case("uce weights", "uce", {"region": "weights"}),
    Case("uce activation", "uce", {"region": "activation"}),
    Case("hang", "hang", {}),
    Case("oom", "oom", {}),
)
#: Kinds that need a peer (a link break at tensor parallel 1 has no collective to break).
NEEDS_PEER = {"link_break"}


@dataclass(frozen=True)
class Plan:
    tps: tuple[int, ...] = (1, 2)
    faults: int = 10
    kills: int = 10
    kill_tp: int = 2


QUICK = Plan(tps=(2,), faults=3, kills=1)


def fault_plan(case: Case, count: int, tp: int) -> list[FaultSpec]:
    tokens = FAULT_TOKENS[:: max(1, len(FAULT_TOKENS) // count)][:count]
    return [FaultSpec.model_validate(
        {"kind": case.kind, "rank": i % tp, "phase": "forward", "times": 1,
         "at": {"request": i % WORKLOAD_REQUESTS, "token": token},
         "params": dict(case.params)}) for i, token in enumerate(tokens)]


# --- in-place recovery ----------------------------------------------------------------------

def measure_tp(tp: int, plan: Plan) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every in-place case at ``tp`` on one engine, then (at ``plan.kill_tp``) the kills."""
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-event-log-") as event_log:
        return _measure_tp(tp, plan, event_log)


def _measure_tp(tp: int, plan: Plan, event_log: str
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    session = EngineSession(EngineSpec(model=tiny_model(), tensor_parallel_size=tp),
                            multiprocess=True,
                            recovery=RecoveryConfig(enabled=True, event_log_dir=event_log))
    workload = prompts(WORKLOAD_REQUESTS)
    with open_sessions({"ftkit": session}):
        fresh = session.generate(workload, SAMPLING)  # the reference, on a new engine
        rows = [measure_case(session, event_log, case, tp, plan.faults, _tokens(fresh))
                for case in CASES if tp > 1 or case.kind not in NEEDS_PEER]
        kill = None
        if tp == plan.kill_tp and plan.kills:
            kill = measure_process_kill(session, event_log, fresh, plan.kills)
    return rows, kill


def measure_case(session: EngineSession, event_log: str, case: Case, tp: int, count: int,
                 reference: list[list[int]]) -> dict[str, Any]:
    settle()
    faults = fault_plan(case, count, tp)
    run_id = session.new_run_id()
    session.set_fault_plan(FaultPlan.from_specs(run_id, faults))
    out = session.generate(prompts(WORKLOAD_REQUESTS), SAMPLING, run_id=run_id,
                           deadline=time.monotonic() + 600)
    events = read_events(event_log)
    fired = [e for e in only(events, FaultFired) if e.run_id == run_id]
    return {"case": case.name, "tp": tp, "planned": len(faults), "fired": len(fired),
            "error": out.error, "identical": out.error is None and _tokens(out) == reference,
            "faults": fault_phases(fired, events)}


def fault_phases(fired: list[FaultFired], events: list[Event]
                 ) -> list[dict[str, float | None]]:
    """The phases (seconds) of each fired fault, from the events that followed it up to the
    next fault."""
    result = []
    for i, fault in enumerate(fired):
        t0 = fault.time
        t_next = fired[i + 1].time if i + 1 < len(fired) else float("inf")
        # A round counts from when it started on a rank, every other event from its writing.
        window = [e for e in events
                  if t0 <= (e.started if isinstance(e, RecoveryRound) else e.time) < t_next]
        rounds = only(window, RecoveryRound)
        if not rounds:
            result.append({p: None for p in PHASES})
            continue
        epoch = min(e.epoch for e in rounds)
        rounds = [e for e in rounds if e.epoch == epoch]
        result.append(round_phases(t0, rounds, only(window, KvRecomputed),
                                   _first_per_rank(only(window, StepRecovered))))
    return result


def round_phases(t0: float, rounds: list[RecoveryRound], kv: list[KvRecomputed],
                 recovered: list[StepRecovered]) -> dict[str, float | None]:
    """Lay one round out on the wall clock; see the module docstring for the phases."""
    detected = max((e.stop_requested or e.started) for e in rounds)
    joined = max(e.started for e in rounds)
    agreed = max(e.started + (e.statuses_s or 0.0) for e in rounds)
    kv_s = {e.rank: e.duration_s for e in kv}
    running = max((e.time for e in recovered), default=None)
    return {
        "detect": detected - t0,
        "stop": joined - detected,
        "agree": agreed - joined,
        "device": max(e.device_s or 0.0 for e in rounds),
        # Collective: the last rank to arrive waits least; its time is the rebuild's own.
        "comms": min(e.comms_s or 0.0 for e in rounds),
        "repair": max(e.repair_s or 0.0 for e in rounds),
        "restore": max((e.rollback_s + kv_s.get(e.rank, 0.0) for e in recovered),
                       default=None),
        "rerun": max((e.rerun_s - kv_s.get(e.rank, 0.0) for e in recovered), default=None),
        "total": None if running is None else running - t0,
    }


def _first_per_rank(events: list[StepRecovered]) -> list[StepRecovered]:
    first: dict[int, StepRecovered] = {}
    for e in events:
        first.setdefault(e.rank, e)
    return list(first.values())


def _tokens(out: Any) -> list[list[int]]:
    return [r.token_ids for r in out.requests]


# --- process kill -----------------------------------------------------------------------------

def measure_process_kill(session: EngineSession, event_log: str, fresh: Any,
                         kills: int) -> dict[str, Any]:
    """``kills`` SIGKILLs of a worker in one workload, each resumed on a new engine.
    ``fresh``: the workload's fault-free output on the session's first engine."""
    tp = session.spec.tensor_parallel_size
    starts: list[float] = []
    closes: list[float] = []
    noticed: list[float] = []
    workload = prompts(WORKLOAD_REQUESTS)
    reference = _tokens(fresh)
    first_start = session.start_s
    session.start = _timed(session.start, starts)  # type: ignore[method-assign]
    session._shut_down = _timed(session._shut_down, closes)  # type: ignore[method-assign]
    # The session's death watch hands the death to the front end through this method.
    session._unblock_front_end = _stamped(  # type: ignore[method-assign]
        session._unblock_front_end, noticed)
    faults = fault_plan(Case("process_kill", "process_kill", {"target": "rank"}), kills, tp)
    run_id = session.new_run_id()
    session.set_fault_plan(FaultPlan.from_specs(run_id, faults))
    settle()
    out = session.generate(workload, SAMPLING, run_id=run_id, max_restarts=len(faults),
                           deadline=time.monotonic() + 600 + 60 * len(faults))
    fired = [e for e in only(read_events(event_log), FaultFired) if e.run_id == run_id]
    kills = []
    token_times = sorted(t for r in out.requests for t in r.token_times)
    for i, restart in enumerate(out.restarts):
        fired_at = fired[i].time - out.started_at if i < len(fired) else None
        watch_at = noticed[i] - out.started_at if i < len(noticed) else None
        after = [t for t in token_times if t > restart.resumed_at_s]
        kills.append({
            "watch": None if fired_at is None or watch_at is None else watch_at - fired_at,
            "detect": None if fired_at is None else restart.died_at_s - fired_at,
            "close": closes[i] if i < len(closes) else None,
            "start": starts[i] if i < len(starts) else None,
            "restart": restart.restart_s,
            "resume": restart.resumed_at_s - restart.died_at_s - restart.restart_s,
            "died_to_resumed": restart.resumed_at_s - restart.died_at_s,
            "first_token": after[0] - restart.resumed_at_s if after else None,
            "total": None if fired_at is None else restart.resumed_at_s - fired_at,
        })
    return {"case": "process_kill", "tp": tp, "planned": len(faults), "fired": len(fired),
            "restarts": len(out.restarts), "error": out.error,
            "identical": out.error is None and _tokens(out) == reference,
            "first_engine_start_s": first_start,
            # For comparison: a new engine's first token without any fault, and what one full
            # garbage collection costs in this (the engine's front-end) process.
            "fresh_first_token_s": min(t for r in fresh.requests for t in r.token_times[:1]),
            "full_gc_s": _full_gc_s(), "kills": kills}


def _full_gc_s() -> float:
    started = time.monotonic()
    gc.collect()
    return time.monotonic() - started


def _stamped(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``method``, recording the wall-clock time of each call."""
    def stamped(*args: Any, **kwargs: Any) -> Any:
        into.append(time.time())
        return method(*args, **kwargs)

    return stamped


def _timed(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.monotonic() - started)

    return timed


def run(quick: bool = False) -> dict[str, Any]:
    plan = QUICK if quick else Plan()
    rows: list[dict[str, Any]] = []
    kill = None
    for tp in plan.tps:
        tp_rows, tp_kill = measure_tp(tp, plan)
        rows += tp_rows
        kill = kill or tp_kill
    return {"plan": asdict(plan), "in_place": rows, "process_kill": kill}


# --- the tables -------------------------------------------------------------------------------

def phase_summary(faults: list[dict[str, Any]], phase: str) -> Summary | None:
    values = [f[phase] for f in faults if f.get(phase) is not None]
    return summarize(values) if values else None


def table(result: dict[str, Any]) -> str:
    rows = []
    for row in result["in_place"]:
        cells = [fmt_summary(phase_summary(row["faults"], p), 0 if p in ("total",) else 1,
                             1000.0) for p in PHASES]
        rows.append([row["case"], row["tp"], f"{row['fired']}/{row['planned']}", *cells,
                     _ok(row)])
    return markdown_table(["fault", "TP", "fired", *(f"{p} ms" for p in PHASES),
                           "tokens identical"], rows)


KILL_COLUMNS = ("watch", "detect", "close", "start", "resume", "died_to_resumed", "first_token",
                "total")


def kill_table(result: dict[str, Any]) -> str:
    kill = result.get("process_kill")
    if not kill:
        return ""
    cells = [fmt_summary(phase_summary(kill["kills"], c), 2) for c in KILL_COLUMNS]
    return markdown_table(
        ["fault", "TP", "fired", "death seen s", "detect s", "close s", "start s", "resume s",
         "death to resumed s", "first token s", "total s", "tokens identical"],
        [["process_kill (rank)", kill["tp"], f"{kill['fired']}/{kill['planned']}", *cells,
          _ok(kill)]])


def _ok(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"NO ({row['error'][:60]})"
    return "yes" if row["identical"] else "NO"


if __name__ == "__main__":
    import sys

    from benchmarks.suite import main

    sys.exit(main("recovery", run, sys.argv[1:], __doc__))
