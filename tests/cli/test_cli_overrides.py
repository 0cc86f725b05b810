"""``ftkit run --set`` / ``--set-file`` (and ``ftkit validate`` with them): the runner gets
the overridden scenarios, the header, the verdict report and every written report show the
overrides, and a bad override exits 2 naming the argument (or file and line) and the field,
before anything runs."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner, Result

from ftkit.results import ScenarioResult, Verdict
from ftkit_cli.main import ftkit

from _stub_runner import install_stub_runner

WIDE = {"COLUMNS": "200"}


def scenario_yaml(name: str, tp: int = 1) -> str:
    return textwrap.dedent(f"""\
        name: {name}
        engine:
          tensor_parallel_size: {tp}
          dtype: float32
          block_size: 32
        workload:
          prompts: ["the quick brown fox", "a lazy dog"]
          max_tokens: 16
        faults:
          - kind: oom
            rank: 0
            at: {{request: 0, token: 12}}
        """)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(ftkit, list(args), env=WIDE)


def passed(name: str, file: str, verdict: Verdict) -> ScenarioResult:
    return ScenarioResult(name=name, file=file, verdict=verdict, reason="ok", duration_s=1.0)


@pytest.fixture
def scenarios(tmp_path) -> list[str]:
    paths = []
    for name, tp in (("one", 1), ("two", 2)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(scenario_yaml(name, tp))
        paths.append(str(path))
    return paths


@pytest.fixture
def runner(monkeypatch):
    """The stub runner; returns the scenario objects it was handed."""
    seen: list = []
    install_stub_runner(monkeypatch, {"one": Verdict.PASS, "two": Verdict.PASS}, passed,
                        seen=seen)
    return seen


NPU = ("--set", "engine.block_size=128", "--set", "engine.dtype=bfloat16")


def test_every_scenario_runs_with_the_overrides(scenarios, runner):
    result = invoke("run", *scenarios, *NPU, "--set", "workload.max_tokens=14")
    assert result.exit_code == 0, result.output
    assert [s.name for s in runner] == ["one", "two"]
    for scenario in runner:
        assert (scenario.engine.block_size, scenario.engine.dtype) == (128, "bfloat16")
        assert scenario.workload.max_tokens == 14
        # What decides the engine group and the baseline key is the overridden value.
        assert scenario.engine_key()["dtype"] == "bfloat16"
    assert [s.engine.tensor_parallel_size for s in runner] == [1, 2]


def test_without_overrides_the_scenarios_run_as_written(scenarios, runner):
    result = invoke("run", *scenarios)
    assert result.exit_code == 0, result.output
    assert {(s.engine.block_size, s.engine.dtype) for s in runner} == {(32, "float32")}
    assert "overrides" not in result.stderr and "overrides" not in result.stdout


def test_the_header_and_the_verdict_report_show_the_overrides(scenarios, runner):
    result = invoke("run", *scenarios, *NPU)
    header = result.stderr.splitlines()[:2]
    assert header == ["ftkit run: 2 scenario(s)",
                      "overrides: engine.block_size=128, engine.dtype=bfloat16"]
    assert "overrides: engine.block_size=128, engine.dtype=bfloat16" in result.stdout


def test_every_report_records_the_overrides(tmp_path, scenarios, runner):
    journal, junit, html = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.html"
    result = invoke("run", *scenarios, *NPU, "--set", "engine.args={enforce_eager: true}",
                    "--json", str(journal), "--junit", str(junit), "--html", str(html))
    assert result.exit_code == 0, result.output
    expected = {"engine.block_size": 128, "engine.dtype": "bfloat16",
                "engine.args.enforce_eager": True}
    assert json.loads(journal.read_text())["overrides"] == expected
    properties = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert {k: v for k, v in properties.items() if k.startswith("override.")} == {
        "override.engine.block_size": "128", "override.engine.dtype": "bfloat16",
        "override.engine.args.enforce_eager": "true"}
    page = html.read_text()
    assert "<code>engine.dtype=bfloat16</code>" in page
    assert "<code>engine.args.enforce_eager=true</code>" in page

    # ``ftkit report`` renders the same from the journal.
    again_xml, again_html = tmp_path / "again.xml", tmp_path / "again.html"
    again = invoke("report", str(journal), "--junit", str(again_xml), "--html", str(again_html))
    assert again.exit_code == 0, again.output
    assert "overrides: engine.block_size=128, engine.dtype=bfloat16" in again.stdout
    assert {p.get("name") for p in ET.parse(again_xml).iter("property")} >= {
        "override.engine.block_size", "override.engine.dtype"}
    assert "<code>engine.block_size=128</code>" in again_html.read_text()


def test_a_run_without_overrides_records_none(tmp_path, scenarios, runner):
    journal, junit, html = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.html"
    invoke("run", *scenarios, "--json", str(journal), "--junit", str(junit), "--html", str(html))
    assert json.loads(journal.read_text())["overrides"] == {}
    assert not [p for p in ET.parse(junit).iter("property")
                if p.get("name").startswith("override.")]
    assert "Overrides for every scenario" not in html.read_text()


@pytest.mark.parametrize("args, expected", [
    (["--set", "engine.dtype=bfloat17"],
     "--set engine.dtype=bfloat17: engine.dtype: input should be 'auto'"),
    (["--set", "engine.blok_size=128"],
     "--set engine.blok_size=128: engine.blok_size: unknown key 'blok_size'; did you mean "
     "'block_size'?"),
    (["--set", "faults[0].at.token=3"],
     "--set faults[0].at.token=3: faults[0].at.token: 'faults' cannot be overridden"),
    (["--set", "engine.block_size"], "--set engine.block_size: expected FIELD=VALUE"),
])
def test_a_bad_override_exits_2_naming_argument_and_field(scenarios, runner, args, expected):
    result = invoke("run", *scenarios, *args)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    # Said once, not once per scenario.
    assert sum(line.startswith(expected) for line in lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert runner == []


def test_an_override_that_breaks_a_scenario_rule_names_the_scenario_line(scenarios, runner):
    result = invoke("run", *scenarios, "--set", "workload.max_tokens=8")
    assert result.exit_code == 2
    for path in scenarios:
        assert (f"{path}:12: faults[0].at.token: token 12 is never computed: "
                f"workload.max_tokens is 8") in result.stderr
    assert "(with the overrides workload.max_tokens=8)" in result.stderr
    assert runner == []


def test_set_file_errors_name_the_file_and_line(tmp_path, scenarios, runner):
    overrides = tmp_path / "npu.yaml"
    overrides.write_text("engine:\n  block_size: 128\n  dtype: bfloat17\n")
    result = invoke("run", *scenarios, "--set-file", str(overrides))
    assert result.exit_code == 2
    assert f"{overrides}:3: engine.dtype: input should be" in result.stderr
    assert runner == []
    missing = invoke("run", *scenarios, "--set-file", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2
    assert "cannot read the override file" in missing.stderr


def test_set_file_and_set_together(tmp_path, scenarios, runner):
    overrides = tmp_path / "npu.yaml"
    overrides.write_text("engine:\n  block_size: 128\n  dtype: float16\n")
    result = invoke("run", *scenarios, "--set-file", str(overrides),
                    "--set", "engine.dtype=bfloat16")
    assert result.exit_code == 0, result.output
    assert {(s.engine.block_size, s.engine.dtype) for s in runner} == {(128, "bfloat16")}


def test_validate_checks_the_scenarios_with_the_overrides(scenarios):
    ok = invoke("validate", *scenarios, *NPU)
    assert ok.exit_code == 0, ok.output
    bad = invoke("validate", *scenarios, "--set", "workload.max_tokens=8")
    assert bad.exit_code == 2
    assert all(f"{path}:12: faults[0].at.token" in bad.stderr for path in scenarios)
