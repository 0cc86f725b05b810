"""The own-time tables of the overhead benchmark: the breakdown adds up to the headline, and a
run of some parts never writes where the whole suite's results go."""

from __future__ import annotations

from benchmarks import overhead, own_time
from benchmarks.common import RESULTS_DIR


def summary(median: float) -> dict[str, float]:
    return {"median": median, "low": median, "high": median, "n": 3}


def test_the_breakdown_splits_the_headline_into_pieces_and_the_rest():
    own = {"tp": 1, "probe_us": 0.2,
           "rows": [{"batch": 32, "steps": 3, "runner_us": summary(2000.0),
                     "ftkit_us": summary(20.0), "share": summary(0.01)}],
           "breakdown": [{"batch": 32, "steps": 3, "ftkit_us": summary(25.0),
                          "record_sample_us": summary(2.0),
                          "gate_us": summary(3.0), "hooks_us": summary(4.0),
                          "floor_us": summary(5.0)}]}
    table = own_time.own_time_table(own)
    assert "| 1 | 32 | 3 | 2000 (2000-2000) | 20.0 (20.0-20.0) |" in table
    assert "| 32 | 20.0 | 5.0 | 2.0 | 3.0 | 4.0 | 6.0 |" in table


def test_the_wide_table_gives_the_per_repeat_ratio():
    result = {"wide": {"rows": [{"tp": 1, "batch": 8,
                                 "tokens_per_s": {"off": [10.0, 20.0], "ftkit": [11.0, 18.0]},
                                 "identical": {"off": True, "ftkit": True}}]}}
    assert "| 1 | 8 | 15.0 (10.0-20.0) | 14.5 (11.0-18.0) | 1.000 (0.900-1.100) | yes |" \
        in overhead.wide_table(result)


def test_a_partial_run_writes_beside_the_suites_results(monkeypatch):
    seen = {}

    def suite_main(name, run, argv, doc):
        seen["argv"] = argv
        return 0

    monkeypatch.setattr("benchmarks.suite.main", suite_main)
    overhead.main(["--part", "own-time", "--quick"])
    assert seen["argv"] == ["--quick", "--out",
                            str(RESULTS_DIR / "partial" / "overhead-own-time.json")]
    overhead.main([])
    assert seen["argv"] == []
