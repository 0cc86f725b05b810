"""The ``ftkit`` command as a user runs it: output, messages and exit codes."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ftkit.progress import ProgressEvent
from ftkit.kinds import KIND_SPECS
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

from _stub_runner import install_stub_runner

WIDE = {"COLUMNS": "200"}


def scenario_yaml(name: str) -> str:
    return textwrap.dedent(f"""\
        name: {name}
        engine:
          tensor_parallel_size: 2
        workload:
          prompts: ["the quick brown fox", "a lazy dog"]
          max_tokens: 8
        faults:
          - kind: link_break
            rank: 1
            at: {{request: 0, token: 3}}
        """)


BAD_YAML = textwrap.dedent("""\
    name: Bad Name
    workload:
      prompts: ["x"]
      max_tokenz: 8
    faults: []
    """)


def write_scenarios(directory: Path, *names: str) -> list[str]:
    paths = []
    for name in names:
        path = directory / f"{name}.yaml"
        path.write_text(scenario_yaml(name))
        paths.append(str(path))
    return paths


def invoke(*args: str) -> Result:
    return CliRunner().invoke(ftkit, list(args), env=WIDE)


# --- validate / schema / list / model build ---------------------------------------------

def test_validate_ok(tmp_path):
    [path] = write_scenarios(tmp_path, "link-break")
    result = invoke("validate", path)
    assert result.exit_code == 0
    assert result.stdout == f"ok: {path} (link-break)\n"


def test_validate_directory(tmp_path):
    write_scenarios(tmp_path, "one", "two")
    result = invoke("validate", str(tmp_path))
    assert result.exit_code == 0
    assert "(one)" in result.stdout and "(two)" in result.stdout


def test_validate_reports_every_error_line_and_exits_2(tmp_path):
    [good] = write_scenarios(tmp_path, "fine")
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    result = invoke("validate", good, str(bad))
    assert result.exit_code == 2
    assert f"ok: {good} (fine)" in result.stdout
    lines = result.stderr.splitlines()
    assert any(line.startswith(f"{bad}:1: name:") for line in lines)
    assert any(line.startswith(f"{bad}:4: workload.max_tokenz: unknown key") for line in lines)
    assert "Traceback" not in result.output


def test_validate_missing_file_exits_2(tmp_path):
    result = invoke("validate", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "no such scenario file" in result.stderr


def test_schema_prints_the_json_schema():
    result = invoke("schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert {"name", "workload", "faults", "expect"} <= schema["properties"].keys()


def test_list_shows_every_fault_kind_with_its_status():
    result = invoke("list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert len(lines) == len(KIND_SPECS)
    by_kind = {line.split()[0]: line for line in lines}
    for kind, info in KIND_SPECS.items():
        status = "implemented" if info.implemented else "not implemented yet"
        assert status in by_kind[kind.value]
        assert ("not implemented yet" in by_kind[kind.value]) is (not info.implemented)


def test_model_build_writes_the_tiny_model(tmp_path):
    out = tmp_path / "tiny"
    result = invoke("model", "build", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").is_file()


def test_usage_errors_exit_2():
    assert invoke("run").exit_code == 2
    assert invoke("no-such-command").exit_code == 2
    assert invoke("run", "--no-such-option", "x.yaml").exit_code == 2


def test_run_with_bad_scenario_exits_2_without_running(tmp_path, fake_runner):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    calls = fake_runner({})
    result = invoke("run", str(bad))
    assert result.exit_code == 2
    assert f"{bad}:4: workload.max_tokenz" in result.stderr
    assert "Traceback" not in result.output
    assert calls == []


def test_run_with_missing_path_exits_2(tmp_path, fake_runner):
    fake_runner({})
    result = invoke("run", str(tmp_path / "missing"))
    assert result.exit_code == 2
    assert "no such scenario file or directory" in result.stderr


# --- run, with a fake runner ------------------------------------------------------------

def fake_result(name: str, file: str, verdict: Verdict) -> ScenarioResult:
    diverged = verdict is Verdict.FAIL
    fired = verdict is not Verdict.NOT_APPLIED
    return ScenarioResult(
        name=name, file=file, verdict=verdict, reason=f"reason for {name}", duration_s=1.5,
        requests=[RequestComparison(index=0, expected=[1, 2, 3, 4], actual=[1, 2, 3, 4],
                                    first_divergence=None),
                  RequestComparison(index=1, expected=[5, 6, 7, 8],
                                    actual=[5, 6, 0, 8] if diverged else [5, 6, 7, 8],
                                    first_divergence=2 if diverged else None)],
        faults=[FaultRecord(kind="link_break", rank=1, request=0, token=3, phase="forward",
                            times=1, fired=fired,
                            fired_at=FiredAt(0, 3, 3) if fired else None)],
        recoveries=[RecoveryRecord(step=3, kind="link_break", decision="recompute",
                                   attempt=1, ranks=[0, 1], duration_s=0.25)] if fired else [],
    )


@pytest.fixture
def fake_runner(monkeypatch) -> Callable[[dict], list[str]]:
    """Install a stand-in ``ftkit.runner`` whose verdicts the test chooses by scenario name.

    A value may be a Verdict or an exception to raise. Returns the list of names it ran.
    """

    def install(outcomes: dict[str, Verdict | BaseException]) -> list[str]:
        return install_stub_runner(monkeypatch, outcomes, fake_result, events=(
            ProgressEvent("", "engine_start", "starting engine"),
            ProgressEvent("", "tokens", tokens_done=4, tokens_total=16),
            ProgressEvent("", "fault", "link_break on rank 1 at step 3"),
            ProgressEvent("", "recovery", "recompute step 3 in 0.25 s")))

    return install


@pytest.mark.parametrize(("verdicts", "code"), [
    ([Verdict.PASS, Verdict.PASS], 0),
    ([Verdict.PASS, Verdict.FAIL], 1),
    ([Verdict.FAIL, Verdict.ERROR], 1),
    ([Verdict.FAIL, Verdict.NOT_APPLIED], 1),
    ([Verdict.PASS, Verdict.NOT_APPLIED], 3),
    ([Verdict.ERROR, Verdict.PASS], 3),
])
def test_run_exit_code_follows_the_verdicts(tmp_path, fake_runner, verdicts, code):
    """Exit-code mapping only: the real run is covered by the integration tests elsewhere."""
    names = [f"s{i}" for i in range(len(verdicts))]
    fake_runner(dict(zip(names, verdicts)))
    result = invoke("run", *write_scenarios(tmp_path, *names))
    assert result.exit_code == code, result.output


def test_run_groups_scenarios_that_need_alike_engines(tmp_path, fake_runner):
    """Scenarios run next to those that need the same engine, so that they share it: group
    order by first appearance, file order within a group."""
    calls = fake_runner({n: Verdict.PASS for n in ("a2", "b1", "c2", "d1", "e2")})
    paths = write_scenarios(tmp_path, "a2", "b1", "c2", "d1", "e2")
    for path in paths[1::2]:  # b1 and d1 at tensor parallel 1
        Path(path).write_text(Path(path).read_text().replace(
            "tensor_parallel_size: 2", "tensor_parallel_size: 1").replace(
            "kind: link_break", "kind: oom").replace("rank: 1", "rank: 0"))
    result = invoke("run", *paths)
    assert result.exit_code == 0, result.output
    assert calls == ["a2", "c2", "e2", "b1", "d1"]


def test_run_renders_the_verdict_table(tmp_path, fake_runner):
    """Table rendering only, with a fake runner: the real run is covered by the
    integration tests elsewhere."""
    outcomes = {"all-good": Verdict.PASS, "diverged": Verdict.FAIL,
                "never-fired": Verdict.NOT_APPLIED, "broke": Verdict.ERROR}
    calls = fake_runner(outcomes)
    result = invoke("run", *write_scenarios(tmp_path, *outcomes))
    assert result.exit_code == 1
    assert calls == list(outcomes)
    rows = {line.split()[1]: line for line in result.stdout.splitlines()
            if line.startswith("│")}
    assert rows.keys() == set(outcomes)
    assert "PASS" in rows["all-good"] and "1/1" in rows["all-good"]
    assert "FAIL" in rows["diverged"] and "req 1 tok 2" in rows["diverged"]
    assert "NOT APPLIED" in rows["never-fired"] and "0/1" in rows["never-fired"]
    assert "ERROR" in rows["broke"]
    assert "0.250 s" in rows["all-good"]
    # Reasons are given for the rows that did not pass, and only for them.
    assert "reason for diverged" in result.stdout
    assert "reason for never-fired" in result.stdout
    assert "reason for broke" in result.stdout
    assert "reason for all-good" not in result.stdout
    # Progress and fault events go to stderr, not into the table.
    assert "link_break on rank 1 at step 3" in result.stderr
    assert "link_break on rank 1" not in result.stdout


def test_runner_exception_becomes_an_error_verdict_and_the_run_goes_on(tmp_path, fake_runner):
    """Runner stand-in raising: the real run is covered by the integration tests elsewhere."""
    calls = fake_runner({"explodes": RuntimeError("worker exploded"), "fine": Verdict.PASS})
    report = tmp_path / "report.json"
    result = invoke("run", *write_scenarios(tmp_path, "explodes", "fine"), "--json",
                    str(report))
    assert result.exit_code == 3
    assert calls == ["explodes", "fine"]
    assert "RuntimeError: worker exploded" in result.stdout
    assert "Traceback" not in result.output
    scenarios = {s["name"]: s for s in read_json_report(report)["scenarios"]}
    assert scenarios["explodes"]["verdict"] == "error"
    assert scenarios["explodes"]["reason"] == "RuntimeError: worker exploded"
    assert scenarios["explodes"]["faults"][0]["fired"] is False
    assert scenarios["fine"]["verdict"] == "pass"


def test_verbose_shows_the_traceback(tmp_path, fake_runner):
    fake_runner({"explodes": RuntimeError("worker exploded")})
    result = invoke("run", "-v", *write_scenarios(tmp_path, "explodes"))
    assert result.exit_code == 3
    assert "Traceback" in result.stderr


def test_interrupt_exits_130_and_keeps_what_finished(tmp_path, fake_runner):
    """Ctrl-C stand-in: the real run is covered by the integration tests elsewhere."""
    calls = fake_runner({"first": Verdict.PASS, "second": KeyboardInterrupt(),
                         "third": Verdict.PASS})
    report = tmp_path / "out" / "report.json"
    result = invoke("run", *write_scenarios(tmp_path, "first", "second", "third"),
                    "--json", str(report))
    assert result.exit_code == 130
    assert "interrupted" in result.stderr
    assert calls == ["first", "second"]
    data = read_json_report(report)
    assert [s["name"] for s in data["scenarios"]] == ["first"]
    assert data["summary"]["pass"] == 1


def test_json_report_holds_every_scenario(tmp_path, fake_runner):
    """JSON wiring only, with a fake runner: the real run is covered elsewhere."""
    fake_runner({"a": Verdict.PASS, "b": Verdict.FAIL})
    report = tmp_path / "r.json"
    result = invoke("run", *write_scenarios(tmp_path, "a", "b"), "--json", str(report))
    assert result.exit_code == 1
    data = read_json_report(report)
    assert data["summary"] == {"total": 2, "pass": 1, "fail": 1, "not_applied": 0, "error": 0}
    assert data["scenarios"][1]["first_divergence"] == {"request": 1, "token": 2}
