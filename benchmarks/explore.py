"""Throughput of the chaos search (``ftkit explore``): generated scenarios per minute at tensor
parallel 1 and 2.

Each tensor parallel size gets a campaign of its own, run in this process as ``ftkit explore
--seed SEED --budget 10m --tp N`` runs it (``--quick``: one minute each): the same ``Campaign``,
on a ``ScenarioRunner`` that keeps its engines between scenarios and caches baselines, with as
many idle engine hosts. Ten minutes, so that the engine starts spread over a campaign's worth
of scenarios, as they do for a user; and each is the campaign of ten minutes per tensor
parallel size that must run clean on the landed code (issue 11): its failures are recorded.

The cache is a fresh directory (``FTKIT_CACHE_DIR``): no earlier run's baselines answer for
this one, and within the campaign a workload's baseline is computed once and then read from
the cache (a workload drawn again, shrinking), as in a user's first campaign. The tiny model is
built there before the campaign starts, outside its time: any earlier ftkit command has built
it for a user.

The campaign's ``execute`` is the default one plus a look at each scenario (``Look``): its
requests and output tokens (the target is stated for 4 requests x 32 tokens, the largest
workload the space draws), its engine configuration, the engines it started, the restarts
after a killed process, whether its baseline came from the cache.

Recorded per tensor parallel size (``figures``): ``per_minute``, generated scenarios per
minute of their own run time (``CampaignResult.per_minute()``, the rate ``ftkit explore``
reports; the target is checked against it), and per minute of the campaign's wall time
(Hypothesis's own time and shrinking included); the runs' mean and median duration; the
share of run time in runs with a ``process_kill`` fault (an engine restart each); shrinking's
runs and the failures found.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ftkit import (Budget, Campaign, CampaignResult, ExploreOptions, ExploreSpace,
                   ProgressEvent, Scenario, ScenarioResult, ScenarioRunner, build_tiny_model,
                   idle_hosts, model_prompt_tokens)

#: The campaigns' seed: the same scenarios on every run of the suite.
SEED = 11
#: Tensor parallel sizes, one campaign each, in this order.
TP_SIZES = (1, 2)
#: Each campaign's budget (seconds): full and ``--quick``.
BUDGET_S = 600.0
QUICK_BUDGET_S = 60.0
#: The fault kind whose runs restart an engine (``ExploredRun.faults`` holds ``kind/phase``).
KILL_PREFIX = "process_kill/"


@dataclass
class Look:
    """What the benchmark saw of one scenario the campaign ran (in the order of its runs)."""

    requests: int
    max_tokens: int
    #: The engine configuration (``Scenario.engine_key()``), as text.
    engine: str
    engine_starts: int = 0
    engine_start_s: float = 0.0
    restart_s: float = 0.0
    baseline_from_cache: bool = False


@dataclass
class LookingExecute:
    """The campaign's default ``execute`` (one ``ScenarioRunner`` for the whole campaign),
    keeping a ``Look`` at every scenario it runs."""

    runner: ScenarioRunner
    looks: list[Look] = field(default_factory=list)

    def __call__(self, scenario: Scenario, file: str) -> ScenarioResult:
        workload = scenario.workload
        look = Look(requests=workload.prompt_count(), max_tokens=workload.max_tokens,
                    engine=json.dumps(scenario.engine_key(), sort_keys=True))
        self.looks.append(look)  # before running: a run that raises is still a campaign run
        started_at: list[float] = []

        def on_event(event: ProgressEvent) -> None:
            # A host says engine_start only when it starts an engine, engine_ready after
            # every start and every reuse.
            if event.stage == "engine_start":
                started_at.append(time.monotonic())
                look.engine_starts += 1
            elif event.stage == "engine_ready" and started_at:
                look.engine_start_s += time.monotonic() - started_at.pop()

        result = self.runner.run(scenario, file=file, on_event=on_event)
        look.restart_s = sum(f.restart_s or 0.0 for f in result.faults)
        look.baseline_from_cache = result.baseline_from_cache
        return result


def figures(result: CampaignResult, looks: list[Look]) -> dict[str, Any]:
    """The campaign's rates and where its time went. ``looks`` follow ``result.runs`` (one
    per run, in order; a look without a run, at an interrupt, is left out)."""
    pairs = list(zip(result.runs, looks))
    generated = [(run, look) for run, look in pairs if not run.shrinking]
    durations = [run.duration_s for run, _ in generated]
    killing = [run.duration_s for run, _ in generated
               if any(f.startswith(KILL_PREFIX) for f in run.faults)]
    generation_s = result.generation_s
    wall_s = result.duration_s
    return {
        "scenarios_run": result.scenarios_run,
        "per_minute": result.per_minute(),
        "generation_s": generation_s,
        "duration_s": wall_s,
        "wall_per_minute": 60.0 * result.scenarios_run / wall_s if wall_s > 0 else 0.0,
        "shrink_runs": len(result.runs) - result.scenarios_run,
        "runs_per_minute": 60.0 * len(result.runs) / wall_s if wall_s > 0 else 0.0,
        "rejected": result.rejected,
        "stopped": result.stopped,
        "failures": [f.signature for f in result.failures],
        "run_s_mean": statistics.fmean(durations) if durations else None,
        "run_s_median": statistics.median(durations) if durations else None,
        "kill_runs": len(killing),
        "kill_share": sum(killing) / generation_s if generation_s > 0 else 0.0,
        "requests_mean": _mean(look.requests for _, look in generated),
        "max_tokens_mean": _mean(look.max_tokens for _, look in generated),
        "at_4x32": sum(1 for _, look in generated
                       if (look.requests, look.max_tokens) == (4, 32)),
        "engine_configs": len({look.engine for _, look in pairs}),
        "engine_starts": sum(look.engine_starts for _, look in pairs),
        "engine_start_s": sum(look.engine_start_s for _, look in pairs),
        "restart_s": sum(look.restart_s for _, look in pairs),
        "baselines_cached": sum(1 for _, look in pairs if look.baseline_from_cache),
    }


def _mean(values: Iterable[float]) -> float | None:
    data = list(values)
    return statistics.fmean(data) if data else None


def campaign(tp: int, seconds: float) -> dict[str, Any]:
    """One campaign at tensor parallel ``tp`` for ``seconds``; its figures and its looks."""
    # The space and the idle hosts the command's campaign has (Campaign.run).
    options = ExploreOptions(seed=SEED, budget=Budget(seconds=seconds),
                             space=ExploreSpace(tp=(tp,), prompt_tokens=model_prompt_tokens()))
    hosts = idle_hosts(options)
    runner = ScenarioRunner(use_cache=options.use_cache, max_idle_hosts=hosts)
    execute = LookingExecute(runner)
    try:
        result = Campaign(options, execute=execute).run()
    finally:
        closing = time.monotonic()
        runner.close()
        close_s = time.monotonic() - closing
    if result.stopped == "interrupted":
        raise KeyboardInterrupt  # the campaign caught the Ctrl-C; the suite stops here too
    return {"tp": tp, "budget_s": seconds, "seed": SEED, "idle_hosts": hosts,
            **figures(result, execute.looks), "close_s": close_s,
            "looks": [asdict(look) for look in execute.looks],
            "runs": [asdict(run) for run in result.runs]}


@contextlib.contextmanager
def fresh_cache() -> Iterator[str]:
    """``FTKIT_CACHE_DIR`` set to an empty directory for the block; the previous value back
    afterwards."""
    before = os.environ.get("FTKIT_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-explore-") as cache:
        os.environ["FTKIT_CACHE_DIR"] = cache
        try:
            yield cache
        finally:
            if before is None:
                os.environ.pop("FTKIT_CACHE_DIR", None)
            else:
                os.environ["FTKIT_CACHE_DIR"] = before


def run(quick: bool = False) -> dict[str, Any]:
    seconds = QUICK_BUDGET_S if quick else BUDGET_S
    with fresh_cache():
        building = time.monotonic()
        build_tiny_model()
        build_s = time.monotonic() - building
        campaigns = [campaign(tp, seconds) for tp in TP_SIZES]
    return {"model_build_s": build_s, "campaigns": campaigns}


if __name__ == "__main__":
    from benchmarks.suite import main

    sys.exit(main("explore", run, sys.argv[1:], __doc__))
