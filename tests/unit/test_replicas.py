"""The data-parallel replicas' client (``ftkit.vllm.replicas``): each replica's configuration,
the balancing, what goes to every replica, and a replica dead for good. The replicas here are
stand-ins with the ``RestartingEngine`` attributes the client reads; the real server is
``tests/serve/test_serve_dp.py``."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

import pytest

from ftkit.vllm.replicas import ReplicatedEngine, independent_replicas, replica_config


class Replica:
    def __init__(self, index: int) -> None:
        self.index = index
        self.errored = False
        self.is_running = True
        self.restarting = False
        self.restarts = 0
        self.resumed_requests = 0
        self.restart_seconds: list[float] = []
        self.on_replaced: list[Any] = []
        self.engine = SimpleNamespace(logger_manager=None, _logger_ref=[None])
        self.calls: list[tuple] = []
        self.release = asyncio.Event()

    async def generate(self, prompt, params, request_id, **kwargs):
        self.calls.append(("generate", request_id))
        yield (self.index, request_id)
        await self.release.wait()

    async def abort(self, ids, internal=False):
        self.calls.append(("abort", tuple(ids)))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [f"{method}@{self.index}.{r}" for r in range(2)]

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    async def check_health(self):
        if self.errored:
            raise RuntimeError(f"replica {self.index} is dead")

    @property
    def dead_error(self):
        return RuntimeError(f"replica {self.index} is dead")


def parallel(size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_size=size, data_parallel_size_local=size,
                           data_parallel_rank=0, data_parallel_rank_local=None,
                           data_parallel_index=0, data_parallel_backend="mp",
                           tensor_parallel_size=2)


def test_a_replica_is_an_engine_of_data_parallel_rank_i_alone():
    server = SimpleNamespace(parallel_config=parallel(3), model_config=SimpleNamespace())
    pristine = copy.deepcopy(server)
    config = replica_config(server, 2)
    p = config.parallel_config
    assert (p.data_parallel_size, p.data_parallel_size_local) == (1, 1)
    # Offline mode (a local rank set): vLLM's client manages engine 2 only, and the engine
    # core runs as data-parallel rank 2 (its cores or devices, its index for ftkit's ranks).
    assert (p.data_parallel_rank, p.data_parallel_rank_local, p.data_parallel_index) == (2, 2, 2)
    assert p.tensor_parallel_size == 2
    assert server.parallel_config.__dict__ == pristine.parallel_config.__dict__  # a copy


@pytest.mark.parametrize("size, moe, kwargs, backend, replicated", [
    (2, False, {}, "mp", True),
    (1, False, {}, "mp", False),                                # one engine
    (2, True, {}, "mp", False),                                 # coupled replicas (refused)
    (2, False, {"client_addresses": {"input": "x"}}, "mp", False),  # engines not its own
    (2, False, {}, "ray", False),                               # vLLM's Ray DP backend
])
def test_which_servers_get_a_client_per_replica(size, moe, kwargs, backend, replicated):
    p = parallel(size)
    p.data_parallel_backend = backend
    config = SimpleNamespace(parallel_config=p, model_config=SimpleNamespace(is_moe=moe))
    assert independent_replicas(config, kwargs) is replicated


def run(coro):
    return asyncio.run(coro)


def test_requests_go_to_the_least_busy_replica_and_abort_goes_where_they_are():
    async def scenario():
        replicas = [Replica(0), Replica(1)]
        engine = ReplicatedEngine(replicas, SimpleNamespace())
        streams = [engine.generate("p", None, f"r{i}") for i in range(3)]
        firsts = [await s.__anext__() for s in streams]
        assert firsts == [(0, "r0"), (1, "r1"), (0, "r2")]
        assert [engine.serving(f"r{i}") for i in range(3)] == [0, 1, 0]
        await engine.abort(["r1", "r2"])
        assert ("abort", ("r2",)) in replicas[0].calls and ("abort", ("r1",)) in replicas[1].calls
        await engine.abort("unknown")  # not in flight: every replica is told
        assert all(("abort", ("unknown",)) in r.calls for r in replicas)
        # A request that ended frees its place.
        replicas[1].release.set()
        with pytest.raises(StopAsyncIteration):
            await streams[1].__anext__()
        assert engine.serving("r1") is None
        stream = engine.generate("p", None, "r3")
        assert await stream.__anext__() == (1, "r3")
        for r in replicas:
            r.release.set()
        for s in (streams[0], streams[2], stream):
            with pytest.raises(StopAsyncIteration):
                await s.__anext__()
    run(scenario())


def test_requests_that_come_one_at_a_time_alternate_between_the_replicas():
    async def scenario():
        replicas = [Replica(0), Replica(1)]
        for r in replicas:
            r.release.set()  # each request ends at once
        engine = ReplicatedEngine(replicas, SimpleNamespace())
        served = []
        for i in range(4):
            outputs = [out async for out in engine.generate("p", None, f"r{i}")]
            served.append(outputs[0][0])
        assert served == [0, 1, 0, 1]
    run(scenario())


def test_calls_on_every_replica_and_answers_in_rank_order():
    async def scenario():
        replicas = [Replica(0), Replica(1)]
        engine = ReplicatedEngine(replicas, SimpleNamespace())
        assert await engine.collective_rpc("m") == ["m@0.0", "m@0.1", "m@1.0", "m@1.1"]
        assert await engine.reset_prefix_cache() is True
        assert all(("reset_prefix_cache",) in r.calls for r in replicas)
    run(scenario())


def test_a_replica_dead_for_good_is_left_out_and_the_server_lives_on_with_the_others():
    async def scenario():
        replicas = [Replica(0), Replica(1)]
        engine = ReplicatedEngine(replicas, SimpleNamespace())
        replicas[0].errored = True
        assert not engine.errored
        await engine.check_health()  # replica 1 serves
        stream = engine.generate("p", None, "r")
        assert await stream.__anext__() == (1, "r")
        replicas[1].release.set()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        # A replica being replaced gets no request while another serves.
        replicas[0].errored, replicas[1].restarting = False, True
        stream = engine.generate("p", None, "r2")
        assert await stream.__anext__() == (0, "r2")
        replicas[0].release.set()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        replicas[0].errored, replicas[1].restarting = True, False
        replicas[1].errored = True
        assert engine.errored
        with pytest.raises(RuntimeError, match="replica 0 is dead"):
            await engine.check_health()
    run(scenario())


def test_every_replica_and_each_new_engine_record_with_the_servers_statistics():
    async def scenario():
        replicas = [Replica(0), Replica(1)]
        shared = object()
        engine = ReplicatedEngine(replicas, SimpleNamespace(), statistics=shared)
        assert all(r.engine.logger_manager is shared and r.engine._logger_ref == [shared]
                   for r in replicas)
        # Each replica's replacement hooks are the server's one list (ftkit's injection
        # route adds its own to it), which adopts the new engine first.
        assert replicas[0].on_replaced is replicas[1].on_replaced is engine.on_replaced
        new = SimpleNamespace(logger_manager="its own", _logger_ref=["its own"])
        for hook in engine.on_replaced:
            await hook(new)
        assert new.logger_manager is shared and new._logger_ref == [shared]
        replicas[1].restarts, replicas[1].resumed_requests = 1, 2
        replicas[1].restarting = True
        assert (engine.restarts, engine.resumed_requests, engine.restarting) == (1, 2, True)
    run(scenario())


def test_a_request_is_no_longer_in_flight_once_its_last_output_went_out():
    """vLLM's handlers may stop at a request's finished output and leave its generator to
    be closed when collected: its replica must count it as done at that output (a count
    left behind sent two later requests of four to one replica)."""
    class Finishing(Replica):
        async def generate(self, prompt, params, request_id, **kwargs):
            yield SimpleNamespace(finished=False)
            yield SimpleNamespace(finished=True)

    async def scenario():
        replicas = [Finishing(0), Finishing(1)]
        engine = ReplicatedEngine(replicas, SimpleNamespace())
        kept = []
        for i in range(2):
            stream = engine.generate("p", None, f"r{i}")
            kept.append(stream)  # not closed: as a handler that stopped at the last output
            while not (await stream.__anext__()).finished:
                pass
        # Both went to replica 0, each done before the next came.
        assert engine._in_flight == [0, 0] and engine.serving("r1") is None
        for stream in kept:
            await stream.aclose()
        assert engine._in_flight == [0, 0]
    run(scenario())
