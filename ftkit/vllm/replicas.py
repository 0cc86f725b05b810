"""Data-parallel replicas of a dense model that die and are replaced one at a time.

``vllm serve --data-parallel-size N`` with a dense model runs N independent replicas, each an
engine core with its own workers (vLLM treats each as an engine of data-parallel size 1,
``ParallelConfig.reconfigure_for_independent_dp_rank``), but gives the API server one client
of all of them: when one replica's engine core or worker dies, that client is dead, every
request on every replica fails, and a replacement has to start every replica again.

With ``max_restarts`` in ``fault_tolerance``, ftkit's plugin hands such a server a
``ReplicatedEngine`` instead: one ``RestartingEngine`` per replica, each the client of that
replica alone. A replica's engine is started as vLLM starts an engine of data-parallel rank
``i`` in offline mode (``replica_config``): its engine core is ``EngineCore_DP<i>``, its
ranks are bound to the cores (CPU) or devices (CUDA: vLLM's worker offsets its device by the
local data-parallel rank) of replica ``i``, its workers say ``data_parallel_index`` ``i``
(ftkit numbers their ranks ``i * W + r`` across the server, as with vLLM's own client). So:

* a fault in one replica is recovered in place there, as before;
* a killed replica (its engine core or a worker) is replaced alone, from the configuration it
  was first started from, and only its own requests are resumed; the other replicas' streams
  never stop;
* requests go to the replica with the fewest requests in flight (ties to the lowest index),
  of those serving now: a replica being replaced gets none while another serves. vLLM's own
  balancer also counts requests in flight per engine.

vLLM's ``/metrics`` series come from one stat logger manager of the server's, labelled by
replica (``engine``) as with vLLM's own client: every replica's engine is started with
statistics on but without vLLM's default loggers (a replica's own Prometheus logger would
unregister the server's series), and its outputs are recorded by the server's manager
(``ReplicatedEngine.adopt``), also after a replacement.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger("ftkit")

#: The calls that change or ask every engine: made on each replica (in replica order; a list
#: of answers where there is one per replica, ``collective_rpc``'s answers concatenated).
_ON_EVERY_REPLICA = frozenset({
    "pause_generation", "resume_generation", "reset_prefix_cache", "reset_mm_cache",
    "reset_encoder_cache", "sleep", "wake_up", "release_kv_cache_memory", "start_profile",
    "stop_profile", "add_lora", "remove_lora", "pin_lora",
})


def independent_replicas(vllm_config: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a server's engine is N > 1 independent data-parallel replicas that ftkit
    replaces one at a time (``start_replicas``): a dense model's, with this API server
    the only client of its engines (vLLM starts them itself: no ``client_addresses``)."""
    parallel = vllm_config.parallel_config
    return (int(getattr(parallel, "data_parallel_size", 1) or 1) > 1
            and not getattr(vllm_config.model_config, "is_moe", False)
            and not kwargs.get("client_addresses")
            and getattr(parallel, "data_parallel_backend", "mp") == "mp")


def replica_config(pristine: Any, index: int) -> Any:
    """A copy of ``pristine`` (a server's ``VllmConfig`` with data-parallel size N, as it
    was before vLLM started anything) for replica ``index`` alone: an engine of
    data-parallel size 1 and rank ``index`` in vLLM's offline mode (its local rank set).
    vLLM's client of it then manages engine ``index`` only, and the engine core it starts
    runs as data-parallel rank ``index`` of independent replicas: its process title, its
    ``data_parallel_index``, the cores its ranks are bound to (``VLLM_CPU_OMP_THREADS_BIND``'s
    entries of replica ``index``) and, on CUDA, its devices are those vLLM's own
    data-parallel engine ``index`` has."""
    config = copy.deepcopy(pristine)
    parallel = config.parallel_config
    parallel.data_parallel_size = 1
    parallel.data_parallel_size_local = 1
    parallel.data_parallel_rank = index
    parallel.data_parallel_rank_local = index
    parallel.data_parallel_index = index
    return config


class ReplicatedEngine:
    """The engine client of a server with N data-parallel replicas: one
    ``RestartingEngine`` per replica (see the module)."""

    def __init__(self, replicas: list[Any], vllm_config: Any,
                 statistics: Any = None) -> None:
        self.replicas = replicas
        #: The server's configuration (data-parallel size N): what the server and ftkit's
        #: routes read (a replica's own says size 1).
        self.vllm_config = vllm_config
        #: The server's stat logger manager (vLLM's ``StatLoggerManager`` of every replica's
        #: engine index), ``None`` with statistics off.
        self.statistics = statistics
        self._in_flight = [0] * len(replicas)
        #: Where the turn for a tie starts: after the replica chosen last.
        self._turn = 0
        #: Which replica serves each request in flight, by the client's request id.
        self._serving: dict[str, int] = {}
        #: Awaited with each new engine of any replica (``RestartingEngine.on_replaced``).
        self.on_replaced: list[Callable[[Any], Any]] = []
        for replica in replicas:
            replica.on_replaced = self.on_replaced
            self.adopt(replica.engine)
        self.on_replaced.append(self._adopt_new)

    def adopt(self, engine: Any) -> None:
        """Record ``engine``'s statistics with the server's manager (before its first request
        is served; vLLM's output loop reads the manager through ``_logger_ref``, a list made
        to be updated)."""
        if self.statistics is None:
            return
        engine.logger_manager = self.statistics
        ref = getattr(engine, "_logger_ref", None)
        if isinstance(ref, list) and ref:
            ref[0] = self.statistics

    async def _adopt_new(self, engine: Any) -> None:
        self.adopt(engine)

    def __getattr__(self, name: str) -> Any:
        if name in _ON_EVERY_REPLICA:
            return _on_every(self.replicas, name)
        return getattr(self.replicas[0], name)

    # --- what the server asks of the whole ---------------------------------------------------

    @property
    def errored(self) -> bool:
        """Dead for good: every replica is (none has a restart left). A replica dead for good
        alone is left out of the balancing: the server serves on with the others (vLLM's
        server ends itself once its client says this)."""
        return all(r.errored for r in self.replicas)

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def restarting(self) -> bool:
        return any(r.restarting for r in self.replicas)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    @property
    def resumed_requests(self) -> int:
        return sum(r.resumed_requests for r in self.replicas)

    @property
    def restart_seconds(self) -> list[float]:
        return [s for r in self.replicas for s in r.restart_seconds]

    @property
    def dead_error(self) -> BaseException:
        for replica in self.replicas:
            if replica.errored:
                return replica.dead_error
        return self.replicas[0].dead_error

    async def check_health(self) -> None:
        """Healthy while a replica serves (see ``errored``); the first replica's error
        otherwise."""
        errors = []
        for replica in self.replicas:
            try:
                await replica.check_health()
                return
            except Exception as exc:  # noqa: BLE001 - vLLM's own, handed on if all fail
                errors.append(exc)
        raise errors[0]

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Every rank of every replica, in the order of their ranks across the server."""
        answers: list[Any] = []
        for replica in self.replicas:
            answers += await replica.collective_rpc(method, timeout=timeout, args=args,
                                                    kwargs=kwargs)
        return answers

    def shutdown(self, timeout: float | None = None) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout=timeout)

    async def do_log_stats(self) -> None:
        if self.statistics is not None:
            self.statistics.log()

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    # --- requests -----------------------------------------------------------------------------

    def _least_busy(self) -> int:
        """The replica with the fewest requests in flight, of those that serve now: not
        being replaced (a request sent there waits for the new engine) and not dead for
        good; ties taken in turn, so that requests that come one at a time (each done before
        the next) alternate. When none serves, one being replaced; when all are dead for
        good, any (the request then fails as vLLM's would)."""
        serving = [i for i, r in enumerate(self.replicas) if not r.errored and not r.restarting]
        replacing = [i for i, r in enumerate(self.replicas) if r.restarting]
        choice = serving or replacing or range(len(self.replicas))
        count = len(self.replicas)
        index = min(choice, key=lambda i: (self._in_flight[i], (i - self._turn) % count))
        self._turn = (index + 1) % count
        return index

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       **kwargs: Any) -> AsyncIterator[Any]:
        index = self._least_busy()
        self._in_flight[index] += 1
        self._serving[request_id] = index
        counted = True

        def done() -> None:
            nonlocal counted
            if counted:
                counted = False
                self._in_flight[index] -= 1
                if self._serving.get(request_id) == index:
                    del self._serving[request_id]

        try:
            async for out in self.replicas[index].generate(prompt, sampling_params,
                                                           request_id, **kwargs):
                if getattr(out, "finished", False):
                    # Its last output: no longer in flight. (A consumer may stop at the
                    # finished output and leave this generator to be closed when it is
                    # collected, which is late.)
                    done()
                yield out
        finally:
            done()

    async def abort(self, request_id: Any, internal: bool = False) -> None:
        """Abort on the replica serving each request (every replica for an unknown one)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for index, replica in enumerate(self.replicas):
            mine = [i for i in ids if self._serving.get(i, index) == index]
            if mine:
                await replica.abort(mine, internal)

    def serving(self, request_id: str) -> int | None:
        """The replica serving ``request_id`` now (``None``: none, or finished)."""
        return self._serving.get(request_id)


def _on_every(replicas: list[Any], name: str) -> Callable[..., Any]:
    """``name`` called on every replica in turn: a coroutine function whose answer is the
    replicas' answers in a list (``None`` when none answered anything; whether all said yes
    where each answered yes or no)."""

    async def call(*args: Any, **kwargs: Any) -> Any:
        answers = []
        for replica in replicas:
            answer = getattr(replica, name)(*args, **kwargs)
            if asyncio.iscoroutine(answer):
                answer = await answer
            answers.append(answer)
        if all(a is None for a in answers):
            return None
        if all(isinstance(a, bool) for a in answers):
            return all(answers)
        return answers

    return call


def quiet_stat_logger() -> Any:
    """A vLLM stat logger factory whose logger does nothing: given to a replica's engine, it
    keeps that engine's statistics on (a custom logger does) without a Prometheus logger of
    its own, which would unregister the server's series. vLLM adds a Prometheus logger to
    every stat logger manager unless a custom one is one: this one is, registering
    nothing."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class QuietStatLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:
            pass  # (no series registered)

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return QuietStatLogger


def start_replicas(original: Callable[..., Any], cls: Any, vllm_config: Any, args: tuple,
                   kwargs: dict[str, Any], config: Any) -> ReplicatedEngine:
    """The ``ReplicatedEngine`` of a server whose ``vllm_config`` asks for N data-parallel
    replicas of a dense model: N ``RestartingEngine`` objects, replica ``i`` started (and
    restarted) by ``original`` (vLLM's ``AsyncLLM.from_vllm_config``) from
    ``replica_config(pristine, i)``, then the server's stat logger manager."""
    from ftkit.vllm.restart import RestartingEngine

    pristine = copy.deepcopy(vllm_config)
    size = int(vllm_config.parallel_config.data_parallel_size)
    statistics_on = not kwargs.get("disable_log_stats", False)
    custom = list(kwargs.get("stat_loggers") or [])
    # Statistics wanted: each engine keeps them, for the server's manager to record.
    engine_kwargs = ({**kwargs, "disable_log_stats": True, "stat_loggers": [quiet_stat_logger()]}
                     if statistics_on or custom else kwargs)

    def starter(index: int) -> Callable[[bool], Any]:
        def start(primary: bool) -> Any:
            return original(cls, replica_config(pristine, index), *args, **engine_kwargs)
        return start

    log.warning("ftkit: this server runs %d data-parallel replicas, each replaced alone when "
                "it dies (up to %d time(s) each)%s", size, config.max_restarts,
                ", each with a warm standby" if config.standby else "")
    replicas = [RestartingEngine(starter(i), config, replica=i)
                for i in range(size)]
    statistics = None
    if statistics_on or custom:
        from vllm.v1.metrics.loggers import StatLoggerManager

        statistics = StatLoggerManager(
            vllm_config=vllm_config, engine_idxs=list(range(size)),
            custom_stat_loggers=custom or None, enable_default_loggers=statistics_on,
            aggregate_engine_logging=bool(kwargs.get("aggregate_engine_logging", False)))
        statistics.log_engine_initialized()
    return ReplicatedEngine(replicas, vllm_config, statistics)
