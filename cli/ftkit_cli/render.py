"""What the ``ftkit`` command shows: live progress and the verdict table.

Everything here is a rich renderable or feeds one; nothing formats strings for ``print``.
Progress goes to a stderr console, the verdict report to a stdout console, so that
``ftkit run ... > verdicts.txt`` keeps only the verdicts. Scenario names, messages and error
texts are always rendered as plain ``Text``, never as markup: a ``[`` in a reason is shown as is.

On a terminal the progress is live bars with the faults and recoveries printed above them; on
anything else (a CI log, a pipe, a file) it is one plain line per phase, each with the seconds
since the run began, and nothing that redraws.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType

from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from ftkit import (TABLE_COLUMNS, ProgressEvent, ScenarioResult, SkippedScenario, Verdict,
                   client_summary, table_cells, verdict_label)

__all__ = [
    "PHASE_LABELS",
    "SKIPPED_STYLE",
    "TOKEN_LINE_INTERVAL_S",
    "VERDICT_STYLES",
    "RunHeader",
    "RunProgress",
    "VerdictReport",
    "error_lines",
    "overrides_text",
    "verdict_table",
    "verdict_text",
]

#: How each verdict is shown: (label, style).
VERDICT_STYLES: dict[Verdict, tuple[str, str]] = {
    verdict: (verdict_label(verdict), style) for verdict, style in (
        (Verdict.PASS, "bold green"),
        (Verdict.FAIL, "bold red"),
        (Verdict.NOT_APPLIED, "bold yellow"),
        (Verdict.ERROR, "bold magenta"),
    )
}

#: How a scenario that was not run is shown.
SKIPPED_STYLE = ("SKIPPED", "dim")


def verdict_text(verdict: Verdict | str) -> Text:
    """The verdict's label in its colour.

    PASS green, FAIL red, NOT APPLIED yellow, ERROR magenta.
    """
    label, style = VERDICT_STYLES[Verdict(verdict)]
    return Text(label, style=style)


def error_lines(message: str) -> list[Text]:
    """One red line per line of an error message (a ScenarioError may hold several)."""
    return [Text(line, style="red") for line in str(message).splitlines() if line.strip()]


# --- the verdict report ---------------------------------------------------------------------

def verdict_table(results: Sequence[ScenarioResult]) -> Table:
    """One row per scenario, the columns of ``ftkit.report.table.TABLE_COLUMNS``.

    Columns: scenario, verdict, requests, tokens (compared), divergence (the first
    difference, as "req R tok T" for a token id, with the field named for another:
    ``ftkit.report.table.divergence_label``), faults (fired/planned), re-inferences,
    recovery (total seconds).
    """
    table = Table(title="ftkit verdicts", title_justify="left")
    name_header, verdict_header, *number_headers = TABLE_COLUMNS
    table.add_column(name_header, overflow="fold", min_width=12)
    table.add_column(verdict_header, no_wrap=True)
    for header in number_headers:
        table.add_column(header, justify="right", no_wrap=True)
    for result in results:
        name, _, *numbers = table_cells(result)
        table.add_row(Text(name), verdict_text(result.verdict), *numbers)
    return table


def overrides_text(overrides: Sequence[str]) -> Text:
    """``overrides: FIELD=VALUE, ...`` (the run's ``--set`` fields, as ``Overrides.lines()``)."""
    return Text.assemble(("overrides", "bold"), ": ", ", ".join(overrides))


class RunHeader:
    """What a run is about to do: how many scenarios, and the fields it overrides in each."""

    def __init__(self, scenarios: int, overrides: Sequence[str] = ()) -> None:
        self.scenarios = scenarios
        self.overrides = list(overrides)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(f"ftkit run: {self.scenarios} scenario(s)")
        if self.overrides:
            yield overrides_text(self.overrides)


class VerdictReport:
    """The final report: the fields the run overrode (``overrides``, as ``FIELD=VALUE``), the
    verdict table, the client view of every serve scenario, the reason of every non-pass,
    what was not run (``skipped``), and a summary line."""

    def __init__(self, results: Sequence[ScenarioResult],
                 skipped: Sequence[SkippedScenario] = (),
                 overrides: Sequence[str] = ()) -> None:
        self.results = list(results)
        self.skipped = list(skipped)
        self.overrides = list(overrides)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.overrides:
            yield overrides_text(self.overrides)
        if self.results:
            yield verdict_table(self.results)
        for result in self.results:
            if result.client is not None:
                yield Text.assemble((result.name, "bold"), ": ", client_summary(result.client))
        for result in self.results:
            if Verdict(result.verdict) is not Verdict.PASS:
                yield Text.assemble(verdict_text(result.verdict), " ", (result.name, "bold"),
                                    ": ", result.reason or "(no reason given)")
        for skipped in self.skipped:
            yield Text.assemble(Text(*SKIPPED_STYLE), " ", (skipped.name, "bold"), ": ",
                                skipped.reason)
        yield self.summary()

    def summary(self) -> Text:
        counts = {v: 0 for v in Verdict}
        for result in self.results:
            counts[Verdict(result.verdict)] += 1
        parts: list[Text | str] = []
        for verdict, count in counts.items():
            if count:
                label, style = VERDICT_STYLES[verdict]
                parts.extend([Text(f"{count} {label.lower()}", style=style), ", "])
        if self.skipped:
            label, style = SKIPPED_STYLE
            parts.extend([Text(f"{len(self.skipped)} {label.lower()}", style=style), ", "])
        total_s = sum(r.duration_s for r in self.results)
        total = len(self.results) + len(self.skipped)
        return Text.assemble(*parts[:-1], f" ({total} scenario(s), {total_s:.1f} s)")


# --- progress -------------------------------------------------------------------------------

#: How each progress stage is named in the plain lines of a CI log.
PHASE_LABELS = {
    "baseline": "baseline",
    "engine_start": "engine starting",
    "engine_ready": "engine ready",
    "tokens": "generating",
    "fault": "fault fired",
    "recovery": "recovery round",
    "recovered": "recovered",
    "done": "done",
}

#: Least time between two "generating" lines of one scenario in a CI log.
TOKEN_LINE_INTERVAL_S = 15.0


class RunProgress:
    """The progress of a series of scenarios, fed by ``ProgressEvent``.

    Use as a context manager; call ``start(name)`` before a scenario, pass the object itself
    as the runner's ``on_event`` sink, and ``finish(result)`` when the scenario has a verdict.

    On a terminal: live bars (transient: only the lines remain afterwards), with faults,
    recoveries and each verdict printed as lines above them; ``verbose`` prints every event.
    Elsewhere (``console.is_terminal`` false, as in a CI log): one plain line per phase
    (scenario started, baseline, engine starting and ready, fault fired, recovery round,
    recovered, verdict), each prefixed with the seconds since the run began; token progress
    at most every ``TOKEN_LINE_INTERVAL_S`` per scenario (every event with ``verbose``).
    """

    def __init__(self, console: Console, *, total: int, verbose: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.verbose = verbose
        self.plain = not console.is_terminal
        self._clock = clock
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}", markup=False),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=self.plain,
        )
        self._total = total
        self._overall: TaskID | None = None
        self._task: TaskID | None = None
        self._name = ""
        self._started = 0
        self._began = clock()
        self._last_tokens_line = float("-inf")

    def __enter__(self) -> RunProgress:
        self._began = self._clock()
        self._progress.start()
        self._overall = self._progress.add_task("scenarios", total=self._total, status="")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()

    def start(self, name: str) -> None:
        """A scenario begins: show a bar for its tokens (a line in a CI log)."""
        self._name = name
        self._started += 1
        self._last_tokens_line = float("-inf")
        self._task = self._progress.add_task(name, total=None, status="loading")
        if self.plain:
            self._log("started", f"scenario {self._started} of {self._total}")

    def __call__(self, event: ProgressEvent) -> None:
        if self.plain:
            self._log_event(event)
            return
        if self.verbose:
            self._line(event.stage, event.message or _token_count(event), "dim")
        if self._task is None:
            return
        if event.stage == "tokens":
            self._progress.update(self._task, completed=event.tokens_done,
                                  total=event.tokens_total or None, status="generating")
        elif event.stage in _STATUS:
            self._progress.update(self._task, status=event.message or _STATUS[event.stage])
        if not self.verbose and event.stage in _LOGGED:
            label, style = _LOGGED[event.stage]
            self._line(label, event.message, style)

    def finish(self, result: ScenarioResult) -> None:
        """A scenario has its verdict: drop its bar and print one line for it."""
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
        if self._overall is not None:
            self._progress.advance(self._overall)
        if self.plain:
            reason = "" if Verdict(result.verdict) is Verdict.PASS else f": {result.reason}"
            self.console.print(Text.assemble(
                self._elapsed(), f" {result.name}: verdict ", verdict_text(result.verdict),
                f" ({result.duration_s:.1f} s){reason}"), soft_wrap=True)
            return
        self.console.print(Text.assemble(verdict_text(result.verdict), " ", result.name,
                                         f" ({result.duration_s:.1f} s)"))

    def _log_event(self, event: ProgressEvent) -> None:
        if event.stage == "done" and not self.verbose:
            return  # ``finish`` prints the verdict
        if event.stage == "tokens":
            now = self._clock()
            if not self.verbose and now - self._last_tokens_line < TOKEN_LINE_INTERVAL_S:
                return
            self._last_tokens_line = now
        self._log(PHASE_LABELS.get(event.stage, event.stage),
                  event.message or _token_count(event))

    def _log(self, label: str, message: str) -> None:
        self.console.print(Text.assemble(self._elapsed(), f" {self._name}: ", (label, "bold"),
                                         f": {message}" if message else ""), soft_wrap=True)

    def _elapsed(self) -> Text:
        return Text(f"[{self._clock() - self._began:7.1f}s]", style="dim")

    def _line(self, label: str, message: str, style: str) -> None:
        self.console.print(Text.assemble(("  " + label, style), f" {self._name}: ", message),
                           soft_wrap=True)


_STATUS = {
    "baseline": "baseline",
    "engine_start": "starting engine",
    "engine_ready": "engine ready",
    "done": "done",
}

_LOGGED = {
    "fault": ("fault fired", "yellow"),
    "recovery": ("recovery", "cyan"),
    "recovered": ("recovered", "green"),
}


def _token_count(event: ProgressEvent) -> str:
    return f"{event.tokens_done}/{event.tokens_total} tokens" if event.tokens_total else ""
