"""Scenario files as test items: which YAML files are collected, and how a verdict becomes a
pytest outcome (see the package docstring)."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ftkit.errors import FtkitError

if TYPE_CHECKING:  # imported lazily: the plugin loads in every pytest run
    from ftkit.results import ScenarioResult
    from ftkit.scenario import Scenario

SCENARIO_SUFFIXES = (".yaml", ".yml")
#: How much of a YAML file is read to decide whether it looks like a scenario.
SNIFF_BYTES = 65536
_TOP_LEVEL_NAME = re.compile(r"^name\s*:", re.MULTILINE)
_TOP_LEVEL_FAULTS = re.compile(r"^faults\s*:", re.MULTILINE)


class ScenarioVerdict(pytest.fail.Exception):
    """A scenario's verdict was not pass; pytest shows the message without a traceback."""

    def __init__(self, result: ScenarioResult) -> None:
        self.result = result
        super().__init__(describe_result(result), pytrace=False)


class ScenarioFailed(ScenarioVerdict):
    """Verdict fail: the run contradicted the scenario's ``expect``."""


class ScenarioNotJudged(ScenarioVerdict):
    """Verdict not_applied or error: no pass/fail could be reached. Raised during setup, so
    pytest reports it as an error."""


# --- which files are scenarios ----------------------------------------------------------------

#: The paths named on the command line (set by ``pytest_configure``).
NAMED_PATHS = pytest.StashKey[frozenset]()
_SCENARIO_RUNNER = pytest.StashKey[Any]()


def _scenario_runner(config: pytest.Config) -> Any:
    """One ``ScenarioRunner`` for the session (per xdist worker): scenario items with alike
    engines share them; every engine is shut down when the session ends."""
    runner = config.stash.get(_SCENARIO_RUNNER, None)
    if runner is None:
        from ftkit.runner import ScenarioRunner

        runner = config.stash[_SCENARIO_RUNNER] = ScenarioRunner()
    return runner


def close_scenario_runner(config: pytest.Config) -> None:
    """Shut down the session's ``ScenarioRunner`` (and every engine it kept), if any."""
    runner = config.stash.get(_SCENARIO_RUNNER, None)
    if runner is not None:
        del config.stash[_SCENARIO_RUNNER]
        runner.close()


def is_scenario_file(config: pytest.Config, path: Path) -> bool:
    """The collection rule of the package docstring."""
    named = config.stash.get(NAMED_PATHS, frozenset())
    resolved = path.resolve()
    if resolved in named:
        return True
    in_named_dir = resolved.parent in named
    try:
        relative = resolved.relative_to(config.rootpath.resolve()).as_posix()
    except ValueError:
        relative = None
    globbed = relative is not None and any(
        fnmatch.fnmatch(relative, pattern) for pattern in config.getini("ftkit_scenario_glob"))
    return (in_named_dir or globbed) and looks_like_scenario(path)


def looks_like_scenario(path: Path) -> bool:
    """True if the file has top-level ``name:`` and ``faults:`` lines (parse errors or not)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return False
    return bool(_TOP_LEVEL_NAME.search(head) and _TOP_LEVEL_FAULTS.search(head))


# --- scenario files as test items -------------------------------------------------------------

class ScenarioFile(pytest.File):
    def collect(self) -> Iterator[ScenarioItem]:
        from ftkit.scenario import load_scenario_text

        shown = self.config.invocation_params.dir
        file = os.path.relpath(self.path, shown) if self.path.is_relative_to(shown) \
            else str(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise self.CollectError(f"{file}: cannot read the scenario: {exc}") from None
        try:
            scenario = load_scenario_text(text, file=file)
        except FtkitError as exc:  # ScenarioErrors: one "FILE:LINE: FIELD: message" per line
            raise self.CollectError(str(exc)) from None
        yield ScenarioItem.from_parent(self, name=scenario.name, scenario=scenario, file=file)


class ScenarioItem(pytest.Item):
    """One scenario run. The run happens in setup, so a run without a verdict is an error."""

    def __init__(self, *, scenario: Scenario, file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.file = file
        self.result: ScenarioResult | None = None
        self.add_marker("ftkit_scenario")

    def setup(self) -> None:
        from ftkit.results import Verdict

        progress: list[str] = []
        try:
            runner = _scenario_runner(self.config)
            self.result = runner.run(self.scenario, file=self.file,
                                     on_event=lambda e: progress.append(
                                         f"{e.stage}: {e.message}" if e.message else e.stage))
        finally:
            if progress:
                self.add_report_section("setup", "ftkit progress", "\n".join(progress))
        self.user_properties.append(("ftkit_verdict", str(self.result.verdict)))
        if self.result.verdict in (Verdict.NOT_APPLIED, Verdict.ERROR):
            raise ScenarioNotJudged(self.result)

    def runtest(self) -> None:
        from ftkit.results import Verdict

        assert self.result is not None
        if self.result.verdict is not Verdict.PASS:
            raise ScenarioFailed(self.result)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        line = self.scenario.line_of("name")
        return self.path, None if line is None else line - 1, f"scenario {self.scenario.name}"


def describe_result(result: ScenarioResult) -> str:
    """What a failed or unjudged scenario shows in the pytest report."""
    from ftkit.verify import describe_divergence

    lines = [f"ftkit verdict {result.verdict}: {result.reason}"]
    diverged = result.first_mismatch
    if diverged is not None:
        lines.append(f"first divergence: {describe_divergence(diverged)}")
    for fault in result.faults:
        state = (f"fired {fault.attempts}x" if fault.fired else "never fired")
        if fault.recovered:
            state += f", recovered in {fault.recovery_s or 0.0:.3f} s"
        lines.append(f"fault: {fault.kind} on rank {fault.rank} at request {fault.request} "
                     f"token {fault.token} ({fault.phase}, times {fault.times}): {state}")
    if result.recoveries:
        decisions = ", ".join(r.decision for r in result.recoveries)
        lines.append(f"recovery rounds: {len(result.recoveries)} ({decisions})")
    if result.error:
        lines.append(f"engine error: {result.error}")
    return "\n".join(lines)


# --- fault injection in tests -----------------------------------------------------------------

