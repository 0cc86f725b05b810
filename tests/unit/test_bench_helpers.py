"""The benchmark suite's own arithmetic: summaries, paired ratios, the order of repeats, the
tables, the phases of a recovery round laid out from events, the performance page, the chaos
search's rates.
(Performance itself is measured by ``make bench``, never asserted by a test.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import explore, recovery, report  # noqa: E402
from ftkit.explore import CampaignResult, ExploredRun  # noqa: E402
from ftkit.progress import ProgressEvent  # noqa: E402
from ftkit.results import FaultRecord, ScenarioResult, Verdict  # noqa: E402
from ftkit.scenario.model import Scenario  # noqa: E402
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


# --- the chaos search's rates ---------------------------------------------------------------

def _explored(index, duration_s, faults, shrinking=False):
    return ExploredRun(index=index, name=f"s{index}", tp=1, faults=faults, features=[],
                       verdict="pass", what="", signature=None, reason="ok",
                       duration_s=duration_s, shrinking=shrinking)


def test_explore_figures_count_generated_runs_and_the_time_of_kills():
    result = CampaignResult(seed=1, space={}, budget="60 s", started_at=0.0, duration_s=12.0)
    result.runs = [_explored(0, 2.0, ["uce/forward"]),
                   _explored(1, 6.0, ["oom/sample", "process_kill/before"]),
                   _explored(2, 1.0, ["hang/forward"]),
                   _explored(3, 0.5, ["uce/forward"], shrinking=True)]
    looks = [explore.Look(4, 32, "plain", engine_starts=2, engine_start_s=3.0),
             explore.Look(2, 16, "chunked", restart_s=1.5),
             explore.Look(1, 8, "plain", baseline_from_cache=True),
             explore.Look(1, 8, "plain", baseline_from_cache=True),
             explore.Look(1, 4, "preempt")]  # interrupted before its run was recorded
    got = explore.figures(result, looks)
    assert (got["scenarios_run"], got["shrink_runs"]) == (3, 1)
    assert got["per_minute"] == pytest.approx(20.0)  # 3 in 9 s of generated runs
    assert got["wall_per_minute"] == pytest.approx(15.0)  # 3 in 12 s
    assert got["runs_per_minute"] == pytest.approx(20.0)  # 4 in 12 s
    assert (got["run_s_mean"], got["run_s_median"]) == (pytest.approx(3.0), 2.0)
    assert (got["kill_runs"], got["kill_share"]) == (1, pytest.approx(6.0 / 9.0))
    assert got["requests_mean"] == pytest.approx(7 / 3)
    assert got["max_tokens_mean"] == pytest.approx(56 / 3)
    assert got["at_4x32"] == 1
    assert (got["engine_configs"], got["engine_starts"], got["baselines_cached"]) == (2, 2, 2)
    assert (got["engine_start_s"], got["restart_s"]) == (3.0, 1.5)


class _Runner:
    """A stand-in for ``ScenarioRunner``: starts one engine, reuses it, one restart."""

    def run(self, scenario, *, file, on_event):
        on_event(ProgressEvent(scenario.name, "engine_start"))
        time.sleep(0.05)
        on_event(ProgressEvent(scenario.name, "engine_ready", "engine started in 0.1 s"))
        on_event(ProgressEvent(scenario.name, "engine_ready", "engine reused"))
        fault = FaultRecord(kind="process_kill", rank=0, request=0, token=1, phase="before",
                            times=1, fired=True, restart_s=4.0)
        return ScenarioResult(name=scenario.name, file=file, verdict=Verdict.PASS,
                              reason="ok", duration_s=1.0, faults=[fault],
                              baseline_from_cache=True)


def test_explore_looks_at_each_scenario_it_runs():
    scenario = Scenario.model_validate({
        "name": "t", "workload": {"requests": [{"prompt": "a b"}, {"prompt": "c d"}],
                                  "max_tokens": 8},
        "faults": [{"kind": "process_kill", "rank": 0, "at": {"request": 0, "token": 1},
                    "phase": "before"}]})
    execute = explore.LookingExecute(_Runner())
    assert execute(scenario, "<t>").verdict == Verdict.PASS
    [look] = execute.looks
    assert (look.requests, look.max_tokens, look.engine_starts) == (2, 8, 1)
    assert 0.05 <= look.engine_start_s < 1.0
    assert (look.restart_s, look.baseline_from_cache) == (4.0, True)
    assert '"tensor_parallel_size": 1' in look.engine


def _campaign_figures(tp, per_minute, failures=()):
    return {"tp": tp, "budget_s": 300.0, "seed": 11, "scenarios_run": 100,
            "per_minute": per_minute, "wall_per_minute": per_minute - 1, "generation_s": 250.0,
            "run_s_mean": 2.5, "run_s_median": 2.0, "engine_starts": 6,
            "engine_start_s": 50.0, "engine_configs": 3, "kill_runs": 2, "kill_share": 0.1,
            "shrink_runs": 7 if failures else 0, "failures": list(failures),
            "requests_mean": 2.5, "max_tokens_mean": 18.0, "at_4x32": 4,
            "baselines_cached": 9}


def test_explore_section_checks_each_target():
    text = report._explore({"quick": False, "campaigns": [
        _campaign_figures(1, 24.0),
        _campaign_figures(2, 5.5, ["fail: logprobs after uce/sample"])]})
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or
            line.startswith("| 2 ")]
    assert rows[0].startswith("| 1 | 300 s | 100 | 24.0 | 20 | met | 23.0 | 2.5 (2.0) |")
    assert rows[1].startswith("| 2 | 300 s | 100 | 5.5 | 6 | not met | 4.5 |")
    assert "TP 1: 24.0 scenarios per minute (target 20: met)" in text
    assert "TP 2: 5.5 scenarios per minute (target 6: not met)" in text
    assert "engine starts took 50 s of the 250 s of run time (20 %" in text
    assert "shrunk in 7 runs: `fail: logprobs after uce/sample`" in text
