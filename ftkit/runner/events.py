"""From the ranks' event log to what a run reports: one record per planned fault and per
recovery round, and the progress lines a front end shows while the run goes on.

Every reader here takes typed events (``ftkit.contracts.eventlog``); times in the records are
seconds after the workload was submitted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from ftkit.contracts.eventlog import Event, FaultFired, RecoveryRound, StepRecovered, only
from ftkit.contracts.job import EngineRestart
from ftkit.kinds import kind_spec
from ftkit.results import FaultRecord, FiredAt, RecoveryRecord
from ftkit.scenario.model import FaultSpec


def events_of_run(events: Iterable[Event], run_id: str | None, since: float) -> list[Event]:
    """The events of one run in a shared event log: those written from ``since``
    (``time.time()``) on, of which fired faults only when they carry ``run_id``."""
    return [e for e in events if e.time >= since
            and (not isinstance(e, FaultFired) or e.run_id == run_id)]


def collect_events(events: Sequence[Event], planned: Sequence[FaultSpec], *,
                   origin: float | None = None, restarts: Sequence[EngineRestart] = ()
                   ) -> tuple[list[FaultRecord], list[RecoveryRecord]]:
    """Turn the ranks' events into one record per planned fault and per round.

    Times are made relative to ``origin`` (when the workload was submitted; the first event
    when it is unknown). A fault that killed a process is recovered by the first engine
    restart after it fired (``restarts``, times relative to ``origin``)."""
    t0 = origin if origin is not None else min((e.time for e in events), default=0.0)
    fired_all = only(events, FaultFired)
    recovered_all = only(events, StepRecovered)
    records = [_fault_record(index, spec, fired_all, recovered_all, t0, restarts)
               for index, spec in enumerate(planned)]
    return records, _rounds(only(events, RecoveryRound), t0)


def _fault_record(index: int, spec: FaultSpec, fired_all: list[FaultFired],
                  recovered_all: list[StepRecovered], t0: float,
                  restarts: Sequence[EngineRestart]) -> FaultRecord:
    rec = FaultRecord(kind=str(spec.kind), rank=spec.rank, request=spec.at.request,
                      token=spec.at.token, phase=spec.phase, times=spec.times)
    fired = [e for e in fired_all if e.index == index]
    if not fired:
        return rec
    first = fired[0]
    rec.fired = True
    rec.fired_at = FiredAt(request=first.request, token=first.token, step=first.step)
    rec.attempts = max(e.attempt for e in fired)
    rec.at_s = first.time - t0
    ranks = {e.rank for e in fired}
    steps = {e.step for e in fired}
    recovered = [e for e in recovered_all
                 if e.rank in ranks and e.time >= first.time and e.step in steps]
    if recovered:
        rec.recovered = True
        rec.recovery_s = max(e.recovery_s for e in recovered)
    if kind_spec(spec.kind).ends_process:
        _resumed_by_restart(rec, restarts)
    return rec


def _rounds(parts_of_all: list[RecoveryRound], t0: float) -> list[RecoveryRecord]:
    """One record per round (epoch), from every rank's part of it."""
    by_epoch: dict[int, list[RecoveryRound]] = defaultdict(list)
    for e in parts_of_all:
        by_epoch[e.epoch].append(e)
    rounds = []
    for epoch in sorted(by_epoch):
        parts = by_epoch[epoch]
        failed = [p for p in parts if p.state == "failed"] or parts
        rounds.append(RecoveryRecord(
            step=min(p.step for p in failed),
            kind=",".join(sorted({p.fault for p in failed if p.fault})) or "unknown",
            decision=parts[0].decision,
            attempt=max(p.failures for p in parts),
            ranks=sorted(p.rank for p in parts),
            duration_s=max(p.duration_s for p in parts),
            reason=parts[0].reason,
            at_s=min(p.started for p in parts) - t0))
    return rounds


def _resumed_by_restart(rec: FaultRecord, restarts: Sequence[EngineRestart]) -> None:
    """A kill is recovered by the first restart after it, if the requests were resumed."""
    if rec.at_s is None:
        return
    after = [r for r in restarts if r.resumed_at_s >= rec.at_s]
    if after:
        first = after[0]
        rec.recovered = True
        rec.restart_s = first.restart_s
        rec.recovery_s = first.resumed_at_s - rec.at_s


def progress_line(event: Event) -> tuple[str, str] | None:
    """The ``(stage, message)`` a front end shows for ``event`` while the run goes on, if any:
    a fired fault, a recovery round's decision, and a step that ran again after failing (the
    last two once, from rank 0)."""
    if isinstance(event, FaultFired):
        return ("fault", f"{event.kind} on rank {event.rank} at step {event.step} "
                         f"({event.phase}, attempt {event.attempt})")
    if isinstance(event, RecoveryRound) and event.rank == 0:
        # A round that gives up says why: that is the line a CI log is read for.
        why = f" ({event.reason})" if event.decision == "raise" and event.reason else ""
        return ("recovery", f"round {event.epoch}: {event.decision} in "
                            f"{event.duration_s * 1000:.0f} ms{why}")
    if isinstance(event, StepRecovered) and event.rank == 0:
        return ("recovered", f"step {event.step} ran again after {event.failures} failed "
                             f"attempt(s), {event.recovery_s * 1000:.0f} ms")
    return None
