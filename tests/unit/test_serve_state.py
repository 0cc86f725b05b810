"""The state a server's workers publish for its API server (``ftkit.serve.state``), and what the
API server makes of it (``ftkit.serve.health``): the files, the Prometheus series, the health
view's transitions, and that an offline engine writes nothing. The real server is in
tests/serve/test_serve_health.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ftkit.config import RecoveryConfig
from ftkit.contracts.eventlog import FaultFired, KvRecomputed, RecoveryRound, StepRecovered
from ftkit.contracts.step import RpcKind
from ftkit.recovery import Coordinator, MemoryChannel, RankState, RankStatus, RecoveryMonitor
from ftkit.recovery import SideChannels
from ftkit.serve import health
from ftkit.serve.health import FtkitCollector, ServerHealth, engine_health
from ftkit.serve.state import (
    DURATION_BUCKETS_S,
    OWNER_FILE,
    EngineSummary,
    RankPublisher,
    RankRecord,
    ServerStateDir,
    read_ranks,
    state_dir,
)


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Python's temporary folder, for this test only (where state directories are made)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def fault(kind: str = "link_break") -> FaultFired:
    return FaultFired(run_id=None, index=0, kind=kind, request=0, token=3, phase="forward",
                      step=7, attempt=1, pid=1)


def round_event(decision: str = "recompute", duration_s: float = 0.2) -> RecoveryRound:
    return RecoveryRound(epoch=0, state="failed", step=7, rpc=13, rpc_kind="execute",
                         failures=1, fault="link_break", error="LinkError", decision=decision,
                         reason="", duration_s=duration_s)


def ftkit_worker(instance_id: str, rank: int = 0, *, enabled: bool = True):
    """ftkit's worker-side object on a stand-in vLLM worker (its step is never run here)."""
    from ftkit.vllm.worker import FtkitWorker

    return FtkitWorker(SimpleNamespace(rank=rank), SimpleNamespace(instance_id=instance_id),
                       RecoveryConfig(enabled=enabled))


def scrape(collector: FtkitCollector) -> dict[str, float]:
    """``generate_latest`` of a fresh registry holding ``collector``, as {sample: value}."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# --- the files ------------------------------------------------------------------------------

def test_the_state_directory_is_named_by_the_instance_id_inside_the_temporary_folder(
        temp_root):
    assert state_dir("1796433014955315785") == temp_root / "ftkit-serve-1796433014955315785"
    # Whatever vLLM puts in an instance id, the name stays one directory inside the folder.
    assert state_dir("../x/y").parent == temp_root
    with pytest.raises(ValueError):
        state_dir("..")


def test_a_rank_publishes_nothing_until_the_server_made_its_directory(temp_root):
    publisher = RankPublisher.for_instance("42", 1)
    publisher.fault_fired("link_break")
    publisher.round_started(0)
    assert list(temp_root.iterdir()) == []  # not even the directory
    made = ServerStateDir.create("42")
    publisher.round_ended("recompute", 0.3)
    [record] = read_ranks(made.directory).values()
    # What happened before the directory existed is counted in the first write after it.
    assert (record.rank, record.faults, record.rounds) == (1, {"link_break": 1},
                                                           {"recompute": 1})
    assert record.recovering_since is None
    # Beside the server's owner file, the rank's record and no temporary file.
    assert sorted(p.name for p in made.directory.iterdir()) == [OWNER_FILE, "rank1.json"]


def test_a_ranks_live_faults_fired_are_kept_across_an_engine_replacement(temp_root):
    """Each rank counts its firings by live fault index too; a replacement engine's worker of
    the same rank adds the dead one's (``absorb``), and ``fired_attempts`` takes, per fault,
    the most any rank saw."""
    from ftkit.serve.state import fired_attempts

    made = ServerStateDir.create("7")
    dead = RankPublisher.for_instance("7", 0)
    dead.fault_fired("process_kill", 0)
    dead.fault_fired("link_flap", 1)
    other = RankPublisher.for_instance("7", 1)
    other.fault_fired("link_flap", 1)
    other.fault_fired("link_flap", 1)
    new = RankPublisher.for_instance("7", 0)
    new.record.pid = -1  # another worker process of rank 0
    new.fault_fired("device_reset", 2)
    records = read_ranks(made.directory)
    assert records[0].fired == {"0": 1, "1": 1, "2": 1}
    assert records[0].faults == {"process_kill": 1, "link_flap": 1, "device_reset": 1}
    assert fired_attempts(records.values()) == {0: 1, 1: 2, 2: 1}
    assert fired_attempts([]) == {}


def test_a_rank_marks_itself_recovering_for_the_length_of_a_round(temp_root):
    made = ServerStateDir.create("7")
    publisher = RankPublisher.for_instance("7", 0)
    publisher.round_started(0)
    assert read_ranks(made.directory)[0].recovering_since is not None
    publisher.round_ended("raise", 12.0)
    record = read_ranks(made.directory)[0]
    assert record.recovering_since is None
    assert record.rounds == {"raise": 1} and record.exhausted == 1
    # 12 s falls in the bucket whose bound is 30 s (the one after 10 s).
    assert record.round_buckets[DURATION_BUCKETS_S.index(30.0)] == 1


def test_the_server_removes_its_directory_with_what_the_workers_wrote(temp_root):
    made = ServerStateDir.create("9")
    RankPublisher.for_instance("9", 0).fault_fired("hang")
    assert made.directory.is_dir()
    made.remove()
    assert list(temp_root.iterdir()) == []
    # A worker that writes afterwards does not make it again.
    RankPublisher.for_instance("9", 0).fault_fired("hang")
    assert list(temp_root.iterdir()) == []


def test_a_starting_server_removes_the_directories_of_servers_that_are_gone(temp_root):
    me = psutil.Process()
    live = ServerStateDir.create("live").directory  # this process made it: it lives
    gone = state_dir("gone")
    gone.mkdir()
    # Its maker's pid now belongs to another process (another start time): gone.
    (gone / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "started": me.create_time() - 1}))
    RankPublisher(gone, 0).fault_fired("hang")
    unowned = state_dir("unowned")
    unowned.mkdir()  # not one of ours to judge
    ServerStateDir.create("next")
    assert sorted(p.name for p in temp_root.iterdir()) == [
        "ftkit-serve-live", "ftkit-serve-next", "ftkit-serve-unowned"]
    assert live.is_dir()


def test_a_record_of_another_version_or_a_torn_file_is_skipped(temp_root):
    made = ServerStateDir.create("5")
    RankPublisher.for_instance("5", 0).fault_fired("uce")
    (made.directory / "rank1.json").write_text('{"v": 99, "rank": 1}')
    (made.directory / "rank2.json").write_text('{"v": 1, "rank": 2, "fau')
    assert list(read_ranks(made.directory)) == [0]
    assert RankRecord.from_json(RankRecord(rank=3).to_json()) == RankRecord(rank=3)


# --- the worker's hooks -----------------------------------------------------------------------

def test_a_worker_of_an_offline_engine_writes_no_file(temp_root):
    """Nobody made a directory for an offline engine's instance: its faults and rounds write
    nothing anywhere in the temporary folder."""
    worker = ftkit_worker("offline-1")
    for event in (fault(), round_event(), StepRecovered(step=7, rpc_kind="execute", failures=1,
                                                        recovery_s=0.1, rollback_s=0.0,
                                                        rerun_s=0.1)):
        worker.events.emit(event)
    worker.publisher.round_started(1)
    assert list(temp_root.iterdir()) == []


def test_a_served_worker_counts_every_event_of_its_event_log(temp_root):
    made = ServerStateDir.create("served-1")
    worker = ftkit_worker("served-1", rank=1)
    worker.events.emit(fault("link_flap"))
    worker.events.emit(fault("link_flap"))
    worker.events.emit(round_event("recompute", 0.04))
    worker.events.emit(StepRecovered(step=7, rpc_kind="execute", failures=2, recovery_s=0.1,
                                     rollback_s=0.0, rerun_s=0.1))
    worker.events.emit(KvRecomputed(step=7, requests=1, tokens=12, passes=1, duration_s=0.01))
    record = read_ranks(made.directory)[1]
    assert record.faults == {"link_flap": 2} and record.rounds == {"recompute": 1}
    assert (record.reinferences, record.kv_recomputes, record.exhausted) == (1, 1, 0)
    assert len(worker.events.events) == 5  # the event log itself is unchanged


def test_a_worker_with_recovery_off_publishes_nothing(temp_root):
    made = ServerStateDir.create("off-1")
    worker = ftkit_worker("off-1", enabled=False)
    assert worker.publisher is None
    worker.events.emit(fault())
    assert read_ranks(made.directory) == {}


def test_the_monitor_marks_the_rank_recovering_while_its_round_runs(temp_root):
    """The round-start hook fires before the round's work, the record after it: a reader in
    the middle of the round (here: during the rebuild) sees the rank recovering."""
    made = ServerStateDir.create("round-1")
    worker = ftkit_worker("round-1")
    seen_in_round = []

    def rebuild(decision, times):
        record = read_ranks(made.directory).get(0)
        seen_in_round.append(record.recovering_since if record is not None else None)

    coordinator = Coordinator(0, 1, max_reinference=3, round_timeout_s=5, rebuild=rebuild)
    channel = MemoryChannel()
    monitor = RecoveryMonitor(coordinator, SideChannels(channel, None),
                              stop_communication=lambda: None, gate_timeout_s=5,
                              on_round=worker._record_round,
                              on_round_start=worker.publisher.round_started)
    monitor.enter_step(1, RpcKind.EXECUTE, 1)
    decision = monitor.join_after_failure(RankStatus(0, RankState.FAILED, 1, RpcKind.EXECUTE,
                                                     1, failures=1, kind="link_break"))
    assert decision.recompute
    assert seen_in_round and seen_in_round[0] is not None
    record = read_ranks(made.directory)[0]
    assert record.recovering_since is None and record.rounds == {"recompute": 1}


# --- over ranks, and the Prometheus series ------------------------------------------------------

def two_ranks(directory: Path) -> None:
    """Rank 1 had a fault (a flap of two attempts); both took part in two rounds."""
    for rank in (0, 1):
        publisher = RankPublisher(directory, rank)
        if rank == 1:
            publisher.fault_fired("link_flap")
            publisher.fault_fired("link_flap")
        publisher.round_ended("recompute", 0.03 if rank == 0 else 0.2)
        publisher.round_ended("recompute", 0.04)
        publisher.step_reinferred()


def test_faults_are_summed_over_ranks_and_rounds_counted_once(tmp_path):
    two_ranks(tmp_path)
    summary = EngineSummary.of(read_ranks(tmp_path).values())
    assert summary.faults == {"link_flap": 2}
    assert summary.rounds == {"recompute": 2} and summary.reinferences == 1
    buckets = dict(summary.duration_buckets)
    # Rank 0: both rounds by 0.05 s; rank 1: one by 0.05 s, both by 0.25 s. Largest per bucket.
    assert (buckets[0.025], buckets[0.05], buckets[0.25], buckets[float("inf")]) == (0, 2, 2, 2)


def test_the_collector_serves_every_series_at_zero_before_any_fault():
    samples = scrape(FtkitCollector())
    assert samples['ftkit_faults_total{kind="link_break"}'] == 0
    assert samples['ftkit_recovery_rounds_total{outcome="recompute"}'] == 0
    assert samples['ftkit_recovery_rounds_total{outcome="raise"}'] == 0
    assert samples['ftkit_recovery_duration_seconds_count'] == 0
    for name in ("ftkit_reinferences_total", "ftkit_exhausted_steps_total",
                 "ftkit_engine_restarts_total", "ftkit_resumed_requests_total"):
        assert samples[name] == 0


def test_the_collector_reads_the_ranks_files_at_each_scrape(tmp_path):
    collector = FtkitCollector(tmp_path)
    assert scrape(collector)['ftkit_faults_total{kind="link_flap"}'] == 0
    two_ranks(tmp_path)
    samples = scrape(collector)
    assert samples['ftkit_faults_total{kind="link_flap"}'] == 2
    assert samples['ftkit_recovery_rounds_total{outcome="recompute"}'] == 2
    assert samples['ftkit_recovery_duration_seconds_bucket{le="0.05"}'] == 2
    assert samples['ftkit_recovery_duration_seconds_count'] == 2
    assert samples['ftkit_reinferences_total'] == 1


def test_the_help_texts_say_how_ranks_are_summed_and_what_stays_zero():
    registry = CollectorRegistry()
    registry.register(FtkitCollector())
    text = generate_latest(registry).decode()
    helps = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP")}
    assert "summed over ranks" in helps["ftkit_faults_total"]
    assert "largest count over ranks" in helps["ftkit_recovery_rounds_total"]
    assert "largest over ranks" in helps["ftkit_recovery_duration_seconds"]
    for name in ("ftkit_engine_restarts_total", "ftkit_resumed_requests_total"):
        assert "stays 0 on a server without engine restarts" in helps[name]


def test_restarts_come_from_an_engine_client_that_replaces_its_engine():
    replacing = SimpleNamespace(restarting=False, restarts=2, resumed_requests=5)
    samples = scrape(FtkitCollector(engine=replacing))
    assert samples["ftkit_engine_restarts_total"] == 2
    assert samples["ftkit_resumed_requests_total"] == 5
    # vLLM's own engine client has none of it.
    assert scrape(FtkitCollector(engine=SimpleNamespace(errored=False)))[
        "ftkit_engine_restarts_total"] == 0


# --- the health view -------------------------------------------------------------------------

def test_health_goes_healthy_recovering_healthy_dead(tmp_path):
    engine = SimpleNamespace(errored=False)
    server = ServerHealth(engine, 2, ServerStateDir(tmp_path))
    rank1 = RankPublisher(tmp_path, 1)

    first = server.health()
    assert (first.status, first.http_status, first.recovering_since) == ("healthy", 200, None)
    assert [r["rank"] for r in first.ranks] == [0, 1]  # every rank, before any published

    rank1.fault_fired("link_break")
    rank1.round_started(0)
    during = server.health()
    assert (during.status, during.http_status) == ("recovering", 200)
    assert during.recovering_since == during.ranks[1]["recovering_since"] is not None
    assert during.ranks[1]["faults"] == {"link_break": 1} and during.ranks[0]["faults"] == {}

    rank1.round_ended("recompute", 0.1)
    after = server.health()
    assert (after.status, after.recovering_since) == ("healthy", None)
    assert after.ranks[1]["rounds"] == {"recompute": 1}

    engine.errored = True
    dead = server.health()
    assert (dead.status, dead.http_status) == ("dead", 503)


def test_a_restarting_server_says_so_before_all_else(tmp_path):
    engine = SimpleNamespace(errored=False, restarting=True)
    RankPublisher(tmp_path, 0).round_started(0)
    restarting = ServerHealth(engine, 1, ServerStateDir(tmp_path)).health()
    assert (restarting.status, restarting.http_status) == ("restarting", 503)
    engine.restarting = False
    assert ServerHealth(engine, 1, ServerStateDir(tmp_path)).health().status == "recovering"


def test_the_mark_of_a_worker_killed_in_a_round_is_not_taken_for_a_recovery(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=60)
    record = RankRecord(rank=0, pid=int(gone.stdout), recovering_since=123.0)
    (tmp_path / "rank0.json").write_text(record.to_json())
    health_now = ServerHealth(SimpleNamespace(errored=False), 1,
                              ServerStateDir(tmp_path)).health()
    assert (health_now.status, health_now.recovering_since) == ("healthy", None)


def test_a_replaced_engines_worker_counts_on_from_its_predecessors_record(tmp_path):
    """A server that replaced its dead engine: the new worker of rank 0 writes where the dead
    one wrote, and its counts go on from there (a counter never goes down)."""
    earlier = RankRecord(rank=0, pid=-1, faults={"process_kill": 1}, rounds={"raise": 1},
                         exhausted=1, recovering_since=99.0)
    earlier.round_buckets[0] = 1
    (tmp_path / "rank0.json").write_text(earlier.to_json())
    publisher = RankPublisher(tmp_path, 0)
    publisher.fault_fired("link_break")
    publisher.round_ended("recompute", 0.001)
    record = read_ranks(tmp_path)[0]
    assert record.faults == {"process_kill": 1, "link_break": 1}
    assert record.rounds == {"raise": 1, "recompute": 1} and record.exhausted == 1
    assert record.round_buckets[0] == 2 and record.recovering_since is None
    assert record.pid == os.getpid()


def test_a_dead_engine_is_dead_even_in_the_middle_of_a_round():
    record = RankRecord(rank=0, recovering_since=123.0)
    assert engine_health(True, 1, {0: record}).status == "dead"
    assert engine_health(False, 1, {0: record}).status == "recovering"


# --- the routes on an app ----------------------------------------------------------------------

def served_engine(instance_id: str, errored: bool = False, enabled: bool = True):
    config = SimpleNamespace(
        instance_id=instance_id, parallel_config=SimpleNamespace(world_size=2),
        additional_config={"fault_tolerance": {"enabled": enabled}})
    return SimpleNamespace(vllm_config=config, errored=errored)


def test_attach_and_init_state_serve_health_and_metrics_on_an_app(temp_root):
    from prometheus_client import REGISTRY, make_asgi_app

    app = FastAPI()
    app.mount("/metrics", make_asgi_app(registry=REGISTRY))  # as vLLM serves it
    health.attach(app)
    engine = served_engine("app-1")
    asyncio.run(health.init_state(engine, app.state, SimpleNamespace()))
    made = app.state.ftkit_health.state
    try:
        assert made.directory == temp_root / "ftkit-serve-app-1" and made.directory.is_dir()
        client = TestClient(app)
        answer = client.get("/ftkit/health")
        assert answer.status_code == 200
        assert answer.json() == {"status": "healthy", "recovering_since": None, "ranks": [
            {"rank": r, "recovering_since": None, "faults": {}, "rounds": {}, "updated": None}
            for r in (0, 1)]}
        worker = ftkit_worker("app-1", rank=1)  # a worker of this server publishes
        worker.events.emit(fault("device_reset"))
        metrics = client.get("/metrics/").text
        assert 'ftkit_faults_total{kind="device_reset"} 1.0' in metrics
        engine.errored = True
        answer = client.get("/ftkit/health")
        assert answer.status_code == 503 and answer.json()["status"] == "dead"
    finally:
        made.remove()
    assert list(temp_root.iterdir()) == []


def test_a_server_without_recovery_makes_no_directory_and_still_answers(temp_root):
    app = FastAPI()
    health.attach(app)
    asyncio.run(health.init_state(served_engine("norec-1", enabled=False), app.state,
                                  SimpleNamespace()))
    assert list(temp_root.iterdir()) == []
    answer = TestClient(app).get("/ftkit/health")
    assert answer.status_code == 200 and answer.json()["status"] == "healthy"


def test_with_prometheus_multiprocess_files_metrics_serves_them_and_ftkit(
        temp_root, tmp_path, monkeypatch):
    """vLLM then serves /metrics from prometheus' multi-process files only; ftkit's route,
    which replaces it, serves both."""
    from prometheus_client import Counter, values

    files = tmp_path / "prom"
    files.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(files))
    # A series in the files (as vLLM's own are there), written as a process started with the
    # variable set writes it (prometheus reads the variable when it is imported).
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    Counter("other_process_requests", "a stand-in", registry=None).inc(3)
    app = FastAPI()
    health.attach(app)
    asyncio.run(health.init_state(served_engine("mp-1"), app.state, SimpleNamespace()))
    made = app.state.ftkit_health.state
    try:
        RankPublisher.for_instance("mp-1", 0).fault_fired("oom")
        text = TestClient(app).get("/metrics").text
        assert 'ftkit_faults_total{kind="oom"} 1.0' in text
        assert "other_process_requests_total 3.0" in text
    finally:
        made.remove()


# --- ftkit's log lines in vLLM's output ------------------------------------------------------

def test_ftkit_records_go_to_vllms_handler_once_where_nothing_else_takes_them(monkeypatch):
    from ftkit.vllm import plugin

    ftkit_log, vllm_log, root = (logging.getLogger(n) for n in ("ftkit", "vllm", ""))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("VLLM-FORMAT %(name)s %(message)s"))
    monkeypatch.setattr(vllm_log, "handlers", [handler])
    monkeypatch.setattr(vllm_log, "level", logging.INFO)
    monkeypatch.setattr(ftkit_log, "handlers", [])
    monkeypatch.setattr(ftkit_log, "level", logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [])  # a server's root logger has none

    plugin._log_like_vllm()
    plugin._log_like_vllm()  # loading twice adds nothing
    ftkit_log.info("ftkit: recovery on")
    assert out.getvalue() == "VLLM-FORMAT ftkit ftkit: recovery on\n"

    # An application that configured logging gets ftkit's records by propagation only.
    theirs = io.StringIO()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(theirs)])
    ftkit_log.warning("ftkit: injecting")
    assert out.getvalue().count("\n") == 1 and theirs.getvalue() == "ftkit: injecting\n"


def test_json_of_the_record_is_what_the_server_reads():
    record = RankRecord(rank=2, faults={"hang": 1})
    raw = json.loads(record.to_json())
    assert raw["v"] == 1 and raw["rank"] == 2 and raw["faults"] == {"hang": 1}


def test_ranks_are_numbered_across_data_parallel_replicas():
    """vLLM runs each replica of a dense model as an engine of its own, its ranks from 0, and
    keeps the replica's index; a server's ranks are numbered across its replicas."""
    from types import SimpleNamespace

    from ftkit.serve.state import served_rank, served_world_size

    replica = SimpleNamespace(world_size=2, data_parallel_index=1, data_parallel_size=1)
    assert [served_rank(replica, r) for r in (0, 1)] == [2, 3]
    assert served_rank(SimpleNamespace(world_size=2), 1) == 1  # no replicas: as it was
    assert served_rank(None, 0) == 0
    # The API server's configuration keeps the replica count.
    assert served_world_size(SimpleNamespace(world_size=2, data_parallel_size=2)) == 4
    assert served_world_size(SimpleNamespace(world_size=1)) == 1
