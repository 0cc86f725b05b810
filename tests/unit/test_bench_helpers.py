"""The benchmark suite's own arithmetic: summaries, paired ratios, the order of repeats, the
tables, the phases of a recovery round laid out from events, the performance page.
(Performance itself is measured by ``make bench``, never asserted by a test.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import recovery, report  # noqa: E402
from ftkit.contracts.eventlog import (  # noqa: E402
    FaultFired,
    KvRecomputed,
    RecoveryRound,
    StepRecovered,
)
from benchmarks.stats import (  # noqa: E402
    Summary,
    fmt_summary,
    markdown_table,
    paired_ratios,
    rotations,
    summarize,
)


def test_summary_is_median_with_range():
    assert summarize([3, 1, 2, 10]) == Summary(2.5, 1, 10, 4)
    with pytest.raises(ValueError):
        summarize([])


def test_ratios_are_taken_per_repeat():
    assert paired_ratios([2, 3], [1, 6]) == [2.0, 0.5]
    with pytest.raises(ValueError):
        paired_ratios([1, 2], [1])


def test_each_item_leads_a_repeat_equally_often():
    orders = rotations(["off", "ftkit", "legacy"], 6)
    assert [o[0] for o in orders] == ["off", "ftkit", "legacy"] * 2
    assert all(sorted(o) == ["ftkit", "legacy", "off"] for o in orders)


def test_markdown_table_and_cells():
    text = markdown_table(["a", "b"], [[1, fmt_summary(Summary(0.5, 0.25, 1.0, 3), 1, 1000)]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | 500.0 (250.0-1000.0) |"]
    with pytest.raises(ValueError):
        markdown_table(["a"], [[1, 2]])


def _round(rank, started, duration, stop=None, epoch=0, **times):
    return RecoveryRound(rank=rank, epoch=epoch, time=started + duration, started=started,
                         duration_s=duration, stop_requested=stop, state="failed", step=1,
                         rpc=1, rpc_kind="execute", failures=1, fault="oom", error=None,
                         decision="recompute", reason="", **times)


def _recovered(rank, time, rollback_s, rerun_s):
    return StepRecovered(rank=rank, time=time, step=1, rpc_kind="execute", failures=1,
                         recovery_s=0.0, rollback_s=rollback_s, rerun_s=rerun_s)


def _fired(time):
    return FaultFired(time=time, run_id="r1", index=0, kind="oom", request=0, token=1,
                      phase="forward", step=1, attempt=1, pid=1)


def test_round_phases_follow_the_slowest_rank():
    t0 = 100.0
    rounds = [
        # The failing rank joins 5 ms after its fault; the peer's monitor stops it at 8 ms
        # and the peer joins at 9 ms.
        _round(0, t0 + 0.005, 0.060, statuses_s=0.006, device_s=0.001, comms_s=0.040,
               repair_s=0.0),
        _round(1, t0 + 0.009, 0.056, stop=t0 + 0.008, statuses_s=0.002, device_s=0.0,
               comms_s=0.045, repair_s=0.0),
    ]
    kv = [KvRecomputed(rank=0, duration_s=0.010, time=t0 + 0.07, step=1, requests=1,
                       tokens=1, passes=1)]
    recovered = [_recovered(0, t0 + 0.090, 0.001, 0.020),
                 _recovered(1, t0 + 0.085, 0.002, 0.015)]
    p = recovery.round_phases(t0, rounds, kv, recovered)
    assert p["detect"] == pytest.approx(0.008)
    assert p["stop"] == pytest.approx(0.001)
    assert p["agree"] == pytest.approx(0.002)  # rank 0: 5 + 6 ms, after rank 1 joined at 9
    assert p["comms"] == pytest.approx(0.040)  # the last to arrive waited least
    assert p["restore"] == pytest.approx(0.011)  # rollback + KV recompute on rank 0
    assert p["rerun"] == pytest.approx(0.015)
    assert p["total"] == pytest.approx(0.090)


def test_faults_are_matched_to_their_own_round():
    fired = [_fired(10.0), _fired(20.0)]
    events = [*fired, _round(0, 10.01, 0.05), _round(0, 20.02, 0.05, epoch=1),
              _recovered(0, 20.2, 0.0, 0.1)]
    first, second = recovery.fault_phases(fired, events)
    assert first["detect"] == pytest.approx(0.01) and first["total"] is None
    assert second["detect"] == pytest.approx(0.02) and second["total"] == pytest.approx(0.2)


def test_fault_plan_spreads_faults_over_steps_requests_and_ranks():
    plan = recovery.fault_plan(recovery.CASES[0], 3, tp=2)
    assert [f.at.token for f in plan] == [4, 22, 40]
    assert [f.rank for f in plan] == [0, 1, 0]
    assert [f.at.request for f in plan] == [0, 1, 2]


def test_performance_page_is_written_whole_from_the_saved_results(tmp_path):
    results = REPO / "benchmarks" / "results"
    out = tmp_path / "results"
    out.mkdir()
    for saved in results.glob("*.json"):
        (out / saved.name).write_text(saved.read_text())
    page = tmp_path / "performance.md"
    page.write_text("stale\n")
    markdown = report.write(out, page=page)
    text = page.read_text()
    assert text.startswith(report.PAGE_TITLE + "\n")
    assert markdown in text and "stale" not in text
    assert (out / "RESULTS.md").read_text() == "# ftkit benchmark results\n\n" + markdown + "\n"


def test_performance_page_is_left_alone_without_results(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("kept\n")
    report.write(tmp_path, page=page)
    assert page.read_text() == "kept\n"
