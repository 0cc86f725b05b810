"""What ``ftkit doctor`` shows: the ``Diagnosis`` of ``ftkit.doctor`` as rich renderables."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from ftkit import REAL, Diagnosis

__all__ = ["DoctorReport"]

_YES = Text("yes", style="green")
_NO = Text("no", style="red")


def _yes_no(value: bool) -> Text:
    return _YES if value else _NO


class DoctorReport:
    """Platform and versions, then the fault kinds, the recovery steps and serving; problems
    last."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        d = self.diagnosis
        yield self._environment()
        yield self._faults()
        yield self._recovery()
        yield self._serving()
        for problem in d.problems:
            yield Text(f"problem: {problem}", style="yellow")
        supported = sum(s.supported for s in d.recovery)
        injectable = sum(f.injectable for f in d.faults)
        yield Text(f"platform {d.platform or '?'} ({d.backend or 'no'} backend): "
                   f"{injectable} of {len(d.faults)} fault kinds injectable, {supported} of "
                   f"{len(d.recovery)} recovery steps supported")

    def _environment(self) -> Table:
        d = self.diagnosis
        table = Table(title="ftkit doctor", title_justify="left", show_header=False)
        table.add_column("what", style="bold", no_wrap=True)
        table.add_column("found", overflow="fold")
        table.add_row("platform", Text(f"{d.platform or '(none)'}  ({d.platform_source})"))
        table.add_row("backend", Text(d.backend or "(none)"))
        for package in d.packages:
            if package.version is None:
                found = Text("not installed", style="dim")
            elif package.distribution not in (None, package.name):
                found = Text(f"{package.version}  (distribution {package.distribution})")
            else:
                found = Text(package.version)
            table.add_row(package.name, found)
        table.add_row("torch build", Text(f"CUDA {d.torch_cuda}" if d.torch_cuda else
                                          "no CUDA"))
        table.add_row("python", Text(f"{d.python} ({d.machine})"))
        return table

    def _faults(self) -> Table:
        table = Table(title="fault kinds", title_justify="left")
        table.add_column("kind", no_wrap=True)
        table.add_column("implemented", no_wrap=True)
        table.add_column("injectable here", no_wrap=True)
        table.add_column("injected", no_wrap=True)
        table.add_column("how", overflow="fold")
        for fault in self.diagnosis.faults:
            mode = Text(fault.mode, style="green" if fault.mode == REAL else "cyan")
            table.add_row(Text(fault.kind), _yes_no(fault.implemented),
                          _yes_no(fault.injectable), mode, Text(fault.reason or fault.how))
        return table

    def _recovery(self) -> Table:
        return _yes_no_table(f"recovery steps ({self.diagnosis.backend or 'no'} backend)",
                             ("step", "supported"),
                             [(s.step, s.supported, s.detail) for s in self.diagnosis.recovery])

    def _serving(self) -> Table:
        return _yes_no_table("serving (vLLM's server with ftkit)", ("what", "works here"),
                             [(r.what, r.works, r.detail) for r in self.diagnosis.serving])


def _yes_no_table(title: str, columns: tuple[str, str],
                  rows: list[tuple[str, bool, str]]) -> Table:
    """A table of things, whether each is so, and how (or why not)."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("how, or why not", overflow="fold")
    for name, yes, detail in rows:
        table.add_row(Text(name), _yes_no(yes), Text(detail))
    return table
