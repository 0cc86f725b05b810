"""Progress events a run emits while it works, for the CLI and other front ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressEvent:
    """Something a front end may show.

    ``stage`` is one of: ``baseline`` (fault-free reference run starts or is taken from
    the cache), ``engine_start``, ``engine_ready``, ``tokens`` (generation progressed),
    ``fault`` (an injected fault fired), ``recovery`` (a recovery round ended with its
    decision), ``recovered`` (a failed step ran again and succeeded, or a dead engine was
    replaced and its requests resumed), ``done`` (the scenario has a verdict).
    """

    scenario: str
    stage: str
    message: str = ""
    tokens_done: int = 0
    tokens_total: int = 0


EventSink = Callable[[ProgressEvent], None]


def ignore_events(_: ProgressEvent) -> None:
    """The default sink: drop everything."""
