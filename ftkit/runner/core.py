"""The scenario runner: the fault-free baseline (cached), the faulty run, the verdict.

Each engine run happens in an engine host child process (``ftkit.vllm.host``), driven through
a ``HostClient`` that owns it and every process below it. The runner turns a scenario into
``EngineJob``s (``ftkit.contracts.job``): the scenario's engine settings with the model
resolved, its workload, the recovery settings and the scenario's faults as a ``FaultPlan``.
"""

from __future__ import annotations

import time
from typing import Any

from ftkit.bounds import HOST_EXIT_GRACE_S, scenario_round_timeout_s
from ftkit.config import RecoveryConfig
from ftkit.contracts.job import EngineJob
from ftkit.contracts.plan import FaultPlan
from ftkit.progress import EventSink, ProgressEvent, ignore_events
from ftkit.kinds import kind_spec
from ftkit.model.tiny import resolve_model
from ftkit.results import RunOutput, ScenarioResult, Verdict
from ftkit.runner import baseline as baseline_cache
from ftkit.runner.host_client import HostClient
from ftkit.scenario.model import Scenario
from ftkit.verify import verify

#: Engine hosts kept alive between scenarios (each holds one engine: its processes and about
#: 1.5 GB per rank). A library mixing plain and ftkit engines at TP 1 and 2 needs four.
MAX_IDLE_HOSTS = 4


class ScenarioRunner:
    """Runs scenarios one after the other, keeping engine hosts between them.

    Scenarios whose engines are configured alike (the same ``EngineJob.engine_key()``) share
    one engine host: one engine start, not one per scenario. ``close()`` (or leaving the
    ``with`` block) shuts every host down and reaps every process below it; so does any
    failure or interrupt inside ``run``.
    """

    def __init__(self, *, use_cache: bool = True, max_idle_hosts: int = MAX_IDLE_HOSTS) -> None:
        self.use_cache = use_cache
        self.max_idle_hosts = max_idle_hosts
        #: Engine keys whose last faulty run did not pass: a failed recovery may have left
        #: the engine damaged (weights not reloaded, KV not rebuilt), so the next job on it
        #: starts a new engine rather than inherit the damage.
        self._suspect: set[str] = set()
        self._hosts: dict[str, HostClient] = {}  # engine key -> host, least recently used first
        self._last_key = ""

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

    def run(self, scenario: Scenario, *, file: str, on_event: EventSink = ignore_events,
            fresh_engine: bool = False) -> ScenarioResult:
        """Run ``scenario`` and return its verdict. Never leaves a process behind.
        ``fresh_engine``: run the faulty run on a new engine whatever ran before. A serve
        scenario (``engine.mode: serve``) always runs on a server of its own."""
        started = time.monotonic()
        model_dir = str(resolve_model(scenario.engine.model))
        if scenario.engine.mode == "serve":
            # A server of its own, its fault-free run on it first (ftkit.runner.serve).
            from ftkit.runner.serve import run_serve_scenario

            return run_serve_scenario(scenario, file=file, model_dir=model_dir,
                                      on_event=on_event)
        deadline = started + scenario.expect.timeout_s
        baseline = self.baseline_for(scenario, model_dir, on_event=on_event, deadline=deadline)
        recovery = RecoveryConfig(
            enabled=scenario.recovery.enabled,
            max_reinference=scenario.recovery.max_reinference,
            round_timeout_s=scenario_round_timeout_s(scenario.expect.timeout_s))
        plan = FaultPlan.from_specs(None, scenario.faults,
                                    max_reinference=scenario.recovery.max_reinference)
        # A fault that ends a process cannot be recovered in place: the engine host restarts
        # the engine and resumes the requests, once per such fault. The engine core then
        # needs its own process.
        kills = sum(1 for f in scenario.faults if kind_spec(f.kind).ends_process)
        run = self.run_job(scenario, model_dir, recovery=recovery, plan=plan,
                           on_event=on_event, timeout_s=max(1.0, deadline - time.monotonic()),
                           max_restarts=kills if scenario.recovery.enabled else 0,
                           multiprocess=kills > 0, fresh_engine=fresh_engine)
        result = verify(scenario, baseline, run, file=file,
                        duration_s=time.monotonic() - started)
        if result.verdict != Verdict.PASS:
            self._suspect.add(self._last_key)
        result.baseline_from_cache = baseline.from_cache
        on_event(ProgressEvent(scenario.name, "done", f"{result.verdict}: {result.reason}"))
        return result

    def baseline_for(self, scenario: Scenario, model_dir: str, *, on_event: EventSink,
                     deadline: float) -> RunOutput:
        """The fault-free run of ``scenario``'s workload on a plain engine, from the cache or
        computed now (and then cached, if it ran to the end)."""
        key = baseline_cache.baseline_key(scenario, model_dir)
        if self.use_cache:
            cached = baseline_cache.load(key)
            if cached is not None:
                on_event(ProgressEvent(scenario.name, "baseline", "fault-free tokens from cache"))
                return cached
        on_event(ProgressEvent(scenario.name, "baseline", "fault-free reference run"))
        out = self.run_job(scenario, model_dir, recovery=None, plan=FaultPlan(None),
                           on_event=on_event, timeout_s=max(1.0, deadline - time.monotonic()))
        if out.error is None and not out.timed_out and self.use_cache:
            baseline_cache.store(key, out)
        return out

    def run_job(self, scenario: Scenario, model_dir: str, *, recovery: RecoveryConfig | None,
                plan: FaultPlan, on_event: EventSink, timeout_s: float,
                max_restarts: int = 0, multiprocess: bool = False,
                fresh_engine: bool = False) -> RunOutput:
        """Run the scenario's workload once on a (possibly kept) engine host, within
        ``timeout_s``. A host that timed out, or whose job failed to finish, is killed."""
        job = EngineJob(
            engine=scenario.engine.model_copy(update={"model": model_dir}),
            sampling=scenario.sampling_spec(),
            prompts=tuple(scenario.prompts()), recovery=recovery, plan=plan,
            max_restarts=max_restarts,
            # Said explicitly, so that jobs that get the same engine share it.
            multiprocess=multiprocess or scenario.engine.world_size > 1)
        key = self._last_key = job.engine_key()
        if fresh_engine or key in self._suspect:
            self._suspect.discard(key)
            job = job.replace(fresh_engine=True)
        host = self._host_for(job)
        try:
            out = host.run(job, scenario.name, on_event, timeout_s,
                           planned=[f.spec for f in plan.faults])
        except BaseException:
            self._drop(host)
            raise
        if out.timed_out or not host.alive:
            self._drop(host)
        return out

    def _host_for(self, job: EngineJob) -> HostClient:
        key = job.engine_key()
        host = self._hosts.pop(key, None)
        if host is None or not host.alive:
            if host is not None:
                host.close()
            host = HostClient(key, event_log=job.recovery is not None)
        self._hosts[key] = host  # most recently used last
        while len(self._hosts) > self.max_idle_hosts:
            oldest = next(iter(self._hosts))
            self._hosts.pop(oldest).close()
        return host

    def _drop(self, host: HostClient) -> None:
        if self._hosts.get(host.key) is host:
            del self._hosts[host.key]
        host.close()


def run_scenario(scenario: Scenario, *, file: str, on_event: EventSink = ignore_events,
                 use_cache: bool = True) -> ScenarioResult:
    """Run one ``scenario`` on engines of its own and return its verdict (see
    ``ScenarioRunner`` to share engines between scenarios). Never leaves a process behind."""
    with ScenarioRunner(use_cache=use_cache) as runner:
        return runner.run(scenario, file=file, on_event=on_event)

