"""The ``ftkit`` command line.

Commands: ``run``, ``explore`` (a chaos search), ``report``, ``validate``, ``schema``,
``list``, ``doctor``, ``model build``, ``serve`` (vLLM's server with recovery).

The exit codes (a script may rely on them) are ``EXIT_CODES`` and ``OTHER_COMMANDS_EXIT`` in
``ftkit_cli.exits``, which ``ftkit --help`` and ``ftkit run --help`` show: ``ftkit run`` exits
0 when every scenario passed, 1 when one failed, 2 on bad input or usage, 3 when none failed
but one was not applied or ended in error, 130 when interrupted. Scenarios that
``--fail-fast`` or Ctrl-C left unrun do not change the exit code; the reports list them as
skipped. Errors are printed, one line each, in red on stderr, without a traceback (``run -v``
shows tracebacks of runner errors). ``--json`` output of ``validate`` and ``list`` is one JSON
document on stdout. The runner, vLLM and torch are imported only by the commands that need
them.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ftkit import KIND_SPECS, FtkitError, override_lines
from ftkit_cli.consoles import print_error as _print_error
from ftkit_cli.consoles import stderr_console as _stderr
from ftkit_cli.consoles import stdout_console as _stdout
from ftkit_cli.explore import explore_command
from ftkit_cli.inject_cmd import inject_command
from ftkit_cli.exits import (EXIT_FAILED, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK,
                             EXIT_USAGE, exit_code, exit_codes_help)
from ftkit_cli.render import VerdictReport
from ftkit_cli.serve_cmd import serve_command
from ftkit_cli.run import (HTML_HELP, JUNIT_HELP, parse_overrides, run_command, set_options,
                           write_reports)
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog=exit_codes_help(other_commands=True))
@click.version_option(package_name="ftkit-cli", prog_name="ftkit")
def ftkit() -> None:
    """Fault injection and chaos testing for vLLM inference."""


ftkit.add_command(run_command)
ftkit.add_command(explore_command)
ftkit.add_command(serve_command)
ftkit.add_command(inject_command)


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
    from ftkit import (overrides_from_report, read_json_report, results_from_report,
                       skipped_from_report)

    err = _stderr()
    try:
        data = read_json_report(journal)
        results, skipped = results_from_report(data), skipped_from_report(data)
        overrides = override_lines(overrides_from_report(data))
    except FtkitError as exc:
        _print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    _stdout().print(VerdictReport(results, skipped=skipped, overrides=overrides))
    # The journal already lists its skipped scenarios: the writers read them from it.
    if not write_reports(results, (), err, junit_path=junit_path, html_path=html_path,
                         report=data):
        raise click.exceptions.Exit(EXIT_USAGE)


# --- validate / schema / list ---------------------------------------------------------------

VALIDATE_JSON_HELP = ("Print one JSON document on stdout: per file, valid or its errors "
                      "(file, line, field, message).")
LIST_JSON_HELP = "Print the fault kinds as one JSON document on stdout."

@ftkit.command("validate")
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option("--json", "as_json", is_flag=True, help=VALIDATE_JSON_HELP)
@set_options
def validate_command(paths: tuple[str, ...], as_json: bool, sets: tuple[str, ...],
                     set_files: tuple[str, ...]) -> None:
    """Check scenario files without running them.

    Prints "ok: FILE (name)" for each valid scenario and every error of the others. With
    --set or --set-file, checks the scenarios as "ftkit run" with them would run them. Exits
    0 when every file is valid, 2 otherwise.
    """
    from ftkit_cli.checks import check_paths, checks_document

    err = _stderr()
    overrides = parse_overrides(sets, set_files, err)
    checks = check_paths(paths, overrides)
    if as_json:
        click.echo(json.dumps(checks_document(checks), indent=2))
    else:
        for check in checks:
            if check.valid:
                click.echo(f"ok: {check.file} ({check.name})")
            for error in check.errors:
                _print_error(err, error)
    if not all(check.valid for check in checks):
        raise click.exceptions.Exit(EXIT_USAGE)


@ftkit.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of scenario files (draft-07).

    The text is that of ftkit/scenario/scenario.schema.json, the file installed with ftkit
    that editors read.
    """
    from ftkit import scenario_json_schema

    click.echo(json.dumps(scenario_json_schema(), indent=2))


@ftkit.command("list")
@click.option("--json", "as_json", is_flag=True, help=LIST_JSON_HELP)
def list_command(as_json: bool) -> None:
    """List the fault kinds a scenario can inject."""
    if as_json:
        kinds = [{"kind": kind.value, "implemented": spec.implemented, "summary": spec.summary}
                 for kind, spec in KIND_SPECS.items()]
        click.echo(json.dumps({"fault_kinds": kinds}, indent=2))
        return
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

