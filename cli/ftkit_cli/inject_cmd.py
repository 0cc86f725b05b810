"""``ftkit inject``: plan a fault in a running server (``ftkit.serve``)."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from ftkit import FtkitError
from ftkit_cli.consoles import print_error, stderr_console
from ftkit_cli.exits import EXIT_FAILED, EXIT_USAGE


def _rank(value: str) -> int | str:
    if value == "all":
        return value
    try:
        rank = int(value)
    except ValueError:
        raise click.BadParameter("a rank from 0, or all") from None
    if rank < 0:
        raise click.BadParameter("a rank from 0, or all")
    return rank


@click.command("inject")
@click.option("--url", required=True, metavar="http://HOST:PORT",
              help="The server (started with ftkit's plugin and injection on).")
@click.option("--kind", required=True, help="The fault kind (`ftkit list`).")
@click.option("--rank", "rank", required=True, metavar="R|all",
              help="The rank that fails, or all.")
@click.option("--times", type=click.IntRange(min=1), default=1, show_default=True,
              help="Consecutive attempts of the step that fail.")
@click.option("--phase", type=click.Choice(["before", "forward", "sample"]),
              default="forward", show_default=True, help="Where inside the step it fires.")
@click.option("--params", "params", default=None, metavar="JSON",
              help="The kind's own settings, as a JSON object.")
@click.option("--request-id", default=None, metavar="ID",
              help="The request the fault hits: the X-Request-Id its client sent (a request "
                   "that has not arrived yet is waited for). Needs --token.")
@click.option("--token", type=click.IntRange(min=0), default=None,
              help="With --request-id: the output token whose step fails (0 = prefill).")
@click.option("--after-steps", type=click.IntRange(min=0), default=None, metavar="K",
              help="Instead of a request: fail the step K steps after the next one (0: the "
                   "next step).")
@click.option("--secret", default=None, help="The server's secret (default: the environment "
                                             "variable FTKIT_INJECT_SECRET).")
@click.option("--id", "plan_id", default=None, metavar="ID",
              help="A name for this call: the same call repeated with the same id (after a "
                   "timeout, say) plans nothing more and prints what the first planned.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=90.0,
              show_default=True, help="Seconds to wait for the server's answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
def inject_command(url: str, kind: str, rank: str, times: int, phase: str,
                   params: str | None, request_id: str | None, token: int | None,
                   after_steps: int | None, secret: str | None, plan_id: str | None,
                   timeout_s: float, as_json: bool) -> None:
    """Plan a fault in a running vLLM server.

    The server must load ftkit's plugin (`ftkit serve`, or VLLM_PLUGINS naming ftkit), say
    "injection": true in its fault_tolerance settings, and have FTKIT_INJECT_SECRET in its
    environment; the same secret goes with every injection. Exits 0 when the fault was
    planned, 1 when the server refused it or could not be reached, 2 on bad options.
    """
    from ftkit import INJECT_SECRET_ENV, InjectRefused, inject_live_fault

    err = stderr_console()
    if (request_id is None) == (after_steps is None):
        print_error(err, "give either --request-id with --token, or --after-steps")
        raise click.exceptions.Exit(EXIT_USAGE)
    if request_id is not None and token is None:
        print_error(err, "--request-id needs --token (the output token the fault hits)")
        raise click.exceptions.Exit(EXIT_USAGE)
    if request_id is None and token is not None:
        print_error(err, "--token goes with --request-id")
        raise click.exceptions.Exit(EXIT_USAGE)
    fault: dict[str, Any] = {"kind": kind, "rank": _rank(rank), "phase": phase,
                             "times": times}
    if params is not None:
        try:
            fault["params"] = json.loads(params)
        except ValueError as exc:
            print_error(err, f"--params is not JSON: {exc}")
            raise click.exceptions.Exit(EXIT_USAGE) from None
        if not isinstance(fault["params"], dict):
            print_error(err, "--params must be a JSON object")
            raise click.exceptions.Exit(EXIT_USAGE)
    if request_id is not None:
        fault.update(request_id=request_id, token=token)
    else:
        fault["after_steps"] = after_steps
    if plan_id is not None:
        fault["id"] = plan_id
    secret = secret if secret is not None else os.environ.get(INJECT_SECRET_ENV)
    try:
        answer = inject_live_fault(url, fault, secret, timeout_s)
    except InjectRefused as exc:
        print_error(err, f"the server refused the fault (HTTP {exc.status}): {exc}")
        bad_fault = exc.status in (400, 422)
        raise click.exceptions.Exit(EXIT_USAGE if bad_fault else EXIT_FAILED) from None
    except FtkitError as exc:
        print_error(err, str(exc))
        raise click.exceptions.Exit(EXIT_FAILED) from None
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    planned = answer["planned"]  # its shape is checked by inject_live_fault
    where = (f"request {planned.get('request_id')!r}, token {planned.get('token')}"
             if "request_id" in planned else f"{planned.get('after_steps')} step(s) after the "
                                              f"next")
    click.echo(f"planned fault {planned.get('index')}: {planned.get('kind')} on rank "
               f"{planned.get('rank')}, {planned.get('phase')} phase, {where}, "
               f"{planned.get('times')} attempt(s)"
               + (" (planned already, by the first call with this id)"
                  if answer.get("repeated") else ""))
