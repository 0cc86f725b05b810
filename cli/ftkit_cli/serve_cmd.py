"""``ftkit serve``: start vLLM's OpenAI server with ftkit's recovery (``ftkit.serve.launch``)."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys

import click

from ftkit import FtkitError
from ftkit_cli.consoles import print_error, stderr_console
from ftkit_cli.exits import EXIT_FAILED, EXIT_USAGE

DRY_RUN_HELP = ("Print the environment (the variables ftkit reads or sets, as export lines) "
                "and the command it would run, and exit 0 without starting the server.")


@click.command("serve", context_settings={"allow_interspersed_args": False,
                                          "help_option_names": ["-h", "--help"]})
@click.option("--dry-run", is_flag=True, help=DRY_RUN_HELP)
@click.argument("model")
@click.argument("options", nargs=-1, type=click.UNPROCESSED, metavar="[VLLM OPTIONS]...")
def serve_command(model: str, options: tuple[str, ...], dry_run: bool) -> None:
    """Serve MODEL with vLLM's OpenAI server and ftkit's recovery, on every platform.

    Every option after MODEL goes to vLLM's server as it is; turn recovery on with
    --additional-config '{"fault_tolerance": {"enabled": true}}'. Before the server starts,
    ftkit checks those settings, refuses what recovery cannot roll back (asynchronous
    scheduling, pipeline or data parallelism, expert parallelism, speculative decoding),
    adds --no-async-scheduling, makes sure vLLM loads ftkit's plugins (VLLM_PLUGINS) and
    sets the engine environment recovery needs where unset; stderr says what it added.
    Then it becomes "python -m vllm.entrypoints.openai.api_server --model MODEL ..." (the
    same process: signals reach the server). Exits 2 when a check fails; otherwise the
    server's exit status.
    """
    from ftkit import plan_serve

    err = stderr_console()
    try:
        # vLLM logs to stdout while it is imported (to detect the platform); keep stdout
        # for --dry-run's output.
        with contextlib.redirect_stdout(sys.stderr):
            launch = plan_serve(model, options, os.environ, python=sys.executable)
    except FtkitError as exc:
        print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    for note in launch.notes:
        err.print(f"ftkit serve: {note}", soft_wrap=True, markup=False)
    if dry_run:
        for name, value in launch.shown_env().items():
            click.echo(f"export {name}={shlex.quote(value)}")
        click.echo(shlex.join(launch.argv))
        return
    # vLLM's sockets and stores go to a temporary folder of the server's own, removed when
    # the server is gone, however it ends.
    own = launch.with_own_temp_folder()
    launch = own.launch
    if own.note is not None:
        err.print(f"ftkit serve: {own.note}", soft_wrap=True, markup=False)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(launch.argv[0], list(launch.argv), dict(launch.env))
    except BaseException as exc:  # no server: nothing for the watchdog to wait for
        own.undo()
        if not isinstance(exc, OSError):
            raise
        print_error(err, f"cannot start {launch.argv[0]}: {exc}")
        raise click.exceptions.Exit(EXIT_FAILED) from None
