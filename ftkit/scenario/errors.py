"""Scenario problems as errors, and the field paths that name where they are.

A field path names one place in a scenario the way a user reads it: ``name``,
``engine.tensor_parallel_size``, ``faults[0].at.token``. Internally the same place is a
*loc*, the tuple pydantic uses: ``("faults", 0, "at", "token")``. ``format_loc`` and
``parse_field`` convert between the two for every path the scenario schema can produce.

``ScenarioErrors`` is the one error that ``load_scenario`` raises: a ``ScenarioError`` (so
``except ScenarioError`` catches it) that holds every problem found, in file order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Union

from ftkit.errors import ScenarioError

Loc = tuple[Union[str, int], ...]


def format_loc(loc: Loc) -> str:
    """``("faults", 0, "at", "token")`` -> ``"faults[0].at.token"``; ``()`` -> ``""``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


_FIELD_PART = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


def parse_field(field: str | None) -> Loc:
    """The inverse of ``format_loc`` for paths whose keys hold no ``.``, ``[`` or ``]``."""
    if not field:
        return ()
    return tuple(int(index) if index else key for index, key in _FIELD_PART.findall(field))


class ScenarioErrors(ScenarioError):
    """Every problem found in one or more scenario files.

    ``errors`` lists them (each a plain ``ScenarioError`` with file, line and field), sorted
    by file and line. The ``message``, ``file``, ``line`` and ``field`` attributes are the
    first error's; ``str()`` is one ``FILE:LINE: FIELD: message`` line per error, so with a
    single error it reads exactly like that error.
    """

    def __init__(self, errors: Iterable[ScenarioError]) -> None:
        flat: list[ScenarioError] = []
        for error in errors:
            flat.extend(error.errors if isinstance(error, ScenarioErrors) else [error])
        if not flat:
            raise ValueError("ScenarioErrors needs at least one error")
        flat.sort(key=lambda e: (e.file or "", e.line or 0, e.field or ""))
        self.errors = flat
        first = flat[0]
        super().__init__(first.message, file=first.file, line=first.line, field=first.field)

    def __str__(self) -> str:
        return "\n".join(ScenarioError.__str__(error) for error in self.errors)

    def __reduce__(self):  # the default would call __init__ with the message: keep the list
        return (type(self), (self.errors,))
