"""From the ranks' typed events to what a run reports: one record per planned fault (fired,
attempts, recovered, when), one per recovery round, a kill recovered by the engine restart
after it, and the progress lines a front end shows."""

from __future__ import annotations

import pytest

from ftkit.contracts.eventlog import FaultFired, KvRecomputed, RecoveryRound, StepRecovered
from ftkit.contracts.job import EngineRestart
from ftkit.runner.events import collect_events, events_of_run, progress_line
from ftkit.scenario import FaultSpec

T0 = 1000.0


def spec(kind: str, rank=0, request=0, token=5, times=1) -> FaultSpec:
    return FaultSpec.model_validate({"kind": kind, "rank": rank, "times": times,
                                     "at": {"request": request, "token": token}})


def fired(index: int, at: float, *, rank=0, step=7, attempt=1, run_id="r1.1",
          kind="oom") -> FaultFired:
    return FaultFired(rank=rank, time=T0 + at, run_id=run_id, index=index, kind=kind,
                      request=0, token=5, phase="forward", step=step, attempt=attempt, pid=42)


def recovered(at: float, *, rank=0, step=7, recovery_s=0.05) -> StepRecovered:
    return StepRecovered(rank=rank, time=T0 + at, step=step, rpc_kind="execute", failures=1,
                         recovery_s=recovery_s, rollback_s=0.001, rerun_s=0.01)


def round_part(epoch: int, rank: int, state: str, at: float, *, decision="recompute",
               fault="oom", failures=1, duration_s=0.04) -> RecoveryRound:
    return RecoveryRound(rank=rank, time=T0 + at + duration_s, epoch=epoch, state=state,
                         step=7, rpc=3, rpc_kind="execute", failures=failures,
                         fault=fault if state == "failed" else None, error=None,
                         decision=decision, reason=f"reason {epoch}", duration_s=duration_s,
                         started=T0 + at)


def test_a_fired_and_recovered_fault_and_its_round():
    events = [fired(0, 0.5, attempt=1), fired(0, 0.6, attempt=2),
              round_part(0, 0, "failed", 0.51, failures=1),
              round_part(0, 1, "stopped", 0.52, failures=1, duration_s=0.06),
              round_part(1, 0, "failed", 0.61, failures=2),
              recovered(0.7, recovery_s=0.2),
              KvRecomputed(rank=0, time=T0 + 0.65, step=7, requests=1, tokens=5, passes=1,
                           duration_s=0.01)]
    faults, rounds = collect_events(events, [spec("oom", times=2), spec("hang", token=9)],
                                    origin=T0)
    oom, hang = faults
    assert oom.fired and oom.attempts == 2 and oom.recovered
    assert oom.recovery_s == pytest.approx(0.2)
    assert oom.at_s == pytest.approx(0.5)
    assert (oom.fired_at.request, oom.fired_at.token, oom.fired_at.step) == (0, 5, 7)
    assert not hang.fired and not hang.recovered and hang.attempts == 0
    assert [(r.decision, r.ranks, r.kind, r.attempt) for r in rounds] == [
        ("recompute", [0, 1], "oom", 1), ("recompute", [0], "oom", 2)]
    assert rounds[0].duration_s == pytest.approx(0.06)  # the slowest rank
    assert rounds[0].at_s == pytest.approx(0.51)


def test_a_step_recovered_on_another_step_does_not_recover_the_fault():
    faults, _ = collect_events([fired(0, 0.5, step=7), recovered(0.7, step=8)],
                               [spec("oom")], origin=T0)
    assert faults[0].fired and not faults[0].recovered


def test_a_kill_is_recovered_by_the_first_restart_after_it():
    restarts = [EngineRestart(error="died", died_at_s=0.2, restart_s=1.0, resumed_at_s=0.3),
                EngineRestart(error="died", died_at_s=1.1, restart_s=2.0, resumed_at_s=3.5)]
    faults, rounds = collect_events([fired(0, 1.0, kind="process_kill")],
                                    [spec("process_kill")], origin=T0, restarts=restarts)
    [kill] = faults
    assert kill.recovered and kill.restart_s == 2.0
    assert kill.recovery_s == pytest.approx(2.5)
    assert rounds == []


def test_a_kill_without_a_restart_is_not_recovered():
    faults, _ = collect_events([fired(0, 1.0, kind="process_kill")], [spec("process_kill")],
                               origin=T0)
    assert faults[0].fired and not faults[0].recovered


def test_times_count_from_the_first_event_when_the_submission_time_is_unknown():
    faults, _ = collect_events([fired(0, 2.0)], [spec("oom")])
    assert faults[0].at_s == 0.0


def test_a_run_sees_its_own_faults_and_everything_after_it_started():
    mine, other, old = fired(0, 1.0, run_id="r1.2"), fired(0, 1.1, run_id="r1.1"), \
        fired(0, -1.0, run_id="r1.2")
    part = round_part(0, 0, "failed", 1.05)
    assert events_of_run([old, mine, other, part], "r1.2", since=T0) == [mine, part]


def test_progress_lines_name_the_fault_and_the_round_once():
    assert progress_line(fired(0, 0.5, rank=1, step=7, attempt=2)) == (
        "fault", "oom on rank 1 at step 7 (forward, attempt 2)")
    assert progress_line(round_part(3, 0, "failed", 0.5, duration_s=0.25)) == (
        "recovery", "round 3: recompute in 250 ms")
    assert progress_line(round_part(3, 1, "stopped", 0.5)) is None
    assert progress_line(recovered(0.7, rank=1)) is None  # rank 0 reports a recovered step
