"""``ftkit validate``: which scenario files load, with every problem of the others, as data
that the command prints as text or as one JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftkit import FtkitError, Overrides, ScenarioError, ScenarioErrors

__all__ = ["FileCheck", "check_paths", "checks_document"]


@dataclass
class FileCheck:
    """One scenario file (or a path that named none): its scenario's name, or its errors."""

    file: str
    name: str | None = None
    errors: list[ScenarioError] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "valid": self.valid, "name": self.name,
                "errors": [{"file": e.file, "line": e.line, "field": e.field,
                            "message": e.message} for e in self.errors]}


def check_paths(paths: Sequence[str], overrides: Overrides | None = None) -> list[FileCheck]:
    """A check per scenario file that ``paths`` name, in order (with ``overrides`` applied).

    A file is loaded on its own; a directory or glob as ``ftkit run`` loads it, which also
    checks that no two of its scenarios share a name. When such a path holds an invalid
    file, its checks are the files with errors only (as the text output lists only errors).
    """
    from ftkit import load_scenario, load_scenarios

    checks: list[FileCheck] = []
    for path in paths:
        try:
            loaded = ([(path, load_scenario(path))] if Path(path).is_file()
                      else list(load_scenarios([path])))
        except ScenarioErrors as exc:
            checks += _by_file(path, exc.errors)
            continue
        except (FtkitError, OSError) as exc:
            checks.append(FileCheck(path, errors=[ScenarioError(str(exc), file=path)]))
            continue
        if not loaded:
            checks.append(FileCheck(path, errors=[ScenarioError("no scenario found",
                                                                file=path)]))
        for file, scenario in loaded:
            try:
                if overrides:
                    overrides.apply(scenario)
            except ScenarioErrors as exc:
                checks.append(FileCheck(file, errors=list(exc.errors)))
                continue
            checks.append(FileCheck(file, name=str(scenario.name)))
    return checks


def checks_document(checks: Sequence[FileCheck]) -> dict[str, Any]:
    """``ftkit validate --json``: ``{"valid": bool, "files": [FileCheck.to_dict(), ...]}``."""
    return {"valid": all(c.valid for c in checks), "files": [c.to_dict() for c in checks]}


def _by_file(path: str, errors: Sequence[ScenarioError]) -> list[FileCheck]:
    """One check per file the loading errors are about (``path`` for those of no file)."""
    checks: dict[str, FileCheck] = {}
    for error in errors:
        checks.setdefault(error.file or path, FileCheck(error.file or path)).errors.append(error)
    return list(checks.values())
