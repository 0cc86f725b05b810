"""A server whose engine dies goes on: the engine is replaced and every request resumed.

vLLM's OpenAI server holds one engine client (``AsyncLLM``) for its whole life; when a worker
or the engine core dies, every request on it fails with ``EngineDeadError`` and the server
answers 503 from then on. With ``"max_restarts": N`` in ``fault_tolerance``, ftkit's plugin
hands the server a ``RestartingEngine`` instead (``install``, which wraps
``AsyncLLM.from_vllm_config`` in the API server process). It passes everything to the engine
of the moment, and its ``generate`` outlives the engine:

* when the engine dies, the first request to see it starts its replacement (a new engine
  from the same configuration, or the warm standby, ``"standby": true``); the others wait for
  that one replacement;
* each request then goes on from the tokens its client already has: its prompt plus those
  tokens is submitted as a new request (``served_resume_id``: the workers fast-forward a
  seeded request's generator past them, and show them to its penalties as outputs), asking
  only for the tokens left;
* what the new engine produces reaches the client as the continuation of the same stream:
  the request's own id and prompt, its text as the original request's detokenizer would
  have made it, its stop strings looked for across the restart (``ftkit.vllm.workload``'s
  shadow detokenizer, the one resume after a process kill uses offline);
* a request with ``n > 1`` goes on completion by completion, each as the request of its own
  that vLLM made of it (its seed plus its index).

A request whose engine died before its client saw a token (all of a non-streamed request)
starts again from its prompt: greedy and seeded sampling give the same tokens again. After
``max_restarts`` replacements the next death ends the requests as vLLM would.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ftkit import procs
from ftkit.config import RecoveryConfig
from ftkit.contracts.eventlog import SERVER_RANK, EngineReplaced, EventLog, RequestResumed
from ftkit.contracts.requests import served_resume_id

log = logging.getLogger("ftkit")

#: How often the watch looks whether the engine, or one of its processes, died.
WATCH_EVERY_S = 0.05
#: After a warm standby took over, the dead engine is ended once every request it served has
#: had an output from the new engine, or after this many seconds, whichever comes first.
DEAD_ENGINE_GRACE_S = 10.0
#: After a replacement, the new engine's scheduler is held (vLLM's pause, mode ``keep``) until
#: every request that was waiting on the dead engine has gone to it, at most this long: their
#: resumed prefills then run in one first step. Let go one by one, the first to arrive ran a
#: step of its own and the others waited for it (a cold replacement's streams had their next
#: outputs 0.2 s apart).
HOLD_FOR_RESUMES_S = 0.5
#: The bound on vLLM's pause and resume calls (engine core utility calls).
HOLD_CALL_TIMEOUT_S = 5.0
#: The bound on the warm standby's warm-up request (its first steps: vLLM compiles some of
#: the model's operations then, and ftkit's workers assemble their recovery).
WARM_UP_TIMEOUT_S = 300.0
#: The warm-up request: a few tokens of a short prompt (less than a KV block: nothing of it
#: stays in the prefix cache), greedy, with the logprob of each token.
WARM_UP_PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
WARM_UP_TOKENS = 4


@dataclass
class _Completion:
    """What one completion of a request delivered so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    #: The original request's detokenizer, once the completion was resumed.
    shadow: Any = None
    #: Tokens of the engine's request of the moment seen so far (cumulative outputs repeat
    #: them).
    engine_seen: int = 0


class RestartingEngine:
    """An engine client that replaces its engine when it dies (see the module)."""

    def __init__(self, start: Callable[[bool], Any], config: RecoveryConfig,
                 replica: int | None = None) -> None:
        """``start(primary)``: a new engine (``primary`` False: a standby, which keeps no
        statistics of its own until it takes over). ``replica``: the data-parallel replica
        whose engine this is (``ftkit.vllm.replicas``), which the log names."""
        self._start = start
        #: What the log calls the engine, and the new one.
        self.name = "the engine" if replica is None else f"replica {replica}"
        self._new_name = "the new engine" + ("" if replica is None else f" of {self.name}")
        self.max_restarts = config.max_restarts
        self.standby_wanted = config.standby
        #: The replacements, in the ranks' event log when the settings name one.
        self._events = EventLog(SERVER_RANK, config.event_log_dir)
        #: The processes of every engine started and not yet ended (``_processes_of``),
        #: changed under ``_processes_lock`` (the standby starts in a thread of its own, a
        #: dead engine is ended in the executor's).
        self._processes: list[tuple[Any, _Processes]] = []
        self._processes_lock = threading.Lock()
        self._engine = self._started(True)
        #: The server's event loop (the standby's warm-up request runs in it).
        self._loop = _running_loop()
        self._standby: Any = None
        #: A standby started and still running its warm-up request.
        self._warming: Any = None
        self._standby_thread: threading.Thread | None = None
        #: Where the standby is (``standby_state``), for ``/ftkit/health`` and the log.
        self._standby_state = "starting" if config.standby else "off"
        #: Standbys lost (dead before they took over, or failed their warm-up).
        self.standbys_lost = 0
        if self.standby_wanted:
            self._prepare_standby()
        self.restarts = 0
        self.resumed_requests = 0
        self._replacing: asyncio.Future[Any] | None = None
        #: Dead engines replaced, whose renderer the server's handlers may still use.
        self._retired: list[Any] = []
        self._watcher: asyncio.Future[None] | None = None
        #: The requests in flight (``generate``).
        self._requests: set[_Request] = set()
        #: A replacement's work left behind it, cancelled at shutdown: a dead engine being
        #: ended behind a standby that took over (``_end_dead_behind``), a new engine's held
        #: scheduler to let go (``_let_go``).
        self._ending: set[asyncio.Future[None]] = set()
        #: Seconds each replacement took, from the death seen to the new engine ready.
        self.restart_seconds: list[float] = []
        #: When the last replacement began (``time.monotonic()``): the death being acted on.
        self._death_at = 0.0
        #: Awaited with each new engine once it serves, before any request goes on there
        #: (ftkit's injection route gives it the live faults still to fire).
        self.on_replaced: list[Callable[[Any], Awaitable[None]]] = []
        if self._loop is not None and self.standby_wanted:
            self._watch()  # the standby is watched from the start, requests or not

    # --- the engine of the moment -----------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def restarting(self) -> bool:
        return self._replacing is not None

    @property
    def errored(self) -> bool:
        """Dead for good: the engine died and no replacement runs or is left (vLLM's server
        refuses requests, and ends itself, on this)."""
        return bool(self._engine.errored) and not self.restarting and not self._can_restart()

    @property
    def is_running(self) -> bool:
        return bool(self._engine.is_running) or self.restarting

    async def check_health(self) -> None:
        if self.restarting:
            return  # answering, and about to serve again
        await self._engine.check_health()

    def shutdown(self, timeout: float | None = None) -> None:
        from vllm.utils.async_utils import cancel_task_threadsafe

        for task in [self._watcher, *self._ending]:
            if task is not None:
                cancel_task_threadsafe(task)
        standby, self._standby = self._standby, None
        warming, self._warming = self._warming, None
        for engine in (self._engine, standby, warming):
            if engine is not None:
                engine.shutdown(timeout=timeout)
        for engine in self._retired:  # one a standby replaced, not ended yet
            if self._processes_of(engine).processes:
                self._end_dead(engine)
        # An engine that shut down removed its segments itself; one that died when no
        # restart was left (or while the server ended) could not.
        for processes in self._forget():
            procs.remove_files(processes.shared_memory)
        for engine in self._retired:  # what the server still used of them (_shut_down)
            renderer = getattr(engine, "renderer", None)
            if renderer is not None:
                renderer.shutdown()

    def _can_restart(self) -> bool:
        return self.restarts < self.max_restarts

    def _started(self, primary: bool) -> Any:
        """A new engine (``start``), its processes and what they share noted at once: a
        process killed before the watch first looked would otherwise leave its segments."""
        engine = self._start(primary)
        processes = _Processes.of(engine)
        with self._processes_lock:
            self._processes.append((engine, processes))
        remove_at_exit(processes.shared_memory)
        return engine

    def _processes_of(self, engine: Any) -> _Processes:
        with self._processes_lock:
            for known, processes in self._processes:
                if known is engine:
                    return processes
        return _Processes([])

    def _forget(self, engine: Any | None = None) -> list[_Processes]:
        """Stop tracking ``engine`` (by default every engine); the processes it had."""
        with self._processes_lock:
            gone = [p for known, p in self._processes if engine is None or known is engine]
            self._processes = [known for known in self._processes
                               if engine is not None and known[0] is not engine]
        return gone

    async def _end_dead_behind(self, dead: Any) -> None:
        """End ``dead`` once each request it served has had an output from the new engine
        (or ended), at most ``DEAD_ENGINE_GRACE_S`` after the takeover. Ending an engine
        costs CPU (the kernel frees its processes' memory): done at once beside a standby on
        two cores, it delayed the resumed streams' first outputs by about a second (measured
        while the dead engine's core still shut itself down)."""
        deadline = time.monotonic() + DEAD_ENGINE_GRACE_S
        served = [s for s in self._requests if s.engine is dead]
        while time.monotonic() < deadline and any(
                s in self._requests and (s.engine is dead or not s.went_on) for s in served):
            await asyncio.sleep(WATCH_EVERY_S)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(self._end_dead, dead))
        finally:
            self._ending = {f for f in self._ending if not f.done()}

    def _end_dead(self, dead: Any) -> None:
        """End what is left of the dead engine, then remove the shared memory segments its
        processes had mapped: vLLM's CPU workers create the ones of their groups (rank 0) and
        remove them when they close, which a killed worker never does. The names are the
        dead engine's own (a new engine's groups have new ones). Its processes that still
        live are SIGKILLed first (``_Processes.end``): a cold replacement would wait seconds
        for their memory and cores."""
        self._processes_of(dead).end()
        _shut_down(dead)
        removed = procs.remove_files(path for processes in self._forget(dead)
                                     for path in processes.shared_memory)
        if removed:
            log.info("ftkit: removed %d shared memory segment(s) of the dead engine",
                     len(removed))

    # --- generate ---------------------------------------------------------------------------

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **kwargs: Any) -> AsyncIterator[Any]:
        from vllm.v1.engine.exceptions import EngineDeadError

        self._watch()
        state = _Request(prompt, sampling_params, request_id)
        resumed: tuple[int, float] | None = None  # (tokens delivered, death) once resumed
        self._requests.add(state)
        try:
            while True:
                engine = state.engine = self._engine
                state.went_on = False
                try:
                    async for out in state.run(engine, kwargs):
                        if resumed is not None:
                            self._resumed(request_id, *resumed)
                            resumed = None
                        state.went_on = True
                        yield out
                    return
                except Exception as exc:  # noqa: BLE001 - a dead engine fails requests in several
                    # ways (EngineDeadError from its output loop; EngineGenerateError or a
                    # socket error where the request met the engine's end first). Only a dead
                    # engine's failure is a death; any other goes to the client as vLLM's
                    # would.
                    if not (isinstance(exc, EngineDeadError) or engine.errored):
                        raise
                    if not await self._replaced(engine):
                        raise
                    self.resumed_requests += 1
                    resumed = (state.delivered(), self._death_at)
                    log.warning("ftkit: resuming request %s on the new engine after %s "
                                "token(s)", request_id, state.delivered())
        finally:
            self._requests.discard(state)

    def _resumed(self, request_id: str, delivered: int, death_at: float) -> None:
        """A resumed request's first output from the new engine is going to its client."""
        after = time.monotonic() - death_at
        log.info("ftkit: request %s goes on: its first output from the new engine %.2f s "
                 "after the engine's death", request_id, after)
        self._events.emit(RequestResumed(request_id=request_id, delivered=delivered,
                                         after_death_s=after))

    def _watch(self) -> None:
        """Start (once, in the server's event loop) the watch that replaces an engine that
        died while no request ran: the next request then finds a live engine."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch_engine())

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            engine = self._engine
            watched = self._processes_of(engine)
            if not engine.errored and self._can_restart() and watched.one_died():
                # vLLM itself sees a worker's death only once its engine core has given the
                # other workers their grace periods (seconds): the engine is dead now.
                log.warning("ftkit: a process of %s died (%s)", self.name, watched.dead)
                _mark_dead(engine)
            if engine.errored and self._replacing is None and self._can_restart():
                await self._replaced(engine)
            await self._watch_standby()

    async def _replaced(self, dead: Any) -> bool:
        """Wait for ``dead``'s replacement (starting it if this is the first request to see
        it die); ``False`` when no restart is left."""
        if self._engine is not dead:
            return True
        if self._replacing is None:
            if not self._can_restart():
                log.error("ftkit: %s died and all %d restart(s) are used up", self.name,
                          self.max_restarts)
                return False
            self._replacing = asyncio.ensure_future(self._replace(dead))
        replacing = self._replacing
        try:
            await asyncio.shield(replacing)
        except Exception:  # noqa: BLE001 - the new engine did not start: the request fails
            return False
        return True

    async def _replace(self, dead: Any) -> None:
        # Every request still waiting on the dead engine learns of its death now. (vLLM's
        # output loop tells them when it meets the death; ending the engine below cancels that
        # loop, and a request it had not told yet would wait for ever.)
        _end_requests(dead)
        self.restarts += 1
        began = self._death_at = time.monotonic()
        standby = self._standby_ready()
        log.warning("ftkit: %s died (%s); replacing it (restart %d of %d, %s)",
                    self.name, _death_of(dead), self.restarts, self.max_restarts,
                    "from the warm standby" if standby else
                    "a new engine" if self._standby_thread is None else
                    "from the standby once it is warm, or a new engine")
        loop = asyncio.get_running_loop()
        try:
            if not standby:  # a cold start gets the dead engine's memory and cores first
                await loop.run_in_executor(None, functools.partial(self._end_dead, dead))
                log.info("ftkit: the dead engine ended in %.2f s", time.monotonic() - began)
            # (A standby that died since it was looked at is ended there, and a new engine
            # started instead: a takeover never hands the requests to a dead engine.)
            new, standby = await loop.run_in_executor(
                None, functools.partial(self._take_standby_or_start, dead, not standby))
            for hook in self.on_replaced:
                try:
                    await hook(new)
                except Exception as exc:  # noqa: BLE001 - the new engine serves regardless
                    log.error("ftkit: after the replacement, %r failed: %s", hook, exc)
            waiting = [r for r in self._requests if r.engine is dead]
            held = bool(waiting) and await _hold(new)
            self._engine = new
            if held:
                self._ending.add(asyncio.ensure_future(self._let_go(new, waiting)))
            self._retired.append(dead)
            if standby:  # the streams go on at once; the dead engine is ended behind them
                self._ending.add(asyncio.ensure_future(self._end_dead_behind(dead)))
            self.restart_seconds.append(time.monotonic() - began)
            log.warning("ftkit: %s serves after %.2f s", self._new_name,
                        self.restart_seconds[-1])
            self._events.emit(EngineReplaced(error=_death_of(dead),
                                             restart_s=self.restart_seconds[-1],
                                             standby=standby))
            if self.standby_wanted and self._can_restart():
                self._prepare_standby()
            elif self.standby_wanted:
                self._standby_state = "none"
        except Exception as exc:
            log.error("ftkit: the replacement engine did not start: %s", exc)
            raise
        finally:
            self._replacing = None

    async def _let_go(self, engine: Any, waiting: list[_Request]) -> None:
        """Resume ``engine``'s held scheduler (``_hold``) once each of ``waiting`` went to it
        (or ended), at most ``HOLD_FOR_RESUMES_S`` after the takeover; always resumed."""
        deadline = time.monotonic() + HOLD_FOR_RESUMES_S
        try:
            while time.monotonic() < deadline and any(
                    r in self._requests and r.sent_to is not engine for r in waiting):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.005)  # (their requests' sends to the engine core)
        finally:
            await _resume(engine)

    # --- the warm standby -------------------------------------------------------------------

    def _prepare_standby(self) -> None:
        """Start the next standby engine in a thread of its own (it takes as long as any
        engine start), and warm it up; ``_take_standby_or_start`` waits for it."""

        def start() -> None:
            try:
                standby = self._started(False)
            except Exception as exc:  # noqa: BLE001 - a restart then starts an engine itself
                self._standby_state = "none"
                self.standbys_lost += 1
                log.error("ftkit: the standby engine did not start: %s", exc)
                return
            self._warming, self._standby_state = standby, "warming"
            warmed = self._warm_up(standby)
            if self._warming is not standby:
                return  # the server shut it down meanwhile
            self._warming = None
            why = ("failed its warm-up request" if warmed is False else
                   _unfit(standby, self._processes_of(standby)))
            if why is not None:  # no standby: a replacement starts a new engine
                self._lose_standby(standby, why)
                return
            self._standby, self._standby_state = standby, "ready"
            log.warning("ftkit: the standby engine is ready%s",
                        f" (warmed up in {warmed:.2f} s)" if warmed is not None else "")

        self._standby_state = "starting"
        self._standby_thread = threading.Thread(target=start, name="ftkit-standby",
                                                daemon=True)
        self._standby_thread.start()

    def _warm_up(self, standby: Any) -> float | bool | None:
        """Run one short request on ``standby`` (in the server's event loop), so that the
        first steps of an engine, which cost seconds (vLLM compiles some of the model's
        operations at its first forward; ftkit's workers assemble their recovery at their
        first step), come before it takes over, not after. Seconds it took; ``None`` when
        there is no event loop to run it in (the standby then takes over cold); ``False``
        when it failed or outlasted ``WARM_UP_TIMEOUT_S``: an engine that cannot answer one
        short request is no standby."""
        if self._loop is None:
            return None
        began = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(_one_request(standby), self._loop)
        try:
            future.result(timeout=WARM_UP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure: no standby
            future.cancel()
            log.error("ftkit: the standby engine's warm-up request failed: %r", exc)
            return False
        return time.monotonic() - began

    @property
    def standby_state(self) -> str:
        """``off`` (not asked for), ``starting`` (its engine starts), ``warming`` (its warm-up
        request runs), ``ready`` (started, warmed up, every process alive when last looked
        at), ``taking-over``, or ``none`` (lost, or failed its warm-up, and none started
        since: the next replacement starts a new engine)."""
        return self._standby_state

    def _standby_ready(self) -> bool:
        """A standby that can take over now: warmed up, not errored, its processes alive."""
        standby = self._standby
        return standby is not None and _unfit(standby, self._processes_of(standby)) is None

    def _take_standby_or_start(self, dead: Any, dead_ended: bool) -> tuple[Any, bool]:
        """The engine that replaces ``dead``: the standby (waited for while it warms up) if it
        is fit to (``_unfit``), else a new engine, started cold once ``dead`` is ended (unless
        ``dead_ended``). ``(engine, from the standby)``."""
        thread = self._standby_thread
        if thread is not None:
            thread.join()
        standby, self._standby, self._standby_thread = self._standby, None, None
        if standby is not None:
            why = _unfit(standby, self._processes_of(standby))
            if why is None:
                self._standby_state = "taking-over"
                return standby, True
            self._lose_standby(standby, why)
        if not dead_ended:
            self._end_dead(dead)
        return self._started(True), False

    def _lose_standby(self, standby: Any, why: str) -> None:
        """``standby`` cannot take over (``why``): end it, and say so."""
        self.standbys_lost += 1
        self._standby_state = "none"
        log.error("ftkit: the standby engine %s: it is ended, and the server has no standby "
                  "until a new one is ready", why)
        self._end_dead(standby)

    async def _watch_standby(self) -> None:
        """End the ready standby if it died since it was last looked at, and start another
        while restarts are left (a standby lost counts no restart: the serving engine still
        serves; at most ``max_restarts`` standbys are started again, so that one that dies at
        every start does not start for ever)."""
        standby = self._standby
        if standby is None or self._replacing is not None:
            return
        why = _unfit(standby, self._processes_of(standby))
        if why is None:
            return
        self._standby = None
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._lose_standby, standby, why))
        if self._can_restart() and self.standbys_lost <= self.max_restarts:
            self._prepare_standby()


#: The shared memory segments of the engines this server process started: removed when it
#: exits (``remove_at_exit``).
_SEGMENTS_AT_EXIT: set[str] = set()
_REMOVING_AT_EXIT = False


def remove_at_exit(paths: set[str]) -> None:
    """Remove ``paths`` (an engine's shared memory segments) when this server process exits.
    vLLM's CPU workers remove their groups' segments only when their shared memory manager is
    destroyed, which a worker killed, or ended by its engine core's shutdown, never reaches:
    a server that stopped on SIGTERM left its engine's behind, 4 MiB each, as did every engine
    that died. The server's process outlives its engines; the names are per engine (vLLM's
    ``VLLM_DIST_IDENT``), so none is another's."""
    global _REMOVING_AT_EXIT
    if not _REMOVING_AT_EXIT:
        atexit.register(_remove_segments)
        _REMOVING_AT_EXIT = True
    _SEGMENTS_AT_EXIT.update(paths)


def _remove_segments() -> None:
    removed = procs.remove_files(_SEGMENTS_AT_EXIT)
    _SEGMENTS_AT_EXIT.clear()
    if removed:
        log.info("ftkit: removed %d shared memory segment(s) the engines left", len(removed))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _one_request(engine: Any) -> None:
    """``WARM_UP_TOKENS`` tokens of ``WARM_UP_PROMPT_IDS`` on ``engine``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=1)
    prompt = TokensPrompt(prompt_token_ids=list(WARM_UP_PROMPT_IDS))
    async for _ in engine.generate(prompt, params, "ftkit-standby-warm-up"):
        pass


class _Processes:
    """The processes of one engine (its engine core and that core's workers, which vLLM names
    ``...Worker...``), to see one of them die."""

    def __init__(self, processes: list[Any], workers: list[Any] | None = None) -> None:
        self.processes = processes
        #: Those of ``processes`` that are workers.
        self.workers = workers or []
        #: The shared memory segments the processes had mapped when found (their groups'),
        #: less Python's named semaphores (which may be the server's own).
        self.shared_memory = procs.shared_memory_files(processes, semaphores=False)
        self.dead = ""

    @classmethod
    def of(cls, engine: Any) -> _Processes:
        import psutil

        cores: list[Any] = []
        workers: list[Any] = []
        try:
            manager = engine.engine_core.resources.engine_manager
            for proc in getattr(manager, "processes", None) or []:
                core = psutil.Process(proc.pid)
                cores.append(core)
                workers += [c for c in core.children() if "Worker" in c.name()]
        except Exception:  # noqa: BLE001 - an engine without local processes: vLLM's own watch
            return cls([])
        return cls(cores + workers, workers)

    def end(self) -> None:
        """SIGKILL the engine's processes still alive, its workers and its engine core
        (``psutil`` checks that each pid is still the process found, not one that took its
        number since). They serve no one any more: a worker left alive would end only after
        the grace period its engine core gives it, and an engine core asked to shut down
        tears down for seconds (2.4 s measured on two cores) that a cold replacement waits
        for. What they shared is removed by ftkit (``RestartingEngine._end_dead``)."""
        import psutil

        for proc in self.workers + [p for p in self.processes if p not in self.workers]:
            try:
                proc.kill()
            except psutil.Error:
                pass  # gone already

    def one_died(self) -> bool:
        import psutil

        for proc in self.processes:
            try:
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                self.dead = f"pid {proc.pid}"
                return True
        return False


def _unfit(engine: Any, processes: _Processes) -> str | None:
    """Why ``engine`` (a standby) cannot serve, or ``None``: it errored (vLLM saw its engine
    core die), or one of its processes is gone."""
    if getattr(engine, "errored", False) is True:
        return "errored (its engine core died)"
    if processes.one_died():
        return f"lost a process ({processes.dead})"
    return None


async def _hold(engine: Any) -> bool:
    """Hold ``engine``'s scheduler: requests queue there, none is scheduled until
    ``resume_generation`` (``RestartingEngine._let_go``). ``False`` when it could not."""
    try:
        await asyncio.wait_for(engine.pause_generation(mode="keep", clear_cache=False),
                               HOLD_CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the resumes then go in one by one, as before
        log.warning("ftkit: the new engine could not be held for the resumed requests: %r", exc)
        await _resume(engine)  # a pause that reached the engine core all the same must not stay
        return False
    return True


async def _resume(engine: Any) -> None:
    """Resume ``engine``'s scheduler (after ``_hold``), within ``HOLD_CALL_TIMEOUT_S``."""
    try:
        await asyncio.wait_for(engine.resume_generation(), HOLD_CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - an engine that died meanwhile is replaced
        log.error("ftkit: the new engine's scheduler could not be resumed: %r", exc)


def _mark_dead(engine: Any) -> None:
    """Mark ``engine`` dead as vLLM's own watch of its engine core does: new requests are
    refused with ``EngineDeadError`` from then on."""
    try:
        engine.engine_core.resources.engine_dead = True
    except AttributeError:
        pass


def _end_requests(engine: Any) -> None:
    """Hand ``EngineDeadError`` to every request waiting on ``engine`` (in the server's event
    loop)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    processor = getattr(engine, "output_processor", None)
    if processor is not None:
        try:
            processor.propagate_error(EngineDeadError())
        except Exception as exc:  # noqa: BLE001 - the requests then meet the death themselves
            log.warning("ftkit: telling the dead engine's requests: %s", exc)


def _shut_down(engine: Any) -> None:
    """End what is left of a dead engine: its engine core client (which reaps the engine's
    processes) and its output loop. Not its renderer: the server's handlers took the first
    engine's renderer (tokenizer, chat templates) when they were built, and keep using it;
    ``RestartingEngine.shutdown`` ends it with the server."""
    from vllm.utils.async_utils import cancel_task_threadsafe

    try:
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        handler = getattr(engine, "output_handler", None)
        if handler is not None:
            cancel_task_threadsafe(handler)
    except Exception as exc:  # noqa: BLE001 - it is dead already
        log.warning("ftkit: ending the dead engine: %s", exc)


def _death_of(engine: Any) -> str:
    try:
        return str(engine.dead_error)
    except Exception:  # noqa: BLE001 - only for the log line
        return "engine dead"


class _Request:
    """One request's life across engines: what its client got, and how to go on."""

    def __init__(self, prompt: Any, params: Any, request_id: str) -> None:
        self.prompt = prompt
        self.params = params
        self.request_id = request_id
        self.prompt_ids: list[int] | None = None
        self.prompt_text: str | None = None
        self.completions: dict[int, _Completion] = {}
        self.attempts = 0
        #: The engine the request runs on now, and whether it had an output from it.
        self.engine: Any = None
        self.went_on = False
        #: The engine this request's last part was sent to (``RestartingEngine._let_go``).
        self.sent_to: Any = None

    def delivered(self) -> int:
        return sum(len(c.token_ids) for c in self.completions.values())

    async def run(self, engine: Any, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """The request's outputs from ``engine``: from its prompt the first time (or when its
        client saw nothing yet), else from where each completion stopped."""
        self.attempts += 1
        from vllm.sampling_params import RequestOutputKind

        kind = self.params.output_kind
        if self.prompt_ids is None or not self.delivered() \
                or kind == RequestOutputKind.FINAL_ONLY:
            self.sent_to = engine
            async for out in engine.generate(self.prompt, self.params, self.request_id,
                                             **kwargs):
                yield self._take_first(out, kind)
            return
        pending = [c for c in self._all_completions() if not c.finished]
        if not pending:
            return
        streams = [self._resumed(engine, c, kwargs, len(pending) > 1 or self.params.n > 1)
                   for c in pending]
        self.sent_to = engine
        async for out in _merged(streams):
            yield out

    def _all_completions(self) -> list[_Completion]:
        for i in range(int(self.params.n or 1)):
            self.completions.setdefault(i, _Completion(i))
        return [self.completions[i] for i in sorted(self.completions)]

    def _take_first(self, out: Any, kind: Any) -> Any:
        """Note what an output of the request's first run delivers; it goes out unchanged."""
        from vllm.sampling_params import RequestOutputKind

        if self.prompt_ids is None and out.prompt_token_ids is not None:
            self.prompt_ids = list(out.prompt_token_ids)
            self.prompt_text = out.prompt
        for completion in out.outputs:
            seen = self.completions.setdefault(completion.index, _Completion(completion.index))
            new_ids = list(completion.token_ids)
            new_lps = list(completion.logprobs or [])
            if kind == RequestOutputKind.CUMULATIVE:
                seen.token_ids, seen.logprobs, seen.text = new_ids, new_lps, completion.text
            else:
                seen.token_ids += new_ids
                seen.logprobs += new_lps
                seen.text += completion.text
            seen.finished = completion.finish_reason is not None
        return out

    async def _resumed(self, engine: Any, completion: _Completion, kwargs: dict[str, Any],
                       several: bool) -> AsyncIterator[Any]:
        """Completion ``completion`` going on on ``engine`` as a request of its own."""
        from vllm.inputs import TokensPrompt

        from ftkit.vllm.workload import _Shadow

        assert self.prompt_ids is not None
        params = self._params_after(completion, several)
        if params is None:
            return
        produced = len(completion.token_ids)
        engine_id = (f"{completion.index}_{self.request_id}" if several else self.request_id)
        if completion.shadow is None:
            completion.shadow = _Shadow(engine.get_tokenizer(), self.prompt_ids,
                                        self._shadow_params(completion.index, several),
                                        completion.token_ids)
        rid = served_resume_id(engine_id, produced)
        completion.engine_seen = 0
        prompt = TokensPrompt(prompt_token_ids=self.prompt_ids + completion.token_ids)
        async for out in engine.generate(prompt, params, rid, **kwargs):
            translated = self._translate(out, completion)
            if translated is not None:
                yield translated
            if completion.finished:
                return  # (a stop string across the restart: the engine's request is aborted)

    def _params_after(self, completion: _Completion, several: bool) -> Any:
        produced = len(completion.token_ids)
        params = self.params.clone()
        if params.max_tokens is not None:
            if params.max_tokens - produced <= 0:
                completion.finished = True
                return None
            params.max_tokens -= produced
        if params.min_tokens:
            params.min_tokens = max(0, params.min_tokens - produced)
        params.prompt_logprobs = None
        params.stop = []  # looked for by the shadow, across the restart
        if several:
            params.n = 1
            if params.seed is not None:
                params.seed += completion.index
        return params

    def _shadow_params(self, index: int, several: bool) -> Any:
        params = self.params.clone()
        if several:
            params.n = 1
            if params.seed is not None:
                params.seed += index
        return params

    def _translate(self, out: Any, completion: _Completion) -> Any | None:
        """An output of a resumed completion as its client's stream goes on."""
        from vllm.sampling_params import RequestOutputKind

        [new] = out.outputs
        cumulative = self.params.output_kind == RequestOutputKind.CUMULATIVE
        fresh = list(new.token_ids)
        fresh_lps = list(new.logprobs or [])
        if cumulative:  # the engine's request repeats what it sent before
            fresh, fresh_lps = fresh[completion.engine_seen:], fresh_lps[completion.engine_seen:]
            completion.engine_seen = len(new.token_ids)
        finish, stop_reason = new.finish_reason, new.stop_reason
        keep = completion.shadow.take(fresh, finish, stop_reason)
        if keep is not None:
            fresh, fresh_lps = fresh[:keep], fresh_lps[:keep]
            finish, stop_reason = "stop", completion.shadow.stop_string
        # The text the client may see now (the detokenizer holds back the end of the text
        # that could still begin a stop string, as the original request's did), and what of
        # it the client does not have yet.
        visible = completion.shadow.visible_text(finished=finish is not None)
        text_delta = visible[len(completion.text):]
        completion.token_ids += fresh
        completion.logprobs += fresh_lps
        completion.text = visible
        completion.finished = finish is not None
        if not fresh and finish is None and not text_delta:
            return None
        if cumulative:
            tokens, lps, text = list(completion.token_ids), list(completion.logprobs), visible
        else:
            tokens, lps, text = fresh, fresh_lps, text_delta
        result = copy.copy(out)
        result.request_id = self.request_id
        result.prompt_token_ids = self.prompt_ids
        result.prompt = self.prompt_text
        result.prompt_logprobs = None
        result.finished = self._all_finished()
        result.outputs = [dataclasses.replace(
            new, index=completion.index, token_ids=tokens,
            logprobs=lps if new.logprobs is not None else None, text=text,
            finish_reason=finish, stop_reason=stop_reason)]
        return result

    def _all_finished(self) -> bool:
        return all(c.finished for c in self._all_completions())


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of ``streams`` as they come; closing this closes every one of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def drain(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, done, exc))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            _, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()


def install() -> None:
    """Make ``AsyncLLM.from_vllm_config`` give a ``RestartingEngine`` to an engine whose
    ``fault_tolerance`` says ``max_restarts`` (in the API server process only; the plugin
    calls this there)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from ftkit.vllm.plugin import WRAPPED_MARK, recovery_settings

    original = AsyncLLM.__dict__["from_vllm_config"].__func__
    if getattr(original, WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def from_vllm_config(cls: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        config = recovery_settings(vllm_config)
        if config is None or not config.enabled:
            return original(cls, vllm_config, *args, **kwargs)
        if not config.max_restarts:
            engine = original(cls, vllm_config, *args, **kwargs)
            remove_at_exit(_Processes.of(engine).shared_memory)
            return engine

        from ftkit.vllm.replicas import independent_replicas, start_replicas

        if independent_replicas(vllm_config, kwargs):
            return start_replicas(original, cls, vllm_config, args, kwargs, config)

        # Each engine after the first starts from a copy of the configuration as it was
        # before any start: vLLM writes into it while it starts an engine (with data
        # parallelism, the devices of the last replica it started), and a second engine
        # started from the written one fails ("--device-ids provides 1 devices").
        pristine = copy.deepcopy(vllm_config)
        first = [True]

        def start(primary: bool) -> Any:
            config = vllm_config if first[0] else copy.deepcopy(pristine)
            first[0] = False
            if primary:
                return original(cls, config, *args, **kwargs)
            return original(cls, config, *args, **{**kwargs, "disable_log_stats": True})

        log.warning("ftkit: this server replaces a dead engine up to %d time(s)%s",
                    config.max_restarts, ", with a warm standby" if config.standby else "")
        return RestartingEngine(start, config)

    setattr(from_vllm_config, WRAPPED_MARK, True)
    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)
