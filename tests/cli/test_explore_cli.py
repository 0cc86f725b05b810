"""``ftkit explore`` as a user runs it: its tables, report files, messages and exit codes.

No engine runs: the scenario runner the campaign would start is replaced by a stand-in that
passes every scenario, or fails those with a UCE in the sampling phase (a chosen "bug"), as
a real run that left the fault unrecovered would. Generating and validating the scenarios is
real (the first validation imports vLLM, once per process).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from html import escape
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ftkit.results import ScenarioResult, Verdict
from ftkit.scenario import load_scenario
from ftkit.verify import planned_faults
from ftkit_cli.main import ftkit

#: The stand-in's bug: a UCE in the sampling phase is never recovered.
BUG = ("uce", "sample")
BUG_REASON = "fault uce on rank 0 was not recovered <script>alert(1)</script>"
BUG_SIGNATURE = "fail: unrecovered after uce/sample"


def has_bug(scenario) -> bool:
    return any((str(f.kind), str(f.phase)) == BUG for f in scenario.faults)


class FakeRunner:
    """The shape of ``ScenarioRunner`` that a campaign uses; every fault fires. Records how
    it was made and what it ran (on the class: the campaign makes the instance)."""

    made: list[dict] = []
    ran: list[str] = []
    buggy = True
    interrupt_at: int | None = None

    def __init__(self, *, use_cache: bool = True, max_idle_hosts: int = 8) -> None:
        FakeRunner.made.append({"use_cache": use_cache, "max_idle_hosts": max_idle_hosts})

    def run(self, scenario, *, file: str) -> ScenarioResult:
        FakeRunner.ran.append(scenario.name)
        if len(FakeRunner.ran) == FakeRunner.interrupt_at:
            raise KeyboardInterrupt
        failing = FakeRunner.buggy and has_bug(scenario)
        return ScenarioResult(
            name=scenario.name, file=file, verdict=Verdict.FAIL if failing else Verdict.PASS,
            reason=BUG_REASON if failing else "every token matches", duration_s=0.01,
            faults=[replace(f, fired=True) for f in planned_faults(scenario)])

    def close(self) -> None:
        pass


@pytest.fixture
def runner(monkeypatch, tmp_path):
    """The stand-in, wherever the campaign may import the scenario runner from. Commands run
    in ``tmp_path``, with ``--out out``."""
    monkeypatch.chdir(tmp_path)
    FakeRunner.made, FakeRunner.ran = [], []
    FakeRunner.buggy, FakeRunner.interrupt_at = True, None
    monkeypatch.setattr("ftkit.runner.core.ScenarioRunner", FakeRunner)
    monkeypatch.setattr("ftkit.runner.ScenarioRunner", FakeRunner)
    return FakeRunner


def explore(tmp_path: Path, *args: str) -> Result:
    return CliRunner().invoke(ftkit, ["explore", "--out", "out", *args],
                              env={"COLUMNS": "250"})


def report_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "campaign.json").read_text())


def table_row(text: str, *labels: str) -> list[str]:
    """The cells of the rich table row whose first cells are ``labels``."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells[:len(labels)] == list(labels):
            return cells
    raise AssertionError(f"no row {labels} in:\n{text}")


def generated(report: dict) -> list[dict]:
    return [run for run in report["runs"] if not run["shrinking"]]


# --- a clean campaign -------------------------------------------------------------------------

def test_a_clean_campaign_exits_0_and_shows_what_it_covered(tmp_path, runner):
    runner.buggy = False
    result = explore(tmp_path, "--budget", "15", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    report = report_of(tmp_path)
    assert report["scenarios_run"] == 15 and report["failures"] == []
    # A line per run on stderr; the report on stdout.
    assert len(re.findall(r"^\[\s*[\d.]+s\] run \d+ tp 1 ", result.stderr, re.M)) == 15
    assert "coverage: fault kinds x phases" in result.stdout
    assert "15 scenario(s) run" in result.stdout and "no failure" in result.stdout
    # Every kind and phase of the space has a row; a row counts each run once, whatever
    # its features.
    for kind in report["space"]["kinds"]:
        for phase in report["space"]["phases"]:
            runs = sum(1 for run in generated(report) if f"{kind}/{phase}" in run["faults"])
            expected = f"{runs}/0" if runs else "-"
            assert table_row(result.stdout, kind, phase)[2] == expected, (kind, phase)
    plain = sum(1 for run in generated(report) if not run["features"])
    assert table_row(result.stdout, "none")[1] == (f"{plain}/0" if plain else "-")


def test_quiet_prints_no_run_line_and_no_cache_reaches_the_runner(tmp_path, runner):
    runner.buggy = False
    result = explore(tmp_path, "--budget", "5", "-q", "--no-cache")
    assert result.exit_code == 0, result.output
    assert not re.search(r"\] run \d+ tp", result.output)
    assert "5 scenario(s) run" in result.stdout
    assert [made["use_cache"] for made in runner.made] == [False]


# --- failures ---------------------------------------------------------------------------------

def test_a_failure_exits_1_and_is_shrunk_to_a_scenario_file_that_loads(tmp_path, runner):
    result = explore(tmp_path, "--budget", "20", "--seed", "1", "--kinds", "uce,oom")
    assert result.exit_code == 1, result.output
    report = report_of(tmp_path)
    failures = {f["signature"]: f for f in report["failures"]}
    assert BUG_SIGNATURE in failures, list(failures)
    failure = failures[BUG_SIGNATURE]
    # Found as it happened, then listed with its file.
    assert re.search(rf"found {re.escape(BUG_SIGNATURE)} at run \d+: ", result.stderr)
    file = Path(failure["file"])
    assert file.parent == Path("out", "failures") and file.is_file()
    assert re.search(rf"shrunk {re.escape(BUG_SIGNATURE)}: tp 1, 1 request\(s\) x \d+ tokens, "
                     rf"1 fault\(s\) \(uce/sample\), .* -> {re.escape(str(file))}$",
                     result.stderr, re.M)
    # The failures table, one row per field (the only failure there, the others with more
    # faults merged into it).
    assert [f["signature"] for f in report["failures"]] == [BUG_SIGNATURE]
    assert table_row(result.stdout, "signature") == ["signature", BUG_SIGNATURE]
    assert table_row(result.stdout, "shrunk to")[1].startswith("tp 1, 1 request(s)")
    assert table_row(result.stdout, "found at") == ["found at", f"run {failure['found_at']}"]
    assert table_row(result.stdout, "file") == ["file", str(file)]
    seen = table_row(result.stdout, "also seen as")[1:] if failure["also_seen_as"] else []
    assert seen[:1] == failure["also_seen_as"][:1]
    shrunk = load_scenario(file)
    assert [(str(f.kind), str(f.phase)) for f in shrunk.faults] == [BUG]
    assert has_bug(shrunk)
    assert failure["faults"] == ["uce/sample"] and failure["shrink_runs"] > 0


def test_without_shrinking_no_run_is_made_to_shrink(tmp_path, runner):
    result = explore(tmp_path, "--budget", "20", "--seed", "1", "--kinds", "uce,oom",
                     "--no-shrink", "-q")
    assert result.exit_code == 1, result.output
    report = report_of(tmp_path)
    assert report["failures"]
    assert not any(run["shrinking"] for run in report["runs"])


# --- reports ----------------------------------------------------------------------------------

def test_the_json_report_is_the_campaigns(tmp_path, runner):
    runner.buggy = False
    path = tmp_path / "reports" / "explore.json"
    result = explore(tmp_path, "--budget", "15", "--seed", "2", "--json", str(path))
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report == report_of(tmp_path)
    assert report["scenarios_run"] == 15 and report["seed"] == 2
    assert report["stopped"] == "budget" and report["out_dir"] == "out"
    assert len(generated(report)) == 15
    assert {"coverage", "failures", "runs", "space", "scenarios_per_minute"} <= set(report)


def test_the_html_report_shows_the_failure_escaped_and_its_coverage_cell(tmp_path, runner):
    path = tmp_path / "explore.html"
    result = explore(tmp_path, "--budget", "20", "--seed", "1", "--kinds", "uce,oom",
                     "--html", str(path))
    assert result.exit_code == 1, result.output
    page = path.read_text()
    assert escape(BUG_SIGNATURE) in page
    assert "<script>" not in page and escape("<script>alert(1)</script>") in page
    # The uce/sample row at tensor parallel 1: its runs and failures, highlighted.
    report = report_of(tmp_path)
    runs = [run for run in generated(report) if "uce/sample" in run["faults"]]
    failed = sum(1 for run in runs if run["signature"])
    cell = re.search(r"<tr><td class=\"text\">uce</td><td class=\"text\">sample</td>"
                     r"<td class=\"(\w*)\"[^>]*>([^<]*)</td></tr>", page)
    assert cell is not None, page
    assert cell.groups() == ("failed", f"{len(runs)}/{failed}")
    assert Path(report["failures"][0]["file"]).name in page
    assert not re.search(r"(src|href)=\"?https?:", page)  # self-contained


def test_a_report_that_cannot_be_written_exits_2_naming_it(tmp_path, runner):
    runner.buggy = False
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    html = blocker / "explore.html"
    result = explore(tmp_path, "--budget", "3", "--html", str(html))
    assert result.exit_code == 2, result.output
    assert f"cannot write the HTML report {html}" in result.stderr
    assert "Traceback" not in result.output
    assert report_of(tmp_path)["scenarios_run"] == 3  # the others are written


def test_an_interrupted_campaign_exits_130_and_still_reports(tmp_path, runner):
    runner.buggy = False
    runner.interrupt_at = 6
    path = tmp_path / "explore.json"
    result = explore(tmp_path, "--budget", "50", "--json", str(path))
    assert result.exit_code == 130, result.output
    report = json.loads(path.read_text())
    assert report["stopped"] == "interrupted" and report["scenarios_run"] == 5
    assert "coverage: fault kinds x phases" in result.stdout
    assert "stopped: interrupted" in result.stdout


# --- the seed ---------------------------------------------------------------------------------

def test_the_same_seed_runs_the_same_scenarios(tmp_path, runner):
    runner.buggy = False
    def runs(seed: str, name: str) -> list[tuple]:
        folder = tmp_path / name
        result = CliRunner().invoke(ftkit, ["explore", "--budget", "12", "--seed", seed,
                                            "--tp", "1,2", "-q", "--out", str(folder)])
        assert result.exit_code == 0, result.output
        report = json.loads((folder / "campaign.json").read_text())
        return [(r["name"], r["tp"], r["faults"], r["features"]) for r in report["runs"]]

    first = runs("5", "a")
    assert len(first) >= 12
    assert runs("5", "b") == first
    assert runs("6", "c") != first


# --- bad usage --------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--budget", "soon"], "--budget 'soon'"),
    (["--budget", "0"], "--budget '0'"),
    (["--kinds", "uce,meteor"], "--kinds 'uce,meteor': unknown fault kind 'meteor'"),
    (["--features", "seeded,telepathy"], "--features 'seeded,telepathy': unknown feature "
                                         "telepathy"),
    (["--phases", "after"], "--phases 'after': unknown phase after"),
    (["--tp", "one"], "--tp 'one'"),
    (["--tp", "0"], "--tp takes tensor parallel sizes of 1 or more"),
    (["--tp", "1", "--kinds", "link_break"], "link_break need a peer rank: add --tp 2"),
])
def test_bad_options_exit_2_with_one_line_naming_them(tmp_path, runner, args, message):
    result = explore(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert runner.ran == [] and not (tmp_path / "out" / "campaign.json").exists()


# --- the documentation ------------------------------------------------------------------------

def test_the_docs_name_every_option_feature_and_phase():
    from ftkit.explore import FEATURES, PHASES
    from ftkit_cli.explore import explore_command

    docs = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text()
    section = docs[docs.index("## `ftkit explore`"):]
    section = section[:section.index("\n## ", 1)]
    options = [opt for param in explore_command.params for opt in param.opts]
    missing = [name for name in [*options, *FEATURES, *PHASES] if f"`{name}" not in section]
    assert not missing, f"docs/commands.md's ftkit explore section lacks {missing}"
