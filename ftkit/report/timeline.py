"""The fault timeline of one scenario, drawn with matplotlib as an inline SVG.

x is the time since the workload was submitted, y the latency of each token: the time since
the previous token of the same request (for a request's first token, since submission). One
line with markers per request. Each fault that fired is a vertical line at the moment it first
fired, labelled with its kind, rank and failing attempts; each recovery round is a shaded span
from its start for its duration, and so is each engine restart after a killed process (from the
kill to the resumption of the requests); the first divergent token of a request, or the first
token whose logprobs drifted if that comes earlier, is marked with a cross.

Token times are taken where the engine hands tokens back, so tokens delivered by one engine step
share a time and all but the first show a latency of 0.

matplotlib is imported when a plot is drawn, never at import time, and only through its
object API (``Figure``): no pyplot, no GUI backend, no change to the process's backend. It is
not a dependency of the library (serving environments need no plotting): the ``ftkit`` command
and the ``report`` extra bring it. Without it ``timeline_svg`` raises ``TimelineUnavailable``,
whose message says how to get the figure, and the HTML report shows that message instead.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ftkit.report.table import fault_label
from ftkit.results import LOGPROBS, TOP_LOGPROBS, RequestComparison, ScenarioResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["TimelineUnavailable", "token_latencies", "timeline_svg"]

#: Shown where the figure would be when matplotlib cannot be imported.
NO_MATPLOTLIB = ("The timeline figure needs matplotlib, which is not installed here: install "
                 "the ftkit command (ftkit-cli) or ftkit's report extra (pip install "
                 "'ftkit[report]'), then render this report again with ftkit report.")

#: Above this many requests the legend is left out (it would hide the plot).
MAX_LEGEND_REQUESTS = 10

#: How a logprob difference is marked, by ``RequestComparison.diverged_field``.
_DRIFTS = {LOGPROBS: "logprob drift", TOP_LOGPROBS: "top-k drift"}

_FAULT_COLOR = "#c62828"
_RECOVERY_COLOR = "#fb8c00"
_RESTART_COLOR = "#5e35b1"

# Text stays text (searchable, small); fixed ids and no date keep the output reproducible.
_SVG_STYLE = {
    "svg.fonttype": "none",
    "svg.hashsalt": "ftkit-timeline",
    "font.size": 9,
}
_SVG_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}


class TimelineUnavailable(RuntimeError):
    """The timeline cannot be drawn here: matplotlib is not installed. The message says how
    to get it."""


def token_latencies(times: Sequence[float]) -> list[float]:
    """Per token, the time since the previous token (the first: since submission)."""
    return [t - (times[i - 1] if i else 0.0) for i, t in enumerate(times)]


def timeline_svg(result: ScenarioResult) -> str | None:
    """The timeline of ``result`` as an ``<svg>`` element, or ``None`` without token times.

    Raises ``TimelineUnavailable`` when there is something to draw but matplotlib cannot be
    imported."""
    timed = [r for r in result.requests if r.actual_times]
    if not timed:
        return None
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as missing:
        raise TimelineUnavailable(NO_MATPLOTLIB) from missing

    with matplotlib.rc_context(_SVG_STYLE):
        figure = Figure(figsize=(9.5, 3.8), layout="constrained")
        axes = figure.subplots()
        for request in timed:
            axes.plot(request.actual_times, token_latencies(request.actual_times),
                      marker="o", markersize=2.5, linewidth=0.9, label=request.name)
        _mark_recoveries(axes, result)
        _mark_faults(axes, result)
        for request in timed:
            _mark_divergence(axes, request)
        axes.set_xlabel("time since the workload was submitted (s)")
        axes.set_ylabel("token latency (s)")
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        _legend(axes, len(timed))
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata=_SVG_METADATA)
    return _svg_element(buffer.getvalue())


def _mark_recoveries(axes: Axes, result: ScenarioResult) -> None:
    for number, round_ in enumerate(r for r in result.recoveries if r.at_s is not None):
        axes.axvspan(round_.at_s, round_.at_s + round_.duration_s, color=_RECOVERY_COLOR,
                     alpha=0.25, linewidth=0, label="recovery round" if number == 0 else None)
    # A killed process is recovered by an engine restart: from the kill to the resumption.
    restarts = [f for f in result.faults if f.restart_s is not None and f.at_s is not None
                and f.recovery_s is not None]
    for number, fault in enumerate(restarts):
        axes.axvspan(fault.at_s, fault.at_s + fault.recovery_s, color=_RESTART_COLOR,
                     alpha=0.2, linewidth=0,
                     label="engine restart and resumption" if number == 0 else None)


def _mark_faults(axes: Axes, result: ScenarioResult) -> None:
    # x in data, y in axes coordinates: the label sits at the top whatever the latencies.
    transform = axes.get_xaxis_transform()
    for fault in result.faults:
        if fault.at_s is None:
            continue
        axes.axvline(fault.at_s, color=_FAULT_COLOR, linestyle="--", linewidth=1.2)
        axes.text(fault.at_s, 0.98, f" {fault_label(fault)}", transform=transform,
                  rotation=90, va="top", ha="right", color=_FAULT_COLOR, fontsize=8)


def _mark_divergence(axes: Axes, request: RequestComparison) -> None:
    index, what = request.first_divergence, "divergence"
    # A logprob that drifted before any token id differs is the first difference to see.
    if request.diverged_field in _DRIFTS and request.position is not None:
        index, what = request.position, _DRIFTS[request.diverged_field]
    if index is None:
        return
    times = request.actual_times
    # A stream that ends early diverges at the token it lacks: mark where it stopped.
    shown = min(index, len(times) - 1)
    latency = token_latencies(times)[shown]
    axes.plot([times[shown]], [latency], marker="X", markersize=11, color=_FAULT_COLOR,
              markeredgecolor="black", linestyle="none", zorder=5)
    text = f"{what}: {request.name} token {index}"
    if shown != index:
        text += f" (stream ends at {len(times)})"
    axes.annotate(text, (times[shown], latency), xytext=(8, 8), textcoords="offset points",
                  color=_FAULT_COLOR, fontsize=8)


def _legend(axes: Axes, requests: int) -> None:
    handles, labels = axes.get_legend_handles_labels()
    if requests > MAX_LEGEND_REQUESTS:
        keep = [i for i, label in enumerate(labels) if not label.startswith("request ")]
        handles, labels = [handles[i] for i in keep], [labels[i] for i in keep]
    if handles:
        axes.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    fontsize=8, frameon=False)


def _svg_element(document: str) -> str:
    """The ``<svg>`` element alone: no XML declaration or DOCTYPE (they are not valid HTML)."""
    return document[document.index("<svg"):].strip()
