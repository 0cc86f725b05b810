"""The exit codes of the ``ftkit`` command, in one place: the code uses the constants, and
``ftkit --help``, ``ftkit run --help`` and the documentation show ``EXIT_CODES``."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from ftkit import ScenarioResult, Verdict

__all__ = [
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "OTHER_COMMANDS_EXIT",
    "exit_code",
    "exit_codes_help",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_INTERRUPTED = 130

#: What each exit status of ``ftkit run`` means (a script may rely on them).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "every scenario passed"),
    (EXIT_FAILED, "at least one scenario failed"),
    (EXIT_USAGE, "bad input or usage: a scenario or an override does not load, no scenario "
                 "found, no scenario matches -k, a bad option, a report cannot be written"),
    (EXIT_INCOMPLETE, "no scenario failed, but at least one was not applied or ended in "
                      "error"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C); every requested report still holds the "
                       "scenarios that finished"),
)

#: The exit statuses of the other commands.
OTHER_COMMANDS_EXIT = (
    "validate: 0 when every file is valid, 2 otherwise. report: 0 once the journal is "
    "rendered, 2 when it cannot be read or a report cannot be written. doctor: 0, or 1 when "
    "--expect-platform names another platform. list, schema: 0. explore: 0 when no failure "
    "was found, 1 when one was, 2 on bad usage or a report that cannot be written, 130 when "
    "interrupted. serve: 2 when a check of the server's options fails, otherwise the "
    "server's own exit status."
)


def exit_code(results: Sequence[ScenarioResult]) -> int:
    """The exit status for a set of verdicts: fail wins over not_applied/error, over pass."""
    verdicts = {Verdict(r.verdict) for r in results}
    if Verdict.FAIL in verdicts:
        return EXIT_FAILED
    if verdicts & {Verdict.NOT_APPLIED, Verdict.ERROR}:
        return EXIT_INCOMPLETE
    return EXIT_OK


def exit_codes_help(*, other_commands: bool = False, width: int = 78) -> str:
    """``EXIT_CODES`` as a click help epilog (``\\b`` keeps click from rewrapping the table;
    the lines are wrapped here, under their meaning)."""
    lines = ["\b", "Exit codes of ftkit run:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(meaning, width=width, initial_indent=f"  {code:<5}",
                               subsequent_indent=" " * 7)
    text = "\n".join(lines)
    if other_commands:
        text += "\n\n" + OTHER_COMMANDS_EXIT
    return text
