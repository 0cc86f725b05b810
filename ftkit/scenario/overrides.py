"""Scenario fields set for a whole run: ``ftkit run --set FIELD=VALUE`` and ``--set-file``.

A CI job that runs the bundled scenarios on other hardware (an NPU wants ``bfloat16`` and a
block size of 128, the files say ``float32`` and 32) sets those fields for every scenario of
the run instead of editing the files::

    overrides = Overrides.parse(sets=["engine.block_size=128", "engine.dtype=bfloat16"])
    scenario = overrides.apply(load_scenario("scenarios/link_flap.yaml"))

What a caller may rely on:

* ``FIELD`` is a field path below one of the sections every scenario has: ``engine``,
  ``workload``, ``recovery``, ``expect`` (``engine.block_size``, ``engine.args.enforce_eager``).
  ``name``, ``description`` and ``faults`` cannot be overridden (a name is a scenario's
  identity; a fault list differs from scenario to scenario), nor can a path index into a list
  (``faults[0].at.token``): each is refused with the reason, before any scenario is touched.
* ``VALUE`` is read as YAML, as in a scenario file: ``128`` is a number, ``bfloat16`` a string,
  ``true`` a boolean, ``[a, b]`` a list, an empty value null. A non-empty mapping is merged
  into the field key by key; anything else replaces the field.
* A ``--set-file`` holds one YAML mapping whose keys are field paths (``engine.dtype``) or
  sections with nested mappings (``engine: {dtype: bfloat16}``), or both. Files are applied
  first, in order, then the ``--set`` arguments; for the same field the last one given wins.
* ``apply`` validates the overridden scenario exactly as a scenario file is validated (the same
  models, the same rules). It raises ``ScenarioErrors``: an error in an overridden field names
  the ``--set`` argument (or the file and line) that set it and the field; an error the
  override caused elsewhere (``workload.max_tokens=8`` under a fault at token 17) names the
  scenario file, line and field, and the overrides.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ftkit.errors import ScenarioError
from ftkit.scenario.errors import Loc, ScenarioErrors, format_loc, parse_field
from ftkit.scenario.load import _type_error
from ftkit.scenario.model import Scenario
from ftkit.scenario.source import Document, read_yaml

__all__ = ["OVERRIDABLE_SECTIONS", "Override", "Overrides", "override_lines"]

#: The top-level sections an override may set fields of: every scenario has them.
OVERRIDABLE_SECTIONS = ("engine", "workload", "recovery", "expect")

#: Top-level fields that cannot be overridden, and why.
_REFUSED = {
    "name": "a scenario's name is its identity in reports and for -k",
    "description": "a scenario's description is its own",
    "faults": "each scenario has its own faults; change the scenario file instead",
}


@dataclass(frozen=True)
class Override:
    """One field set for every scenario of a run, and where it was given."""

    #: The field path, as in scenario errors: ``engine.block_size``.
    field: str
    value: Any
    #: The ``--set`` argument as given, or the file that holds the override.
    origin: str
    #: The line in ``origin`` when it is a file.
    line: int | None = None

    @property
    def loc(self) -> Loc:
        return parse_field(self.field)

    def error(self, message: str, field: str | None = None) -> ScenarioError:
        """An error about this override, named by where it was given."""
        return ScenarioError(message, file=self.origin, line=self.line,
                             field=field or self.field)


class Overrides:
    """The fields a run sets in every scenario, in the order they are applied (a field given
    again moves to the end: the last one given wins)."""

    def __init__(self, overrides: Iterable[Override] = ()) -> None:
        self._by_field: dict[str, Override] = {}
        for override in overrides:
            self._by_field.pop(override.field, None)
            self._by_field[override.field] = override

    @classmethod
    def parse(cls, sets: Sequence[str] = (),
              files: Sequence[str | os.PathLike[str]] = ()) -> Overrides:
        """The overrides of ``--set-file`` ``files`` then ``--set`` arguments ``sets``.

        Raises ``ScenarioErrors`` listing every malformed argument, file or field path.
        """
        found: list[Override] = []
        errors: list[ScenarioError] = []
        for path in files:
            try:
                found += read_override_file(path)
            except ScenarioErrors as exc:
                errors += exc.errors
        for argument in sets:
            try:
                found += parse_set_argument(argument)
            except ScenarioErrors as exc:
                errors += exc.errors
        if errors:
            raise ScenarioErrors(errors)
        return cls(found)

    def __bool__(self) -> bool:
        return bool(self._by_field)

    def __iter__(self) -> Iterator[Override]:
        return iter(self._by_field.values())

    def __len__(self) -> int:
        return len(self._by_field)

    def to_dict(self) -> dict[str, Any]:
        """``{field: value}`` in the order applied, for reports (the values are JSON types
        wherever YAML gave them)."""
        return {o.field: o.value for o in self}

    def lines(self) -> list[str]:
        """``FIELD=VALUE`` for each override, as ``--set`` would take it back."""
        return override_lines(self.to_dict())

    def apply(self, scenario: Scenario) -> Scenario:
        """``scenario`` with every override set, validated like a scenario file.

        The result keeps the scenario's file and line numbers. Raises ``ScenarioErrors``.
        """
        if not self:
            return scenario
        data = scenario.model_dump(mode="json", exclude_unset=True)
        errors: list[ScenarioError] = []
        for override in self:
            problem = _set(data, override)
            if problem is not None:
                errors.append(problem)
        if errors:
            raise ScenarioErrors(errors)
        doc = Document(file=scenario.source or "<scenario>", data=data,
                       lines=dict(scenario._lines))
        try:
            overridden = Scenario.model_validate(data)
        except ValidationError as exc:
            found = [_type_error(doc, detail) for detail in exc.errors(include_url=False)]
            raise ScenarioErrors(self._blame(found)) from None
        except ScenarioErrors as exc:  # the semantic rules
            found = [doc.error(e.message, parse_field(e.field)) for e in exc.errors]
            raise ScenarioErrors(self._blame(found)) from None
        overridden._source = scenario._source
        overridden._lines = scenario._lines
        return overridden

    def apply_all(self, loaded: Sequence[tuple[str, Scenario]]
                  ) -> list[tuple[str, Scenario]]:
        """Every ``(file, scenario)`` with the overrides applied.

        Raises one ``ScenarioErrors`` with the problems of all scenarios, an override's own
        problem once however many scenarios it breaks.
        """
        applied: list[tuple[str, Scenario]] = []
        errors: dict[str, ScenarioError] = {}
        for file, scenario in loaded:
            try:
                applied.append((file, self.apply(scenario)))
            except ScenarioErrors as exc:
                errors.update((str(e), e) for e in exc.errors)
        if errors:
            raise ScenarioErrors(errors.values())
        return applied

    def _blame(self, found: list[ScenarioError]) -> list[ScenarioError]:
        """Each error of an overridden scenario, named by the override that set its field
        or, when it lies elsewhere, by the scenario file and the run's overrides."""
        blamed = []
        for error in found:
            loc = parse_field(error.field)
            culprit = next((o for o in reversed(list(self)) if _related(o.loc, loc)), None)
            if culprit is not None:
                blamed.append(culprit.error(error.message, error.field))
            else:
                blamed.append(ScenarioError(
                    f"{error.message} (with the overrides {', '.join(self.lines())})",
                    file=error.file, line=error.line, field=error.field))
        return blamed


def override_lines(overrides: Mapping[str, Any]) -> list[str]:
    """``FIELD=VALUE`` for each entry of ``{field: value}`` (a report's ``overrides``), each
    value written so that ``--set`` reads it back as the same value."""
    return [f"{field}={_yaml_text(value)}" for field, value in overrides.items()]


def parse_set_argument(argument: str) -> list[Override]:
    """The overrides of one ``--set FIELD=VALUE`` argument (a mapping VALUE gives several)."""
    field, equals, text = argument.partition("=")
    field = field.strip()
    origin = f"--set {argument}"
    if not equals or not field:
        raise ScenarioErrors([ScenarioError(
            "expected FIELD=VALUE, e.g. engine.block_size=128", file=origin)])
    try:
        loc = _field_loc(field, origin, None)
        doc = read_yaml(text, origin)
        if doc.problems:
            raise ScenarioErrors(doc.problems)
        return [Override(format_loc(leaf), value, origin)
                for leaf, value, _ in _leaves(doc, doc.data, loc, ())]
    except ScenarioErrors as exc:
        # Lines of a VALUE on the command line mean nothing to the user: the argument names it.
        raise ScenarioErrors(ScenarioError(e.message, file=origin, field=e.field)
                             for e in exc.errors) from None


def read_override_file(path: str | os.PathLike[str]) -> list[Override]:
    """The overrides in a ``--set-file``: one YAML mapping of field paths or sections."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ScenarioErrors([ScenarioError(f"cannot read the override file: {reason}",
                                            file=file)]) from None
    doc = read_yaml(text, file)
    if not isinstance(doc.data, dict) or not doc.data:
        raise ScenarioErrors(doc.problems or [ScenarioError(
            "an override file holds one non-empty mapping of field paths to values, "
            "e.g. 'engine.block_size: 128'", file=file, line=doc.line_of(()))])
    if doc.problems:
        raise ScenarioErrors(doc.problems)
    found: list[Override] = []
    errors: list[ScenarioError] = []
    for key, value in doc.data.items():
        line = doc.line_of((key,))
        try:
            loc = _field_loc(key, file, line)
            found += [Override(format_loc(leaf), leaf_value, file, leaf_line)
                      for leaf, leaf_value, leaf_line in _leaves(doc, value, loc, (key,))]
        except ScenarioErrors as exc:
            errors += exc.errors
    if errors:
        raise ScenarioErrors(errors)
    return found


# --- internals ------------------------------------------------------------------------------

def _field_loc(field: str, origin: str, line: int | None) -> Loc:
    """The loc of a written field path, or ``ScenarioErrors`` saying why it cannot be set."""
    def refuse(message: str) -> ScenarioErrors:
        return ScenarioErrors([ScenarioError(message, file=origin, line=line,
                                             field=field or None)])

    section = field.split(".")[0].split("[")[0].strip()
    if section in _REFUSED:
        raise refuse(f"'{section}' cannot be overridden: {_REFUSED[section]}")
    if section not in OVERRIDABLE_SECTIONS:
        close = difflib.get_close_matches(section, OVERRIDABLE_SECTIONS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise refuse(f"unknown section '{section}'{hint} (fields of "
                     f"{', '.join(OVERRIDABLE_SECTIONS)} can be overridden)")
    if any(c in field for c in "[]"):
        raise refuse("an override applies to every scenario of the run, so it cannot index "
                      "into a list (the same index names a different item in each "
                      "scenario): set the whole list")
    parts = field.split(".")
    if any(not part.strip() for part in parts):
        raise refuse("a field path is names joined by '.', e.g. engine.block_size")
    return tuple(part.strip() for part in parts)


def _leaves(doc: Document, value: Any, loc: Loc, written: Loc
            ) -> list[tuple[Loc, Any, int | None]]:
    """``(loc, value, line)`` for each field a value sets: a non-empty mapping sets its
    entries (their keys may be dotted paths too), anything else the field itself."""
    if not isinstance(value, dict) or not value:
        return [(loc, value, doc.line_of(written))]
    leaves = []
    for key, inner in value.items():
        if any(c in key for c in "[]") or any(not p.strip() for p in key.split(".")):
            raise ScenarioErrors([ScenarioError(
                "a field path is names joined by '.' and cannot index into a list",
                file=doc.file, line=doc.line_of(written + (key,)),
                field=format_loc(loc) + "." + key)])
        sub = tuple(part.strip() for part in key.split("."))
        leaves += _leaves(doc, inner, loc + sub, written + (key,))
    return leaves


def _set(data: dict[str, Any], override: Override) -> ScenarioError | None:
    """Set the override's field in a scenario's data, making the mappings on its way."""
    *path, last = override.loc
    place: Any = data
    for depth, key in enumerate(path):
        if place.get(key) is None:
            place[key] = {}
        place = place[key]
        if not isinstance(place, dict):
            above = format_loc(override.loc[:depth + 1])
            return override.error(f"{above} is a value, not a mapping of fields: it has no "
                                  f"field '{override.loc[depth + 1]}'")
    place[last] = override.value
    return None


def _related(override: Loc, error: Loc) -> bool:
    """Whether an error at ``error`` is about the field ``override`` set: one contains the
    other (a rule about ``workload`` is about ``workload.prompts`` and the reverse)."""
    shorter = min(len(override), len(error))
    return shorter > 0 and override[:shorter] == error[:shorter]


def _yaml_text(value: Any) -> str:
    """``value`` as YAML that reads back as itself: a string plainly when it would, anything
    else (and a string that YAML would read as something else) as JSON, which is YAML."""
    if isinstance(value, str):
        try:
            doc = read_yaml(value, "<value>")
        except ScenarioErrors:
            doc = None
        if doc is not None and doc.data == value and value == value.strip():
            return value
    return json.dumps(value, default=str)
