"""Load scenario files, reporting every problem with its file, line and field.

What a caller may rely on: ``load_scenario`` returns a valid ``Scenario`` or raises
``ScenarioErrors`` (a ``ScenarioError``) listing every problem found in the file: YAML
syntax, duplicate keys, unknown keys, wrong types, missing fields, broken semantic rules.
Each error has ``file``, a 1-based ``line`` (for a missing field, the line of the mapping
that lacks it) and ``field``, a path such as ``faults[0].at.token``. Type problems hide
semantic ones: the rules run only on a scenario whose types are right.
"""

from __future__ import annotations

import difflib
import glob
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ftkit.errors import ScenarioError
from ftkit.scenario.errors import Loc, ScenarioErrors, parse_field
from ftkit.scenario.model import Scenario
from ftkit.scenario.source import Document, read_yaml

SCENARIO_SUFFIXES = (".yaml", ".yml")
_GLOB_CHARS = frozenset("*?[")


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Load and validate one scenario file; ``scenario.source`` is ``str(path)``."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioErrors([ScenarioError("no such scenario file", file=file)]) from None
    except IsADirectoryError:
        raise ScenarioErrors([ScenarioError("is a directory; load_scenarios expands "
                                            "directories", file=file)]) from None
    except UnicodeDecodeError as exc:
        raise ScenarioErrors([ScenarioError(f"not UTF-8 text ({exc.reason} at byte "
                                            f"{exc.start})", file=file)]) from None
    except OSError as exc:
        raise ScenarioErrors([ScenarioError(f"cannot read: {exc.strerror}",
                                            file=file)]) from None
    return load_scenario_text(text, file=file)


def load_scenario_text(text: str, file: str = "<scenario>") -> Scenario:
    """Load and validate a scenario from YAML text; ``file`` names it in errors."""
    doc = read_yaml(text, file)
    if doc.data is None:
        raise ScenarioErrors(doc.problems or [ScenarioError(
            "the file is empty: a scenario needs at least name, workload and faults",
            file=file, line=1)])
    if not isinstance(doc.data, dict):
        raise ScenarioErrors(doc.problems + [doc.error(
            f"the top level must be a mapping of scenario fields (name, engine, workload, "
            f"...), not {_kind_of(doc.data)}", ())])
    errors = list(doc.problems)
    scenario = None
    try:
        scenario = Scenario.model_validate(doc.data)
    except ValidationError as exc:
        errors += [_type_error(doc, detail) for detail in exc.errors(include_url=False)]
    except ScenarioErrors as exc:  # the semantic rules; they name fields, not lines
        errors += [doc.error(e.message, parse_field(e.field)) for e in exc.errors]
    if errors or scenario is None:
        raise ScenarioErrors(errors)
    scenario._source = file
    scenario._lines = doc.lines
    return scenario


def load_scenarios(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[str, Scenario]]:
    """Load every scenario that ``paths`` name, in order, each file once.

    A path may be a file, a directory (its ``*.yaml`` and ``*.yml`` files, sorted, not
    recursive) or a glob (``**`` recurses; matches sorted). A path that matches nothing
    is an error. Problems of all files, and scenario names used twice, are reported
    together in one ``ScenarioErrors``.
    """
    errors: list[ScenarioError] = []
    files: list[str] = []
    for path in paths:
        found, error = _expand(str(path))
        if error is not None:
            errors.append(error)
        files += [f for f in found if f not in files]
    loaded: list[tuple[str, Scenario]] = []
    first_file_of: dict[str, str] = {}
    for file in files:
        try:
            scenario = load_scenario(file)
        except ScenarioError as exc:
            errors.append(exc)
            continue
        if scenario.name in first_file_of:
            # Reports and the pytest plugin key results by name.
            errors.append(ScenarioError(
                f"scenario name '{scenario.name}' is already used by "
                f"{first_file_of[scenario.name]}", file=file,
                line=scenario.line_of("name"), field="name"))
            continue
        first_file_of[scenario.name] = file
        loaded.append((file, scenario))
    if errors:
        raise ScenarioErrors(errors)
    return loaded


def _expand(path: str) -> tuple[list[str], ScenarioError | None]:
    if any(c in _GLOB_CHARS for c in path):
        matches = sorted(glob.glob(path, recursive=True))
        if not matches:
            return [], ScenarioError("the pattern matches no file", file=path)
        files = []
        for match in matches:
            files += _scenario_files(match) if os.path.isdir(match) else [match]
        return files, None
    if os.path.isdir(path):
        files = _scenario_files(path)
        if not files:
            return [], ScenarioError("the directory holds no *.yaml or *.yml file", file=path)
        return files, None
    if not os.path.exists(path):
        return [], ScenarioError("no such scenario file or directory", file=path)
    return [path], None


def _scenario_files(directory: str) -> list[str]:
    return sorted(str(p) for p in Path(directory).iterdir()
                  if p.suffix in SCENARIO_SUFFIXES and p.is_file())


# --- pydantic errors to ScenarioErrors ----------------------------------------------------

def _type_error(doc: Document, detail: dict[str, Any]) -> ScenarioError:
    loc = _written_loc(doc.data, tuple(detail["loc"]))
    kind = detail["type"]
    if kind == "invalid_key" or detail["loc"][-1:] == ("[key]",):
        # The YAML reader keeps integer keys for logit_bias; everywhere else they are errors.
        message = f"key {detail.get('input')!r} is not a string (quote it)"
    elif kind == "missing":
        message = "required, but missing"
    elif kind == "extra_forbidden":
        message = _unknown_key_message(loc)
    else:
        message = detail["msg"][:1].lower() + detail["msg"][1:]
        message += f" (got {_short_repr(detail.get('input'))})"
    return doc.error(message, loc)


def _written_loc(data: Any, loc: Loc) -> Loc:
    """``loc`` cut where it leaves the data, keeping one missing key at the end.

    Pydantic adds union member names to locs (``rank.int``); those are not fields.
    """
    walked: list[str | int] = []
    for part in loc:
        if isinstance(data, dict):
            walked.append(part)
            if part not in data:
                break
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            walked.append(part)
            data = data[part]
        else:
            break
    return tuple(walked)


def _unknown_key_message(loc: Loc) -> str:
    key = str(loc[-1])
    model = _model_at(loc[:-1])
    if model is None:
        return f"unknown key '{key}'"
    known = list(model.model_fields)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown key '{key}'{hint} (known keys: {', '.join(known)})"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The model class whose instance sits at ``loc`` in a scenario, if any."""
    annotation: Any = Scenario
    for part in loc:
        annotation = _strip(annotation)
        if isinstance(part, int):
            if get_origin(annotation) is not list:
                return None
            annotation = get_args(annotation)[0]
        elif _is_model(annotation) and part in annotation.model_fields:
            annotation = annotation.model_fields[part].annotation
        else:
            return None
    annotation = _strip(annotation)
    return annotation if _is_model(annotation) else None


def _strip(annotation: Any) -> Any:
    # Annotated[X, ...] -> X; X | None -> X.
    while hasattr(annotation, "__metadata__"):
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, type(int | None)):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _kind_of(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} ({_short_repr(value)})"


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
