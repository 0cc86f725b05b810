"""The consoles the ``ftkit`` command writes to, and how it prints errors."""

from __future__ import annotations

import os

from rich.console import Console

from ftkit_cli.render import error_lines

__all__ = ["LOG_WIDTH", "print_error", "stderr_console", "stdout_console"]

#: Width of the verdict table when stdout is not a terminal (a CI log, a file).
LOG_WIDTH = 120


def stdout_console() -> Console:
    # Consoles are made per command so that they write to the streams of the moment
    # (click's test runner swaps them).
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_error(console: Console, message: object) -> None:
    for line in error_lines(str(message)):
        console.print(line, soft_wrap=True)
