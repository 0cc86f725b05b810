"""JUnit XML: every scenario as a test case, for CI test views.

Layout (the common JUnit schema that Jenkins, GitLab and GitHub reporters read)::

    <testsuites name="ftkit" tests= failures= errors= skipped= time=>
      <testsuite name="ftkit" tests= failures= errors= skipped= time= timestamp=>
        <properties>  environment: ftkit, vllm, torch, python, platform versions;
                      "override.<field>" for each field ftkit run --set overrode
        <testcase classname="ftkit.<file stem>" name="<scenario>" time="<duration_s>">
          <failure message="<reason>" type="fail">      verdict fail, first difference in the text
          <error message="<reason>" type="not_applied"> verdict not_applied (never a pass)
          <error message="<reason>" type="error">       verdict error
          <skipped message="<why>"/>                    not run (--fail-fast, interrupt)
          <system-out>  faults fired, re-inferences, recovery time

Characters that XML 1.0 cannot carry (terminal escapes in an engine error) are dropped.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ftkit.report.journal import (
    ReportSource,
    SkippedScenario,
    atomic_write_text,
    report_contents,
)
from ftkit.report.table import client_summary, describe_fault, tokens_around, verdict_label
from ftkit.results import ScenarioResult, Verdict
from ftkit.scenario.overrides import override_lines
from ftkit.verify import describe_divergence

__all__ = ["junit_xml", "write_junit_report"]

SUITE_NAME = "ftkit"

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def write_junit_report(report: ReportSource, path: str | os.PathLike[str], *,
                       skipped: Sequence[SkippedScenario] = (),
                       overrides: Mapping[str, Any] | None = None) -> Path:
    """Write JUnit XML for ``report`` (results, or a journal from ``read_json_report``).

    ``skipped`` adds scenarios that were not run; ``overrides`` are the run's ``{field:
    value}`` (a journal brings its own). The write is atomic; returns the path.
    """
    return atomic_write_text(path, junit_xml(report, skipped=skipped, overrides=overrides))


def junit_xml(report: ReportSource, *, skipped: Sequence[SkippedScenario] = (),
              overrides: Mapping[str, Any] | None = None) -> str:
    """The JUnit XML document for ``report``, as text."""
    contents = report_contents(report, skipped=skipped, overrides=overrides)
    cases = [_testcase(r) for r in contents.results]
    cases += [_skipped_case(s) for s in contents.skipped]
    counts = {
        "tests": str(len(cases)),
        "failures": str(_count(contents.results, Verdict.FAIL)),
        "errors": str(_count(contents.results, Verdict.ERROR, Verdict.NOT_APPLIED)),
        "skipped": str(len(contents.skipped)),
        "time": _seconds(sum(r.duration_s for r in contents.results)),
    }
    root = ET.Element("testsuites", name=SUITE_NAME, **counts)
    suite = ET.SubElement(root, "testsuite", name=SUITE_NAME, **counts)
    if contents.created_at:
        suite.set("timestamp", contents.created_at)
    properties = ET.SubElement(suite, "properties")
    for key, value in contents.environment.items():
        if value is not None:
            ET.SubElement(properties, "property", name=str(key), value=_clean(value))
    for line in override_lines(contents.overrides):
        field, _, value = line.partition("=")
        ET.SubElement(properties, "property", name=_clean(f"override.{field}"),
                      value=_clean(value))
    suite.extend(cases)
    ET.indent(root)
    return f'<?xml version="1.0" encoding="UTF-8"?>\n{ET.tostring(root, encoding="unicode")}\n'


def _testcase(result: ScenarioResult) -> ET.Element:
    case = _case(result.name, result.file, result.duration_s)
    verdict = Verdict(result.verdict)
    reason = result.reason or "(no reason given)"
    if verdict is Verdict.FAIL:
        outcome = ET.SubElement(case, "failure", message=_clean(reason), type=verdict.value)
        outcome.text = _clean(_failure_text(result))
    elif verdict in (Verdict.ERROR, Verdict.NOT_APPLIED):
        outcome = ET.SubElement(case, "error", message=_clean(reason), type=verdict.value)
        outcome.text = _clean("\n".join(
            [f"{verdict_label(verdict)}: {reason}"]
            + ([f"engine error: {result.error}"] if result.error else [])))
    ET.SubElement(case, "system-out").text = _clean(_evidence(result))
    return case


def _skipped_case(skipped: SkippedScenario) -> ET.Element:
    case = _case(skipped.name, skipped.file, 0.0)
    ET.SubElement(case, "skipped", message=_clean(skipped.reason))
    return case


def _case(name: str, file: str, duration_s: float) -> ET.Element:
    return ET.Element("testcase", classname=f"{SUITE_NAME}.{Path(file).stem}",
                      name=_clean(name), file=_clean(file), time=_seconds(duration_s))


def _failure_text(result: ScenarioResult) -> str:
    """The reason, the first difference (its field, position and values, and the tokens
    around the first divergent token), and the engine's error."""
    lines = [result.reason]
    diverged = result.first_mismatch
    if diverged is not None:
        if describe_divergence(diverged) not in result.reason:
            lines.append(describe_divergence(diverged))
        if diverged.beyond_token_ids:
            position = "" if diverged.position is None else f" at {diverged.position}"
            lines.append(f"{diverged.diverged_field}{position}: expected "
                         f"{diverged.expected_value!r}, actual {diverged.actual_value!r}")
        around = tokens_around(diverged)
        if around:
            width = max(len(cell) for row in around for cell in (str(row[0]), row[1], row[2]))
            for label, column in (("token   ", 0), ("expected", 1), ("actual  ", 2)):
                lines.append(label + " " + " ".join(f"{row[column]!s:>{width}}"
                                                    for row in around))
    if result.error:
        lines.append(f"engine error: {result.error}")
    return "\n".join(lines)


def _evidence(result: ScenarioResult) -> str:
    """What the run did: faults fired, re-inferences, recovery time, and a serve scenario's
    client view."""
    fired = sum(1 for f in result.faults if f.fired)
    lines = [f"faults fired: {fired}/{len(result.faults)}"]
    lines += [f"  {describe_fault(f)}" for f in result.faults]
    lines.append(f"re-inferences: {result.reinferences}")
    lines.append(f"recovery time: {result.recovery_s:.3f} s in {len(result.recoveries)} "
                 "round(s)")
    lines.append(f"tokens compared: {result.tokens_compared} in {len(result.requests)} "
                 "request(s)")
    if result.client is not None:
        lines.append(client_summary(result.client))
    return "\n".join(lines)


def _count(results: Sequence[ScenarioResult], *verdicts: Verdict) -> int:
    return sum(1 for r in results if Verdict(r.verdict) in verdicts)


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def _clean(value: object) -> str:
    return _NOT_XML.sub("", str(value))
