"""The suite's tiers and CI gate (``tests/conftest.py``, ``tests/_tiers.py``), run on small
generated suites in a pytest of their own: under CI a real-engine test of the selected tiers
that is skipped, deselected, marked xfail, skipped with its module or not collected fails the
run with a message naming it; outside CI the same run passes. The tiers select what they
say, and the shards of the exhaustive tier hold every exhaustive test once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
GATE = TESTS / "conftest.py"

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
    shutil.copy(TESTS / "_tiers.py", tmp_path / "tests" / "_tiers.py")
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
    assert ("not collected: tests/vllm/engine_check.py defines 2 test(s), 0 collected"
            in ci.stdout)
    assert "2 passed" in ci.stdout
    assert run_pytest(root, "tests", ci=False).returncode == 0


def test_under_ci_a_run_of_other_folders_has_no_floor(tmp_path):
    root = suite(tmp_path, {"tests/vllm/test_engine.py": ENGINE_TESTS,
                            "tests/unit/test_plain.py": "def test_plain():\n    pass\n"})
    ci = run_pytest(root, "tests/unit", ci=True)
    assert ci.returncode == 0, ci.stdout


XFAIL = """\
import pytest


@pytest.mark.vllm
@pytest.mark.xfail(reason="flaky engine")
def test_engine_fails():
    assert False


@pytest.mark.vllm
@pytest.mark.xfail(reason="flaky engine")
def test_engine_passes():
    pass
"""


def test_under_ci_an_xfail_mark_on_an_engine_test_fails_the_run(tmp_path):
    """An xfail mark turns the engine test's failure into "xfailed" (and its pass into
    "xpassed"): the run would pass whatever the engine did."""
    root = suite(tmp_path, {"tests/unit/test_xfail.py": XFAIL})
    ci = run_pytest(root, "tests", ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "xfail: tests/unit/test_xfail.py::test_engine_fails (flaky engine)" in ci.stdout
    assert "xfail: tests/unit/test_xfail.py::test_engine_passes (flaky engine)" in ci.stdout
    assert run_pytest(root, "tests", ci=False).returncode == 0


MODULE_SKIP = """\
import pytest

pytestmark = pytest.mark.vllm
pytest.skip("no server here", allow_module_level=True)


def test_server():
    pass
"""


def test_under_ci_a_module_skip_of_engine_tests_outside_the_engine_folders_fails_the_run(
        tmp_path):
    """tests/serve is not one of the engine folders (no floor per file there): a module-level
    skip of its engine tests reports no test at all, only a skipped collection."""
    root = suite(tmp_path, {"tests/unit/test_plain.py": "def test_plain():\n    pass\n"})
    (root / "tests" / "serve").mkdir()
    (root / "tests" / "serve" / "test_server.py").write_text(MODULE_SKIP)
    ci = run_pytest(root, "tests", ci=True)
    assert ci.returncode == 1, ci.stdout
    assert ("skipped at collection: tests/serve/test_server.py (no server here)"
            in ci.stdout)
    assert run_pytest(root, "tests", ci=False).returncode == 0
    # A module skip of tests that start no engine is not the gate's business.
    (root / "tests" / "serve" / "test_server.py").write_text(
        MODULE_SKIP.replace("pytestmark = pytest.mark.vllm\n", ""))
    assert run_pytest(root, "tests", ci=True).returncode == 0


TIERED = """\
import pytest

pytestmark = pytest.mark.vllm


def test_fast():
    pass


@pytest.mark.exhaustive
def test_thorough():
    pass
"""


PARTS = """\
import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.exhaustive(alone=True)
@pytest.mark.parametrize("part", [1, 2])
def test_part(part):
    pass
"""


def tiered_suite(tmp_path: Path) -> Path:
    files = {f"tests/vllm/test_{name}.py": TIERED.replace("test_thorough", f"test_{name}_more")
             for name in ("a", "b", "c")}
    return suite(tmp_path, {**files, "tests/vllm/test_parts.py": PARTS})


def passed(result: subprocess.CompletedProcess) -> set[str]:
    """The tests that passed (``-v``), as ``file stem::name``."""
    return {Path(line.split("::", 1)[0]).stem + "::" + line.split("::", 1)[1].split(" ", 1)[0]
            for line in result.stdout.splitlines() if " PASSED" in line}


FAST = {"test_a::test_fast", "test_b::test_fast", "test_c::test_fast"}
MORE = {"test_a::test_a_more", "test_b::test_b_more", "test_c::test_c_more",
        "test_parts::test_part[1]", "test_parts::test_part[2]"}


def test_the_fast_tier_leaves_the_exhaustive_tests_out_and_ci_does_not_ask_for_them(tmp_path):
    root = tiered_suite(tmp_path)
    ci = run_pytest(root, "tests", "--tier", "fast", "-v", ci=True)
    assert ci.returncode == 0, ci.stdout
    assert passed(ci) == FAST
    assert "3 passed, 5 deselected" in ci.stdout
    assert "ftkit tiers: fast" in ci.stdout
    # The same selection by -m is not a tier: the gate asks for what it left out.
    marked = run_pytest(root, "tests", "-m", "not exhaustive", ci=True)
    assert marked.returncode == 1, marked.stdout
    assert "deselected: tests/vllm/test_a.py::test_a_more" in marked.stdout


def test_the_shards_hold_each_exhaustive_test_once_and_ci_asks_for_the_fast_tier(tmp_path):
    root = tiered_suite(tmp_path)
    seen, parts = [], []
    for k in (1, 2):
        shard = run_pytest(root, "tests", "--tier", "exhaustive", "--shard", f"{k}/2", "-v",
                           ci=True)
        assert shard.returncode == 0, shard.stdout
        assert f"ftkit tiers: exhaustive (shard {k} of 2)" in shard.stdout
        seen += sorted(passed(shard))
        parts.append({t for t in passed(shard) if t.startswith("test_parts")})
    assert sorted(seen) == sorted(MORE)
    # A test marked alone=True is a unit of its own: the two parts went to different shards.
    assert [len(p) for p in parts] == [1, 1]
    both = run_pytest(root, "tests", "--tier", "all", "--shard", "2/2", "-v", ci=True)
    assert both.returncode == 0, both.stdout
    assert FAST < passed(both) and passed(both) - FAST < MORE


def test_the_shards_are_balanced_by_the_recorded_seconds():
    import _tiers

    weights = {"a.py": 600.0, "b.py": 300.0, "c.py": 250.0, "d.py": 200.0, "e.py": 50.0}
    shards = _tiers.assign_shards(weights, 2)
    assert shards == {"a.py": 1, "b.py": 2, "c.py": 2, "d.py": 2, "e.py": 1}
    loads = [sum(w for f, w in weights.items() if shards[f] == k) for k in (1, 2)]
    assert loads == [650.0, 750.0]
    # Every file in exactly one shard, however many shards.
    for count in (1, 3, 7):
        assert set(_tiers.assign_shards(weights, count)) == set(weights)


@pytest.mark.parametrize("bad", ["3/2", "0/2", "two", "1-2"])
def test_a_bad_shard_is_a_usage_error(tmp_path, bad):
    root = tiered_suite(tmp_path)
    result = run_pytest(root, "tests", "--shard", bad, ci=False)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "--shard" in result.stderr
