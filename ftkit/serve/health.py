"""ftkit's health view and Prometheus series in a vLLM server.

ftkit's endpoint plugin (``ftkit.serve.control``) calls ``attach(app)`` from its
``attach_router`` and ``init_state`` from its ``init_state``. Both read what the server's
workers publish (``ftkit.serve.state``): small files, read when asked, never an RPC to the
workers, which would wait behind the step a recovery blocks.

``GET /ftkit/health`` (vLLM's own ``/health`` is left as it is: 200 while the engine lives,
503 once it is dead) answers::

    {"status": "healthy" | "recovering" | "restarting" | "dead",
     "recovering_since": <unix time the running round began, or null>,
     "ranks": [{"rank": 0, "recovering_since": null, "faults": {"link_break": 1},
                "rounds": {"recompute": 1}, "updated": <unix time or null>}, ...],
     "restarts_left": <int: a server that replaces a dead engine (max_restarts)>,
     "standby": "off" | "starting" | "warming" | "ready" | "taking-over" | "none"}

=============  ======  =====================================================================
status         HTTP    meaning
=============  ======  =====================================================================
healthy        200     the engine serves
recovering     200     a recovery round runs: the engine serves on, its requests wait a
                       moment (a round is bounded: three round timeouts, 90 s by default)
restarting     503     the server replaces its dead engine (``max_restarts``): requests
                       wait and resume, but a restart takes as long as an engine start, so
                       a balancer had better send new requests elsewhere meanwhile
dead           503     the engine is dead (vLLM's ``/health`` answers 503 too; vLLM's server
                       then ends itself, unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``)
=============  ======  =====================================================================

A load balancer keeps a ``recovering`` server in rotation (nothing is lost, answers are only
late); one that would rather drain it matches on the body's ``status``, and may judge a round
stuck by its ``recovering_since``.

``/metrics`` (vLLM's) carries ftkit's series, collected from the same files at each scrape
(``FtkitCollector``; ``SERIES`` has their help texts, which say how ranks are summed).

One API server per engine: the state is found by the engine's ``VllmConfig.instance_id``, and
``vllm serve --api-server-count N`` (N > 1) gives each API server a configuration of its own.
Where ``PROMETHEUS_MULTIPROC_DIR`` is set (the user's, for a single API server), vLLM serves
``/metrics`` from prometheus' multi-process files only; ``attach`` then adds its own
``/metrics`` route (it replaces vLLM's) that serves those files and ftkit's series together.
"""

import atexit
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.faults import FaultKind
from ftkit.serve.state import (
    OUTCOMES,
    EngineSummary,
    RankRecord,
    ServerStateDir,
    read_ranks,
    served_world_size,
    without_stale_marks,
)

log = logging.getLogger("ftkit")

HEALTH_PATH = "/ftkit/health"
METRICS_PATH = "/metrics"
#: Where set, vLLM serves ``/metrics`` from prometheus' multi-process files.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

HEALTHY, RECOVERING, RESTARTING, DEAD = "healthy", "recovering", "restarting", "dead"
#: The HTTP status of each health status.
HTTP_STATUS = {HEALTHY: 200, RECOVERING: 200, RESTARTING: 503, DEAD: 503}

#: A fault fires on one rank; a round runs on every rank. Said once, in every help text.
_FAULTS_SUMMED = "summed over ranks (a fault fires on one rank, so each firing counts once)"
_ROUNDS_ONCE = ("every rank takes part in every round and counts it: the largest count over "
                "ranks, so each round counts once")
_NO_RESTARTS = ("counted by a server that replaces a dead engine (fault_tolerance "
                "max_restarts); stays 0 on a server without engine restarts")
#: Name (without ``_total``) and help text of each series.
SERIES = {
    "ftkit_faults": f"Faults injected by ftkit that fired, by fault kind; a flap counts each "
                    f"failing attempt; {_FAULTS_SUMMED}.",
    "ftkit_recovery_rounds": f"Recovery rounds, by outcome (recompute: the step was re-run; "
                             f"raise: the fault was surfaced to vLLM); {_ROUNDS_ONCE}.",
    "ftkit_recovery_duration_seconds": "Duration of recovery rounds (one rank's part, from its "
                                       "report to every rank's rebuild); each bucket is the "
                                       "largest over ranks, so each round counts once.",
    "ftkit_reinferences": f"Steps that failed and returned on a re-run (token-level "
                          f"re-inference); {_ROUNDS_ONCE}.",
    "ftkit_exhausted_steps": f"Steps whose fault ftkit surfaced to vLLM (a round decided "
                             f"raise: re-runs exhausted or not possible); {_ROUNDS_ONCE}.",
    "ftkit_kv_recomputes": f"Recomputations of KV cache that a fault destroyed, before a "
                           f"re-run; {_ROUNDS_ONCE}.",
    "ftkit_engine_restarts": f"Engine restarts after a rank process died; {_NO_RESTARTS}.",
    "ftkit_resumed_requests": f"Requests resumed from their tokens so far after an engine "
                              f"restart; {_NO_RESTARTS}.",
    "ftkit_standby_ready": "1 while a warm standby engine (fault_tolerance standby) is started, "
                           "warmed up and alive, ready to take over; 0 otherwise.",
    "ftkit_standbys_lost": "Standby engines lost before they took over (one that died, or "
                           "failed its warm-up); 0 on a server without a standby.",
}


@dataclass(frozen=True)
class Health:
    """The health view's answer (see the module)."""

    status: str
    recovering_since: float | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: A server that replaces a dead engine: its restarts left, and its warm standby's
    #: state (``RestartingEngine.standby_state``); ``None`` on other servers.
    restarts_left: int | None = None
    standby: str | None = None

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.status]

    def to_json(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"status": self.status,
                                  "recovering_since": self.recovering_since,
                                  "ranks": self.ranks}
        if self.restarts_left is not None:
            answer["restarts_left"] = self.restarts_left
        if self.standby is not None:
            answer["standby"] = self.standby
        return answer


def engine_health(engine_dead: bool, world_size: int, records: dict[int, RankRecord],
                  restarting: bool = False) -> Health:
    """The health of an engine of ``world_size`` ranks whose ranks published ``records``
    (a rank that published nothing has seen no fault); ``restarting``: the server is
    replacing its dead engine."""
    ranks = []
    for rank in range(max(world_size, max(records, default=-1) + 1)):
        record = records.get(rank)
        ranks.append({
            "rank": rank,
            "recovering_since": record.recovering_since if record else None,
            "faults": dict(record.faults) if record else {},
            "rounds": dict(record.rounds) if record else {},
            "updated": record.updated if record else None,
        })
    since = EngineSummary.of(records.values()).recovering_since
    if restarting:
        status = RESTARTING
    elif engine_dead:
        status = DEAD
    elif since is not None:
        status = RECOVERING
    else:
        status = HEALTHY
    return Health(status, since, ranks)


class FtkitCollector(Collector):
    """ftkit's series, read at each scrape from a server's state directory (``directory``:
    ``None`` until the server made it; the series are then 0) and its engine client's
    restarts (``engine``, ``engine_restarts``)."""

    def __init__(self, directory: Path | None = None, engine: Any = None) -> None:
        self.directory = directory
        self.engine = engine

    def describe(self) -> Iterator[Metric]:
        # The names, for the registry's check of duplicates, without reading a file.
        return iter(families(EngineSummary.of([])))

    def collect(self) -> Iterator[Metric]:
        directory = self.directory
        records = read_ranks(directory) if directory is not None else {}
        _, restarts, resumed = engine_restarts(self.engine)
        standby, lost = engine_standby(self.engine)
        return iter(families(EngineSummary.of(records.values()), restarts, resumed,
                             standby_ready=standby == "ready", standbys_lost=lost))


def families(summary: EngineSummary, restarts: int = 0, resumed: int = 0, *,
             standby_ready: bool = False, standbys_lost: int = 0) -> list[Metric]:
    """ftkit's metric families for ``summary``. Every fault kind and outcome is there from the
    start (at 0), so that a dashboard's series exist before the first fault."""
    faults = CounterMetricFamily("ftkit_faults", SERIES["ftkit_faults"], labels=["kind"])
    for kind in sorted({*(k.value for k in FaultKind), *summary.faults}):
        faults.add_metric([kind], summary.faults.get(kind, 0))
    rounds = CounterMetricFamily("ftkit_recovery_rounds", SERIES["ftkit_recovery_rounds"],
                                 labels=["outcome"])
    for outcome in sorted({*OUTCOMES, *summary.rounds}):
        rounds.add_metric([outcome], summary.rounds.get(outcome, 0))
    duration = HistogramMetricFamily(
        "ftkit_recovery_duration_seconds", SERIES["ftkit_recovery_duration_seconds"],
        buckets=[("+Inf" if bound == float("inf") else repr(bound), count)
                 for bound, count in summary.duration_buckets],
        sum_value=summary.duration_sum_s)

    def counter(name: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, SERIES[name], value=value)

    return [faults, rounds, duration,
            counter("ftkit_reinferences", summary.reinferences),
            counter("ftkit_exhausted_steps", summary.exhausted),
            counter("ftkit_kv_recomputes", summary.kv_recomputes),
            counter("ftkit_engine_restarts", restarts),
            counter("ftkit_resumed_requests", resumed),
            GaugeMetricFamily("ftkit_standby_ready", SERIES["ftkit_standby_ready"],
                              value=1 if standby_ready else 0),
            counter("ftkit_standbys_lost", standbys_lost)]


def engine_restarts(engine_client: Any) -> tuple[bool, int, int]:
    """(restarting now, restarts, requests resumed) of a server's engine client: an engine
    client that replaces a dead engine (``ftkit.vllm.restart.RestartingEngine``, with
    ``max_restarts``) says so by its ``restarting``, ``restarts`` and ``resumed_requests``;
    vLLM's own never restarts."""
    return (getattr(engine_client, "restarting", False) is True,
            int(getattr(engine_client, "restarts", 0) or 0),
            int(getattr(engine_client, "resumed_requests", 0) or 0))


def engine_standby(engine_client: Any) -> tuple[str | None, int]:
    """(the warm standby's state, standbys lost) of a server's engine client
    (``RestartingEngine.standby_state``, ``standbys_lost``); ``(None, 0)`` for one that keeps
    no standby."""
    state = getattr(engine_client, "standby_state", None)
    return (state if isinstance(state, str) else None,
            int(getattr(engine_client, "standbys_lost", 0) or 0))


def restarts_left(engine_client: Any) -> int | None:
    """How many more times the server replaces a dead engine; ``None`` where it never does."""
    most = getattr(engine_client, "max_restarts", None)
    if not isinstance(most, int) or isinstance(most, bool):
        return None
    return max(0, most - engine_restarts(engine_client)[1])


class ServerHealth:
    """One server's health: its engine client (``errored``: vLLM's own knowledge of a dead
    engine, no RPC; a restart, ``engine_restarts``), its world size and its state directory
    (``None`` with recovery off)."""

    def __init__(self, engine_client: Any, world_size: int,
                 state: ServerStateDir | None) -> None:
        self.engine_client = engine_client
        self.world_size = world_size
        self.state = state

    def health(self) -> Health:
        client = self.engine_client
        dead = bool(getattr(client, "errored", False)) if client is not None else False
        records = without_stale_marks(self.state.read()) if self.state is not None else {}
        health = engine_health(dead, self.world_size, records, engine_restarts(client)[0])
        return replace(health, restarts_left=restarts_left(client),
                       standby=engine_standby(client)[0])


#: The collector this process registered on prometheus' default registry (the one vLLM's
#: ``/metrics`` serves without ``PROMETHEUS_MULTIPROC_DIR``): one per process.
_collector: FtkitCollector | None = None
_collector_lock = threading.Lock()


def process_collector() -> FtkitCollector:
    """This process's collector, registered on prometheus' default registry once."""
    global _collector
    with _collector_lock:
        if _collector is None:
            collector = FtkitCollector()
            REGISTRY.register(collector)
            _collector = collector
        return _collector


async def health_route(request: Request) -> JSONResponse:
    """``GET /ftkit/health``: see the module."""
    server = getattr(request.app.state, "ftkit_health", None)
    if not isinstance(server, ServerHealth):
        # No engine (vLLM's render-only server), or not initialised: as vLLM's /health.
        return JSONResponse(Health(HEALTHY).to_json())
    health = server.health()
    return JSONResponse(health.to_json(), status_code=health.http_status)


def multiprocess_metrics_route(collector: FtkitCollector) -> Any:
    """A ``/metrics`` handler for ``PROMETHEUS_MULTIPROC_DIR``: prometheus' multi-process
    files (vLLM's series) and ``collector``'s series, in one answer."""
    from prometheus_client import multiprocess

    async def metrics() -> Response:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(collector)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics


def attach(app: FastAPI) -> None:
    """Add ``GET /ftkit/health`` to ``app`` and ftkit's series to its ``/metrics``."""
    app.add_api_route(HEALTH_PATH, health_route, methods=["GET"])
    collector = process_collector()
    if os.environ.get(MULTIPROC_ENV):
        app.add_api_route(METRICS_PATH, multiprocess_metrics_route(collector), methods=["GET"],
                          include_in_schema=False)


async def init_state(engine_client: Any, state: Any, args: Any) -> None:
    """Make the state directory the server's workers publish into (with recovery on; it is
    removed when this process exits) and the health view's state (``state.ftkit_health``)."""
    if engine_client is None:
        return  # vLLM's render-only server: no engine, no workers
    vllm_config = engine_client.vllm_config
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    recovery = raw is not None and RecoveryConfig.from_mapping(raw).enabled
    directory = None
    if recovery:
        directory = ServerStateDir.create(str(vllm_config.instance_id))
        atexit.register(directory.remove)
        log.info("ftkit: workers publish their recovery state in %s", directory.directory)
    collector = process_collector()
    collector.directory = directory.directory if directory is not None else None
    collector.engine = engine_client
    parallel = getattr(vllm_config, "parallel_config", None)
    state.ftkit_health = ServerHealth(engine_client, served_world_size(parallel),
                                      directory)
