"""One self-contained HTML page: the verdict table and every scenario's fault timeline.

The page has no external reference (no script, stylesheet, font or image is fetched): the
style is inline and each timeline is an inline SVG (see ``ftkit.report.timeline``). It can be
kept as a CI artifact and opened anywhere. Per scenario it shows the reason, the engine's
error, the timeline, the faults, the recovery rounds and, where a completion differs from the
baseline, the first difference: its field and the two values there, and the expected and
actual tokens around the first divergent token. Every text from the run (names,
reasons, errors) is escaped.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ftkit.report.journal import (
    ReportContents,
    ReportSource,
    SkippedScenario,
    atomic_write_text,
    report_contents,
)
from ftkit.report.table import (
    NONE,
    TABLE_COLUMNS,
    client_summary,
    fault_label,
    seconds_label,
    table_cells,
    tokens_around,
    verdict_label,
)
from ftkit.report.timeline import TimelineUnavailable, timeline_svg
from ftkit.results import ScenarioResult, Verdict
from ftkit.scenario.overrides import override_lines
from ftkit.verify import describe_divergence

__all__ = ["html_report", "write_html_report"]

TITLE = "ftkit report"

#: Environment entries shown under the title, in this order.
_PROVENANCE = ("ftkit", "vllm", "vllm_ascend", "torch", "torch_npu", "python", "platform")

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
.meta { color: #666; font-size: 12px; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f5f5f5; } td.text, th.text { text-align: left; }
.verdict { font-weight: bold; white-space: nowrap; }
.pass { color: #2e7d32; } .fail { color: #c62828; } .not_applied { color: #b28704; }
.error { color: #8e24aa; } .skipped { color: #777; }
td.diverged { background: #ffebee; font-weight: bold; }
pre { background: #f7f7f7; padding: 0.6em; white-space: pre-wrap; word-break: break-word; }
figure { margin: 0.8em 0; } figure svg { max-width: 100%; height: auto; }
"""


def write_html_report(report: ReportSource, path: str | os.PathLike[str], *,
                      skipped: Sequence[SkippedScenario] = (),
                      overrides: Mapping[str, Any] | None = None) -> Path:
    """Write the HTML report for ``report`` (results, or a journal from ``read_json_report``).

    ``skipped`` adds scenarios that were not run; ``overrides`` are the run's ``{field:
    value}`` (a journal brings its own). The write is atomic; returns the path.
    """
    return atomic_write_text(path, html_report(report, skipped=skipped, overrides=overrides))


def html_report(report: ReportSource, *, skipped: Sequence[SkippedScenario] = (),
                overrides: Mapping[str, Any] | None = None) -> str:
    """The HTML page for ``report``, as text."""
    contents = report_contents(report, skipped=skipped, overrides=overrides)
    body = [f"<h1>{TITLE}</h1>", _provenance(contents), _overrides(contents),
            _summary(contents), _verdict_table(contents.results)]
    if contents.skipped:
        body += ["<h2>Not run</h2>", _list(f"{_e(s.name)} ({_e(s.file)}): {_e(s.reason)}"
                                           for s in contents.skipped)]
    body += [_scenario_section(position, result)
             for position, result in enumerate(contents.results)]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{TITLE}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        *body,
        "</body>",
        "</html>",
        "",
    ])


# --- the top of the page --------------------------------------------------------------------

def _provenance(contents: ReportContents) -> str:
    env = contents.environment
    parts = [f"created {contents.created_at}"] if contents.created_at else []
    parts += [f"{key} {env[key]}" for key in _PROVENANCE if env.get(key)]
    return f'<p class="meta">{_e(" · ".join(parts))}</p>'


def _overrides(contents: ReportContents) -> str:
    """The fields the run set in every scenario (``ftkit run --set``), if any."""
    if not contents.overrides:
        return ""
    items = "".join(f"<code>{_e(line)}</code> " for line in override_lines(contents.overrides))
    return f'<p class="overrides">Overrides for every scenario: {items.strip()}</p>'


def _summary(contents: ReportContents) -> str:
    parts = []
    for verdict in Verdict:
        count = sum(1 for r in contents.results if Verdict(r.verdict) is verdict)
        if count:
            parts.append(f'<span class="{verdict.value}">{count} '
                         f"{_e(verdict_label(verdict).lower())}</span>")
    if contents.skipped:
        parts.append(f'<span class="skipped">{len(contents.skipped)} skipped</span>')
    total = len(contents.results) + len(contents.skipped)
    seconds = sum(r.duration_s for r in contents.results)
    return f"<p>{', '.join(parts)} ({total} scenario(s), {seconds:.1f} s)</p>"


def _verdict_table(results: Sequence[ScenarioResult]) -> str:
    rows = []
    for position, result in enumerate(results):
        name, verdict, *numbers = table_cells(result)
        cells = [f'<td class="text"><a href="#scenario-{position}">{_e(name)}</a></td>',
                 _verdict_cell(result.verdict, verdict)]
        cells += [f"<td>{_e(cell)}</td>" for cell in numbers]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return _table(TABLE_COLUMNS, rows, text={0, 1})


# --- one scenario ---------------------------------------------------------------------------

def _scenario_section(position: int, result: ScenarioResult) -> str:
    verdict = Verdict(result.verdict)
    details = f"{result.file} · {result.duration_s:.1f} s"
    if result.tokens_per_s:
        details += f" · {result.tokens_per_s:.1f} tokens/s"
    if result.baseline_from_cache:
        details += " · baseline from cache"
    parts = [
        f'<section id="scenario-{position}">',
        f'<h2>{_e(result.name)} <span class="verdict {verdict.value}">'
        f"{_e(verdict_label(verdict))}</span></h2>",
        f'<p class="meta">{_e(details)}</p>',
        f"<p>{_e(result.reason or '(no reason given)')}</p>",
    ]
    if result.error:
        parts.append(f'<pre class="error">{_e(result.error)}</pre>')
    try:
        svg = timeline_svg(result)
    except TimelineUnavailable as unavailable:
        parts.append(f"<p>{_e(unavailable)}</p>")
    else:
        parts.append(f"<figure>{svg}</figure>" if svg is not None
                     else "<p>No token times were recorded: no timeline.</p>")
    parts += [_faults_table(result), _recoveries_table(result), _clients_table(result),
              _divergence(result), "</section>"]
    return "\n".join(p for p in parts if p)


def _faults_table(result: ScenarioResult) -> str:
    if not result.faults:
        return "<p>No fault planned.</p>"
    rows = []
    for fault in result.faults:
        fired = "yes" if fault.fired else "no"
        step = str(fault.fired_at.step) if fault.fired_at is not None else NONE
        recovered = "yes" if fault.recovered else "no"
        rows.append(_row([
            fault_label(fault), f"request {fault.request} token {fault.token}", fault.phase,
            str(fault.times), fired, step, seconds_label(fault.at_s), recovered,
            seconds_label(fault.recovery_s)], text={0, 1, 2}))
    headers = ("fault", "trigger", "phase", "times", "fired", "step", "fired at", "recovered",
               "recovery")
    return "<h3>Faults</h3>\n" + _table(headers, rows, text={0, 1, 2})


def _recoveries_table(result: ScenarioResult) -> str:
    if not result.recoveries:
        return ""
    rows = [_row([str(r.step), r.kind, r.decision, str(r.attempt),
                  ", ".join(str(rank) for rank in r.ranks), seconds_label(r.at_s),
                  seconds_label(r.duration_s), r.reason], text={1, 2, 7})
            for r in result.recoveries]
    headers = ("step", "kind", "decision", "attempt", "ranks", "started", "duration", "reason")
    return "<h3>Recovery rounds</h3>\n" + _table(headers, rows, text={1, 2, 7})


def _clients_table(result: ScenarioResult) -> str:
    """A serve scenario's streams as its clients saw them, the faulted run's then the
    fault-free run's."""
    client = result.client
    if client is None:
        return ""
    rows = [_row([run, "background" if s.background else str(s.request), str(s.tokens),
                  seconds_label(s.ttft_s), seconds_label(s.max_gap_s), s.error or NONE],
                 text={0, 1, 5})
            for run, streams in (("faulted", client.run), ("fault-free", client.baseline))
            for s in streams]
    headers = ("run", "request", "tokens", "first token", "largest gap", "error")
    return (f"<h3>Clients</h3>\n<p>{_e(client_summary(client))}</p>\n"
            + _table(headers, rows, text={0, 1, 5}))


def _divergence(result: ScenarioResult) -> str:
    """The first completion that differs: the sentence, the field that differs with its two
    values (for a field other than the token ids), and the token ids around the first that
    differs (if one does)."""
    diverged = result.first_mismatch
    if diverged is None:
        return ""
    parts = ["<h3>Divergence</h3>", f"<p>{_e(describe_divergence(diverged))}</p>"]
    if diverged.beyond_token_ids:
        position = NONE if diverged.position is None else str(diverged.position)
        parts.append(_table(("field", "position", "expected", "actual"), [_row(
            [diverged.diverged_field, position, repr(diverged.expected_value),
             repr(diverged.actual_value)], text={0, 2, 3})], text={0, 2, 3}))
    if diverged.first_divergence is not None:
        around = tokens_around(diverged)
        rows = []
        for label, column in (("expected", 1), ("actual", 2)):
            cells = [f'<th class="text">{label}</th>']
            cells += [f"<td{_diverged(row[0], diverged.first_divergence)}>{_e(row[column])}"
                      "</td>" for row in around]
            rows.append(f"<tr>{''.join(cells)}</tr>")
        headers = ("token", *(str(row[0]) for row in around))
        parts.append(_table(headers, rows, text={0}))
    return "\n".join(parts)


# --- small HTML helpers ---------------------------------------------------------------------

def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _table(headers: Sequence[str], rows: Iterable[str], *, text: Container[int] = ()) -> str:
    """A table of pre-rendered rows; columns in ``text`` are left-aligned."""
    head = "".join(f"<th{_align(i, text)}>{_e(h)}</th>" for i, h in enumerate(headers))
    body = "\n".join(rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"


def _row(cells: Sequence[str], *, text: Container[int] = ()) -> str:
    """A row of escaped cells; columns in ``text`` are left-aligned."""
    return "<tr>" + "".join(f"<td{_align(i, text)}>{_e(c)}</td>"
                            for i, c in enumerate(cells)) + "</tr>"


def _align(column: int, text: Container[int]) -> str:
    return ' class="text"' if column in text else ""


def _verdict_cell(verdict: Verdict | str, label: str) -> str:
    return f'<td class="text verdict {Verdict(verdict).value}">{_e(label)}</td>'


def _diverged(index: int, divergence: int | None) -> str:
    return ' class="diverged"' if index == divergence else ""


def _list(items: Iterable[str]) -> str:
    return "<ul>\n" + "\n".join(f"<li>{item}</li>" for item in items) + "\n</ul>"

