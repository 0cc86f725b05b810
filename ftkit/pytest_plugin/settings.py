"""The plugin's settings: where each can be given, and one order of precedence.

Every setting has a marker keyword (``ftkit_settings``), a command-line option, an ini key and
an environment variable; ``resolve_setting`` applies the precedence marker > command line >
ini > environment > default, and a bad value raises ``FtkitSettingError`` naming its source.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftkit.errors import FtkitError

# --- help texts, shared by --help, the ini keys and the markers -------------------------------

MODEL_HELP = ("model of the ftkit engine: 'tiny' (the embedded test model) or a local model "
              "directory (default: tiny)")
TENSOR_PARALLEL_SIZE_HELP = "tensor parallel size of the ftkit engine (default: 1)"
MAX_REINFERENCE_HELP = ("re-runs of one failed step before the recovery engine surfaces the "
                        "fault (default: 3)")
TIMEOUT_HELP = ("bound in seconds on one ftkit_injector.generate call; a call past it fails "
                "the test and the engine is restarted (default: 300)")
SCENARIO_GLOB_HELP = ("patterns, relative to the rootdir, of scenario YAML files to collect "
                      "besides those directly in directories named on the command line")
FAULT_MARKER_HELP = (
    "ftkit_fault(kind, rank, at={'request': i, 'token': t}, phase='forward', times=1, "
    "params={}): inject this fault in every ftkit_injector.generate call of the test; "
    "several markers make several faults")
SETTINGS_MARKER_HELP = (
    "ftkit_settings(model=..., tensor_parallel_size=..., max_reinference=..., timeout=...): "
    "ftkit settings for this test; they take precedence over command line, ini and environment")
SCENARIO_MARKER_HELP = "ftkit_scenario: a test item made from an ftkit scenario file"


class FtkitSettingError(FtkitError):
    """A setting or an ``ftkit_fault`` marker has a value ftkit cannot use."""


# --- settings ---------------------------------------------------------------------------------

def _text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected a non-empty string, got {raw!r}")
    return raw.strip()


def _integer(minimum: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        value = int(raw) if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?\d+\s*", raw) \
            else raw
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {raw!r}")
        return value
    return parse


def _positive_seconds(raw: Any) -> float:
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"expected a number of seconds > 0, got {raw!r}")
    return float(value)


@dataclass(frozen=True)
class Setting:
    """One ftkit setting and the names it goes by in each place it can be given."""

    key: str  # also the ftkit_settings marker keyword
    option: str
    ini: str
    env: str
    help: str
    default: Any
    parse: Callable[[Any], Any]

    @property
    def dest(self) -> str:
        return "ftkit_" + self.key


SETTINGS = (
    Setting("model", "--ftkit-model", "ftkit_model", "FTKIT_MODEL", MODEL_HELP, "tiny", _text),
    Setting("tensor_parallel_size", "--ftkit-tp", "ftkit_tensor_parallel_size",
            "FTKIT_TENSOR_PARALLEL_SIZE", TENSOR_PARALLEL_SIZE_HELP, 1, _integer(1)),
    Setting("max_reinference", "--ftkit-max-reinference", "ftkit_max_reinference",
            "FTKIT_MAX_REINFERENCE", MAX_REINFERENCE_HELP, 3, _integer(0)),
    Setting("timeout", "--ftkit-timeout", "ftkit_timeout", "FTKIT_TIMEOUT", TIMEOUT_HELP,
            300.0, _positive_seconds),
)
_SETTING_BY_KEY = {s.key: s for s in SETTINGS}


def resolve_setting(setting: Setting, *, marker: Any = None, cli: Any = None, ini: Any = None,
                    env: str | None = None) -> Any:
    """The value of ``setting``: marker > command line > ini > environment > default.

    A source counts as given unless it is ``None`` or an empty string. The winning value is
    parsed and checked; a bad one raises ``FtkitSettingError`` naming its source (a bad value
    is never skipped in favour of a lower source).
    """
    sources = (("ftkit_settings marker", marker), (setting.option, cli),
               (f"ini {setting.ini}", ini), (f"environment {setting.env}", env))
    for where, raw in sources:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        try:
            return setting.parse(raw)
        except ValueError as exc:
            raise FtkitSettingError(f"{where} ({setting.key}): {exc}") from None
    return setting.default


@dataclass(frozen=True)
class FtkitSettings:
    model: str
    tensor_parallel_size: int
    max_reinference: int
    timeout: float

    def engine_key(self) -> tuple[str, int, int]:
        """What decides the engine (the timeout is per call)."""
        return (self.model, self.tensor_parallel_size, self.max_reinference)


def resolve_settings(config: pytest.Config, marker: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] = os.environ) -> FtkitSettings:
    """Every setting for one test (``marker``: the merged ``ftkit_settings`` keywords) or,
    without ``marker``, for the session."""
    marker = dict(marker or {})
    unknown = sorted(set(marker) - set(_SETTING_BY_KEY))
    if unknown:
        raise FtkitSettingError(f"ftkit_settings marker: unknown keyword(s) {', '.join(unknown)}"
                                f"; known: {', '.join(_SETTING_BY_KEY)}")
    values = {}
    for setting in SETTINGS:
        ini = config.getini(setting.ini)
        if setting.key == "model" and isinstance(ini, str):
            ini = _relative_to_inifile(config, ini)
        values[setting.key] = resolve_setting(
            setting, marker=marker.get(setting.key), cli=config.getoption(setting.dest),
            ini=ini, env=environ.get(setting.env))
    return FtkitSettings(**values)


def _relative_to_inifile(config: pytest.Config, model: str) -> str:
    # A model directory written in an ini file means the directory next to that file.
    if not model.strip() or model.strip() == "tiny" or config.inipath is None:
        return model
    path = Path(model.strip()).expanduser()
    return model if path.is_absolute() else str(config.inipath.parent / path)


def _marker_settings(node: pytest.Item) -> dict[str, Any]:
    """``ftkit_settings`` keywords of a test; a closer marker wins per keyword."""
    merged: dict[str, Any] = {}
    for mark in node.iter_markers("ftkit_settings"):
        if mark.args:
            raise FtkitSettingError("ftkit_settings takes keywords only, e.g. "
                                    "ftkit_settings(max_reinference=1)")
        for key, value in mark.kwargs.items():
            merged.setdefault(key, value)
    return merged

