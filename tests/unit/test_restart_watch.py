"""The server's watch of its engine's processes (``ftkit.vllm.restart``): it sees a worker of
the engine core die at once (vLLM sees it seconds later), and hands the death to every request
still waiting on the dead engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from ftkit import procs
from ftkit.config import RecoveryConfig
from ftkit.vllm import restart

#: A stand-in engine core: a process with two children named as vLLM names its workers (the
#: process title is what ``psutil`` reads) and one helper child of another name.
#: The first worker maps a segment of shared memory of its own, as vLLM's first CPU worker
#: of a group does (it creates the group's segments, and removes them when it closes).
CORE = r"""
import subprocess, sys, time
code = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(120)"
segment = ("import mmap, os, sys; fd = os.open(sys.argv[2], os.O_CREAT | os.O_RDWR, 0o600); "
           "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); os.close(fd); ")
kids = [subprocess.Popen([sys.executable, "-c", (segment if name.endswith("TP0") else "") + code,
                          name, sys.argv[1]])
        for name in ("VLLM::Worker_TP0", "VLLM::Worker_TP1", "helper")]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


#: The stand-in's segment.
SEGMENT = f"{procs.SHM_DIR}ftkit-test-restart-watch-{os.getpid()}"


@pytest.fixture
def core():
    proc = subprocess.Popen([sys.executable, "-c", CORE, SEGMENT], stdout=subprocess.PIPE,
                            text=True)
    pids: list[int] = []
    try:
        pids += [int(p) for p in proc.stdout.readline().split()]
        deadline = time.monotonic() + 30
        while not (all("Worker" in psutil.Process(p).name() for p in pids[:2])
                   and SEGMENT in procs.shared_memory_files([psutil.Process(pids[0])])):
            assert time.monotonic() < deadline, "the stand-in workers did not start"
            time.sleep(0.05)
        yield proc, pids
    finally:
        if os.path.exists(SEGMENT):
            os.unlink(SEGMENT)
        for pid in pids:  # ours, by id (orphaned once the stand-in core is killed)
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def engine_of(pid: int) -> SimpleNamespace:
    manager = SimpleNamespace(processes=[SimpleNamespace(pid=pid)])
    return SimpleNamespace(engine_core=SimpleNamespace(
        resources=SimpleNamespace(engine_manager=manager, engine_dead=False)))


def test_the_watch_sees_a_killed_worker(core):
    proc, (w0, w1, helper) = core
    watched = restart._Processes.of(engine_of(proc.pid))
    assert sorted(p.pid for p in watched.processes) == sorted([proc.pid, w0, w1])
    assert not watched.one_died()
    os.kill(helper, signal.SIGKILL)  # not a worker: not the engine's death
    time.sleep(0.2)
    assert not watched.one_died()
    os.kill(w1, signal.SIGKILL)  # a zombie until its parent reaps it: dead all the same
    deadline = time.monotonic() + 10
    while not watched.one_died():
        assert time.monotonic() < deadline, "the watch did not see the killed worker"
        time.sleep(0.05)
    assert watched.dead == f"pid {w1}"


def test_the_watch_sees_a_killed_engine_core(core):
    proc, _ = core
    watched = restart._Processes.of(engine_of(proc.pid))
    proc.kill()
    proc.wait(10)
    assert watched.one_died() and watched.dead == f"pid {proc.pid}"


def test_a_dead_engines_processes_are_ended(core):
    proc, (w0, w1, helper) = core
    watched = restart._Processes.of(engine_of(proc.pid))
    assert sorted(p.pid for p in watched.workers) == sorted([w0, w1])
    os.kill(w1, signal.SIGKILL)  # the death; w0 and the core live on
    watched.end()
    deadline = time.monotonic() + 10
    while psutil.Process(w0).status() != psutil.STATUS_ZOMBIE or proc.poll() is None:
        assert time.monotonic() < deadline, "the surviving worker or the core was not ended"
        time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL
    # A process that is not the engine's (neither its core nor a worker) is left alone.
    assert procs.alive(psutil.Process(helper))


@pytest.mark.skipif(not os.path.isdir(procs.SHM_DIR), reason="no /dev/shm on this system")
def test_a_dead_engines_shared_memory_is_removed_when_it_is_ended(core):
    proc, (w0, w1, helper) = core
    engine = engine_of(proc.pid)
    server = restart.RestartingEngine(lambda primary: engine, RecoveryConfig(max_restarts=1))
    assert SEGMENT in server._processes_of(engine).shared_memory
    os.kill(w0, signal.SIGKILL)  # the segment's maker: nothing of vLLM's removes it now
    deadline = time.monotonic() + 10
    while procs.alive(psutil.Process(w0)):
        assert time.monotonic() < deadline, "the killed worker did not end"
        time.sleep(0.05)
    assert os.path.exists(SEGMENT)  # without ftkit's clean-up it stays (the crippled case)
    server._end_dead(engine)
    assert not os.path.exists(SEGMENT)
    # The engine is forgotten: a second end (or a new engine's) removes nothing of it again.
    assert server._processes_of(engine).shared_memory == set()


def test_an_engine_without_local_processes_is_left_to_vllms_own_watch():
    assert restart._Processes.of(SimpleNamespace()).processes == []
    assert not restart._Processes([]).one_died()


def test_a_dead_engine_is_marked_and_its_waiting_requests_are_told():
    from vllm.v1.engine.exceptions import EngineDeadError

    told: list[BaseException] = []
    engine = engine_of(1)
    engine.output_processor = SimpleNamespace(propagate_error=told.append)
    restart._mark_dead(engine)
    assert engine.engine_core.resources.engine_dead is True
    restart._end_requests(engine)
    assert len(told) == 1 and isinstance(told[0], EngineDeadError)


def test_behind_a_standby_the_dead_engine_is_ended_once_its_requests_went_on(monkeypatch):
    import asyncio

    dead, new = engine_of(1), engine_of(2)
    server = restart.RestartingEngine(lambda primary: new, RecoveryConfig(max_restarts=1))
    ended: list[float] = []
    monkeypatch.setattr(server, "_end_dead", lambda engine: ended.append(time.monotonic()))
    waiting = restart._Request(None, None, "a")
    waiting.engine = dead
    elsewhere = restart._Request(None, None, "b")  # on the new engine already: not waited for
    elsewhere.engine = new
    server._requests |= {waiting, elsewhere}

    async def run() -> float:
        behind = asyncio.ensure_future(server._end_dead_behind(dead))
        await asyncio.sleep(0.3)
        assert not ended, "the dead engine was ended before its request went on"
        waiting.engine = new  # resumed on the new engine ...
        await asyncio.sleep(0.2)
        assert not ended, "the dead engine was ended before the resumed request's output"
        went_on = time.monotonic()
        waiting.went_on = True  # ... and its first output from it went out
        await asyncio.wait_for(behind, 5)
        return went_on

    went_on = asyncio.run(run())
    assert len(ended) == 1 and ended[0] >= went_on


def test_behind_a_standby_the_dead_engine_is_ended_after_the_grace_at_most(monkeypatch):
    import asyncio

    dead, new = engine_of(1), engine_of(2)
    server = restart.RestartingEngine(lambda primary: new, RecoveryConfig(max_restarts=1))
    stuck = restart._Request(None, None, "a")
    stuck.engine = dead  # never goes on
    server._requests.add(stuck)
    ended: list[tuple[Any, float, bool]] = []
    monkeypatch.setattr(server, "_end_dead", lambda engine: ended.append(
        (engine, time.monotonic(), stuck.engine is dead and not stuck.went_on)))
    monkeypatch.setattr(restart, "DEAD_ENGINE_GRACE_S", 0.3)
    began = time.monotonic()
    # At most the grace: the product's bound, with generous slack for a loaded machine.
    asyncio.run(asyncio.wait_for(server._end_dead_behind(dead), 10))
    # Ended once, while its request was still stuck on it, and not before the grace ran out.
    [(engine, at, still_stuck)] = ended
    assert engine is dead and still_stuck
    assert at - began >= 0.3


def test_a_new_engine_is_handed_to_the_hooks_before_any_request_goes_on(monkeypatch):
    """``on_replaced`` (the injection route's ``replan``) runs with the new engine before the
    replacement completes, so before a waiting request is resumed there; a hook that fails
    is logged and the new engine serves regardless."""
    import asyncio

    first, new = engine_of(1), engine_of(2)
    engines = iter([first, new])
    server = restart.RestartingEngine(lambda primary: next(engines),
                                      RecoveryConfig(max_restarts=1))
    monkeypatch.setattr(server, "_end_dead", lambda engine: None)
    monkeypatch.setattr(restart, "_end_requests", lambda engine: None)
    seen: list[tuple[Any, Any]] = []

    async def hook(engine: Any) -> None:
        seen.append((engine, server._engine))

    async def failing(engine: Any) -> None:
        raise RuntimeError("the route could not plan")

    server.on_replaced += [failing, hook]
    assert asyncio.run(server._replaced(first)) is True
    # The hook had the new engine while the server still named the dead one (requests wait
    # on the replacement until it completes); then the new engine serves.
    assert seen == [(new, first)] and server._engine is new


def _holdable(engine: SimpleNamespace, calls: list[tuple[str, float]]) -> SimpleNamespace:
    """``engine`` with vLLM's pause and resume, noting each call and when."""

    async def pause_generation(*, mode: str, clear_cache: bool) -> None:
        assert (mode, clear_cache) == ("keep", False)
        calls.append(("pause", time.monotonic()))

    async def resume_generation() -> None:
        calls.append(("resume", time.monotonic()))

    engine.pause_generation, engine.resume_generation = pause_generation, resume_generation
    return engine


def _replacing(monkeypatch: Any, calls: list[tuple[str, float]], restarts: int = 1
               ) -> tuple[Any, SimpleNamespace, SimpleNamespace]:
    """A server whose engine, once dead, is replaced by one that notes its pause and resume
    in ``calls`` (nothing of the dead one is ended): (server, first engine, the new one)."""
    first, new = engine_of(1), _holdable(engine_of(2), calls)
    engines = iter([first, new])
    server = restart.RestartingEngine(lambda primary: next(engines),
                                      RecoveryConfig(max_restarts=restarts))
    monkeypatch.setattr(server, "_end_dead", lambda engine: None)
    monkeypatch.setattr(restart, "_end_requests", lambda engine: None)
    return server, first, new


def test_the_requests_resumed_on_a_new_engine_go_into_its_first_step_together(monkeypatch):
    """The new engine's scheduler is held from before it serves until every request that
    waited on the dead engine has gone to it: their resumed prefills then share one first
    step (crippled: not held, the first to arrive ran a step of its own, and the cold
    replacement's streams had their next outputs 0.2 s apart). The hold ends when the last
    one went, and within ``HOLD_FOR_RESUMES_S`` if one never goes."""
    import asyncio

    calls: list[tuple[str, float]] = []
    server, first, new = _replacing(monkeypatch, calls, restarts=2)
    a, b = restart._Request(None, None, "a"), restart._Request(None, None, "b")
    a.engine = b.engine = first
    server._requests |= {a, b}

    async def run() -> float:
        assert await server._replaced(first) is True
        assert [c for c, _ in calls] == ["pause"] and server._engine is new
        a.sent_to = new
        await asyncio.sleep(0.1)
        assert [c for c, _ in calls] == ["pause"], "resumed before every request went"
        sent = time.monotonic()
        b.sent_to = new
        await asyncio.gather(*server._ending)
        return sent

    sent = asyncio.run(run())
    assert [c for c, _ in calls] == ["pause", "resume"] and calls[1][1] >= sent

    # One that never goes (its client left, say) holds the engine no longer than the bound.
    calls.clear()
    third = _holdable(engine_of(3), calls)
    server._start = lambda primary: third
    stuck = restart._Request(None, None, "c")
    stuck.engine = new
    server._requests, server._ending = {stuck}, set()
    monkeypatch.setattr(restart, "HOLD_FOR_RESUMES_S", 0.3)

    async def bounded() -> None:
        assert await server._replaced(new) is True
        await asyncio.wait_for(asyncio.gather(*server._ending), 5)

    began = time.monotonic()
    asyncio.run(bounded())
    assert [c for c, _ in calls] == ["pause", "resume"]
    assert 0.3 <= calls[1][1] - began < 3


def test_a_new_engine_with_no_request_waiting_is_not_held(monkeypatch):
    import asyncio

    calls: list[tuple[str, float]] = []
    server, first, new = _replacing(monkeypatch, calls)
    assert asyncio.run(server._replaced(first)) is True
    assert calls == [] and server._engine is new


def test_a_hold_that_fails_is_undone_and_the_resumes_go_in_unheld(monkeypatch):
    """A pause that times out may still have reached the engine core: it is resumed at once
    (crippled: left, the new engine would never schedule a request), and the replacement
    goes on without the hold."""
    import asyncio

    calls: list[tuple[str, float]] = []
    server, first, new = _replacing(monkeypatch, calls)

    async def slow_pause(*, mode: str, clear_cache: bool) -> None:
        calls.append(("pause", time.monotonic()))
        await asyncio.sleep(10)

    new.pause_generation = slow_pause
    monkeypatch.setattr(restart, "HOLD_CALL_TIMEOUT_S", 0.2)
    waiting = restart._Request(None, None, "a")
    waiting.engine = first
    server._requests.add(waiting)
    assert asyncio.run(server._replaced(first)) is True
    assert [c for c, _ in calls] == ["pause", "resume"] and server._engine is new
    assert not server._ending  # no hold to end


# --- the warm standby ------------------------------------------------------------------------

def _until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def _with_standby(monkeypatch: Any, engines: list[Any], restarts: int = 1
                  ) -> tuple[Any, list[Any]]:
    """A server started with a standby (``engines``: the serving engine, the standby, then
    any started later), its standby ready (no event loop: no warm-up request); the engines
    it ended are noted, not ended."""
    started = iter(engines)
    server = restart.RestartingEngine(lambda primary: next(started),
                                      RecoveryConfig(max_restarts=restarts, standby=True))
    ended: list[Any] = []
    monkeypatch.setattr(server, "_end_dead", ended.append)
    monkeypatch.setattr(restart, "_end_requests", lambda engine: None)
    server._standby_thread.join(10)
    return server, ended


def test_a_standby_that_died_never_takes_over(monkeypatch, core):
    """Issue 39's first defect: the ready standby's process killed, then the serving engine
    dies. The replacement sees the standby unfit, ends it and starts a new engine (within the
    same restart); crippled (the standby taken because it exists, as before), the requests
    went to the dead standby and the server ended with its restarts used up."""
    import asyncio

    proc, (w0, w1, _helper) = core
    first, standby, cold = engine_of(1), engine_of(proc.pid), engine_of(2)
    server, ended = _with_standby(monkeypatch, [first, standby, cold])
    assert server.standby_state == "ready" and server._standby_ready()
    os.kill(w1, signal.SIGKILL)
    _until(lambda: not server._standby_ready())
    assert asyncio.run(server._replaced(first)) is True
    assert server._engine is cold  # a cold start, not the dead standby
    assert standby in ended and first in ended  # both ended; the cold start came after them
    assert server.standbys_lost == 1 and server.restarts == 1
    assert server.standby_state == "none"  # no restart left to back with a standby


def test_a_standby_that_dies_while_it_waits_is_replaced(monkeypatch, core):
    """The watch looks at the standby too: a ready standby that died is ended and another
    started (no restart used: the serving engine serves on)."""
    import asyncio

    proc, (w0, _w1, _helper) = core
    first, standby, second = engine_of(1), engine_of(proc.pid), engine_of(2)
    server, ended = _with_standby(monkeypatch, [first, standby, second])
    asyncio.run(server._watch_standby())
    assert server._standby is standby and ended == []  # alive: left alone
    os.kill(proc.pid, signal.SIGKILL)  # its engine core
    proc.wait(10)
    asyncio.run(server._watch_standby())
    assert ended == [standby] and server.standbys_lost == 1
    server._standby_thread.join(10)
    assert server._standby is second and server.standby_state == "ready"
    assert server.restarts == 0


def test_a_standby_whose_warm_up_failed_is_no_standby(monkeypatch):
    import asyncio

    first, standby, cold = engine_of(1), engine_of(2), engine_of(1)
    monkeypatch.setattr(restart.RestartingEngine, "_warm_up", lambda self, engine: False)
    server, ended = _with_standby(monkeypatch, [first, standby, cold])
    assert ended == [standby] and server._standby is None
    assert server.standby_state == "none" and server.standbys_lost == 1
    assert asyncio.run(server._replaced(first)) is True
    assert server._engine is cold and ended == [standby, first]


def test_an_errored_standby_is_unfit():
    engine = engine_of(1)
    processes = restart._Processes([])
    assert restart._unfit(engine, processes) is None
    engine.errored = True
    assert "errored" in restart._unfit(engine, processes)


def test_the_health_view_says_where_the_standby_is_and_the_restarts_left():
    from ftkit.serve import health

    server = SimpleNamespace(errored=False, restarting=False, restarts=1, max_restarts=3,
                             resumed_requests=2, standby_state="warming", standbys_lost=1)
    view = health.ServerHealth(server, 1, None).health().to_json()
    assert (view["status"], view["restarts_left"], view["standby"]) == ("healthy", 2,
                                                                        "warming")
    plain = health.ServerHealth(SimpleNamespace(errored=False), 1, None).health().to_json()
    assert "standby" not in plain and "restarts_left" not in plain
    samples = {m.name: m.samples[0].value for m in health.families(
        health.EngineSummary.of([]), standby_ready=True, standbys_lost=1)
        if m.name in ("ftkit_standby_ready", "ftkit_standbys_lost")}
    assert samples == {"ftkit_standby_ready": 1, "ftkit_standbys_lost": 1}
