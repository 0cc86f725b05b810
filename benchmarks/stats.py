"""Summaries of repeated measurements and the Markdown tables the results are shown in.

Every figure the benchmarks report is the median of its repeats with the spread (minimum and
maximum) beside it; ratios are taken per repeat between measurements made side by side (the
same repeat, one right after the other) and then summarised the same way, so that a slow
minute of the machine affects both sides of a ratio alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, float]) -> Summary:
        return cls(float(raw["median"]), float(raw["low"]), float(raw["high"]), int(raw["n"]))


def summarize(values: Iterable[float]) -> Summary:
    """Median, minimum and maximum of ``values`` (at least one)."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("nothing to summarise")
    return Summary(statistics.median(data), min(data), max(data), len(data))


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[i] / denominators[i]`` for each repeat ``i`` (same length required)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators for {len(denominators)} denominators")
    return [n / d for n, d in zip(numerators, denominators)]


def rotations(items: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of ``items`` in each repeat: rotated by one per repeat, so that each item
    is first, second, ... equally often (a position in the sequence costs all items alike)."""
    k = len(items)
    return [[items[(r + i) % k] for i in range(k)] for r in range(repeats)]


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def fmt_summary(s: Summary | None, digits: int = 0, scale: float = 1.0) -> str:
    """``median (low-high)``, each multiplied by ``scale``."""
    if s is None:
        return "-"
    return (f"{s.median * scale:.{digits}f} "
            f"({s.low * scale:.{digits}f}-{s.high * scale:.{digits}f})")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table; cells are written with ``str``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row of {len(cells)} cells for {len(headers)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
