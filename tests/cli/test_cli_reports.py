"""``ftkit run`` reports and selection: --junit, --html, --fail-fast, -k, and ``ftkit report``.

Most tests use a stand-in ``ftkit.runner`` (as tests/cli/test_cli.py does) so that they run in
a second; the last one runs a real engine end to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ftkit.report import read_json_report
from ftkit.results import (
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)
from ftkit_cli.main import ftkit
from ftkit_cli.select import name_matcher

from _stub_runner import install_stub_runner

ROOT = Path(__file__).resolve().parents[2]
FTKIT = [sys.executable, "-c", "from ftkit_cli.main import main; main()"]


def scenario_yaml(name: str) -> str:
    return textwrap.dedent(f"""\
        name: {name}
        workload:
          prompts: ["the quick brown fox", "a lazy dog"]
          max_tokens: 8
        faults:
          - kind: oom
            rank: 0
            at: {{request: 0, token: 3}}
        """)


def write_scenarios(directory: Path, *names: str) -> list[str]:
    paths = []
    for name in names:
        path = directory / f"{name}.yaml"
        path.write_text(scenario_yaml(name))
        paths.append(str(path))
    return paths


def invoke(*args: str) -> Result:
    return CliRunner().invoke(ftkit, list(args), env={"COLUMNS": "200"})


def fake_result(name: str, file: str, verdict: Verdict) -> ScenarioResult:
    fired = verdict is not Verdict.NOT_APPLIED
    actual = [1, 2, 3, 9] if verdict is Verdict.FAIL else [1, 2, 3, 4]
    return ScenarioResult(
        name=name, file=file, verdict=verdict, reason=f"reason for {name}", duration_s=1.5,
        requests=[RequestComparison(index=0, expected=[1, 2, 3, 4], actual=actual,
                                    first_divergence=3 if verdict is Verdict.FAIL else None,
                                    actual_times=[0.1, 0.2, 0.9, 1.0])],
        faults=[FaultRecord(kind="oom", rank=0, request=0, token=3, phase="forward", times=1,
                            fired=fired, fired_at=FiredAt(0, 3, 3) if fired else None,
                            attempts=int(fired), recovered=fired, at_s=0.25 if fired else None)],
        recoveries=[RecoveryRecord(step=3, kind="oom", decision="recompute", attempt=1,
                                   ranks=[0], duration_s=0.5, at_s=0.3)] if fired else [],
    )


@pytest.fixture
def fake_runner(monkeypatch) -> Callable[[dict], list[str]]:
    """Install a stand-in ``ftkit.runner`` whose verdicts the test chooses by scenario name.

    A value may be a Verdict or an exception to raise. Returns the list of names it ran.
    """

    def install(outcomes: dict[str, Verdict | BaseException]) -> list[str]:
        return install_stub_runner(monkeypatch, outcomes, fake_result)

    return install


def junit_counts(path: Path) -> dict[str, str]:
    root = ET.parse(path).getroot()
    return {key: root.get(key) for key in ("tests", "failures", "errors", "skipped")}


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test case's outcome: pass, failure, error or skipped."""
    outcome = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = [child.tag for child in case if child.tag != "system-out"]
        outcome[case.get("name")] = tags[0] if tags else "pass"
    return outcome


# --- --junit and --html -----------------------------------------------------------------

def test_run_writes_every_requested_report(tmp_path, fake_runner):
    fake_runner({"good": Verdict.PASS, "bad": Verdict.FAIL, "idle": Verdict.NOT_APPLIED})
    out = tmp_path / "reports"
    result = invoke("run", *write_scenarios(tmp_path, "good", "bad", "idle"),
                    "--json", str(out / "r.json"), "--junit", str(out / "r.xml"),
                    "--html", str(out / "r.html"))
    assert result.exit_code == 1, result.output
    for label in ("JSON", "JUnit", "HTML"):
        assert f"{label} report written to {out}" in result.stderr
    assert junit_counts(out / "r.xml") == {"tests": "3", "failures": "1", "errors": "1",
                                           "skipped": "0"}
    assert junit_outcomes(out / "r.xml") == {"good": "pass", "bad": "failure",
                                             "idle": "error"}
    page = (out / "r.html").read_text(encoding="utf-8")
    assert page.count("<svg") == 3
    assert all(name in page for name in ("good", "bad", "idle"))
    assert read_json_report(out / "r.json")["skipped"] == []


def test_a_report_that_cannot_be_written_exits_2_and_the_others_are_written(
        tmp_path, fake_runner):
    fake_runner({"good": Verdict.PASS})
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    blocked = not_a_directory / "r.xml"
    result = invoke("run", *write_scenarios(tmp_path, "good"), "--junit", str(blocked),
                    "--html", str(tmp_path / "r.html"))
    assert result.exit_code == 2
    assert f"cannot write the JUnit report {blocked}" in result.stderr
    assert (tmp_path / "r.html").is_file()


# --- --fail-fast ------------------------------------------------------------------------

@pytest.mark.parametrize(("stopper", "code"), [(Verdict.FAIL, 1), (Verdict.NOT_APPLIED, 3),
                                               (Verdict.ERROR, 3)])
def test_fail_fast_stops_after_the_first_non_pass(tmp_path, fake_runner, stopper, code):
    calls = fake_runner({"one": Verdict.PASS, "two": stopper, "three": Verdict.PASS,
                         "four": Verdict.FAIL})
    junit, report = tmp_path / "j.xml", tmp_path / "r.json"
    result = invoke("run", *write_scenarios(tmp_path, "one", "two", "three", "four"),
                    "--fail-fast", "--junit", str(junit), "--json", str(report))
    assert result.exit_code == code, result.output
    assert calls == ["one", "two"]
    assert "2 skipped (4 scenario(s)" in result.stdout
    assert f"SKIPPED three: not run: --fail-fast stopped after two ({stopper.value})" \
        in result.stdout
    assert junit_counts(junit)["tests"] == "4" and junit_counts(junit)["skipped"] == "2"
    assert junit_outcomes(junit)["three"] == junit_outcomes(junit)["four"] == "skipped"
    data = read_json_report(report)
    assert [s["name"] for s in data["scenarios"]] == ["one", "two"]
    assert [s["name"] for s in data["skipped"]] == ["three", "four"]


def test_without_fail_fast_every_scenario_runs(tmp_path, fake_runner):
    calls = fake_runner({"one": Verdict.FAIL, "two": Verdict.PASS})
    result = invoke("run", *write_scenarios(tmp_path, "one", "two"))
    assert result.exit_code == 1
    assert calls == ["one", "two"]
    assert "skipped" not in result.stdout


def test_fail_fast_when_everything_passes_skips_nothing(tmp_path, fake_runner):
    calls = fake_runner({"one": Verdict.PASS, "two": Verdict.PASS})
    result = invoke("run", *write_scenarios(tmp_path, "one", "two"), "--fail-fast")
    assert result.exit_code == 0
    assert calls == ["one", "two"]


# --- -k ---------------------------------------------------------------------------------

NAMES = ("oom-decode", "oom-prefill", "link-flap", "link-break")


@pytest.mark.parametrize(("pattern", "selected"), [
    ("oom", ["oom-decode", "oom-prefill"]),
    ("OOM", ["oom-decode", "oom-prefill"]),
    ("decode", ["oom-decode"]),
    ("oom and not prefill", ["oom-decode"]),
    ("flap or prefill", ["oom-prefill", "link-flap"]),
    ("not oom", ["link-flap", "link-break"]),
    ("link and not (flap or break) or decode", ["oom-decode"]),
    ("not not flap", ["link-flap"]),
    ("-", list(NAMES)),
])
def test_k_selects_scenarios_by_name(tmp_path, fake_runner, pattern, selected):
    calls = fake_runner(dict.fromkeys(NAMES, Verdict.PASS))
    result = invoke("run", *write_scenarios(tmp_path, *NAMES), "-k", pattern)
    assert result.exit_code == 0, result.output
    assert calls == selected
    assert f"({len(selected)} scenario(s)" in result.stdout


def test_k_without_a_match_exits_2_and_runs_nothing(tmp_path, fake_runner):
    calls = fake_runner(dict.fromkeys(NAMES, Verdict.PASS))
    result = invoke("run", *write_scenarios(tmp_path, *NAMES), "-k", "hang")
    assert result.exit_code == 2
    assert calls == []
    assert "no scenario matches -k 'hang' (found: oom-decode, oom-prefill, link-flap, " \
           "link-break)" in result.stderr


@pytest.mark.parametrize("pattern", ["", "oom and", "(oom", "oom)", "and oom", "oom flap",
                                     "not", "()"])
def test_a_malformed_k_expression_exits_2(tmp_path, fake_runner, pattern):
    calls = fake_runner(dict.fromkeys(NAMES, Verdict.PASS))
    result = invoke("run", *write_scenarios(tmp_path, *NAMES), "-k", pattern)
    assert result.exit_code == 2
    assert calls == []
    assert f"bad -k expression {pattern!r}" in result.stderr
    assert "Traceback" not in result.output


def test_name_matcher_precedence_is_not_and_or():
    # "a or b and c" is "a or (b and c)", as in Python and pytest.
    matches = name_matcher("x or y and z")
    assert matches("x") and matches("yz") and not matches("y")
    with pytest.raises(ValueError, match="missing"):
        name_matcher("(x or y")


# --- Ctrl-C -----------------------------------------------------------------------------

def test_interrupt_still_writes_every_report(tmp_path, fake_runner):
    calls = fake_runner({"first": Verdict.PASS, "second": KeyboardInterrupt(),
                         "third": Verdict.PASS})
    out = tmp_path / "out"
    result = invoke("run", *write_scenarios(tmp_path, "first", "second", "third"),
                    "--json", str(out / "r.json"), "--junit", str(out / "r.xml"),
                    "--html", str(out / "r.html"))
    assert result.exit_code == 130
    assert calls == ["first", "second"]
    assert "interrupted" in result.stderr
    data = read_json_report(out / "r.json")
    assert [s["name"] for s in data["scenarios"]] == ["first"]
    assert [s["name"] for s in data["skipped"]] == ["second", "third"]
    assert junit_outcomes(out / "r.xml") == {"first": "pass", "second": "skipped",
                                             "third": "skipped"}
    page = (out / "r.html").read_text(encoding="utf-8")
    assert page.count("<svg") == 1
    assert "second (" in page and "not run to the end: interrupted" in page


# --- end to end, with a real engine -----------------------------------------------------

TP1_OOM_REPORTS = """\
name: oom_reports
engine: {tensor_parallel_size: 1}
workload:
  prompts: ["the quick brown fox", "one two three four five"]
  max_tokens: 16
faults:
  - {kind: oom, rank: 0, at: {request: 0, token: 5}, times: 2}
expect: {outcome: recovered, tokens: identical, timeout_s: 240}
"""


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_real_run_writes_reports_that_ftkit_report_renders_again(tmp_path):
    scenario = tmp_path / "oom_reports.yaml"
    scenario.write_text(TP1_OOM_REPORTS)
    env = dict(os.environ, FTKIT_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="160")
    journal, junit, page = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.html"
    proc = subprocess.run(FTKIT + ["run", str(scenario), "--json", str(journal), "--junit",
                                   str(junit), "--html", str(page)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    (entry,) = json.loads(journal.read_text())["scenarios"]
    assert entry["verdict"] == "pass"
    assert entry["faults"][0]["at_s"] > 0 and entry["recoveries"][0]["at_s"] > 0
    assert [len(r["actual_times"]) for r in entry["requests"]] == [16, 16]
    assert junit_counts(junit) == {"tests": "1", "failures": "0", "errors": "0",
                                   "skipped": "0"}
    assert "faults fired: 1/1" in ET.parse(junit).getroot().find(".//system-out").text
    html = page.read_text(encoding="utf-8")
    assert html.count("<svg") == 1
    assert "oom rank 0, 2 attempts" in re.search(r"<svg.*</svg>", html, re.DOTALL).group()

    again = tmp_path / "again.html"
    rerun = subprocess.run(FTKIT + ["report", str(journal), "--html", str(again)],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "PASS" in rerun.stdout and "oom_reports" in rerun.stdout

    def body(text: str) -> str:  # all but the provenance line (when, on what)
        return re.sub(r'<p class="meta">created .*?</p>', "", text)

    assert body(again.read_text(encoding="utf-8")) == body(html)
