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
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftkit.errors import EngineError, RunTimeout
from ftkit.inject import parse_request_id, request_id
from ftkit.recovery.config import CONFIG_KEY
from ftkit.results import RequestOutput

log = logging.getLogger("ftkit")

#: Engine arguments ftkit sets unless the scenario's ``engine.args`` says otherwise.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    # torch.compile costs minutes on CPU for no benefit to a correctness check.
    "enforce_eager": True,
    "disable_log_stats": True,
}
#: Environment for the engine's processes (read by vLLM when the engine starts).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
REAP_GRACE_S = 10.0


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
        self.pids: list[int] = []
        self.dead: str | None = None
        self._runs = 0

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

    def close(self) -> None:
        """Shut the engine down and reap every process it started (killed if need be)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # noqa: BLE001 - a dead engine may not shut down cleanly
                log.debug("engine shutdown raised %s", exc)
            del llm
            # Run vLLM's finalizers now, not at some later collection: they tear down the
            # distributed state of this process, which a later in-process engine owns.
            gc.collect()
        reap(self.pids, REAP_GRACE_S)

    def __enter__(self) -> EngineSession:
        return self.start() if self.llm is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- workloads ----------------------------------------------------------------------------

    def set_fault_plan(self, run_id: str | None, faults: list[dict[str, Any]]) -> None:
        if self.recovery is None:
            raise EngineError("this engine was started without ftkit; it cannot inject faults")
        self.llm.collective_rpc("ftkit_set_fault_plan", args=(run_id, faults))

    def new_run_id(self) -> str:
        self._runs += 1
        return f"r{os.getpid()}.{self._runs}"

    def generate(self, prompts: list[str], sampling: SamplingSpec, *, run_id: str | None = None,
                 deadline: float | None = None,
                 on_tokens: Callable[[int, int], None] | None = None,
                 submit_after_steps: list[int] | None = None) -> GenerateResult:
        """Run the prompts to completion; never raises for an engine error (it is returned).

        ``deadline`` (``time.monotonic()``) is checked between engine steps; ``RunTimeout`` is
        raised when it passes (the caller then closes the engine). ``submit_after_steps``
        staggers arrivals: request *i* is submitted once the engine has run that many steps of
        this workload (default: every request at once, before the first step).
        """
        from vllm import SamplingParams

        if self.dead is not None:
            return GenerateResult([RequestOutput(i, []) for i in range(len(prompts))],
                                  f"engine already dead: {self.dead}", 0.0)
        run_id = run_id or self.new_run_id()
        engine = self.llm.llm_engine
        outputs = [RequestOutput(i, []) for i in range(len(prompts))]
        total = len(prompts) * sampling.max_tokens
        started_at = time.time()
        started = time.monotonic()
        arrivals = list(submit_after_steps or [0] * len(prompts))
        if len(arrivals) != len(prompts):
            raise ValueError("submit_after_steps needs one entry per prompt")
        waiting = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        steps = 0

        def submit_due() -> None:
            while waiting and (arrivals[waiting[0]] <= steps
                               or not engine.has_unfinished_requests()):
                i = waiting.pop(0)
                params = SamplingParams(
                    max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                    top_p=sampling.top_p, ignore_eos=True,
                    # One stream per request: the workload seed offset by the request index.
                    seed=None if sampling.seed is None else sampling.seed + i)
                engine.add_request(request_id(run_id, i), prompts[i], params)

        error = None
        try:
            done = 0
            submit_due()
            while engine.has_unfinished_requests():
                if deadline is not None and time.monotonic() > deadline:
                    raise RunTimeout("the workload did not finish before its deadline")
                step_outputs = engine.step()
                # One time per engine step: the tokens of one step share it.
                now = time.monotonic() - started
                for out in step_outputs:
                    parsed = parse_request_id(out.request_id)
                    if parsed is None or parsed[0] != run_id:
                        continue
                    req = outputs[parsed[1]]
                    completion = out.outputs[0]
                    new = list(completion.token_ids[len(req.token_ids):])
                    req.token_ids.extend(new)
                    req.token_times.extend([now] * len(new))
                    done += len(new)
                    if out.finished:
                        req.finish_reason = completion.finish_reason
                steps += 1
                submit_due()
                if on_tokens is not None:
                    on_tokens(done, total)
        except RunTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's error is the run's result
            error = f"{type(exc).__name__}: {exc}"
            cause = exc.__cause__ or exc.__context__
            if cause is not None and str(cause) not in error:
                error += f" (caused by {type(cause).__name__}: {cause})"
            error += self._recovery_verdict(started)
            self.dead = error
        return GenerateResult(outputs, error, time.monotonic() - started, started_at)


    def _recovery_verdict(self, since_monotonic: float) -> str:
        """The reason the ranks gave for surfacing a fault, from their journal: a worker's
        exception reaches a multi-process front end only as a generic "engine dead"."""
        journal = (self.recovery or {}).get("journal_dir")
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
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]
