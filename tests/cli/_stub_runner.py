"""A stand-in ``ftkit.runner`` for CLI tests that check the CLI itself (exit codes, tables,
reports), not a run: the real runs are covered by the end-to-end tests."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence

from ftkit.progress import ProgressEvent
from ftkit.results import ScenarioResult, Verdict

ResultFactory = Callable[[str, str, Verdict], ScenarioResult]


def install_stub_runner(monkeypatch, outcomes: dict[str, Verdict | BaseException],
                        make_result: ResultFactory,
                        events: Sequence[ProgressEvent] = (),
                        seen: list | None = None) -> list[str]:
    """Put a runner in ``sys.modules`` whose verdicts come from ``outcomes`` by scenario name
    (a value may be an exception to raise). ``events`` are emitted for every scenario, with
    the scenario's name; ``seen``, when given, collects the scenario objects it was handed.
    Returns the list of scenario names it ran, in order."""
    calls: list[str] = []

    def run_scenario(scenario, *, file, on_event):
        calls.append(scenario.name)
        if seen is not None:
            seen.append(scenario)
        for event in events:
            on_event(ProgressEvent(scenario.name, event.stage, event.message,
                                   event.tokens_done, event.tokens_total))
        outcome = outcomes[scenario.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return make_result(scenario.name, file, outcome)

    class ScenarioRunner:
        """The runner's shape: a context manager whose ``run`` gives the verdicts."""

        closed = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            ScenarioRunner.closed = True

        def run(self, scenario, *, file, on_event):
            return run_scenario(scenario, file=file, on_event=on_event)

    module = types.ModuleType("ftkit.runner")
    module.run_scenario = run_scenario
    module.ScenarioRunner = ScenarioRunner
    monkeypatch.setitem(sys.modules, "ftkit.runner", module)
    return calls
