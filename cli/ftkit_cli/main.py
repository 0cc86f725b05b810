"""The ``ftkit`` command line.

Commands: ``run``, ``validate``, ``schema``, ``list``, ``model build``.

Exit codes of ``ftkit run`` (a script may rely on them)::

    0    every scenario passed
    1    at least one scenario failed
    2    bad input or usage: a scenario does not load, no scenario found, bad option
    3    no scenario failed, but at least one was not applied or ended in error
    130  interrupted (Ctrl-C); the --json report still holds the scenarios that finished

``validate`` exits 0 when every file is valid and 2 otherwise. Errors are printed, one line
each, in red on stderr, without a traceback (``run -v`` shows tracebacks of runner errors).
The runner, vLLM and torch are imported only by the commands that need them.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ftkit.errors import FtkitError
from ftkit.events import EventSink
from ftkit.faults import KINDS
from ftkit.results import ScenarioResult, Verdict
from ftkit.verify import planned_faults
from ftkit_cli.render import RunProgress, VerdictReport, error_lines

__all__ = [
    "EXIT_FAILED",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "exit_code",
    "ftkit",
    "main",
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

@ftkit.command("run")
@click.argument("paths", nargs=-1, required=True, metavar="FILE_OR_DIR...")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSON report (journal) to this file.")
@click.option("-v", "--verbose", is_flag=True,
              help="Show every progress event and the traceback of runner errors.")
@click.pass_context
def run_command(ctx: click.Context, paths: tuple[str, ...], json_path: Path | None,
                verbose: bool) -> None:
    """Run scenarios and compare every token with a fault-free run.

    FILE_OR_DIR may be a scenario file, a directory of them or a glob.
    """
    err, out = _stderr(), _stdout()
    scenarios = _load_all(list(paths), err)
    runner = _import_runner()
    results: list[ScenarioResult] = []
    interrupted = False
    try:
        with RunProgress(err, total=len(scenarios), verbose=verbose) as progress:
            for file, scenario in scenarios:
                progress.start(str(scenario.name))
                result = _run_one(runner, scenario, file, progress, err, verbose)
                results.append(result)
                progress.finish(result)
    except KeyboardInterrupt:
        interrupted = True
    if results:
        out.print(VerdictReport(results))
    code = EXIT_INTERRUPTED if interrupted else exit_code(results)
    if json_path is not None and not _write_report(results, json_path, err):
        code = code if interrupted else EXIT_USAGE
    if interrupted:
        err.print("interrupted", style="bold red")
    ctx.exit(code)


def _load_all(paths: list[str], err: Console) -> list[tuple[str, Any]]:
    """Every scenario named by the arguments, or exit 2 after printing the errors."""
    from ftkit.scenario import load_scenarios

    try:
        scenarios = load_scenarios(paths)
    except (FtkitError, OSError) as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    if not scenarios:
        _print_error(err, f"no scenario found in: {' '.join(paths)}")
        raise click.exceptions.Exit(EXIT_USAGE)
    return list(scenarios)


def _import_runner() -> Runner:
    """``ftkit.runner.run_scenario``, or a stand-in that reports why it cannot be had."""
    try:
        from ftkit.runner import run_scenario
    except ImportError as exc:
        problem = exc

        def run_scenario(scenario: Any, *, file: str, on_event: EventSink) -> ScenarioResult:
            raise FtkitError(f"cannot load the scenario runner: {problem}")

    return run_scenario


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


def _write_report(results: Sequence[ScenarioResult], path: Path, err: Console) -> bool:
    from ftkit.report import write_json_report

    try:
        write_json_report(results, path)
    except OSError as exc:
        _print_error(err, f"cannot write the JSON report {path}: {exc}")
        return False
    err.print(f"report written to {path}", markup=False)
    return True


# --- validate / schema / list ---------------------------------------------------------------

@ftkit.command("validate")
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
def validate_command(paths: tuple[str, ...]) -> None:
    """Check scenario files without running them.

    Prints "ok: FILE (name)" for each valid scenario and every error of the others.
    """
    from ftkit.scenario import load_scenario, load_scenarios

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
    from ftkit.scenario import scenario_json_schema

    click.echo(json.dumps(scenario_json_schema(), indent=2))


@ftkit.command("list")
def list_command() -> None:
    """List the fault kinds a scenario can inject."""
    width = max(len(kind.value) for kind in KINDS)
    for kind, info in KINDS.items():
        status = "implemented" if info.implemented else "not implemented yet"
        click.echo(f"{kind.value:<{width}}  {status:<19}  {info.summary}")


# --- model ----------------------------------------------------------------------------------

@ftkit.group("model")
def model_group() -> None:
    """The embedded tiny model."""


@model_group.command("build")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the model here instead of the cache directory.")
def model_build_command(out: Path | None) -> None:
    """Build the tiny Llama model and tokenizer; print its directory."""
    from ftkit.model import build_tiny_model

    try:
        path = build_tiny_model(out)
    except (FtkitError, OSError, ImportError) as exc:
        _print_error(_stderr(), f"cannot build the tiny model: {exc}")
        raise click.exceptions.Exit(EXIT_FAILED) from None
    click.echo(str(path))


def main() -> None:
    """Console-script entry point."""
    ftkit(prog_name="ftkit")

