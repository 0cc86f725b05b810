"""The ``ftkit`` command line.

Commands: ``run``, ``report``, ``validate``, ``schema``, ``list``, ``doctor``, ``model build``.

Exit codes of ``ftkit run`` (a script may rely on them)::

    0    every scenario passed
    1    at least one scenario failed
    2    bad input or usage: a scenario does not load, no scenario found, no scenario matches
         -k, bad option, a report cannot be written
    3    no scenario failed, but at least one was not applied or ended in error
    130  interrupted (Ctrl-C); every requested report still holds the scenarios that finished

Scenarios that ``--fail-fast`` or Ctrl-C left unrun do not change the exit code; the reports
list them as skipped. ``report`` exits 0 once it has rendered a journal and 2 when the journal
cannot be read or a report cannot be written. ``validate`` exits 0 when every file is valid
and 2 otherwise. Errors are printed, one line
each, in red on stderr, without a traceback (``run -v`` shows tracebacks of runner errors).
The runner, vLLM and torch are imported only by the commands that need them.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ftkit import (KIND_SPECS, EventSink, FtkitError, ScenarioResult, SkippedScenario, Verdict,
                   planned_faults)
from ftkit_cli.render import RunProgress, VerdictReport, error_lines
from ftkit_cli.select import name_matcher

__all__ = [
    "EXIT_FAILED",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "exit_code",
    "ftkit",
    "main",
    "name_matcher",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130

Runner = Callable[..., ScenarioResult]


def exit_code(results: Sequence[ScenarioResult]) -> int:
    """The exit status for a set of verdicts: fail wins over not_applied/error, over pass."""
    verdicts = {Verdict(r.verdict) for r in results}
    if Verdict.FAIL in verdicts:
        return EXIT_FAILED
    if verdicts & {Verdict.NOT_APPLIED, Verdict.ERROR}:
        return EXIT_INCOMPLETE
    return EXIT_OK


#: Width of the verdict table when stdout is not a terminal (a CI log, a file).
LOG_WIDTH = 120


def _stdout() -> Console:
    # Consoles are made per command so that they write to the streams of the moment
    # (click's test runner swaps them).
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _print_error(console: Console, message: object) -> None:
    for line in error_lines(str(message)):
        console.print(line, soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ftkit-cli", prog_name="ftkit")
def ftkit() -> None:
    """Fault injection and chaos testing for vLLM inference."""


# --- run ------------------------------------------------------------------------------------

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


@ftkit.command("run")
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
@click.pass_context
def run_command(ctx: click.Context, paths: tuple[str, ...], json_path: Path | None,
                junit_path: Path | None, html_path: Path | None, fail_fast: bool,
                pattern: str | None, verbose: bool) -> None:
    """Run scenarios and compare every token with a fault-free run.

    FILE_OR_DIR may be a scenario file, a directory of them or a glob. Scenarios that need
    alike engines run one after the other and share the engine.
    """
    err, out = _stderr(), _stdout()
    scenarios = _grouped_by_engine(_select(_load_all(list(paths), err), pattern, err))
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
        out.print(VerdictReport(results, skipped=skipped))
    code = EXIT_INTERRUPTED if interrupted else exit_code(results)
    written = _write_reports(results, skipped, err, json_path=json_path,
                             junit_path=junit_path, html_path=html_path)
    if not written:
        code = code if interrupted else EXIT_USAGE
    if interrupted:
        err.print("interrupted", style="bold red")
    ctx.exit(code)


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


def _write_reports(results: Sequence[ScenarioResult], skipped: Sequence[SkippedScenario],
                   err: Console, *, json_path: Path | None = None,
                   junit_path: Path | None = None, html_path: Path | None = None,
                   report: dict[str, Any] | None = None) -> bool:
    """Write every requested report; False if one could not be written (the others are).

    From ``report`` (a loaded journal) when given, else from ``results`` and ``skipped``.
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
            write(what, path, skipped=skipped)
        except (OSError, ImportError, FtkitError) as exc:
            _print_error(err, f"cannot write the {label} report {path}: {exc}")
            written = False
            continue
        err.print(f"{label} report written to {path}", markup=False)
    return written


# --- scenario selection (-k) ----------------------------------------------------------------

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


# --- report ---------------------------------------------------------------------------------

@ftkit.command("report")
@click.argument("journal", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help=HTML_HELP)
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help=JUNIT_HELP)
def report_command(journal: Path, html_path: Path | None, junit_path: Path | None) -> None:
    """Render a saved JSON report (written by "ftkit run --json") again.

    Prints the verdict table and writes the HTML and JUnit reports that are asked for.
    """
    from ftkit import read_json_report, results_from_report, skipped_from_report

    err = _stderr()
    try:
        data = read_json_report(journal)
        results, skipped = results_from_report(data), skipped_from_report(data)
    except FtkitError as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    _stdout().print(VerdictReport(results, skipped=skipped))
    # The journal already lists its skipped scenarios: the writers read them from it.
    if not _write_reports(results, (), err, junit_path=junit_path, html_path=html_path,
                          report=data):
        raise click.exceptions.Exit(EXIT_USAGE)


# --- validate / schema / list ---------------------------------------------------------------

@ftkit.command("validate")
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
def validate_command(paths: tuple[str, ...]) -> None:
    """Check scenario files without running them.

    Prints "ok: FILE (name)" for each valid scenario and every error of the others.
    """
    from ftkit import load_scenario, load_scenarios

    err = _stderr()
    valid = True
    for path in paths:
        try:
            if Path(path).is_file():
                loaded = [(path, load_scenario(path))]
            else:
                loaded = list(load_scenarios([path]))
        except (FtkitError, OSError) as exc:
            _print_error(err, exc)
            valid = False
            continue
        if not loaded:
            _print_error(err, f"{path}: no scenario found")
            valid = False
        for file, scenario in loaded:
            click.echo(f"ok: {file} ({scenario.name})")
    if not valid:
        raise click.exceptions.Exit(EXIT_USAGE)


@ftkit.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of scenario files."""
    from ftkit import scenario_json_schema

    click.echo(json.dumps(scenario_json_schema(), indent=2))


@ftkit.command("list")
def list_command() -> None:
    """List the fault kinds a scenario can inject."""
    width = max(len(kind.value) for kind in KIND_SPECS)
    for kind, spec in KIND_SPECS.items():
        status = "implemented" if spec.implemented else "not implemented yet"
        click.echo(f"{kind.value:<{width}}  {status:<19}  {spec.summary}")


# --- doctor ---------------------------------------------------------------------------------

DOCTOR_JSON_HELP = "Print the diagnosis as JSON (for machines) instead of tables."
EXPECT_PLATFORM_HELP = ("Exit 1 unless vLLM detects this platform (cpu, cuda, npu): a CI job "
                        "on NPU runners then cannot pass by running on the CPU.")


@ftkit.command("doctor")
@click.option("--json", "as_json", is_flag=True, help=DOCTOR_JSON_HELP)
@click.option("--expect-platform", type=click.Choice(["cpu", "cuda", "npu"]), default=None,
              help=EXPECT_PLATFORM_HELP)
def doctor_command(as_json: bool, expect_platform: str | None) -> None:
    """Show what ftkit can do on this machine.

    The platform vLLM detects and the installed vLLM, vllm-ascend, torch and torch_npu; for
    each fault kind whether a scenario can inject it here, for real or emulated; for each
    recovery step whether this platform's backend supports it. Exits 0, or 1 when
    --expect-platform names another platform.
    """
    import contextlib
    import sys

    from ftkit import diagnose

    # vLLM logs to stdout while it is imported; keep stdout for the report (and its JSON).
    with contextlib.redirect_stdout(sys.stderr):
        diagnosis = diagnose()
    if as_json:
        click.echo(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        from ftkit_cli.doctor_view import DoctorReport

        _stdout().print(DoctorReport(diagnosis))
    if expect_platform is not None and diagnosis.platform != expect_platform:
        _print_error(_stderr(), f"expected platform {expect_platform}, found "
                                f"{diagnosis.platform or 'none'} ({diagnosis.platform_source})")
        raise click.exceptions.Exit(EXIT_FAILED)


# --- model ----------------------------------------------------------------------------------

@ftkit.group("model")
def model_group() -> None:
    """The embedded tiny model."""


@model_group.command("build")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the model here instead of the cache directory.")
def model_build_command(out: Path | None) -> None:
    """Build the tiny Llama model and tokenizer; print its directory."""
    from ftkit import build_tiny_model

    try:
        path = build_tiny_model(out)
    except (FtkitError, OSError, ImportError) as exc:
        _print_error(_stderr(), f"cannot build the tiny model: {exc}")
        raise click.exceptions.Exit(EXIT_FAILED) from None
    click.echo(str(path))


def main() -> None:
    """Console-script entry point."""
    ftkit(prog_name="ftkit")

