"""The ranks' event log: what each rank did about faults, as typed records in JSON lines.

Every rank appends to a file of its own (``rank<r>-<pid>.jsonl`` in the event-log directory);
the file is the only channel that survives the engine's death, so every event is written and
flushed as it happens. Readers merge the files of all ranks with ``read_events``, the one
reader every consumer uses (the scenario runner, the engine session's re-planning after a
restart, the pytest plugin, the benchmarks).

The events, one class each::

    FaultFired       the injector fired a planned fault (written before the fault acts)
    FaultSkipped     a live fault (planned in a server) that could not act where it fired:
                     skipped, the engine serves on
    StepRecovered    a step that failed returned on its re-run
    RecoveryRound    this rank's part of one recovery round: its status and the decision
    KvRecomputed     lost KV was recomputed before a re-run
    ParamsReloaded   parameters hit by a memory error were reloaded
    EngineReplaced   a server's engine died and was replaced (written by the API server,
                     as rank -1: ``ftkit.vllm.restart``)
    RequestResumed   a request the server resumed on the new engine got its first output
                     from it (the API server too)

Each line is ``{"event": NAME, "v": VERSION, "rank": ..., "time": ..., <fields>}``. A reader
skips a line cut short by a killed process; a line of another version is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ftkit.errors import FtkitError

#: The version of the event-log line format.
VERSION = 1


class EventLogError(FtkitError):
    """An event-log line that this ftkit cannot read (another version, an unknown event)."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """Fields every event has; ``rank`` and ``time`` are filled in by ``EventLog.emit``."""

    NAME: ClassVar[str] = ""
    rank: int = -1
    #: ``time.time()`` when the event was written.
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"event": self.NAME, "v": VERSION, **dataclasses.asdict(self)})

    @staticmethod
    def from_json(line: str) -> Event:
        raw = json.loads(line)
        version = raw.pop("v", None)
        if version != VERSION:
            raise EventLogError(f"event-log line of version {version!r}; this ftkit reads "
                                f"version {VERSION}")
        name = raw.pop("event", None)
        cls = _BY_NAME.get(name)
        if cls is None:
            raise EventLogError(f"unknown event {name!r} in the event log")
        return cls(**raw)


@dataclass(frozen=True, kw_only=True)
class FaultFired(Event):
    NAME: ClassVar[str] = "fault_fired"
    run_id: str | None
    #: The fault's place in the scenario's (the plan's) faults.
    index: int
    kind: str
    request: int
    #: The output token index the fault was planned at.
    token: int
    phase: str
    step: int
    #: Which failing attempt of the step this firing is (1 for the first).
    attempt: int
    pid: int


@dataclass(frozen=True, kw_only=True)
class FaultSkipped(Event):
    """A live fault fired (``FaultFired``) and could not act there (its kind's injection
    said why): it is skipped, no attempt of it is left, and the step runs on unharmed."""

    NAME: ClassVar[str] = "fault_skipped"
    index: int
    kind: str
    step: int
    phase: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class StepRecovered(Event):
    NAME: ClassVar[str] = "step_recovered"
    step: int
    rpc_kind: str
    failures: int
    recovery_s: float
    rollback_s: float
    rerun_s: float


@dataclass(frozen=True, kw_only=True)
class RecoveryRound(Event):
    """One rank's part of a recovery round (``epoch``): its status and the decision."""

    NAME: ClassVar[str] = "recovery_round"
    epoch: int
    #: The rank's state in the round: ``failed`` (its own fault) or ``stopped`` (a peer's).
    state: str
    step: int
    rpc: int
    rpc_kind: str
    failures: int
    #: The kind of this rank's own fault, if any.
    fault: str | None
    error: str | None
    #: ``recompute`` or ``raise``.
    decision: str
    reason: str
    kinds: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    #: ``time.time()`` when the round started on this rank.
    started: float = 0.0
    kv_lost_all: bool = False
    kv_lost_blocks: int = 0
    reload_params: list[str] = field(default_factory=list)
    #: ``time.time()`` when this rank's monitor stopped its step for this round (when it
    #: learnt of a peer's fault), if it did.
    stop_requested: float | None = None
    statuses_s: float | None = None
    rebuild_s: float | None = None
    peers_done_s: float | None = None
    #: Parts of this rank's rebuild: device restart, communicators, repairs.
    device_s: float | None = None
    comms_s: float | None = None
    repair_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class KvRecomputed(Event):
    NAME: ClassVar[str] = "kv_recomputed"
    step: int
    requests: int
    tokens: int
    passes: int
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class ParamsReloaded(Event):
    NAME: ClassVar[str] = "params_reloaded"
    params: list[str]


@dataclass(frozen=True, kw_only=True)
class EngineReplaced(Event):
    """A server's engine that died, replaced by a new engine (or the warm standby), which
    resumed the requests the dead one ran. ``time``: when the new engine took over."""

    NAME: ClassVar[str] = "engine_replaced"
    #: How the death showed.
    error: str
    #: From the death being acted on until the new engine took over.
    restart_s: float
    standby: bool


@dataclass(frozen=True, kw_only=True)
class RequestResumed(Event):
    """A request resumed on a server's new engine (after ``EngineReplaced``) got its first
    output from that engine: its client's stream goes on. ``time``: when that output went to
    the client's stream."""

    NAME: ClassVar[str] = "request_resumed"
    #: The request's id in the server (vLLM's, from the client's ``X-Request-Id``).
    request_id: str
    #: Tokens its client had before the engine died.
    delivered: int
    #: From the death being acted on (the replacement's start) until that output.
    after_death_s: float


#: The rank an API server's events carry: it is no rank of the engine.
SERVER_RANK = -1

_BY_NAME: dict[str, type[Event]] = {
    cls.NAME: cls for cls in (FaultFired, FaultSkipped, StepRecovered, RecoveryRound,
                              KvRecomputed, ParamsReloaded, EngineReplaced, RequestResumed)
}

E = TypeVar("E", bound=Event)


class EventLog:
    """One rank's writer. ``directory=None`` keeps the events in memory only."""

    def __init__(self, rank: int, directory: str | Path | None) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._path = (Path(directory) / f"rank{rank}-{os.getpid()}.jsonl"
                      if directory else None)
        self.events: list[Event] = []

    def emit(self, event: Event) -> Event:
        """Write ``event`` (stamped with this rank and the time) and flush it."""
        event = dataclasses.replace(event, rank=self.rank, time=time.time())
        with self._lock:
            self.events.append(event)
            if self._path is not None:
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(event.to_json() + "\n")
        return event


def read_events(directory: str | Path) -> list[Event]:
    """Every event of every rank in ``directory``, ordered by time."""
    events: list[Event] = []
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                events.append(Event.from_json(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
    events.sort(key=lambda e: e.time)
    return events


def only(events: Iterable[Event], cls: type[E]) -> list[E]:
    """The events of type ``cls``, in order."""
    return [e for e in events if isinstance(e, cls)]
