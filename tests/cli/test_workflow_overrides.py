"""The Ascend workflow runs the bundled scenarios with the overrides docs/ascend.md recommends,
and those overrides validate against every bundled scenario."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml
from click.testing import CliRunner

from ftkit_cli.main import ftkit

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ascend.yml"
DOCS = ROOT / "docs" / "ascend.md"


def run_step_sets() -> list[str]:
    """The ``--set`` values of the workflow's ``ftkit run scenarios/`` command."""
    [job] = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    [script] = [s["run"] for s in job["steps"] if "ftkit run scenarios/" in s.get("run", "")]
    command = script.replace("\\\n", " ")
    [line] = [ln for ln in command.splitlines() if "ftkit run scenarios/" in ln]
    words = shlex.split(line)
    return [words[i + 1] for i, word in enumerate(words) if word == "--set"]


def test_the_workflow_sets_the_npu_settings_the_docs_recommend():
    sets = run_step_sets()
    assert "engine.dtype=bfloat16" in sets and "engine.block_size=128" in sets
    recommended = re.findall(r"ftkit run scenarios/ ((?:--set \S+ ?)+)", DOCS.read_text())
    assert recommended, "docs/ascend.md shows no ftkit run scenarios/ --set line"
    for line in recommended:
        assert shlex.split(line)[1::2] == sets


def test_the_workflow_overrides_validate_against_every_bundled_scenario():
    args = [word for value in run_step_sets() for word in ("--set", value)]
    result = CliRunner().invoke(ftkit, ["validate", "--json", str(ROOT / "scenarios"), *args])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    bundled = sorted(str(p) for p in (ROOT / "scenarios").glob("*.yaml"))
    assert len(bundled) > 1 and document["valid"] is True
    assert sorted(entry["file"] for entry in document["files"]) == bundled
