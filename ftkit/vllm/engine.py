"""Run a workload on a real vLLM engine and collect every request's tokens with their times.

``EngineSession`` owns one engine: tensor parallel 1 runs in-process (no engine-core process),
tensor parallel 2 and more use vLLM's normal multi-process executor. Every process the engine
starts is recorded at start and reaped at ``close()``, also when the engine died; a process
that outlives the grace period is killed (``ftkit.procs``). What those processes hold in shared
memory (vLLM's CPU communicator segments, its message queues) is noted at start, and each
engine gets a temporary folder of its own (vLLM's file store of the distributed group goes
there); both are removed once the processes are reaped: a killed engine (a ``process_kill``
fault, a restart, a host killed with its front end) would leave them behind for good, 8 MB
per engine at tensor parallel 2 and more for larger ones.

The process that owns the session may itself be killed with SIGKILL (a ``pytest`` run or a
script stopped hard): each engine then has a watchdog (``ftkit.procs.Watchdog``), a small
process that knows the engine's processes and files as they are noted (also while the engine
starts) and, when its owner dies, kills exactly those processes and removes those files.

An engine on vLLM's Ray executor (``distributed_executor_backend: ray``) gets a Ray cluster of
its own on this host (``ftkit.vllm.ray_cluster``, ``spec.nodes`` nodes), started with the
first engine, kept across restarts (a lost node started again first) and closed with the
session. The session then watches only the engine core's death itself; its workers' deaths
reach it through Ray, which ends the engine core.

The engine is built from the scenario's ``EngineSpec`` (``model``: the model directory) and,
for an ftkit engine, a ``RecoveryConfig``; faults are planned per run with a ``FaultPlan``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psutil

from ftkit import procs
from ftkit.bounds import ENGINE_START_TRACK_S, REAP_GRACE_S, VLLM_EXECUTE_TIMEOUT_DEFAULT_S
from ftkit.config import INJECT_SECRET_ENV, RecoveryConfig
from ftkit.contracts.eventlog import FaultFired, RecoveryRound, only, read_events
from ftkit.contracts.job import EngineRestart, SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.errors import EngineError, RunTimeout
from ftkit.results import RequestOutput
from ftkit.scenario.model import EngineSpec
from ftkit.vllm.ray_cluster import RayCluster, joining_environment
from ftkit.vllm.environment import (ExecuteTimeout, engine_args, engine_environment,
                                    hold_engine_env)
from ftkit.vllm.workload import GenerateResult, Workload

log = logging.getLogger("ftkit")

#: The watchdog's record, in the engine's temporary folder (removed with it).
WATCH_RECORD = "ftkit-watch-record"


#: Numbers the runs of this process (``EngineSession.new_run_id``).
_RUN_NUMBERS = itertools.count(1)


class EngineSession:
    """One real vLLM engine, started once and used for one or more workloads."""

    def __init__(self, spec: EngineSpec, *, recovery: RecoveryConfig | None = None,
                 multiprocess: bool | None = None, leftovers_file: str | None = None,
                 watchdog: bool = True) -> None:
        """``spec.model`` is a model directory. ``recovery``: run ftkit in the engine with
        these settings (None: a plain vLLM engine). ``multiprocess``: run the engine core in
        its own process. The default is vLLM's multi-process executor for tensor parallel 2
        and more, in-process for 1. Only one in-process engine may live in a process at a
        time (it owns the process's default process group). ``leftovers_file``: a file to
        which the paths of ``leftovers`` are appended as they are noted, one per line, for an
        owner that may have to remove them after killing this process. ``watchdog``: give
        each engine a watchdog process that cleans up if this process dies without closing
        the session (off: what a killed owner leaves stays behind)."""
        self.spec = spec
        self.multiprocess = spec.world_size > 1 if multiprocess is None else multiprocess
        self.recovery = recovery
        self.llm: Any = None
        self.start_s = 0.0
        #: Every process this session's engines started (all of them, across restarts).
        self.pids: list[int] = []
        self._procs: list[psutil.Process] = []
        #: The current engine's workers on this host that another owner started (a Ray
        #: cluster given by address): their shared memory is noted, nothing else.
        self._foreign: list[psutil.Process] = []
        #: Processes of a dead engine, killed and not yet waited for (see ``_restart``).
        self._dying: list[psutil.Process] = []
        self.dead: str | None = None
        #: vLLM's bound on one step RPC of the current engine, against what its recovery
        #: needs (raised where short; ``None``: vLLM bounds no step of this engine).
        self.execute_timeout: ExecuteTimeout | None = None
        #: The fault plan of each run id, as given, to plan it again after a restart.
        self._plans: dict[str, FaultPlan] = {}
        #: Files the current engine's processes hold in shared memory, and its temporary
        #: folder: removed once they are reaped.
        self.leftovers: set[str] = set()
        self._leftovers_file = leftovers_file
        self._use_watchdog = watchdog
        #: The current engine's watchdog (see the module docstring).
        self._watchdog: procs.Watchdog | None = None
        #: Puts back the environment an in-process engine keeps while it lives
        #: (``hold_engine_env``).
        self._release_env: Callable[[], None] | None = None
        #: The Ray cluster of an engine on vLLM's Ray executor: started with the first
        #: engine, kept across restarts, closed with the session.
        self.ray_cluster: RayCluster | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EngineSession:
        from vllm import LLM

        me = psutil.Process()
        started = time.monotonic()
        if self.ray_cluster is not None:
            self.ray_cluster.revive()  # a node lost with the engine that this one replaces
        elif self.spec.uses_ray and self.spec.ray_address is None:
            # Before the children are counted: the cluster's own processes are not the
            # engine's (the Ray workers the engine starts are: they are counted below).
            self.ray_cluster = RayCluster(self.spec.nodes,
                                          -(-self.spec.world_size // self.spec.nodes))
            try:
                self.ray_cluster.start()
            except BaseException:
                self.ray_cluster = None
                raise
        tmp_dir = tempfile.mkdtemp(prefix="ftkit-engine-")
        if self._use_watchdog:
            self._watchdog = procs.Watchdog(os.path.join(tmp_dir, WATCH_RECORD)).start()
        # Taken after the watchdog started: it is not one of the engine's processes.
        before = {p.pid for p in me.children(recursive=True)}
        self._note_leftovers([tmp_dir])

        def look() -> None:
            self._track_children(me, before)
            self._note_leftovers()

        try:
            with engine_environment(self.spec.world_size, self.multiprocess,
                                    tmp_dir, self.recovery) as self.execute_timeout, \
                    _joining(self.ray_cluster, self.spec.ray_address), \
                    procs.polling(ENGINE_START_TRACK_S, look):
                self.llm = LLM(**engine_args(self.spec, self.recovery))
        except BaseException as exc:  # Ctrl-C too: nothing of a half-started engine stays
            look()
            self.close()
            if not isinstance(exc, Exception):
                raise
            raise EngineError(f"vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc
        if not self.multiprocess:
            self._release_env = hold_engine_env()
        if self.spec.ray_address is not None:
            self._foreign = self._workers_elsewhere()
        look()
        # A process that came and went during the start (a helper vLLM or torch ran) is not
        # one of the engine's: a death watch would take its end for the engine's death.
        ended = {p.pid for p in self._procs if not procs.alive(p)}
        procs.wait_gone(p for p in self._procs if p.pid in ended)  # reaped, if ours
        self._procs = [p for p in self._procs if p.pid not in ended]
        self.pids = [pid for pid in self.pids if pid not in ended]
        self.start_s = time.monotonic() - started
        return self

    def _note_leftovers(self, paths: Iterable[str] | None = None) -> None:
        """Note ``paths`` (default: what the engine's processes hold in shared memory) to
        remove once they are reaped."""
        if paths is None:
            paths = procs.shared_memory_files(p for p in self._procs + self._foreign
                                              if procs.alive(p))
        new = sorted(set(paths) - self.leftovers)
        self.leftovers.update(new)
        if new and self._watchdog is not None:
            self._watchdog.note_paths(new)
        if new and self._leftovers_file is not None:
            with open(self._leftovers_file, "a") as out:
                out.writelines(f"{path}\n" for path in new)

    def _workers_elsewhere(self) -> list[psutil.Process]:
        """The engine's workers on this host that are no processes of this session's: those
        a Ray cluster it joined started. Only what they hold in shared memory is of concern
        here (noted, removed once the engine is gone); they are neither watched nor killed."""
        identities = self.llm.collective_rpc("ftkit_process_identity")
        found = [procs.identified_process(identity) for identity in identities]
        return [p for p in found if p is not None and p.pid not in self.pids]

    def _track_children(self, me: psutil.Process, before: set[int]) -> None:
        new = [p for p in procs.descendants(me)
               if p.pid not in before and p.pid not in self.pids
               and not procs.is_process_helper(p)]
        self.pids += [p.pid for p in new]
        # psutil remembers the start time: a reused pid is never signalled.
        self._procs += new
        if new and self._watchdog is not None:
            self._watchdog.note_processes(new)

    @property
    def watchdog_pid(self) -> int | None:
        """The current engine's watchdog process, if it has one."""
        return self._watchdog.pid if self._watchdog is not None else None

    def close(self) -> None:
        """Shut the engine down and reap every process it started (killed if need be), then
        its Ray cluster, if it has one."""
        self._shut_down()
        procs.reap(self._procs + self._dying, REAP_GRACE_S)
        self._clean_up()
        self._close_cluster()

    def kill(self) -> None:
        """End the engine at once, from any thread, for an owner that is about to exit: its
        processes are killed (no shut-down of vLLM's) and what they left is removed."""
        procs.wait_gone(procs.kill(self._procs + self._dying))
        self._clean_up()
        self._close_cluster()

    def _close_cluster(self) -> None:
        cluster, self.ray_cluster = self.ray_cluster, None
        if cluster is not None:
            cluster.close()

    def _clean_up(self) -> None:
        """The engine's processes are gone: remove what they left, then end the watchdog
        (last: it cleans up if this process dies before)."""
        self._procs, self._dying, self._foreign = [], [], []
        release, self._release_env = self._release_env, None
        if release is not None:
            release()
        procs.remove_files(self.leftovers)
        self.leftovers = set()
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

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

    def set_fault_plan(self, plan: FaultPlan) -> None:
        """Plan ``plan``'s faults for its run on every rank. Its ``max_reinference``, if set,
        replaces the engine's setting from this run on (engines are shared between scenarios
        that differ only there)."""
        if self.recovery is None:
            raise EngineError("this engine was started without ftkit; it cannot inject faults")
        if plan.run_id is not None:
            self._plans[plan.run_id] = plan
        self._send_plan(plan)

    def _send_plan(self, plan: FaultPlan) -> None:
        # The workers inherit this process's environment: where it has an injection secret,
        # they ask for it (``ftkit.vllm.worker.secret_problem``).
        self.llm.collective_rpc("ftkit_set_fault_plan",
                                args=(plan.to_json(), os.environ.get(INJECT_SECRET_ENV)))

    def reset_prefix_cache(self) -> None:
        """Forget the KV blocks cached from earlier workloads, so that one workload cannot
        change how the next is computed."""
        if self.llm is not None:
            self.llm.reset_prefix_cache()

    def new_run_id(self) -> str:
        """An id no other run of this process has had, whichever of its sessions ran it: the
        fault plans and fired faults of the event log are told apart by it (a host that
        replaces its session after a failed run shares the log with the one it replaced)."""
        return f"r{os.getpid()}.{next(_RUN_NUMBERS)}"

    def generate(self, prompts: list[str], sampling: SamplingSpec, *, run_id: str | None = None,
                 deadline: float | None = None,
                 on_tokens: Callable[[int, int], None] | None = None,
                 submit_after_steps: list[int] | None = None,
                 max_restarts: int = 0,
                 on_restart: Callable[[EngineRestart], None] | None = None
                 ) -> GenerateResult:
        """Run the prompts to completion; never raises for an engine error (it is returned).

        ``deadline`` (``time.monotonic()``) is checked between engine steps; ``RunTimeout`` is
        raised when it passes (the caller then closes the engine). ``submit_after_steps``
        staggers arrivals: request *i* is submitted once the engine has run that many steps of
        this workload (default: every request at once, before the first step).

        ``max_restarts``: when the engine dies (a process was killed), start a new one and
        resume every unfinished request from the tokens it had produced, up to this many
        times (``ftkit.vllm.resume``); the fault plan of ``run_id`` is planned again with the
        attempts that already fired. Each restart is in ``GenerateResult.restarts``, and
        handed to ``on_restart`` as the requests are resumed.
        """
        if self.dead is not None:
            return GenerateResult([RequestOutput(i, []) for i in range(len(prompts))],
                                  f"engine already dead: {self.dead}", 0.0)
        run_id = run_id or self.new_run_id()
        work = Workload(run_id, prompts, sampling, submit_after_steps)
        started_at = time.time()
        started = time.monotonic()
        restarts: list[EngineRestart] = []
        error = None
        while True:
            try:
                self._drive(work, started, deadline, on_tokens, watch=self.multiprocess)
                break
            except RunTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's error is the run's result
                error = _describe_engine_error(exc) + self._recovery_verdict(started_at)
                if len(restarts) >= max_restarts or self.recovery is None:
                    self.dead = error
                    break
                try:
                    restarts.append(self._restart(work, error, started))
                    if on_restart is not None:
                        on_restart(restarts[-1])
                except EngineError as exc:  # the replacement did not start: the run ends
                    error = self.dead = f"{error}; no engine could replace it: {exc}"
                    break
                error = None
        if error is None:
            try:
                self._settle(deadline)
            except RunTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - a rank's failed round is the run's result
                error = self.dead = (_describe_engine_error(exc)
                                     + self._recovery_verdict(started_at))
        return GenerateResult(work.outputs, error, time.monotonic() - started, started_at,
                              restarts=restarts)

    def _drive(self, work: Workload, started: float, deadline: float | None,
               on_tokens: Callable[[int, int], None] | None, watch: bool) -> None:
        # Without the watch, vLLM shuts its executor down gracefully after a worker dies and
        # waits out its grace periods (about 9 s) for a surviving rank blocked in a collective
        # with the dead one; and a front end whose engine core died abruptly waits for output
        # forever.
        engine = self.llm.llm_engine
        with procs.DeathWatch(self._watched() if watch else [],
                              on_death=self._unblock_front_end):
            work.submit_due(engine)
            self._steps(engine, work, started, deadline, on_tokens)

    def _steps(self, engine: Any, work: Workload, started: float, deadline: float | None,
               on_tokens: Callable[[int, int], None] | None) -> None:
        while engine.has_unfinished_requests():
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout("the workload did not finish before its deadline")
            step_outputs = engine.step()
            # One time per engine step: the tokens of one step share it.
            now = time.monotonic() - started
            for out in step_outputs:
                work.take(out, now)
            if work.to_abort:
                # Resumed requests whose joined stream reached a stop string.
                engine.abort_request(work.to_abort)
                work.to_abort = []
            work.steps += 1
            work.submit_due(engine)
            if on_tokens is not None:
                on_tokens(work.done, work.total)

    def _settle(self, deadline: float | None) -> None:
        """Wait until every rank has finished the workload's last step, and its recovery.

        The engine reads a step's output from one rank only: the others may still be in
        that step, or recovering from a fault in it, when the workload is already complete.
        Until they are done, the run's records (its recovery rounds) are incomplete, and
        the engine is not ready for a next workload or to be closed. ``ftkit_settle`` waits
        for every rank (it queues behind their steps), twice: a round that a lagging rank
        began may involve a peer that had already answered the first call. Each call is
        bounded by vLLM's bound on one step, which covers the step's recovery
        (``ExecuteTimeout``), and by ``deadline``."""
        if self.recovery is None or self.spec.world_size < 2:
            return
        bound = float(self.execute_timeout.seconds if self.execute_timeout is not None
                      else VLLM_EXECUTE_TIMEOUT_DEFAULT_S)
        for _ in range(2):
            timeout = bound
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise RunTimeout("the engine's ranks did not settle before the deadline")
                timeout = min(bound, timeout)
            try:
                self.llm.collective_rpc("ftkit_settle", timeout=timeout)
            except TimeoutError as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RunTimeout("the engine's ranks did not settle before the "
                                     "deadline") from exc
                raise

    def _watched(self) -> list[psutil.Process]:
        """The engine's processes whose death the session watches for itself: all of them,
        except on vLLM's Ray executor, whose workers run on the cluster's nodes (here as on
        other hosts): Ray tells their death to the executor, which ends the engine core."""
        if self.ray_cluster is None:
            return self._procs
        self.ray_cluster.look()
        on_nodes = {p.pid for node in self.ray_cluster.nodes for p in node.seen}
        return [p for p in self._procs if p.pid not in on_nodes]

    def _unblock_front_end(self, pid: int) -> None:
        """vLLM's front end notices the engine core's death but leaves a caller blocked in
        ``step()`` waiting for output forever: hand that caller the death as its output."""
        from vllm.v1.engine.exceptions import EngineDeadError

        queue = getattr(getattr(self.llm.llm_engine, "engine_core", None), "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError(f"engine process {pid} died"))

    def _restart(self, work: Workload, error: str, started: float) -> EngineRestart:
        """The engine died: reap it, start a new one, plan the faults again, resume."""
        died = time.monotonic()
        log.warning("ftkit: engine died (%s); restarting it and resuming the requests", error)
        # The engine is dead: kill what is left of it at once and start the new engine while
        # the kernel tears the old processes down (freeing a killed worker's memory took about
        # 2 s here); they are waited for once the new engine is up, and by ``close``.
        self._shut_down()
        self._dying += procs.kill(self._procs)
        self._procs, self._foreign = [], []
        dead_engines, self.leftovers = self.leftovers, set()
        # The dead engine's watchdog stays until what it knows of is cleaned up.
        dead_watchdog, self._watchdog = self._watchdog, None
        try:
            self.start()
        finally:  # also when the new engine fails to start (``start`` closed it)
            procs.reap(self._dying, REAP_GRACE_S)
            self._dying = []
            procs.remove_files(dead_engines - self.leftovers)
            if dead_watchdog is not None:
                dead_watchdog.stop()
        restart_s = time.monotonic() - died
        plan = self._plans.get(work.run_id)
        if plan is not None:
            self._send_plan(plan.with_fired(self._fired(work.run_id)))
        resumed = work.resume(self.llm.llm_engine)
        return EngineRestart(error=error, died_at_s=died - started, restart_s=restart_s,
                             resumed_at_s=time.monotonic() - started,
                             resumed_requests=tuple(resumed))

    def _fired(self, run_id: str) -> dict[int, int]:
        """The attempts of each fault (by index) of ``run_id`` that already fired."""
        fired: dict[int, int] = {}
        if self.recovery is not None and self.recovery.event_log_dir:
            for e in only(read_events(self.recovery.event_log_dir), FaultFired):
                if e.run_id == run_id:
                    fired[e.index] = max(fired.get(e.index, 0), e.attempt)
        return fired

    def _recovery_verdict(self, since: float) -> str:
        """The reason the ranks gave for surfacing a fault since ``since`` (``time.time()``),
        from their event log: a worker's exception reaches a multi-process front end only as
        a generic "engine dead"."""
        if self.recovery is None or not self.recovery.event_log_dir:
            return ""
        reasons = [e.reason for e in only(read_events(self.recovery.event_log_dir),
                                          RecoveryRound)
                   if e.decision == "raise" and e.time >= since]
        return f"; ftkit: {reasons[0]}" if reasons else ""


@contextlib.contextmanager
def _joining(cluster: RayCluster | None, address: str | None = None) -> Iterator[None]:
    """The environment an engine joins ``cluster``, or the running cluster at ``address``,
    with (vLLM's Ray executor reads it in the engine core; nothing without either), restored
    afterwards."""
    if cluster is not None:
        address = cluster.address
    wanted = joining_environment(address) if address is not None else {}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _describe_engine_error(exc: BaseException) -> str:
    error = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) not in error:
        error += f" (caused by {type(cause).__name__}: {cause})"
    return error
