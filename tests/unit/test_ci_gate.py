"""The suite's CI gate (``tests/conftest.py``), run on small generated suites in a pytest of
their own: under CI a real-engine test that is skipped, deselected or not collected fails the
run with a message naming it; outside CI the same run passes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GATE = Path(__file__).resolve().parents[1] / "conftest.py"

PYPROJECT = """\
[tool.pytest.ini_options]
markers = ["vllm: real engine", "multiprocess: real workers"]
"""
ENGINE_TESTS = """\
import pytest

pytestmark = pytest.mark.vllm


def test_engine_one():
    pass


def test_engine_two():
    pass
"""
SKIPPING = """\
import pytest


@pytest.mark.vllm
def test_needs_an_engine():
    pytest.skip("no engine here")


def test_plain():
    pass
"""


def suite(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "tests" / "vllm").mkdir(parents=True)
    (tmp_path / "tests" / "unit").mkdir()
    shutil.copy(GATE, tmp_path / "tests" / "conftest.py")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def run_pytest(root: Path, *args: str, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_skipped_engine_test_fails_the_run(tmp_path):
    root = suite(tmp_path, {"tests/unit/test_skipping.py": SKIPPING})
    ci = run_pytest(root, "tests", ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "CI gate: real-engine tests that did not run" in ci.stdout
    assert ("skipped: tests/unit/test_skipping.py::test_needs_an_engine (no engine here)"
            in ci.stdout)
    assert "1 passed, 1 skipped" in ci.stdout
    local = run_pytest(root, "tests", ci=False)
    assert local.returncode == 0, local.stdout
    assert "CI gate" not in local.stdout


def test_under_ci_a_full_run_passes(tmp_path):
    root = suite(tmp_path, {"tests/vllm/test_engine.py": ENGINE_TESTS})
    ci = run_pytest(root, "tests", ci=True)
    assert ci.returncode == 0, ci.stdout
    assert "CI gate" not in ci.stdout


@pytest.mark.parametrize("selection", [["-m", "not vllm"], ["-k", "one"]])
def test_under_ci_deselected_engine_tests_fail_the_run(tmp_path, selection):
    root = suite(tmp_path, {"tests/vllm/test_engine.py": ENGINE_TESTS})
    ci = run_pytest(root, "tests", *selection, ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "deselected: tests/vllm/test_engine.py::test_engine_two" in ci.stdout
    assert run_pytest(root, "tests", *selection, ci=False).returncode in (0, 5)


def test_under_ci_an_engine_test_file_that_is_not_collected_fails_the_run(tmp_path):
    """A file in tests/vllm whose name pytest does not collect: its tests never run."""
    root = suite(tmp_path, {"tests/vllm/test_engine.py": ENGINE_TESTS,
                            "tests/vllm/engine_check.py": ENGINE_TESTS})
    ci = run_pytest(root, "tests", ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "not run: tests/vllm/engine_check.py defines 2 test(s), 0 ran" in ci.stdout
    assert "2 passed" in ci.stdout
    assert run_pytest(root, "tests", ci=False).returncode == 0


def test_under_ci_a_run_of_other_folders_has_no_floor(tmp_path):
    root = suite(tmp_path, {"tests/vllm/test_engine.py": ENGINE_TESTS,
                            "tests/unit/test_plain.py": "def test_plain():\n    pass\n"})
    ci = run_pytest(root, "tests/unit", ci=True)
    assert ci.returncode == 0, ci.stdout
