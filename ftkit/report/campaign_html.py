"""The report of an ``ftkit explore`` campaign as one self-contained HTML page, and the two
coverage matrices that page and the ``ftkit explore`` tables show.

The page is drawn from the campaign's JSON report (``CampaignResult.to_dict()``), so that a
saved report renders the same page. Like ``ftkit.report.html`` it fetches nothing (the style
is inline) and escapes every text from the campaign (signatures, reasons, file names). It
shows the summary, the coverage of fault kinds x phases and of workload features per tensor
parallel size (cells with failures highlighted), the shrunk failures with their scenario
files, and every run.

The matrices count runs, not the campaign's ``coverage`` cells: a run counts in one cell per
feature it turns on, so summing those cells over the features would count a run with three
features three times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftkit.report.html import _STYLE, _e, _list, _row, _table
from ftkit.report.journal import atomic_write_text
from ftkit.report.table import NONE, verdict_label
from ftkit.results import Verdict

__all__ = ["CoverageMatrix", "Tally", "coverage_by_fault", "coverage_by_feature", "render",
           "write_campaign_html"]

TITLE = "ftkit explore"
#: The feature column of a run whose workload turns no feature on.
PLAIN = "none"

_CAMPAIGN_STYLE = """
td.failed { background: #ffebee; color: #c62828; font-weight: bold; }
td.empty { color: #aaa; }
tr.shrinking td { color: #888; }
code { word-break: break-all; }
"""


@dataclass
class Tally:
    """Runs that touched one cell, and how many of them failed or left a fault unfired."""

    runs: int = 0
    failures: int = 0
    not_fired: int = 0

    def __str__(self) -> str:
        return f"{self.runs}/{self.failures}" if self.runs else NONE


@dataclass
class CoverageMatrix:
    """Generated runs (shrinking's excluded) per row and tensor parallel size. A row is a
    ``(kind, phase)`` or a ``(feature,)``; every row and size of the campaign's space is
    there, run or not, so that what was never exercised shows."""

    rows: list[tuple[str, ...]]
    tp: list[int]
    cells: dict[tuple[tuple[str, ...], int], Tally] = field(default_factory=dict)

    def cell(self, row: tuple[str, ...], tp: int) -> Tally:
        return self.cells.get((row, tp), Tally())


def coverage_by_fault(report: Mapping[str, Any]) -> CoverageMatrix:
    """Fault kinds x phases x tensor parallel size: a run counts once in each ``(kind,
    phase)`` of its faults."""
    space = report["space"]
    rows = [(kind, phase) for kind in space["kinds"] for phase in space["phases"]]
    return _matrix(report, rows, lambda run: {tuple(f.split("/", 1)) for f in run["faults"]})


def coverage_by_feature(report: Mapping[str, Any]) -> CoverageMatrix:
    """Workload features x tensor parallel size: a run counts once in each feature it turns
    on, or in ``none`` for a plain workload."""
    rows = [(PLAIN,)] + [(feature,) for feature in report["space"]["features"]]
    return _matrix(report, rows, lambda run: {(f,) for f in run["features"] or [PLAIN]})


def _matrix(report: Mapping[str, Any], rows: list[tuple[str, ...]],
            touched: Any) -> CoverageMatrix:
    matrix = CoverageMatrix(rows=list(rows), tp=list(report["space"]["tp"]))
    for run in report["runs"]:
        if run["shrinking"]:
            continue
        for row in sorted(touched(run)):
            if row not in matrix.rows:  # a run outside the stated space: shown, not dropped
                matrix.rows.append(row)
            if run["tp"] not in matrix.tp:
                matrix.tp.append(run["tp"])
            tally = matrix.cells.setdefault((row, run["tp"]), Tally())
            tally.runs += 1
            tally.failures += int(run["signature"] is not None)
            tally.not_fired += int(run["what"] == "not_fired")
    matrix.tp.sort()
    return matrix


# --- the page ---------------------------------------------------------------------------------

def write_campaign_html(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the page of ``report`` (a campaign's ``to_dict()``) atomically; return the path."""
    return atomic_write_text(path, render(report))


def render(report: Mapping[str, Any]) -> str:
    """The HTML page of ``report`` (a campaign's ``to_dict()``), as text."""
    body = [f"<h1>{TITLE}</h1>", _meta(report), _summary(report),
            "<h2>Coverage: fault kinds &times; phases</h2>",
            _note("Runs/failures per tensor parallel size; shrinking runs are not counted."),
            _matrix_table(coverage_by_fault(report), ("kind", "phase")),
            "<h2>Coverage: workload features</h2>",
            _note(f"Runs/failures per tensor parallel size; {PLAIN}: a plain workload."),
            _matrix_table(coverage_by_feature(report), ("feature",)),
            "<h2>Failures</h2>", _failures(report["failures"]),
            "<h2>Runs</h2>", _runs(report["runs"])]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{TITLE}</title>",
        f"<style>{_STYLE}{_CAMPAIGN_STYLE}</style>",
        "</head>",
        "<body>",
        *body,
        "</body>",
        "</html>",
        "",
    ])


def _meta(report: Mapping[str, Any]) -> str:
    space = report["space"]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report["started_at"]))
    parts = [f"started {started}", f"seed {report['seed']}", f"budget {report['budget']}",
             f"tensor parallel {', '.join(map(str, space['tp']))}",
             f"kinds {', '.join(space['kinds'])}", f"phases {', '.join(space['phases'])}",
             f"features {', '.join(space['features']) or PLAIN}"]
    return f'<p class="meta">{_e(" · ".join(parts))}</p>'


def _summary(report: Mapping[str, Any]) -> str:
    failures = len(report["failures"])
    shrinking = sum(1 for run in report["runs"] if run["shrinking"])
    found = (f'<span class="fail">{failures} failure(s)</span>' if failures
             else '<span class="pass">no failure</span>')
    text = (f"{report['scenarios_run']} scenario(s) run ({report['scenarios_per_minute']:.1f} "
            f"per minute), {shrinking} shrinking run(s), {report['duration_s']:.1f} s; "
            f"stopped: {report['stopped']}")
    out_dir = f" Campaign folder: <code>{_e(report['out_dir'])}</code>." \
        if report.get("out_dir") else ""
    return f"<p>{_e(text)}; {found}.{out_dir}</p>"


def _note(text: str) -> str:
    return f'<p class="meta">{_e(text)}</p>'


def _matrix_table(matrix: CoverageMatrix, labels: Sequence[str]) -> str:
    rows = []
    for row in matrix.rows:
        cells = [f'<td class="text">{_e(label)}</td>' for label in row]
        for tp in matrix.tp:
            tally = matrix.cell(row, tp)
            kind = "failed" if tally.failures else "empty" if not tally.runs else ""
            title = (f"{tally.runs} run(s), {tally.failures} failed, {tally.not_fired} with "
                     "a fault that did not fire")
            cells.append(f'<td class="{kind}" title="{_e(title)}">{_e(tally)}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    headers = [*labels, *(f"tp {tp}" for tp in matrix.tp)]
    return _table(headers, rows, text=set(range(len(labels))))


def _failures(failures: Sequence[Mapping[str, Any]]) -> str:
    if not failures:
        return "<p>No failure found.</p>"
    return "\n".join(_failure(failure) for failure in failures)


def _failure(failure: Mapping[str, Any]) -> str:
    original = failure.get("original") or {}
    rows = [_row([what, _size(failure, key), _size(original, key)], text={0, 1, 2})
            for what, key in (("tensor parallel", "tp"), ("requests", "requests"),
                              ("max tokens", "max_tokens"), ("faults", "faults"),
                              ("features", "features"))]
    verdict = Verdict(failure["verdict"])
    file = (f"<p>Scenario file: <code>{_e(failure['file'])}</code> "
            f"(<code>ftkit run {_e(failure['file'])}</code> reproduces it)</p>"
            if failure["file"] else "<p>Not written (no output folder).</p>")
    parts = [
        f'<section class="failure"><h3><span class="verdict {verdict.value}">'
        f"{_e(verdict_label(verdict))}</span> {_e(failure['signature'])}</h3>",
        f"<p>{_e(failure['reason'] or '(no reason given)')}</p>",
        file,
        f'<p class="meta">{_e(_found(failure))}</p>',
        _table(("", "shrunk", "first found"), rows, text={0, 1, 2}),
    ]
    if failure["also_seen_as"]:
        parts += ["<p>Also seen as (the same failure with more faults):</p>",
                  _list(_e(signature) for signature in failure["also_seen_as"])]
    parts.append("</section>")
    return "\n".join(parts)


def _found(failure: Mapping[str, Any]) -> str:
    reproduced = {None: "not checked alone", True: "reproduced alone on a new engine",
                  False: "NOT reproduced alone on a new engine (an earlier run left the "
                         "engine damaged)"}[failure.get("reproduced")]
    complete = "" if failure.get("shrink_complete", True) else " (shrinking ran out of time)"
    return (f"found at run {failure['found_at']}, shrunk in {failure['shrink_runs']} "
            f"run(s){complete}; {reproduced}")


def _size(size: Mapping[str, Any], key: str) -> str:
    value = size.get(key)
    if value is None:
        return NONE
    if isinstance(value, list):
        return ", ".join(map(str, value)) or NONE
    return str(value)


def _runs(runs: Sequence[Mapping[str, Any]]) -> str:
    if not runs:
        return "<p>No scenario ran.</p>"
    rows = []
    for run in runs:
        verdict = Verdict(run["verdict"])
        cells = [f"<td>{run['index']}</td>",
                 f'<td class="text">{_e(run["name"])}</td>',
                 f"<td>{run['tp']}</td>",
                 f'<td class="text">{_e(" + ".join(run["faults"]))}</td>',
                 f'<td class="text">{_e(", ".join(run["features"]) or PLAIN)}</td>',
                 f'<td class="text verdict {verdict.value}">{_e(verdict_label(verdict))}</td>',
                 f'<td class="text">{_e(run["signature"] or run["what"] or NONE)}</td>',
                 f"<td>{run['duration_s']:.2f} s</td>",
                 f'<td class="text">{"shrinking" if run["shrinking"] else "generated"}</td>']
        shrinking = ' class="shrinking"' if run["shrinking"] else ""
        rows.append(f"<tr{shrinking}>{''.join(cells)}</tr>")
    headers = ("run", "name", "tp", "faults", "features", "verdict", "failure", "time",
               "made")
    return _table(headers, rows, text={1, 3, 4, 5, 6, 8})
