"""Run a workload on a real vLLM engine and collect every request's tokens with their times.

``EngineSession`` owns one engine: tensor parallel 1 runs in-process (no engine-core process),
tensor parallel 2 and more use vLLM's normal multi-process executor. Every process the engine
starts is recorded at start and reaped at ``close()``, also when the engine died; a process
that outlives the grace period is killed by its pid.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftkit.errors import EngineError, RunTimeout
from ftkit.inject import parse_request_id, request_id
from ftkit.config import CONFIG_KEY
from ftkit.results import RequestOutput

log = logging.getLogger("ftkit")

#: Engine arguments ftkit sets unless the scenario's ``engine.args`` says otherwise.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    # torch.compile costs minutes on CPU for no benefit to a correctness check (and CUDA
    # graphs replay a step that recovery cannot roll back).
    "enforce_eager": True,
    "disable_log_stats": True,
    # The recovery engine restores one step at a time; vLLM on GPU schedules ahead by default.
    "async_scheduling": False,
}
#: Environment for the engine's processes (read by vLLM when the engine starts); a value
#: already in the environment wins.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The recovery engine knows how to restore vLLM's V1 model runner (GPU default: V2).
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
REAP_GRACE_S = 10.0
#: How often a running workload looks at the engine's processes (to see one die).
DEATH_WATCH_POLL_S = 0.05


@dataclass(frozen=True)
class EngineSpec:
    """What determines an engine: the model directory and vLLM engine arguments."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    max_model_len: int = 512
    block_size: int = 32
    seed: int = 0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerateResult:
    requests: list[RequestOutput]
    error: str | None
    generate_s: float
    #: ``time.time()`` when the workload was submitted (token times count from here).
    started_at: float | None = None
    #: One entry per engine restart: ``error``, ``died_at_s``, ``restart_s``,
    #: ``resumed_at_s`` (seconds from submission) and ``resumed_requests``.
    restarts: list[dict[str, Any]] = field(default_factory=list)


class _Workload:
    """The requests of one ``generate`` call: what was submitted, what each produced."""

    def __init__(self, run_id: str, prompts: list[str], sampling: SamplingSpec,
                 submit_after_steps: list[int] | None) -> None:
        self.run_id = run_id
        self.prompts = prompts
        self.sampling = sampling
        self.outputs = [RequestOutput(i, []) for i in range(len(prompts))]
        self.arrivals = list(submit_after_steps or [0] * len(prompts))
        if len(self.arrivals) != len(prompts):
            raise ValueError("submit_after_steps needs one entry per prompt")
        self.waiting = sorted(range(len(prompts)), key=lambda i: self.arrivals[i])
        self.prompt_token_ids: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.steps = 0
        self.done = 0
        self.total = len(prompts) * sampling.max_tokens

    def params(self, index: int, max_tokens: int) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, ignore_eos=True,
            # One stream per request: the workload seed offset by the request index.
            seed=None if s.seed is None else s.seed + index)

    def submit_due(self, engine: Any) -> None:
        while self.waiting and (self.arrivals[self.waiting[0]] <= self.steps
                                or not engine.has_unfinished_requests()):
            i = self.waiting.pop(0)
            engine.add_request(request_id(self.run_id, i), self.prompts[i],
                               self.params(i, self.sampling.max_tokens))

    def take(self, out: Any, now: float) -> None:
        ref = parse_request_id(out.request_id)
        if ref is None or ref.run_id != self.run_id:
            return
        req = self.outputs[ref.index]
        if ref.offset == 0 and out.prompt_token_ids is not None:
            self.prompt_token_ids.setdefault(ref.index, list(out.prompt_token_ids))
        completion = out.outputs[0]
        # A resumed request counts its tokens from where it resumed.
        new = list(completion.token_ids[len(req.token_ids) - ref.offset:])
        req.token_ids.extend(new)
        req.token_times.extend([now] * len(new))
        self.done += len(new)
        if out.finished:
            req.finish_reason = completion.finish_reason
            self.finished.add(ref.index)

    def resume(self, engine: Any) -> list[int]:
        """Submit every started, unfinished request again from where it stopped."""
        from vllm.inputs import TokensPrompt

        resumed = []
        waiting = set(self.waiting)
        for req in self.outputs:
            i = req.index
            if i in self.finished or i in waiting:
                continue
            produced = len(req.token_ids)
            left = self.sampling.max_tokens - produced
            if left <= 0:
                self.finished.add(i)
                continue
            prompt_ids = self.prompt_token_ids.get(i)
            if produced == 0 or prompt_ids is None:
                engine.add_request(request_id(self.run_id, i), self.prompts[i],
                                   self.params(i, self.sampling.max_tokens))
            else:
                prompt = TokensPrompt(prompt_token_ids=prompt_ids + req.token_ids)
                engine.add_request(request_id(self.run_id, i, offset=produced), prompt,
                                   self.params(i, left))
            resumed.append(i)
        return resumed


class _DeathWatch:
    """While a workload runs: notices the death of any process of the engine, kills the
    others (only these, by pid) and hands the death to the front end, so that ``step()``
    raises at once.

    Without it, vLLM shuts its executor down gracefully after a worker dies and waits out its
    grace periods (about 9 s) for a surviving rank blocked in a collective with the dead one;
    and a front end whose engine core died abruptly waits for output forever.
    """

    def __init__(self, procs: list[psutil.Process],
                 on_death: Callable[[int], None] | None = None) -> None:
        self._procs = list(procs)
        self._on_death = on_death
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: (pid, monotonic time) of the first death seen.
        self.died: tuple[int, float] | None = None

    def __enter__(self) -> _DeathWatch:
        if self._procs:
            self._thread = threading.Thread(target=self._watch, name="ftkit-death-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DEATH_WATCH_POLL_S * 20)

    def _watch(self) -> None:
        while not self._stop.wait(DEATH_WATCH_POLL_S):
            dead = next((p for p in self._procs if not _running(p)), None)
            if dead is None:
                continue
            self.died = (dead.pid, time.monotonic())
            log.warning("ftkit: engine process %d died; stopping the rest of the engine",
                        dead.pid)
            for p in self._procs:
                if p is not dead and _running(p):
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
            if self._on_death is not None:
                self._on_death(dead.pid)
            return


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe_engine_error(exc: BaseException) -> str:
    error = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) not in error:
        error += f" (caused by {type(cause).__name__}: {cause})"
    return error


@contextmanager
def _engine_environment(tp: int, multiprocess: bool):
    saved = {k: os.environ.get(k) for k in [*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING",
                                             "VLLM_CPU_OMP_THREADS_BIND"]}
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    me = psutil.Process()
    affinity = me.cpu_affinity()
    if tp > 1:
        # An in-process engine started earlier in this process pinned it to one core; the
        # workers would inherit that pin and share the core. Give them every core again.
        me.cpu_affinity([])
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        # One core per rank where there are enough (far faster than no binding on 2 cores).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
            "|".join(str(cores[i % len(cores)]) for i in range(tp)) if cores else "nobind")
    # vLLM caches its environment once an engine is up; a second engine in this process must
    # see the settings above, not the first engine's.
    from vllm import envs

    envs.disable_envs_cache()
    try:
        yield
    finally:
        me.cpu_affinity(affinity)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class EngineSession:
    """One real vLLM engine, started once and used for one or more workloads."""

    def __init__(self, spec: EngineSpec, *, recovery: dict[str, Any] | None = None,
                 multiprocess: bool | None = None) -> None:
        """``multiprocess``: run the engine core in its own process. The default is vLLM's
        multi-process executor for tensor parallel 2 and more, in-process for 1. Only one
        in-process engine may live in a process at a time (it owns the process's default
        process group)."""
        self.spec = spec
        self.multiprocess = spec.tensor_parallel_size > 1 if multiprocess is None else multiprocess
        self.recovery = recovery
        self.llm: Any = None
        self.start_s = 0.0
        #: Every process this session's engines started (all of them, across restarts).
        self.pids: list[int] = []
        self._procs: list[psutil.Process] = []
        #: Processes of a dead engine, killed and not yet waited for (see ``_restart``).
        self._dying: list[psutil.Process] = []
        self.dead: str | None = None
        self._runs = 0
        #: The fault plan (and max_reinference) of each run id, as given, to plan it again
        #: after a restart.
        self._plans: dict[str, tuple[list[dict[str, Any]], int | None]] = {}

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EngineSession:
        from vllm import LLM

        args: dict[str, Any] = dict(DEFAULT_ENGINE_ARGS)
        args.update(self.spec.args)
        if self.recovery is not None:
            extra = dict(args.pop("additional_config", None) or {})
            extra[CONFIG_KEY] = dict(self.recovery)
            args["additional_config"] = extra
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        started = time.monotonic()
        try:
            with _engine_environment(self.spec.tensor_parallel_size, self.multiprocess):
                self.llm = LLM(model=self.spec.model, dtype=self.spec.dtype,
                               tensor_parallel_size=self.spec.tensor_parallel_size,
                               max_model_len=self.spec.max_model_len,
                               block_size=self.spec.block_size, seed=self.spec.seed, **args)
        except Exception as exc:
            self._track_children(me, before)
            self.close()
            raise EngineError(f"vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        finally:
            self._track_children(me, before)
        self.start_s = time.monotonic() - started
        return self

    def _track_children(self, me: psutil.Process, before: set[int]) -> None:
        for p in me.children(recursive=True):
            if p.pid not in before and p.pid not in self.pids and not is_process_helper(p):
                self.pids.append(p.pid)
                # psutil remembers the start time: a reused pid is never signalled.
                self._procs.append(p)

    def close(self) -> None:
        """Shut the engine down and reap every process it started (killed if need be)."""
        self._shut_down()
        reap_processes(self._procs + self._dying, REAP_GRACE_S)
        self._procs, self._dying = [], []

    def _shut_down(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # noqa: BLE001 - a dead engine may not shut down cleanly
                log.debug("engine shutdown raised %s", exc)
            del llm
            if not self.multiprocess:
                # Run vLLM's finalizers now, not at some later collection: they tear down the
                # distributed state of this process, which a later in-process engine owns.
                # (A multi-process engine leaves none here; a full collection of the front
                # end's heap costs about 0.4 s, on the path of a restart after a kill.)
                gc.collect()

    def __enter__(self) -> EngineSession:
        return self.start() if self.llm is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- workloads ----------------------------------------------------------------------------

    def set_fault_plan(self, run_id: str | None, faults: list[dict[str, Any]], *,
                       max_reinference: int | None = None) -> None:
        """Plan ``faults`` for the run ``run_id`` on every rank. ``max_reinference``, if
        given, replaces the engine's setting from this run on (engines are shared between
        scenarios that differ only there)."""
        if self.recovery is None:
            raise EngineError("this engine was started without ftkit; it cannot inject faults")
        if run_id is not None:
            self._plans[run_id] = ([dict(f) for f in faults], max_reinference)
        self._send_plan(run_id, faults, max_reinference)

    def _send_plan(self, run_id: str | None, faults: list[dict[str, Any]],
                   max_reinference: int | None) -> None:
        self.llm.collective_rpc("ftkit_set_fault_plan", args=(run_id, faults, max_reinference))

    def reset_prefix_cache(self) -> None:
        """Forget the KV blocks cached from earlier workloads, so that one workload cannot
        change how the next is computed."""
        if self.llm is not None:
            self.llm.reset_prefix_cache()

    def new_run_id(self) -> str:
        self._runs += 1
        return f"r{os.getpid()}.{self._runs}"

    def generate(self, prompts: list[str], sampling: SamplingSpec, *, run_id: str | None = None,
                 deadline: float | None = None,
                 on_tokens: Callable[[int, int], None] | None = None,
                 submit_after_steps: list[int] | None = None,
                 max_restarts: int = 0) -> GenerateResult:
        """Run the prompts to completion; never raises for an engine error (it is returned).

        ``deadline`` (``time.monotonic()``) is checked between engine steps; ``RunTimeout`` is
        raised when it passes (the caller then closes the engine). ``submit_after_steps``
        staggers arrivals: request *i* is submitted once the engine has run that many steps of
        this workload (default: every request at once, before the first step).

        ``max_restarts``: when the engine dies (a process was killed), start a new one and
        resume every unfinished request from the tokens it had produced, up to this many
        times (``ftkit.vllm.resume``); the fault plan of ``run_id`` is planned again with the
        attempts that already fired. Each restart is in ``GenerateResult.restarts``.
        """
        if self.dead is not None:
            return GenerateResult([RequestOutput(i, []) for i in range(len(prompts))],
                                  f"engine already dead: {self.dead}", 0.0)
        run_id = run_id or self.new_run_id()
        work = _Workload(run_id, prompts, sampling, submit_after_steps)
        started_at = time.time()
        started = time.monotonic()
        restarts: list[dict[str, Any]] = []
        error = None
        while True:
            try:
                self._drive(work, started, deadline, on_tokens, watch=self.multiprocess)
                break
            except RunTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's error is the run's result
                error = _describe_engine_error(exc) + self._recovery_verdict(started)
                if len(restarts) >= max_restarts or self.recovery is None:
                    self.dead = error
                    break
                restarts.append(self._restart(work, run_id, error, started))
                error = None
        return GenerateResult(work.outputs, error, time.monotonic() - started, started_at,
                              restarts=restarts)

    def _drive(self, work: _Workload, started: float, deadline: float | None,
               on_tokens: Callable[[int, int], None] | None, watch: bool) -> None:
        engine = self.llm.llm_engine
        with _DeathWatch(self._procs if watch else [], on_death=self._unblock_front_end):
            work.submit_due(engine)
            self._steps(engine, work, started, deadline, on_tokens)

    def _steps(self, engine: Any, work: _Workload, started: float, deadline: float | None,
               on_tokens: Callable[[int, int], None] | None) -> None:
        while engine.has_unfinished_requests():
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout("the workload did not finish before its deadline")
            step_outputs = engine.step()
            # One time per engine step: the tokens of one step share it.
            now = time.monotonic() - started
            for out in step_outputs:
                work.take(out, now)
            work.steps += 1
            work.submit_due(engine)
            if on_tokens is not None:
                on_tokens(work.done, work.total)

    def _unblock_front_end(self, pid: int) -> None:
        """vLLM's front end notices the engine core's death but leaves a caller blocked in
        ``step()`` waiting for output forever: hand that caller the death as its output."""
        from vllm.v1.engine.exceptions import EngineDeadError

        queue = getattr(getattr(self.llm.llm_engine, "engine_core", None), "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError(f"engine process {pid} died"))

    def _restart(self, work: _Workload, run_id: str, error: str,
                 started: float) -> dict[str, Any]:
        """The engine died: reap it, start a new one, plan the faults again, resume."""
        died = time.monotonic()
        log.warning("ftkit: engine died (%s); restarting it and resuming the requests", error)
        # The engine is dead: kill what is left of it at once and start the new engine while
        # the kernel tears the old processes down (freeing a killed worker's memory took about
        # 2 s here); they are waited for once the new engine is up, and by ``close``.
        self._shut_down()
        self._dying += kill_processes_now(self._procs)
        self._procs = []
        self.start()
        reap_processes(self._dying, REAP_GRACE_S)
        self._dying = []
        restart_s = time.monotonic() - died
        planned = self._plans.get(run_id)
        if planned is not None:
            plan, max_reinference = planned
            self._send_plan(run_id, self._replan(run_id, plan), max_reinference)
        resumed = work.resume(self.llm.llm_engine)
        return {"error": error, "died_at_s": died - started, "restart_s": restart_s,
                "resumed_at_s": time.monotonic() - started, "resumed_requests": resumed}

    def _replan(self, run_id: str, plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The plan of ``run_id`` with each fault's attempts that already fired."""
        from ftkit.recovery.events import read_events

        journal = (self.recovery or {}).get("event_log_dir")
        fired: dict[int, int] = {}
        if journal:
            for e in read_events(journal):
                if e["event"] == "fault_fired" and e.get("run_id") == run_id:
                    fired[e["index"]] = max(fired.get(e["index"], 0), e["attempt"])
        return [{**fault, "index": i, "fired": fired.get(i, 0)} for i, fault in enumerate(plan)]

    def _recovery_verdict(self, since_monotonic: float) -> str:
        """The reason the ranks gave for surfacing a fault, from their journal: a worker's
        exception reaches a multi-process front end only as a generic "engine dead"."""
        journal = (self.recovery or {}).get("event_log_dir")
        if not journal:
            return ""
        from ftkit.recovery.events import read_events

        since = time.time() - (time.monotonic() - since_monotonic)
        reasons = [e["reason"] for e in read_events(journal)
                   if e["event"] == "recovery" and e["decision"] == "raise"
                   and e["time"] >= since]
        return f"; ftkit: {reasons[0]}" if reasons else ""


def is_process_helper(proc: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker: one per process, started by the first
    engine that needs it, not owned by any engine. It ignores SIGTERM and exits by itself when
    the process that started it exits, so it is neither an engine process nor an orphan."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def reap(pids: list[int], grace_s: float) -> list[int]:
    """Terminate, then kill, the given processes (only these); return those that had to be
    killed. Waits at most about ``grace_s`` seconds."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return reap_processes(procs, grace_s)


def kill_processes_now(procs: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each of ``procs`` that is alive, without waiting; return all of them, to be
    reaped later (``reap_processes``)."""
    for p in procs:
        if _alive(p):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    return list(procs)


def reap_processes(procs: list[psutil.Process], grace_s: float) -> list[int]:
    """``reap`` for processes already known (psutil checks they are still the same)."""
    procs = [p for p in procs if _alive(p)]
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    kill_processes_now(alive)
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]


def _alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still needs a signal or a wait. A zombie of this process counts
    (waiting for it reaps it); a zombie of another parent does not: it is dead, and only that
    parent (init, for a worker orphaned when its engine core was killed) can reap it, in its
    own time (seconds, under some inits)."""
    try:
        if not proc.is_running():
            return False
        return proc.status() != psutil.STATUS_ZOMBIE or proc.ppid() == os.getpid()
    except psutil.NoSuchProcess:
        return False
