"""``ftkit run``: load the scenarios (with the run's overrides), run them one after the
other on shared engines while the progress is shown, print the verdicts, write the reports.

The exit status follows the verdicts (``ftkit_cli.exits``). The scenario runner is imported
only when the command runs: it brings the engine host client, not vLLM itself.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ftkit import (EventSink, FtkitError, Overrides, ScenarioResult, SkippedScenario, Verdict,
                   planned_faults)
from ftkit_cli.consoles import print_error as _print_error
from ftkit_cli.consoles import stderr_console as _stderr
from ftkit_cli.consoles import stdout_console as _stdout
from ftkit_cli.exits import EXIT_INTERRUPTED, EXIT_USAGE, exit_code, exit_codes_help
from ftkit_cli.render import RunHeader, RunProgress, VerdictReport
from ftkit_cli.select import name_matcher

__all__ = ["HTML_HELP", "JSON_HELP", "JUNIT_HELP", "parse_overrides", "run_command",
           "set_options", "write_reports"]

Runner = Callable[..., ScenarioResult]


#: Help texts of the options of ``run`` (and ``report``), in one place.
JSON_HELP = "Write the JSON report (journal) to this file."
JUNIT_HELP = "Write a JUnit XML report (one test case per scenario) to this file."
HTML_HELP = ("Write one self-contained HTML report (verdict table, fault timeline per "
             "scenario) to this file.")
FAIL_FAST_HELP = ("Stop after the first scenario that does not pass; the rest are not run "
                  "and are reported as skipped.")
SELECT_HELP = ("Run only the scenarios whose name matches PATTERN: a substring, or an "
               "expression of substrings with not/and/or and parentheses, e.g. "
               "'oom and not exhausted'. Case-insensitive.")
SET_HELP = ("Set a field in every scenario of the run, e.g. --set engine.block_size=128. "
            "FIELD is a path below engine, workload, recovery or expect; VALUE is read as "
            "YAML. Validated like the scenario file; repeatable, the last one wins.")
SET_FILE_HELP = ("Set the fields of a YAML mapping in every scenario (keys: field paths such "
                 "as engine.dtype, or sections with nested mappings). Applied before --set; "
                 "repeatable.")


def set_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--set`` and ``--set-file``, for the commands that load scenarios."""
    command = click.option("--set-file", "set_files", multiple=True, metavar="FILE",
                           help=SET_FILE_HELP)(command)
    return click.option("--set", "sets", multiple=True, metavar="FIELD=VALUE",
                        help=SET_HELP)(command)


@click.command("run", epilog=exit_codes_help())
@click.argument("paths", nargs=-1, required=True, metavar="FILE_OR_DIR...")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help=JSON_HELP)
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help=JUNIT_HELP)
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help=HTML_HELP)
@click.option("--fail-fast", is_flag=True, help=FAIL_FAST_HELP)
@click.option("-k", "pattern", metavar="PATTERN", help=SELECT_HELP)
@click.option("-v", "--verbose", is_flag=True,
              help="Show every progress event and the traceback of runner errors.")
@set_options
@click.pass_context
def run_command(ctx: click.Context, paths: tuple[str, ...], json_path: Path | None,
                junit_path: Path | None, html_path: Path | None, fail_fast: bool,
                pattern: str | None, verbose: bool, sets: tuple[str, ...],
                set_files: tuple[str, ...]) -> None:
    """Run scenarios and compare every token with a fault-free run.

    FILE_OR_DIR may be a scenario file, a directory of them or a glob. Scenarios that need
    alike engines run one after the other and share the engine. On a terminal progress is
    shown live; elsewhere (a CI log) as one line per phase.
    """
    err, out = _stderr(), _stdout()
    overrides = parse_overrides(sets, set_files, err)
    selected = _select(_load_all(list(paths), err), pattern, err)
    scenarios = _grouped_by_engine(_overridden(selected, overrides, err))
    err.print(RunHeader(len(scenarios), overrides.lines()))
    results: list[ScenarioResult] = []
    skipped: list[SkippedScenario] = []
    interrupted = False
    try:
        with _scenario_runner() as runner, \
                RunProgress(err, total=len(scenarios), verbose=verbose) as progress:
            for file, scenario in scenarios:
                progress.start(str(scenario.name))
                result = _run_one(runner, scenario, file, progress, err, verbose)
                results.append(result)
                progress.finish(result)
                if fail_fast and Verdict(result.verdict) is not Verdict.PASS:
                    why = f"not run: --fail-fast stopped after {result.name} ({result.verdict})"
                    skipped = _unrun(scenarios, len(results), why)
                    break
    except KeyboardInterrupt:
        interrupted = True
        skipped = _unrun(scenarios, len(results), "not run to the end: interrupted")
    if results or skipped:
        out.print(VerdictReport(results, skipped=skipped, overrides=overrides.lines()))
    code = EXIT_INTERRUPTED if interrupted else exit_code(results)
    written = write_reports(results, skipped, err, json_path=json_path,
                            junit_path=junit_path, html_path=html_path,
                            overrides=overrides.to_dict())
    if not written:
        code = code if interrupted else EXIT_USAGE
    if interrupted:
        err.print("interrupted", style="bold red")
    ctx.exit(code)


def parse_overrides(sets: Sequence[str], set_files: Sequence[str], err: Console) -> Overrides:
    """The ``--set-file`` and ``--set`` overrides, or exit 2 after printing their errors."""
    try:
        return Overrides.parse(sets=sets, files=set_files)
    except FtkitError as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None


def _overridden(scenarios: list[tuple[str, Any]], overrides: Overrides,
                err: Console) -> list[tuple[str, Any]]:
    """The scenarios with the overrides applied (so also keyed by them: the engine groups
    and the baseline cache see the overridden fields), or exit 2 after the errors."""
    try:
        return overrides.apply_all(scenarios)
    except FtkitError as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None


def _grouped_by_engine(scenarios: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The scenarios with those that need alike engines next to each other (groups in order
    of first appearance, file order within a group): they then share one engine."""
    groups: dict[str, list[tuple[str, Any]]] = {}
    for item in scenarios:
        groups.setdefault(_engine_group(item[1]), []).append(item)
    return [item for group in groups.values() for item in group]


def _engine_group(scenario: Any) -> str:
    kills = any(str(f.kind) == "process_kill" for f in scenario.faults)
    return json.dumps([scenario.engine_key(), scenario.recovery.enabled, kills],
                      sort_keys=True, default=str)


def _unrun(scenarios: Sequence[tuple[str, Any]], done: int, reason: str
           ) -> list[SkippedScenario]:
    """The scenarios after the first ``done``, as skipped for ``reason``."""
    return [SkippedScenario(name=str(scenario.name), file=file, reason=reason)
            for file, scenario in scenarios[done:]]


def _load_all(paths: list[str], err: Console) -> list[tuple[str, Any]]:
    """Every scenario named by the arguments, or exit 2 after printing the errors."""
    from ftkit import load_scenarios

    try:
        scenarios = load_scenarios(paths)
    except (FtkitError, OSError) as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    if not scenarios:
        _print_error(err, f"no scenario found in: {' '.join(paths)}")
        raise click.exceptions.Exit(EXIT_USAGE)
    return list(scenarios)


@contextmanager
def _scenario_runner() -> Iterator[Runner]:
    """``ftkit.runner.ScenarioRunner().run`` for the whole command (scenarios share engines;
    every engine is shut down when the block ends, also on Ctrl-C), or a stand-in that
    reports why the runner cannot be had."""
    try:
        from ftkit import ScenarioRunner
    except ImportError as exc:
        problem = exc

        def unavailable(scenario: Any, *, file: str, on_event: EventSink) -> ScenarioResult:
            raise FtkitError(f"cannot load the scenario runner: {problem}")

        yield unavailable
        return
    with ScenarioRunner() as runner:
        yield runner.run


def _run_one(runner: Runner, scenario: Any, file: str, sink: EventSink, err: Console,
             verbose: bool) -> ScenarioResult:
    """Run one scenario; an unexpected exception becomes that scenario's ``error`` verdict."""
    started = time.monotonic()
    try:
        return runner(scenario, file=file, on_event=sink)
    except Exception as exc:
        if verbose:
            err.print(traceback.format_exc(), style="red", markup=False, highlight=False)
        return ScenarioResult(name=str(scenario.name), file=file, verdict=Verdict.ERROR,
                              reason=f"{type(exc).__name__}: {exc}",
                              duration_s=time.monotonic() - started, error=str(exc),
                              faults=planned_faults(scenario))


def write_reports(results: Sequence[ScenarioResult], skipped: Sequence[SkippedScenario],
                  err: Console, *, json_path: Path | None = None,
                  junit_path: Path | None = None, html_path: Path | None = None,
                  report: dict[str, Any] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> bool:
    """Write every requested report; False if one could not be written (the others are).

    From ``report`` (a loaded journal) when given, else from ``results``, ``skipped`` and
    ``overrides`` (the run's ``{field: value}``).
    """
    from ftkit import write_html_report, write_json_report, write_junit_report

    source: Any = results if report is None else report
    writers = (("JSON", json_path, write_json_report, results),
               ("JUnit", junit_path, write_junit_report, source),
               ("HTML", html_path, write_html_report, source))
    written = True
    for label, path, write, what in writers:
        if path is None:
            continue
        try:
            write(what, path, skipped=skipped, overrides=overrides)
        except (OSError, ImportError, FtkitError) as exc:
            _print_error(err, f"cannot write the {label} report {path}: {exc}")
            written = False
            continue
        err.print(f"{label} report written to {path}", markup=False)
    return written


# --- scenario selection (-k) ---------------------------------------------------------------

def _select(scenarios: list[tuple[str, Any]], pattern: str | None,
            err: Console) -> list[tuple[str, Any]]:
    """The scenarios whose name matches ``-k PATTERN`` (all without one), or exit 2."""
    if pattern is None:
        return scenarios
    try:
        matches = name_matcher(pattern)
    except ValueError as exc:
        _print_error(err, f"bad -k expression {pattern!r}: {exc}")
        raise click.exceptions.Exit(EXIT_USAGE) from None
    selected = [(file, s) for file, s in scenarios if matches(str(s.name))]
    if not selected:
        names = ", ".join(str(s.name) for _, s in scenarios)
        _print_error(err, f"no scenario matches -k {pattern!r} (found: {names})")
        raise click.exceptions.Exit(EXIT_USAGE)
    return selected
