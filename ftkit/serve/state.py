"""A server's ftkit state, published by its workers for its API server: what faults fired and
how recovery went on every rank, and whether a recovery round runs now.

Why files, not an RPC: during a recovery the engine core is blocked inside one step RPC, so a
``collective_rpc`` from the API server would wait behind it, and the health view must answer
then above all. Each rank writes one small JSON file; the API server reads them when asked.

Where: ``<temp>/ftkit-serve-<instance id>/rank<r>.json``. The instance id is vLLM's
``VllmConfig.instance_id``, drawn once where the configuration is made (the API server) and
carried inside it to the engine core and to every worker, so every process of one server
finds the same directory and no two servers share one; ``<temp>`` is Python's temporary folder
(``tempfile.gettempdir()``), the same in the API server and in the processes it starts, which
inherit its environment.

Who writes: the API server creates the directory (``ServerStateDir.create``, from the endpoint
plugin's ``init_state``) and removes it when it exits; a worker writes its file only while that
directory exists, and never creates it (a server killed with SIGKILL leaves its directory
behind: the next server to start removes it, ``remove_orphans``). An offline engine (``vllm.LLM``, ftkit's own runner)
therefore writes nothing: nobody made a directory for its instance. (ftkit's general plugin
cannot tell a server from an offline engine when it loads: it loads in both, and a server's
engine starts before the API server's ``init_state`` runs. A server's first fault comes with
its first requests, after the directory exists.)

When: only when something happens (a fault fired, a recovery round started or ended, a failed
step returned on its re-run, KV recomputed): a fault-free step writes nothing. A write replaces
the rank's whole record atomically (temporary file, then ``os.replace``): a reader sees the old
record or the new one, never half of one. A failed write is logged and dropped; it never
disturbs the recovery it records.

Writing: ``RankPublisher`` (one per worker, fed by the worker's event log and its recovery
monitor: ``ftkit.vllm.worker``). Reading: ``read_ranks`` (the one reader) and
``EngineSummary.of`` (counts over ranks, the rule for each in its docstring), used by
``ftkit.serve.health``.

This module imports nothing of ftkit: the workers (``ftkit.vllm``) import it, and the rest of
``ftkit.serve`` imports ``ftkit.vllm``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger("ftkit")

#: The version of a rank's record; a reader skips a record of another version.
VERSION = 1
#: The state directory's name is this prefix and the instance id.
DIR_PREFIX = "ftkit-serve-"
#: Upper bounds of the recovery-duration histogram's buckets, in seconds (a round lasts at most
#: three round timeouts, 90 s by default: ``ftkit.bounds.round_bound_s``).
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0)
#: How often removing the directory is tried again when a worker wrote into it meanwhile.
REMOVE_TRIES = 3
#: The file in a state directory that names the API server process that made it.
OWNER_FILE = "owner.json"

#: The outcomes of a round (a decision's action): re-run the step, or surface the fault.
OUTCOMES = ("recompute", "raise")


def served_rank(parallel: Any, rank: int) -> int:
    """Rank ``rank`` of an engine, numbered across a server's data-parallel replicas:
    ``parallel`` is the engine's ``ParallelConfig``. vLLM runs each replica of a dense model
    as an engine of its own, its ranks numbered from 0, and keeps the replica's index as
    ``data_parallel_index``; rank ``r`` of replica ``i`` is ``i * world_size + r``."""
    index = int(getattr(parallel, "data_parallel_index", 0) or 0)
    return index * int(getattr(parallel, "world_size", 1) or 1) + rank


def served_world_size(parallel: Any) -> int:
    """How many ranks a server has across its data-parallel replicas (``served_rank``):
    ``parallel`` is the API server's ``ParallelConfig``, which keeps the replica count."""
    return (int(getattr(parallel, "world_size", 1) or 1)
            * int(getattr(parallel, "data_parallel_size", 1) or 1))


def state_dir(instance_id: str, root: str | Path | None = None) -> Path:
    """The state directory of the server whose vLLM configuration has ``instance_id``
    (under ``root``, by default the temporary folder)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(instance_id))
    if not safe.strip("."):
        raise ValueError(f"no state directory for instance id {instance_id!r}")
    return Path(root if root is not None else tempfile.gettempdir()) / f"{DIR_PREFIX}{safe}"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.json"


@dataclass
class RankRecord:
    """What one rank has seen since its worker started; serialises itself."""

    rank: int
    pid: int = 0
    #: Fault firings on this rank, by fault kind (a flap counts each failing attempt).
    faults: dict[str, int] = field(default_factory=dict)
    #: The same by the live fault's index in the server's plan (as a string: JSON keys), so
    #: that a replacement engine is given the faults that have not fired all their attempts.
    fired: dict[str, int] = field(default_factory=dict)
    #: This rank's part of each recovery round, by outcome (``OUTCOMES``).
    rounds: dict[str, int] = field(default_factory=dict)
    #: Rounds whose part on this rank lasted at most each of ``DURATION_BUCKETS_S`` (and not
    #: the bound before), then those longer than the last: one more entry than the bounds.
    round_buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS_S) + 1))
    #: Seconds this rank spent in rounds, in all.
    round_seconds: float = 0.0
    #: Steps that failed on this rank and returned on a re-run (re-inferred).
    reinferences: int = 0
    #: Steps whose fault this rank surfaced to vLLM (a round decided ``raise``).
    exhausted: int = 0
    #: Lost KV recomputed on this rank before a re-run.
    kv_recomputes: int = 0
    #: ``time.time()`` when this rank's part of the round now running began; ``None``: none runs.
    recovering_since: float | None = None
    #: ``time.time()`` of the last write.
    updated: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"v": VERSION, **dataclasses.asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> RankRecord:
        """The record in ``text``; ``ValueError`` if it is not one of this version."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.pop("v", None) != VERSION:
            raise ValueError("not a rank record of this version")
        record = cls(**raw)
        if len(record.round_buckets) != len(DURATION_BUCKETS_S) + 1:
            raise ValueError("a rank record with other duration buckets")
        return record

    def absorb(self, earlier: RankRecord) -> None:
        """Add the counts of ``earlier`` (this rank's record by a worker of an engine that
        died and was replaced under the same server), so that they never go down."""
        for kind, n in earlier.faults.items():
            self.faults[kind] = self.faults.get(kind, 0) + n
        for index, n in earlier.fired.items():
            self.fired[index] = self.fired.get(index, 0) + n
        for outcome, n in earlier.rounds.items():
            self.rounds[outcome] = self.rounds.get(outcome, 0) + n
        self.round_buckets = [a + b for a, b in zip(self.round_buckets, earlier.round_buckets)]
        self.round_seconds += earlier.round_seconds
        self.reinferences += earlier.reinferences
        self.exhausted += earlier.exhausted
        self.kv_recomputes += earlier.kv_recomputes

    def observe_round(self, outcome: str, duration_s: float) -> None:
        self.rounds[outcome] = self.rounds.get(outcome, 0) + 1
        index = next((i for i, bound in enumerate(DURATION_BUCKETS_S) if duration_s <= bound),
                     len(DURATION_BUCKETS_S))
        self.round_buckets[index] += 1
        self.round_seconds += duration_s
        if outcome == "raise":
            self.exhausted += 1
        self.recovering_since = None


class RankPublisher:
    """One rank's writer: keeps its ``RankRecord`` and, whenever something happens, writes it
    to the state directory, if the API server made one. Safe to call from the main thread and
    the monitor thread; never raises (a write that fails is logged at debug level)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = directory
        self.record = RankRecord(rank=rank, pid=os.getpid())
        self._lock = threading.Lock()
        #: Whether the record of this rank's earlier worker (if any) was taken over.
        self._took_over = False

    @classmethod
    def for_instance(cls, instance_id: str, rank: int) -> RankPublisher:
        return cls(state_dir(instance_id), rank)

    def fault_fired(self, kind: str, index: int | None = None) -> None:
        """A fault of ``kind`` fired on this rank (``index``: the live fault's place in the
        server's plan)."""
        with self._lock:
            record = self.record
            record.faults[kind] = record.faults.get(kind, 0) + 1
            if index is not None:
                record.fired[str(index)] = record.fired.get(str(index), 0) + 1
            self._write()

    def round_started(self, epoch: int) -> None:
        """Mark this rank as recovering from now until its part of round ``epoch`` ends."""
        with self._lock:
            self.record.recovering_since = time.time()
            self._write()

    def round_ended(self, outcome: str, duration_s: float) -> None:
        """This rank's part of a round ended with ``outcome`` (``OUTCOMES``) after
        ``duration_s``; it no longer recovers."""
        with self._lock:
            self.record.observe_round(outcome, duration_s)
            self._write()

    def step_reinferred(self) -> None:
        with self._lock:
            self.record.reinferences += 1
            self._write()

    def kv_recomputed(self) -> None:
        with self._lock:
            self.record.kv_recomputes += 1
            self._write()

    def _write(self) -> None:
        """(Lock held.) Replace this rank's file, if the directory exists; never create it."""
        directory = self.directory
        if not directory.is_dir():
            return  # no server made it: an offline engine, or the server is gone
        record = self.record
        final = _rank_file(directory, record.rank)
        if not self._took_over:
            self._take_over(final)
        record.updated = time.time()
        temporary = directory / f".{final.name}.{os.getpid()}.tmp"
        try:
            temporary.write_text(record.to_json(), encoding="utf-8")
            os.replace(temporary, final)
        except OSError as exc:  # the server removed the directory meanwhile, a full disk
            log.debug("ftkit: rank %d could not publish its state: %s", record.rank, exc)
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass


    def _take_over(self, path: Path) -> None:
        """(Lock held, first write.) Count in the record an earlier worker of this rank left
        (an engine replaced under the same server writes where the dead one wrote)."""
        self._took_over = True
        try:
            earlier = RankRecord.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            return  # none (the usual case), or unreadable
        if earlier.pid != self.record.pid:
            self.record.absorb(earlier)


def read_ranks(directory: Path) -> dict[int, RankRecord]:
    """The record of every rank that published one in ``directory`` (empty when it does not
    exist); a file that cannot be read as a record of this version is skipped."""
    records: dict[int, RankRecord] = {}
    try:
        paths = sorted(directory.glob("rank*.json"))
    except OSError:
        return records
    for path in paths:
        try:
            record = RankRecord.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError) as exc:
            log.debug("ftkit: skipping state file %s: %s", path, exc)
            continue
        records[record.rank] = record
    return records


def fired_attempts(records: Iterable[RankRecord]) -> dict[int, int]:
    """Live fault index -> the attempts it failed, over every rank: the most any rank saw (a
    fault on every rank fires on each of them for one attempt)."""
    fired: dict[int, int] = {}
    for record in records:
        for index, n in record.fired.items():
            fired[int(index)] = max(fired.get(int(index), 0), n)
    return fired


def without_stale_marks(records: Mapping[int, RankRecord]) -> dict[int, RankRecord]:
    """``records`` without the recovering mark of a worker that is no longer running (killed
    in the middle of a round: nobody will clear its mark)."""
    return {rank: (record if record.recovering_since is None or _running(record.pid)
                   else dataclasses.replace(record, recovering_since=None))
            for rank, record in records.items()}


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class EngineSummary:
    """One engine's counts, over its ranks.

    A fault fires on one rank: ``faults`` is the sum over ranks. A round runs on every rank,
    each recording its own part: the round counts (``rounds``, ``reinferences``,
    ``exhausted``, ``kv_recomputes``) and each cumulative duration bucket are the largest over
    ranks, so that a round counts once (and a count never goes down: each rank's only grows).
    ``duration_sum_s`` is the largest total time a rank spent in rounds.
    """

    faults: Mapping[str, int]
    rounds: Mapping[str, int]
    #: (upper bound, rounds that lasted at most it), cumulative, the last bound ``inf``.
    duration_buckets: tuple[tuple[float, int], ...]
    duration_sum_s: float
    reinferences: int
    exhausted: int
    kv_recomputes: int
    #: The earliest ``recovering_since`` of a rank in a round now, or ``None``.
    recovering_since: float | None

    @classmethod
    def of(cls, records: Iterable[RankRecord]) -> EngineSummary:
        records = list(records)
        faults: dict[str, int] = {}
        rounds: dict[str, int] = {}
        for record in records:
            for kind, n in record.faults.items():
                faults[kind] = faults.get(kind, 0) + n
            for outcome, n in record.rounds.items():
                rounds[outcome] = max(rounds.get(outcome, 0), n)
        bounds = (*DURATION_BUCKETS_S, float("inf"))
        cumulative = [0] * len(bounds)
        for record in records:
            running = 0
            for i, n in enumerate(record.round_buckets):
                running += n
                cumulative[i] = max(cumulative[i], running)
        since = [r.recovering_since for r in records if r.recovering_since is not None]
        return cls(
            faults=faults, rounds=rounds,
            duration_buckets=tuple(zip(bounds, cumulative)),
            duration_sum_s=max((r.round_seconds for r in records), default=0.0),
            reinferences=max((r.reinferences for r in records), default=0),
            exhausted=max((r.exhausted for r in records), default=0),
            kv_recomputes=max((r.kv_recomputes for r in records), default=0),
            recovering_since=min(since, default=None))


class ServerStateDir:
    """The API server's side: makes the state directory its workers publish into, and
    removes it (``remove``, idempotent) when the server exits.

    A server killed with SIGKILL cannot remove its directory: each directory names the
    process that made it (``OWNER_FILE``: pid and start time), and the next server to start
    under the same temporary folder removes those whose maker is gone."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._created = False

    @classmethod
    def create(cls, instance_id: str, root: str | Path | None = None) -> ServerStateDir:
        """Make the directory of the server of ``instance_id`` (readable by its owner only),
        owned by this process; remove those of servers that are gone."""
        made = cls(state_dir(instance_id, root))
        remove_orphans(made.directory.parent)
        made.directory.mkdir(mode=0o700, exist_ok=True)
        me = psutil.Process()
        (made.directory / OWNER_FILE).write_text(
            json.dumps({"pid": me.pid, "started": me.create_time()}), encoding="utf-8")
        made._created = True
        return made

    def read(self) -> dict[int, RankRecord]:
        return read_ranks(self.directory)

    def remove(self) -> None:
        """Remove the directory and what the workers wrote in it. A worker may write a
        file while it goes: the removal is tried again, ``REMOVE_TRIES`` times."""
        if not self._created:
            return
        for _ in range(REMOVE_TRIES):
            shutil.rmtree(self.directory, ignore_errors=True)
            if not self.directory.exists():
                break
        self._created = False


def remove_orphans(root: Path) -> list[Path]:
    """Remove the state directories under ``root`` whose maker (``OWNER_FILE``) is no longer
    running; those removed. A directory without a readable owner is left alone."""
    removed = []
    for directory in root.glob(f"{DIR_PREFIX}*"):
        try:
            owner = json.loads((directory / OWNER_FILE).read_text(encoding="utf-8"))
            pid, started = int(owner["pid"]), float(owner["started"])
        except (OSError, ValueError, TypeError, KeyError):
            continue
        try:
            alive = psutil.Process(pid).create_time() == started
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
