"""``ftkit explore``: a chaos search. Generate scenarios from a seed, run them on reused
engines, shrink every failure to a minimal scenario file, and show what was covered.

The campaign itself is the library's (``ftkit.Campaign``); this module turns the options into
its ``ExploreOptions``, prints its progress and its report, and writes the report files. As
``ftkit run`` does, it prints the progress on stderr (one plain line per run: a campaign lasts
minutes and is read as often in a CI log as on a terminal) and the final tables on stdout, so
that ``ftkit explore ... > report.txt`` keeps the report. The tables and the HTML page are both
drawn from the campaign's JSON report (``CampaignResult.to_dict()``).

The exit status: 0 when no failure was found, 1 when one was, 2 on bad usage or a report that
cannot be written, 130 when interrupted (the tables and every report are still written).
Hypothesis and the campaign are imported only when the command runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ftkit import FtkitError, coverage_by_fault, coverage_by_feature
from ftkit_cli.consoles import print_error, stderr_console, stdout_console
from ftkit_cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from ftkit_cli.render import verdict_text

if TYPE_CHECKING:
    from ftkit import CampaignEvent, ExploreOptions

__all__ = ["CAMPAIGN_REPORT", "CampaignProgress", "CampaignReport", "explore_command",
           "explore_exit_code"]

#: The JSON report the command always writes in its ``--out`` folder.
CAMPAIGN_REPORT = "campaign.json"

#: Help texts of the options, in one place.
SEED_HELP = "Seed of the search: the same seed (and options) generates the same scenarios."
BUDGET_HELP = ("How long to generate: a wall time (90s, 5m, 1h) or a number of scenarios "
               "(40). Shrinking the failures found may run past it.")
TP_HELP = "Tensor parallel sizes to draw from, a comma list (1,2)."
KINDS_HELP = ("Fault kinds to draw from, a comma list (uce,oom); all by default. Link faults "
              "need --tp 2 or more.")
FEATURES_HELP = ("Workload and engine features that may be turned on, a comma list "
                 "(seeded,stop,prefix); all by default (docs/commands.md lists them).")
PHASES_HELP = "Phases a fault fires in, a comma list (forward,before,sample); all by default."
OUT_HELP = ("Folder for the campaign: its JSON report (campaign.json) and the shrunk failing "
            "scenarios (failures/*.yaml, each reproduced by ftkit run).")
JSON_HELP = "Also write the campaign's JSON report to this file."
HTML_HELP = ("Write one self-contained HTML page (summary, coverage matrices, failures, "
             "runs) to this file.")
NO_CACHE_HELP = "Run every fault-free baseline instead of reading it from the cache."
NO_SHRINK_HELP = "Report failures as found, without shrinking them."
QUIET_HELP = "Print no line per run (found failures and the report are still printed)."


@click.command("explore")
@click.option("--seed", type=int, default=0, show_default=True, help=SEED_HELP)
@click.option("--budget", default="5m", show_default=True, help=BUDGET_HELP)
@click.option("--tp", default="1", show_default=True, help=TP_HELP)
@click.option("--kinds", default=None, help=KINDS_HELP)
@click.option("--features", default=None, help=FEATURES_HELP)
@click.option("--phases", default=None, help=PHASES_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("ftkit-explore"), show_default=True, help=OUT_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help=JSON_HELP)
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help=HTML_HELP)
@click.option("--no-cache", is_flag=True, help=NO_CACHE_HELP)
@click.option("--no-shrink", is_flag=True, help=NO_SHRINK_HELP)
@click.option("-q", "--quiet", is_flag=True, help=QUIET_HELP)
@click.pass_context
def explore_command(ctx: click.Context, seed: int, budget: str, tp: str, kinds: str | None,
                    features: str | None, phases: str | None, out_dir: Path,
                    json_path: Path | None, html_path: Path | None, no_cache: bool,
                    no_shrink: bool, quiet: bool) -> None:
    """Search for the faults and workloads that break recovery.

    Generates scenarios from --seed (fault kinds, phases, ranks, tokens, compound faults,
    workload features, tensor parallel sizes), runs them on engines kept between scenarios,
    and shrinks every failure to the smallest scenario that still fails the same way; it is
    written under --out as a scenario file. Prints a line per run, then the coverage (runs
    and failures per fault kind, phase, feature and tensor parallel size) and the failures.
    Exits 0 when no failure was found, 1 when one was, 2 on bad usage or a report that cannot
    be written, 130 when interrupted.
    """
    from ftkit import Campaign

    err, out = stderr_console(), stdout_console()
    try:
        options = _options(seed=seed, budget=budget, tp=tp, kinds=kinds, features=features,
                           phases=phases, out_dir=out_dir, use_cache=not no_cache,
                           shrink=not no_shrink)
        out_dir.mkdir(parents=True, exist_ok=True)
    except FtkitError as exc:
        print_error(err, exc)
        raise click.exceptions.Exit(EXIT_USAGE) from None
    except OSError as exc:
        print_error(err, f"--out {out_dir}: cannot make the folder: {exc}")
        raise click.exceptions.Exit(EXIT_USAGE) from None

    err.print(_header(options), soft_wrap=True)
    progress = CampaignProgress(err, quiet=quiet)
    report = Campaign(options, on_event=progress).run().to_dict()
    out.print(CampaignReport(report))
    code = explore_exit_code(report)
    written = _write_reports(report, err, out_dir / CAMPAIGN_REPORT, json_path, html_path)
    if code == EXIT_INTERRUPTED:
        err.print("interrupted", style="bold red")
    elif not written:
        code = EXIT_USAGE
    ctx.exit(code)


def explore_exit_code(report: Mapping[str, Any]) -> int:
    """130 for an interrupted campaign, else 1 when it found a failure, else 0."""
    if report["stopped"] == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_FAILED if report["failures"] else EXIT_OK


# --- the options ----------------------------------------------------------------------------

def _options(*, seed: int, budget: str, tp: str, kinds: str | None, features: str | None,
             phases: str | None, out_dir: Path, use_cache: bool,
             shrink: bool) -> ExploreOptions:
    """The campaign's options; an ``FtkitError`` names the option at fault."""
    from ftkit import Budget, ExploreOptions, ExploreSpace, parse_kinds, parse_names

    whole = ExploreSpace()  # its defaults are every feature and phase there is
    space = ExploreSpace(
        tp=_parse_tp(tp),
        kinds=_naming("--kinds", kinds, parse_kinds),
        features=_naming("--features", features,
                         lambda text: parse_names(text, whole.features, "feature")),
        phases=_naming("--phases", phases,
                       lambda text: parse_names(text, whole.phases, "phase")))
    return ExploreOptions(seed=seed, budget=Budget.parse(budget), space=space,
                          out_dir=out_dir, use_cache=use_cache, shrink=shrink)


def _naming(option: str, text: str | None, parse: Callable[[str | None], Any]) -> Any:
    """``parse(text)``, its error prefixed with the option's name."""
    try:
        return parse(text)
    except FtkitError as exc:
        raise FtkitError(f"{option} {text!r}: {exc}") from None


def _parse_tp(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes:
        raise FtkitError(f"--tp {text!r}: give tensor parallel sizes as a comma list of "
                         "whole numbers (1,2)")
    return sizes


def _header(options: ExploreOptions) -> Text:
    space = options.space.describe()
    return Text(f"ftkit explore: seed {options.seed}, budget {options.budget}, tensor "
                f"parallel {', '.join(map(str, space['tp']))}; kinds "
                f"{', '.join(space['kinds'])}; phases {', '.join(space['phases'])}; features "
                f"{', '.join(space['features']) or 'none'}")


# --- progress -------------------------------------------------------------------------------

class CampaignProgress:
    """The campaign's ``on_event``: a line per run (none with ``quiet``; a shrinking run
    dimmed), a red line as soon as a new failure signature shows, and one line per shrunk
    failure with its file when the campaign ends. Each line starts with the seconds since
    the campaign began. Plain lines only: nothing redraws, so a CI log reads as a terminal."""

    def __init__(self, console: Console, *, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.quiet = quiet
        self._clock = clock
        self._began = clock()

    def __call__(self, event: CampaignEvent) -> None:
        if event.kind == "found" and event.run is not None:
            run = event.run
            self._print(Text.assemble("found ", (event.detail, "bold"),
                                      f" at run {run.index}: {run.reason}", style="red"))
        elif event.kind == "run" and event.run is not None and not self.quiet:
            self._print(_run_line(event.run))
        elif event.kind == "shrunk" and event.failure is not None:
            failure = event.failure
            self._print(Text.assemble(
                ("shrunk ", "bold"), failure.signature, ": ",
                _size_text(failure.tp, failure.requests, failure.max_tokens, failure.faults,
                           failure.features),
                f" -> {failure.file or '(not written)'}"))

    def _print(self, line: Text) -> None:
        elapsed = Text(f"[{self._clock() - self._began:7.1f}s] ", style="dim")
        self.console.print(Text.assemble(elapsed, line), soft_wrap=True)


def _run_line(run: Any) -> Text:
    """``run 7 tp 2 uce/sample + oom/forward [seeded, stop] PASS 1.2 s``"""
    line = Text.assemble("shrinking " if run.shrinking else "", f"run {run.index} tp {run.tp} ",
                         " + ".join(run.faults), f" [{', '.join(run.features) or 'plain'}] ",
                         verdict_text(run.verdict), f" {run.duration_s:.1f} s")
    if run.signature:
        line.append(f": {run.signature}")
    if run.shrinking:
        line.stylize("dim")
    return line


def _size_text(tp: int, requests: int, max_tokens: int, faults: Sequence[str],
               features: Sequence[str]) -> str:
    return (f"tp {tp}, {requests} request(s) x {max_tokens} tokens, {len(faults)} fault(s) "
            f"({', '.join(faults)}), features: {', '.join(features) or 'none'}")


# --- the report -----------------------------------------------------------------------------

class CampaignReport:
    """What a campaign covered and found, from its JSON report: the coverage of fault kinds
    x phases and of features (runs/failures per tensor parallel size; cells with failures in
    red), the shrunk failures, and a summary line."""

    def __init__(self, report: Mapping[str, Any]) -> None:
        self.report = report

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield _heading("coverage: fault kinds x phases (runs/failures per tensor parallel size)")
        yield _matrix_table(coverage_by_fault(self.report), ("kind", "phase"))
        yield _heading("coverage: workload features (runs/failures per tensor parallel size; "
                       "none: a plain workload)")
        yield _matrix_table(coverage_by_feature(self.report), ("feature",))
        if self.report["failures"]:
            yield _heading("failures, shrunk (ftkit run FILE reproduces one)")
            yield self._failures()
        yield self.summary()

    def _failures(self) -> Table:
        """A section of rows per failure: its signature, the size it was shrunk to, when it
        was found, its file and the signatures it was also seen as. Rows, not columns: a
        file name or a signature then folds only on a narrow console, and can be copied."""
        table = Table(show_header=False)
        table.add_column("what", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        for position, failure in enumerate(self.report["failures"]):
            if position:
                table.add_section()
            size = _size_text(failure["tp"], failure["requests"], failure["max_tokens"],
                              failure["faults"], failure["features"])
            table.add_row("signature", Text(failure["signature"], style="bold red"))
            table.add_row("shrunk to", Text(size))
            table.add_row("found at", Text(f"run {failure['found_at']}"))
            table.add_row("shrink runs", Text(str(failure["shrink_runs"]) + (
                "" if failure.get("shrink_complete", True) else " (stopped: out of time)")))
            table.add_row("reproduced", Text(_reproduced(failure.get("reproduced"))))
            table.add_row("file", Text(failure["file"] or "(not written)"))
            if failure["also_seen_as"]:
                table.add_row("also seen as", Text("\n".join(failure["also_seen_as"])))
        return table

    def summary(self) -> Text:
        report = self.report
        failures = len(report["failures"])
        found = Text(f"{failures} failure(s)", style="bold red") if failures else \
            Text("no failure", style="bold green")
        shrinking = sum(1 for run in report["runs"] if run["shrinking"])
        return Text.assemble(
            f"{report['scenarios_run']} scenario(s) run ({report['scenarios_per_minute']:.1f} "
            f"per minute) and {shrinking} shrinking run(s) in {report['duration_s']:.1f} s; "
            f"stopped: {report['stopped']}; ", found)


def _heading(text: str) -> Text:
    # A line of its own, not the table's title: rich wraps a title to the table's width.
    return Text(text, style="bold")


def _matrix_table(matrix: Any, labels: Sequence[str]) -> Table:
    table = Table()
    for label in labels:
        table.add_column(label, no_wrap=True)
    for tp in matrix.tp:
        table.add_column(f"tp {tp}", justify="right", no_wrap=True)
    for row in matrix.rows:
        cells = [matrix.cell(row, tp) for tp in matrix.tp]
        table.add_row(*row, *(Text(str(cell), style="bold red" if cell.failures else
                                   "dim" if not cell.runs else "") for cell in cells))
    return table


# --- report files ---------------------------------------------------------------------------

def _write_reports(report: Mapping[str, Any], err: Console, campaign_json: Path,
                   json_path: Path | None, html_path: Path | None) -> bool:
    """Write the campaign's own JSON report and those asked for; False if one could not be
    written (the others are)."""
    from ftkit import write_campaign_html

    text = json.dumps(report, indent=2) + "\n"

    def write_json(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    written = True
    for label, path, write in (("JSON", campaign_json, write_json),
                               ("JSON", json_path, write_json),
                               ("HTML", html_path,
                                lambda path: write_campaign_html(report, path))):
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            print_error(err, f"cannot write the {label} report {path}: {exc}")
            written = False
            continue
        err.print(f"{label} report written to {path}", markup=False, soft_wrap=True)
    return written


def _reproduced(value: bool | None) -> str:
    if value is None:
        return "not checked"
    return ("yes: it fails the same way alone, on a new engine" if value else
            "no: alone on a new engine it does not fail so; an earlier run left the engine "
            "damaged")
