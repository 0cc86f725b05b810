"""The serve benchmark suite's own arithmetic: tokens per second, gaps, stream comparison, the
delays after a kill, which process is the serving engine's, CPU per cent, and its tables.
(Performance itself is measured by ``make bench``, never asserted by a test.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import report, serve  # noqa: E402


def test_tokens_per_s_counts_every_token_up_to_the_last():
    assert serve.tokens_per_s([[0.5, 1.0], [0.5, 1.0, 2.0]]) == pytest.approx(5 / 2.0)
    assert serve.tokens_per_s([[], []]) is None


PROMETHEUS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 2048.0
vllm:generation_tokens_total{engine="1",model_name="m"} 1024.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:request_inference_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 0.0
vllm:request_inference_time_seconds_count{engine="0",model_name="m"} 16.0
vllm:request_inference_time_seconds_sum{engine="0",model_name="m"} 40.5
"""


def test_metric_totals_sum_each_series_over_its_labels_and_nothing_else():
    totals = serve.metric_totals(PROMETHEUS)
    assert totals == {serve.GENERATED: 3072.0, serve.INFERENCE_SUM: 40.5,
                      serve.INFERENCE_COUNT: 16.0}
    assert serve.metric_totals("") == dict.fromkeys(serve.ENGINE_SERIES, 0.0)


def test_engine_tokens_per_s_is_per_second_of_the_runs_mean_time_in_the_engine():
    before = {serve.GENERATED: 100.0, serve.INFERENCE_SUM: 10.0, serve.INFERENCE_COUNT: 4.0}
    # 16 requests of 128 tokens, each 2.0 s from first scheduled to last token.
    after = {serve.GENERATED: 100.0 + 16 * 128, serve.INFERENCE_SUM: 10.0 + 16 * 2.0,
             serve.INFERENCE_COUNT: 20.0}
    assert serve.engine_tokens_per_s(before, after) == pytest.approx(16 * 128 / 2.0)
    assert serve.engine_tokens_per_s(before, before) is None


def test_largest_gap_is_within_one_stream_never_across():
    assert serve.largest_gap([[0.0, 0.1, 0.5], [10.0, 10.2]]) == pytest.approx(0.4)
    assert serve.largest_gap([[1.0], []]) is None


def test_the_largest_gap_span_says_when_it_was():
    assert serve.largest_gap_span([[0.0, 0.1, 0.5], [10.0, 10.2]]) == (0.1, 0.5)
    assert serve.largest_gap_span([[]]) is None


def test_stalls_count_only_their_part_within_the_window():
    stalls = [(1.0, 2.0), (5.0, 9.0), (20.0, 20.5)]
    # 0.5 s of the first, 3 s of the second (the longest there); the third lies outside.
    assert serve.stalled_within(stalls, 1.5, 8.0) == (3.5, 3.0)
    assert serve.stalled_within(stalls, 10.0, 19.0) == (0.0, 0.0)
    assert serve.stalled_within([], 0.0, 1.0) == (0.0, 0.0)


def test_a_runs_stalls_are_placed_on_its_clients_clock():
    run = serve.Driven([], False, released_wall=0.0, released=100.0,
                       stalls=[(101.0, 104.0)])
    assert run.stalled(0.5, 2.0) == (1.0, 1.0)
    assert run.stalled(4.0, 5.0) == (0.0, 0.0)


def test_a_process_not_run_is_noted_by_the_stall_watch():
    import time
    stalls = serve.Stalls()
    time.sleep(0.05)
    # What a stall looks like to the watch: a tick that woke far too late. Holding the
    # interpreter lock in one call (a long C call, as a starved process sees it) makes one.
    sum(range(30_000_000))
    time.sleep(0.05)
    intervals = stalls.stop()
    assert intervals and max(b - a for a, b in intervals) > serve.Stalls.STALL_S


def test_mismatched_names_streams_whose_ids_or_logprobs_differ():
    ref = [([1, 2], [-0.1, -0.2]), ([3], [-0.3])]
    assert serve.mismatched(ref, ref) == []
    assert serve.mismatched(ref, [([1, 2], [-0.1, -0.25]), ([3], [-0.3])]) == [0]
    assert serve.mismatched(ref, [([1, 2], [-0.1, -0.2]), ([4], [-0.3])]) == [1]
    with pytest.raises(ValueError):
        serve.mismatched(ref, ref[:1])


def test_resumed_streams_are_read_from_the_servers_log():
    log = ("WARNING ftkit: resuming request cmpl-kill-run-1-0 on the new engine after 7 "
           "token(s)\nWARNING ftkit: resuming request cmpl-kill-run-12-0 on the new engine "
           "after 0 token(s)\nWARNING ftkit: resuming request other-3 on the new engine "
           "after 2 token(s)\n")
    assert serve.resumed_after(log, "kill-run") == {1: 7, 12: 0}


def test_resume_delays_count_the_new_engines_first_token_only():
    # Stream 0 had 2 tokens when resumed: its third (at 9.0) is the new engine's first; the
    # token at 5.1, after the kill at 5.0, was made before it.
    times = [[1.0, 5.1, 9.0, 9.1], [1.0], [1.0, 2.0]]
    assert serve.resume_delays(5.0, times, {0: 2, 1: 1}) == [4.0, None]
    assert serve.resume_delays(5.0, times, {}) == []


def test_resume_gaps_are_what_the_clients_read_across_the_resume():
    # Kill at 5.0. Stream 0 (2 tokens before it) read its second at 6.0, a backlog, and the
    # new engine's first at 6.5; stream 2 read its last dead-engine token at 4.0 and the
    # next at 7.0; stream 1 was resumed with no token: no gap of its own.
    times = [[1.0, 6.0, 6.5, 6.6], [8.0], [1.0, 4.0, 7.0]]
    gap, behind = serve.resume_gaps(5.0, times, {0: 2, 1: 0, 2: 2})
    assert gap == pytest.approx(3.0) and behind == pytest.approx(1.0)
    assert serve.resume_gaps(5.0, times, {1: 0}) == (None, None)


def test_server_resume_delays_count_each_streams_first_event_after_the_kill():
    from ftkit import RequestResumed

    def event(request_id: str, at: float) -> RequestResumed:
        return RequestResumed(request_id=request_id, delivered=5, after_death_s=0.1, time=at)

    events = [event("cmpl-kill-run-0-0", 99.0),  # an earlier kill's
              event("cmpl-kill-run-0-0", 101.5), event("cmpl-kill-run-0-0", 103.0),
              event("cmpl-kill-run-12-0", 102.0), event("cmpl-other-3", 101.0)]
    assert serve.server_resume_delays(100.0, events, "kill-run") == {0: 1.5, 12: 2.0}


def test_cpu_percent_and_spread():
    assert serve.cpu_percent(1.0, 1.5, 5.0) == pytest.approx(10.0)
    assert serve.spread([1.0]) == 0.0
    assert serve.spread([0.9, 1.0, 1.2]) == pytest.approx(0.3)


def test_the_on_off_servers_start_in_both_orders_over_the_repeats():
    assert serve.halves(7) == [(("on", "off"), 4), (("off", "on"), 3)]
    assert serve.halves(2) == [(("on", "off"), 1), (("off", "on"), 1)]
    assert serve.halves(1) == [(("on", "off"), 1)]


def test_the_halves_merge_into_one_result_with_ratios_over_every_repeat():
    def half(on, off, failed, started):
        return {"engine_tokens_per_s": {"on": on, "off": off},
                "tokens_per_s": {"on": [r / 2 for r in on], "off": [r / 2 for r in off]},
                "clients_stalled_s": {"on": [0.0] * len(on), "off": [0.1] * len(off)},
                "failed_streams": {"on": failed, "off": 0},
                "engine_ratios": [a / b for a, b in zip(on, off)], "started": started}

    merged = serve.merged_halves([half([90.0, 100.0], [100.0, 100.0], 1, ["on", "off"]),
                                  half([110.0], [100.0], 2, ["off", "on"])])
    assert merged["engine_tokens_per_s"] == {"on": [90.0, 100.0, 110.0],
                                             "off": [100.0, 100.0, 100.0]}
    assert merged["engine_ratios"] == pytest.approx([0.9, 1.0, 1.1])
    assert merged["ratios"] == pytest.approx([0.9, 1.0, 1.1])
    assert merged["engine_ratio_spread"] == pytest.approx(0.2)
    assert merged["clients_stalled_s"]["off"] == [0.1, 0.1, 0.1]
    assert merged["failed_streams"] == {"on": 3, "off": 0}
    assert [h["started"] for h in merged["halves"]] == [["on", "off"], ["off", "on"]]
    assert merged["halves"][1]["engine_ratios"] == pytest.approx([1.1])


def test_the_order_of_the_starts_cancels_in_the_geometric_mean_of_the_halves():
    # The server started second ran faster, on or off: 4 % either way cancels.
    halves = [{"started": ["on", "off"], "engine_ratios": [0.95, 0.96, 0.99]},
              {"started": ["off", "on"], "engine_ratios": [1.04, 1.0, 1.05]}]
    assert serve.order_balanced(halves) == pytest.approx((0.96 * 1.04) ** 0.5)
    assert serve.order_balanced(halves[:1]) is None
    assert serve.order_balanced([]) is None


def test_the_reading_checks_the_throughput_target_on_the_balanced_ratio():
    def reading(halves):
        result = _result(cold=25.5, standby=0.4)
        ratios = [r for h in halves for r in h["engine_ratios"]]
        result["wide_throughput"].update(engine_ratios=ratios, halves=halves)
        return report.render({"serve": result})

    # The median of all (0.97) misses the target; with the order cancelled it is met.
    text = reading([{"started": ["on", "off"], "engine_ratios": [0.95, 0.96, 0.97]},
                    {"started": ["off", "on"], "engine_ratios": [1.03, 1.04]}])
    assert ("wide model, on/off >= 0.99: met (0.997, the geometric mean of the two halves' "
            "medians, 0.960 with on started first and 1.035 with off started first; median "
            "of all 0.970, repeats 0.950-1.040, 1.0 inside the range)") in text
    # Both halves low: not met.
    text = reading([{"started": ["on", "off"], "engine_ratios": [0.95, 0.96, 0.97]},
                    {"started": ["off", "on"], "engine_ratios": [0.97, 0.98]}])
    assert "wide model, on/off >= 0.99: not met (0.967, the geometric mean" in text


def test_the_fault_body_is_what_the_injection_route_takes():
    case = serve.FaultCase("uce kv", "uce", 1, params=(("region", "kv"),))
    assert case.body("f-1", 8) == {"kind": "uce", "rank": 1, "phase": "forward", "times": 1,
                                   "params": {"region": "kv"}, "request_id": "f-1", "token": 8}


def test_engine_starts_are_laid_out_from_the_log_lines():
    # The server's line at 100; the first engine up at 120; the standby, begun then, at 150.
    assert serve.engine_starts(100.0, [120.0, 150.0]) == [20.0, 30.0]
    assert serve.engine_starts(None, [120.0]) == []
    assert serve.engine_start_s({"faults": [20.0], "standby": [21.0, 30.0]}) == 20.0
    assert serve.engine_start_s({"faults": []}) is None


def _result(cold: float | None, standby: float | None, failed: int = 0,
            clients_late_s: float | None = None,
            engine_ratios: tuple[float, ...] = (0.99, 1.01)) -> dict:
    """A serve result; ``clients_late_s``: a result measured on the server too (its resumes
    as given, the clients' that much later)."""
    def kill(mode: str, slowest: float | None) -> dict:
        on_server = {} if clients_late_s is None else {
            "server_resumed": 4 if slowest is not None else 0,
            "server_all_resumed_s": slowest,
            "server_resumed_s": {"0": slowest} if slowest is not None else {}}
        if clients_late_s is not None and slowest is not None:
            slowest += clients_late_s
            on_server.update(client_resume_gap_s=0.25, clients_behind_s=clients_late_s,
                             clients_stalled_s=clients_late_s * 0.9,
                             clients_longest_stall_s=clients_late_s * 0.6)
        return {**on_server, "mode": mode, "streams": 4, "max_tokens": 100, "killed_pid": 1,
                "kill_at_s": 1.0, "running_at_kill": 4,
                "resumed": 4 if slowest is not None else 0,
                "resumed_by_server": 4 if slowest is not None else 0,
                "all_resumed_s": slowest, "slowest_resumed_s": slowest,
                "failed_streams": failed, "errors": [], "complete": 4, "differ": [],
                "reference_errors": 0, "server_restart_s": 20.0}

    return {
        "suite": "serve", "quick": True, "wall_s": 1.0, "load_avg_1m_after": 1.0,
        "machine": {"cpus": 2, "vllm": "x", "torch": "y", "commit": "c", "when": "now",
                    "load_avg_1m": 1.0},
        "plan": {"repeats": 2, "streams": 8, "max_tokens": 48, "fault_streams": 4,
                 "fault_tokens": 32, "kill_streams": 4, "kill_tokens": 100, "idle_s": 4.0,
                 "wide_repeats": 3, "wide_streams": 4, "wide_max_tokens": 16},
        "tp": 2,
        "throughput": {"engine_tokens_per_s": {"on": [990.0, 1010.0],
                                               "off": [1000.0, 1000.0]},
                       "engine_ratios": list(engine_ratios), "engine_ratio_spread": 0.02,
                       "tokens_per_s": {"on": [99.0, 101.0], "off": [100.0, 100.0]},
                       "ratios": [0.5, 0.6], "failed_streams": {"on": 0, "off": 0},
                       "ratio_spread": 0.02},
        "wide_throughput": {"engine_tokens_per_s": {"on": [40.0, 41.0, 39.0],
                                                    "off": [40.0, 40.0, 40.0]},
                            "engine_ratios": [1.0, 1.025, 0.975], "engine_ratio_spread": 0.05,
                            "tokens_per_s": {"on": [30.0, 30.0, 30.0],
                                             "off": [30.0, 30.0, 30.0]},
                            "ratios": [1.0, 1.0, 1.0], "failed_streams": {"on": 0, "off": 1},
                            "ratio_spread": 0.0},
        "faults": {"streams": 4, "max_tokens": 32, "token": 8, "request": 1,
                   "reference_gap_s": 0.05, "reference_errors": 0,
                   "reference_repeat_mismatched": [],
                   "rows": [{"case": "device_reset", "kind": "device_reset", "rank": 0,
                             "planned": 1, "fired": 1, "planned_index": 0,
                             "largest_gap_s": 0.5, "failed_streams": 0, "timed_out": False,
                             "errors": [], "mismatched": []}]},
        "kills": [kill("cold", cold), kill("standby", standby)],
        "server_start_s": {"on": 40.0, "off": 40.0, "faults": 40.0, "standby": 45.0},
        "engine_starts_s": {"faults": [25.0], "standby": [25.0, 30.0]}, "engine_start_s": 25.0,
        "idle": {"idle_s": 4.0, "engines": [
            {"engine": "serving", "processes": 3, "rss_bytes": 2**30, "uss_bytes": 2**29,
             "cpu_percent": 1.0},
            {"engine": "standby", "processes": 3, "rss_bytes": 2**30, "uss_bytes": 2**29,
             "cpu_percent": 0.5}]},
    }


def test_the_serve_section_checks_its_targets():
    text = report.render({"serve": _result(cold=25.5, standby=0.4)})
    assert "### Serving" in text
    assert ("Tokens per second in the engine, tiny model, on/off >= 0.99: met (median 1.000, "
            "repeats 0.990-1.010, 1.0 inside the range); as the clients read them, 0.550") in text
    assert "| tiny | engine | 8 x 48 | 2 | 1000 " in text
    assert "| tiny | clients | 8 x 48 | 2 | 100 " in text
    # The wide model's on and off, with its own plan.
    assert ("Tokens per second in the engine, wide model, on/off >= 0.99: met (median 1.000, "
            "repeats 0.975-1.025, 1.0 inside the range); as the clients read them, 1.000") in text
    assert "| wide | engine | 4 x 16 | 3 | 40 (40-40) | 40 (39-41) | 1.000 " in text
    assert "| wide | clients | 4 x 16 | 3 | 30 " in text and "| 1/0 |" in text
    slower = report.render({"serve": _result(cold=25.5, standby=0.4,
                                             engine_ratios=(0.95, 0.97))})
    assert "in the engine, tiny model, on/off >= 0.99: not met (median 0.960" in slower
    # A run of some parts: only what it measured.
    result = _result(cold=25.5, standby=0.4)
    del result["throughput"]
    wide_only = report.render({"serve": result})
    assert "wide model, on/off" in wide_only and "tiny model, on/off" not in wide_only
    assert "Tokens per second, tiny model: not in these results" in wide_only
    assert "cold replacement: every resumed stream's next token 25.50 s after the kill" in text
    assert "standby" in text and "not met" not in text
    missed = report.render({"serve": _result(cold=40.0, standby=2.0, failed=1)})
    none = report.render({"serve": _result(cold=None, standby=0.5)})
    assert "cold replacement: no stream was resumed" in none
    # cold, standby, and the failed streams of each
    assert missed.count("not met") == 4


def test_the_kill_targets_are_checked_on_the_server_where_it_was_measured():
    text = report.render({"serve": _result(cold=25.5, standby=0.4, clients_late_s=9.0)})
    assert ("standby replacement: every resumed stream had its next output from the server "
            "0.40 s after the kill (its next token at the clients after 9.40 s; the largest "
            "gap a client read across the resume 0.25 s; the clients read the dead engine's "
            "last tokens up to 9.00 s after the kill; meanwhile the clients' own process was "
            "not run for 8.10 s (longest 5.40 s))") in text
    assert "not met" not in text
    late = report.render({"serve": _result(cold=25.5, standby=1.5, clients_late_s=0.1)})
    assert late.count("not met") == 1
    # Both columns in the table.
    assert "| 0.40 | 9.40 |" in text


def test_a_cold_replacement_is_held_to_its_own_engine_start_where_the_log_gave_it():
    result = _result(cold=27.0, standby=0.4, clients_late_s=0.0)
    cold = result["kills"][0]
    # Launch's engine start 25.0 s: 27.0 s would miss 26.0 s; the new engine's own 26.5 s
    # under the same load makes the target 27.5 s.
    cold["replacement_start_s"] = 26.5
    text = report.render({"serve": result})
    assert ("(target the new engine's own start + 1 s = 27.50 s; the server's first engine "
            "started in 25.00 s, at launch: met)") in text
    cold["replacement_start_s"] = 25.5
    assert "= 26.50 s; the server's first engine started in 25.00 s, at launch: not met" in (
        report.render({"serve": result}))
    del cold["replacement_start_s"]
    assert "(target engine start + 1 s = 26.00 s: not met)" in report.render({"serve": result})


def test_the_serve_section_is_on_the_page_before_any_result():
    text = report.render({})
    assert "### Serving" in text and "python -m benchmarks --only serve" in text
