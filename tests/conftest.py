"""The suite's tiers (``_tiers.py``: ``--tier``, ``--shard``) and its CI gate: under CI, a run
in which the real-engine tests of the selected tiers did not all run fails.

Real-engine tests are those marked ``vllm`` or ``multiprocess`` and every test in the folders
of ``REAL_ENGINE_DIRS``. A run that skips one, deselects one (``-m``, ``-k``, a plugin), marks
one ``xfail`` (a failure then passes), skips a module that holds one at collection, or
collects fewer tests from one of those folders' files than the file defines (a file that is
not collected, a test that vanished) would pass while proving nothing about the engines;
under CI (``CI`` set to ``true``, ``1`` or ``yes``, as CI services and ``.ci/run`` do) such a
run ends with exit status 1 and a list of what did not run. Tests that the tier or the shard
leaves out are not asked for. Outside CI nothing changes: a local run may narrow the suite as
it likes.

The floor per file is the number of test functions it defines; it applies to the files below
the paths the run was given (a run of ``tests/unit`` has no floor, a run of ``tests`` has all).

Every run ends with the number of vLLM engines it started, in any process below it: each
engine's rank 0 notes its start (``ftkit.vllm.plugin.ENGINE_STARTS_FILE_ENV``).
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

import _tiers
from ftkit.vllm.plugin import ENGINE_STARTS_FILE_ENV
from _tiers import (  # noqa: F401 (hooks of the tiers, found here by pytest)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_report_header,
)

#: Markers of the tests that start real engines or real worker processes.
REAL_ENGINE_MARKERS = ("vllm", "multiprocess")
#: Folders (below this one) whose every test must run under CI.
REAL_ENGINE_DIRS = ("vllm", "multiprocess")
#: Values of ``CI`` that switch the gate on.
CI_VALUES = ("1", "true", "yes")

_HERE = Path(__file__).resolve().parent
#: The file that counts this run's engine starts (``ENGINE_STARTS_FILE_ENV``), if it made one.
_ENGINE_STARTS = pytest.StashKey[Path]()


def ci_run() -> bool:
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def defined_tests(file: Path) -> int:
    """The test functions ``file`` defines: ``test_*`` at module level and in ``Test*``
    classes (not those in strings, such as a test file a test writes)."""
    try:
        tree = ast.parse(file.read_text(errors="replace"))
    except SyntaxError:
        return 1  # a file that does not even parse runs no test: at least one is missing
    bodies = [tree.body] + [node.body for node in tree.body
                            if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
    return sum(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               and node.name.startswith("test") for body in bodies for node in body)


def marks_real_engine(file: Path) -> bool:
    """Whether ``file``'s code names a real-engine marker (``pytest.mark.vllm``, ...)."""
    try:
        tree = ast.parse(file.read_text(errors="replace"))
    except (OSError, SyntaxError):
        return False
    return any(isinstance(node, ast.Attribute) and node.attr in REAL_ENGINE_MARKERS
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(tree))


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason a skipped report gives, without pytest's ``Skipped: `` prefix."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    return reason.removeprefix("Skipped: ")


class CiGate:
    """A plugin, registered under CI: what the run did with the real-engine tests (the outcome
    of each, those deselected, the tests reported per file) and, at the end, the verdict."""

    def __init__(self, config: pytest.Config) -> None:
        self.rootdir = config.rootpath.resolve()
        invoked_in = config.invocation_params.dir
        #: The run's paths, absolute (a node id part ``::test`` kept).
        self.args = [arg if Path(arg).is_absolute() else str(invoked_in / arg)
                     for arg in config.args]
        #: nodeid -> "passed", "failed", "skipped (reason)" or "xfail (reason)".
        self.outcomes: dict[str, str] = {}
        self.deselected: list[str] = []
        #: Items collected per file, before any selection (the tiers' included).
        self.collected_per_file: dict[str, int] = {}
        #: Real-engine items the run holds after every selection: each must report.
        self.expected: list[str] = []
        self.collection_skips: list[str] = []
        self.problems: list[str] = []

    # --- hooks ------------------------------------------------------------------------------

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += [item.nodeid for item in items if self._is_real_engine_item(item)
                            and not item.stash.get(_tiers.OUT_OF_TIER, False)]

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Counted before the tiers, ``-m`` or ``-k`` take any item out (registered after
        ``conftest.py``, this runs before its hook of the same name)."""
        for item in items:
            path = item.nodeid.split("::", 1)[0]
            self.collected_per_file[path] = self.collected_per_file.get(path, 0) + 1

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped as a whole (``pytest.skip(allow_module_level=True)``, an
        ``importorskip``) that holds real-engine tests, in any folder."""
        path = self.rootdir / report.nodeid
        if not report.skipped or "::" in report.nodeid or path.suffix != ".py":
            return
        if self._in_real_engine_dir(path) or marks_real_engine(path):
            self.collection_skips.append(
                f"skipped at collection: {report.nodeid} ({skip_reason(report)})")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.expected = [item.nodeid for item in session.items
                         if self._is_real_engine_item(item)]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        real = any(m in report.keywords for m in REAL_ENGINE_MARKERS)
        if not real and not self._in_real_engine_dir(self.rootdir / path):
            return
        if hasattr(report, "wasxfail"):
            # Marked xfail: a failure passes as "xfailed" and a pass as "xpassed".
            self.outcomes[report.nodeid] = f"xfail ({report.wasxfail or 'no reason given'})"
        elif report.skipped:
            self.outcomes[report.nodeid] = f"skipped ({skip_reason(report)})"
        else:
            self.outcomes.setdefault(report.nodeid, report.outcome)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.problems = self.verdict()
        if self.problems and session.exitstatus in (pytest.ExitCode.OK,
                                                    pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.problems:
            return
        terminalreporter.section("CI gate: real-engine tests that did not run", red=True)
        for line in self.problems:
            terminalreporter.line(line, red=True)
        terminalreporter.line(
            "Under CI every test marked " + " or ".join(REAL_ENGINE_MARKERS) + " and every test "
            "in tests/" + " and tests/".join(REAL_ENGINE_DIRS) + " of the selected tiers must "
            "run, so this run fails. Make them run (install what they need, drop the -m/-k "
            "selection and the xfail marks), or run without CI=true.", red=True)

    # --- the verdict --------------------------------------------------------------------------

    def verdict(self) -> list[str]:
        found = [f"{outcome.split(' ', 1)[0]}: {nodeid} {outcome.split(' ', 1)[1]}"
                 for nodeid, outcome in sorted(self.outcomes.items())
                 if outcome.startswith(("skipped", "xfail"))]
        found += [f"deselected: {nodeid}" for nodeid in sorted(self.deselected)]
        found += sorted(self.collection_skips)
        found += [f"not run: {nodeid}" for nodeid in self.expected if nodeid not in self.outcomes]
        for path, floor in sorted(self.floors().items()):
            count = self.collected_per_file.get(path, 0)
            if count < floor:
                found.append(f"not collected: {path} defines {floor} test(s), "
                             f"{count} collected")
        return found

    def floors(self) -> dict[str, int]:
        """The number of tests each real-engine file defines, for the files the run's paths
        take in whole (rootdir-relative, as in node ids)."""
        floors = {}
        for folder in REAL_ENGINE_DIRS:
            for file in sorted((_HERE / folder).rglob("*.py")):
                if file.name.startswith(("_", "conftest")) or not self._in_scope(file):
                    continue
                count = defined_tests(file)
                if count:
                    floors[file.relative_to(self.rootdir).as_posix()] = count
        return floors

    def _in_scope(self, file: Path) -> bool:
        """Whether the run's paths take in ``file`` whole (a path narrowed to some of its
        tests, ``file.py::test``, does not)."""
        for arg in self.args:
            if "::" in arg:
                continue
            path = Path(arg).resolve()
            if file == path or path in file.parents:
                return True
        return False

    def _is_real_engine_item(self, item: pytest.Item) -> bool:
        return (any(item.get_closest_marker(m) is not None for m in REAL_ENGINE_MARKERS)
                or self._in_real_engine_dir(Path(item.path)))

    @staticmethod
    def _in_real_engine_dir(file: Path) -> bool:
        parents = file.resolve().parents
        return any((_HERE / folder) in parents for folder in REAL_ENGINE_DIRS)


def pytest_configure(config: pytest.Config) -> None:
    _tiers.configure(config)
    if ci_run() and not config.option.collectonly:
        config.pluginmanager.register(CiGate(config), "ftkit-ci-gate")
    if ENGINE_STARTS_FILE_ENV not in os.environ and not hasattr(config, "workerinput"):
        # Every engine this run starts, in any process below it, adds a line (the plugin).
        handle, path = tempfile.mkstemp(prefix="pytest-engine-starts-", suffix=".jsonl")
        os.close(handle)
        os.environ[ENGINE_STARTS_FILE_ENV] = path
        config.stash[_ENGINE_STARTS] = Path(path)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    path = config.stash.get(_ENGINE_STARTS, None)
    if path is None or not path.is_file():
        return
    starts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wide = sum(1 for s in starts
               if s["tensor_parallel_size"] * s["pipeline_parallel_size"] > 1)
    terminalreporter.write_sep("=", f"{len(starts)} vLLM engine starts ({wide} of more than "
                               f"one rank; offline and served, restarts included)")


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_ENGINE_STARTS, None)
    if path is not None:
        path.unlink(missing_ok=True)
        os.environ.pop(ENGINE_STARTS_FILE_ENV, None)
