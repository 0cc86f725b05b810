"""ftkit's own time per fault-free step, measured where it is spent, and where it goes.

At tensor parallel 1, in process (the worker lives in this process): the worker's
``execute_model`` / ``sample_tokens``, as vLLM's RPCs reach them (ftkit's plugin replaced them
with its wrapper bound to the worker's own method), are timed whole, and the worker's own
method inside is timed too (``perf_counter_ns``); ftkit's own time is the difference, per step
(an execute and a sample RPC): everything ftkit runs on the step's path, from the plugin's
entry to the model runner and back.

Where it goes is measured in separate runs of the same workload (``breakdown``): the pieces of
the wrapped step are timed too, each on its instance, so that their timers do not inflate the
headline figure:

* ``record sample``: ``StepState.begin_sample`` (the forward state, the row map, generators;
  ``execute_model`` takes no record: its rollback is derived from the scheduler output),
* ``gate``: the step gate, ``RecoveryMonitor.enter_step`` and ``exit_step_ok``, per attempt,
* ``hooks``: every step hook's ``on_attempt`` and the lost-KV repair
  (``StepState.before_attempt``); both are skipped on the fault-free path (no fault planned,
  nothing lost), so this piece is zero there unless a plan is set,
* ``timer floor``: what the same outer timers report around a bare call (ftkit's wrapper
  replaced by ``call(arg)``, in runs of their own): the measurement's own share of the headline,
* ``rest``: the headline minus all of the above: the wrapper's own code (its calls, the attempt
  loop, the counters).

The pieces are medians over the steps of their runs, the rest is what they leave of the
headline median. Every piece timer adds its own cost (two clock reads and a call; ``probe_us``
is that cost measured on a warm no-op) to its piece. After the model's forward pass the
caches are cold, and every Python call on the step's path costs about a microsecond.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import open_sessions, prompts, tiny_model, worker_of
from benchmarks.stats import Summary, fmt_summary, markdown_table, summarize
from ftkit import EngineSession, EngineSpec, RecoveryConfig, SamplingSpec

PIECES = ("record_sample", "gate", "hooks")
_LABELS = {"record_sample": "record sample", "gate": "gate", "hooks": "hooks"}


RPCS = ("execute_model", "sample_tokens")


def ftkit_entries(worker: Any) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """Per step RPC of ``worker``: (ftkit's wrapper, the worker's own method), from the
    ``functools.partial(wrapper, own_method)`` that ftkit's plugin installed on the worker."""
    entries = {}
    for name in RPCS:
        bound = getattr(worker, name)
        if not isinstance(bound, functools.partial) or len(bound.args) != 1:
            raise RuntimeError(f"ftkit: the worker's {name} is not ftkit's wrapper")
        entries[name] = (bound.func, bound.args[0])
    return entries


class OwnTime:
    """Replaces one worker's ``execute_model`` / ``sample_tokens`` (``entries``: ftkit's
    wrapper and the worker's own method, per RPC) by timed ones: the whole call and the
    worker's own method inside it are timed; ftkit's own time is the difference. With
    ``pieces``, the pieces of the step (``PIECES``) are timed as well, each on its instance
    (``wrapper``: the worker's ``StepWrapper``)."""

    def __init__(self, worker: Any, entries: dict[str, tuple[Callable[..., Any],
                                                             Callable[..., Any]]],
                 wrapper: Any = None, pieces: bool = False) -> None:
        #: (whole ns, runner ns, {piece: ns}) per RPC
        self.samples: list[tuple[int, int, dict[str, int]]] = []
        self._pieces = dict.fromkeys(PIECES, 0)
        self._timed: list[tuple[Any, str]] = []  # (instance, method name) timed as a piece
        for name, (method, inner) in entries.items():
            setattr(worker, name, self._wrap(method, inner))
        if pieces:
            state, monitor = wrapper.state, wrapper.monitor
            self._time(state, "begin_sample", "record_sample")
            self._time(monitor, "enter_step", "gate")
            self._time(monitor, "exit_step_ok", "gate")
            self._time(state, "before_attempt", "hooks")
            for hook in wrapper.hooks:
                self._time(hook, "on_attempt", "hooks")

    def remove_piece_timers(self) -> None:
        for obj, name in self._timed:
            delattr(obj, name)  # the class's method shows through again
        self._timed = []

    def _time(self, obj: Any, name: str, piece: str) -> None:
        method = getattr(obj, name)
        self._timed.append((obj, name))
        totals = self._pieces
        clock = time.perf_counter_ns

        def timed(*args: Any) -> Any:
            started = clock()
            try:
                return method(*args)
            finally:
                totals[piece] += clock() - started
        setattr(obj, name, timed)

    def _wrap(self, method: Callable[..., Any], call: Callable[..., Any]) -> Callable[..., Any]:
        inner = [0]

        def runner_call(a: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return call(a)
            finally:
                inner[0] += time.perf_counter_ns() - started

        def timed(arg: Any) -> Any:
            inner[0] = 0
            for piece in PIECES:
                self._pieces[piece] = 0
            started = time.perf_counter_ns()
            out = method(runner_call, arg)
            self.samples.append((time.perf_counter_ns() - started, inner[0],
                                 dict(self._pieces)))
            return out
        return timed

    def take(self) -> list[tuple[int, int, dict[str, int]]]:
        samples, self.samples = self.samples, []
        return samples


def probe_cost_us(repeats: int = 20000) -> float:
    """What one piece timer adds around a no-op call (median of batches of calls)."""
    class Noop:
        def call(self) -> None:
            return None

    plain, timed = Noop(), Noop()
    probe = OwnTime.__new__(OwnTime)
    probe._pieces, probe._timed = {"gate": 0}, []
    probe._time(timed, "call", "gate")
    costs = []
    for _ in range(5):
        started = time.perf_counter_ns()
        for _ in range(repeats):
            plain.call()
        base = time.perf_counter_ns() - started
        started = time.perf_counter_ns()
        for _ in range(repeats):
            timed.call()
        costs.append((time.perf_counter_ns() - started - base) / repeats / 1000)
    return sorted(costs)[len(costs) // 2]


def _steps(samples: list[tuple[int, int, dict[str, int]]]) -> list[dict[str, float]]:
    """Pairs of RPCs, (execute, sample) of one step, in microseconds."""
    steps = []
    for ex, sa in zip(samples[0::2], samples[1::2]):
        runner_ns = ex[1] + sa[1]
        own_ns = ex[0] + sa[0] - runner_ns
        step = {"runner": runner_ns / 1000, "ftkit": own_ns / 1000}
        for piece in PIECES:
            step[piece] = (ex[2][piece] + sa[2][piece]) / 1000
        steps.append(step)
    return steps


def measure_own_time(batches: tuple[int, ...], repeats: int, max_tokens: int,
                     max_model_len: int, max_num_seqs: int,
                     breakdown: bool = True) -> dict[str, Any]:
    """Per batch size: the runner's time and ftkit's own time per step (``rows``), and,
    with ``breakdown``, where ftkit's time goes (``breakdown``, from runs of their own)."""
    spec = EngineSpec(model=tiny_model(), max_model_len=max_model_len,
                      args={"max_num_seqs": max_num_seqs})
    session = EngineSession(spec, multiprocess=False, recovery=RecoveryConfig(enabled=True))
    sampling = SamplingSpec(max_tokens=max_tokens)
    rows, pieces_rows = [], []
    with open_sessions({"ftkit": session}):
        session.generate(prompts(2), sampling)  # builds the recovery engine at its first step
        worker = worker_of(session)
        wrapper = worker._ftkit.step_wrapper
        entries = ftkit_entries(worker)
        probe = OwnTime(worker, entries)
        for batch in batches:
            steps = _run(session, probe, batch, repeats, sampling)
            rows.append({"batch": batch, "steps": len(steps),
                         "runner_us": summarize(s["runner"] for s in steps).to_dict(),
                         "ftkit_us": summarize(s["ftkit"] for s in steps).to_dict(),
                         "share": summarize(s["ftkit"] / s["runner"] for s in steps
                                            if s["runner"] > 0).to_dict()})
        if breakdown:
            probe = OwnTime(worker, entries, wrapper, pieces=True)
            for batch in batches:
                steps = _run(session, probe, batch, repeats, sampling)
                pieces_rows.append(
                    {"batch": batch, "steps": len(steps),
                     **{f"{k}_us": summarize(s[k] for s in steps).to_dict()
                        for k in ("ftkit", *PIECES)}})
            probe.remove_piece_timers()
            # The bare call: what the timers alone report.
            probe = OwnTime(worker, {name: (_bare, inner)
                                     for name, (_, inner) in entries.items()})
            for batch, row in zip(batches, pieces_rows):
                steps = _run(session, probe, batch, repeats, sampling)
                row["floor_us"] = summarize(s["ftkit"] for s in steps).to_dict()
        for name, (method, inner) in entries.items():  # ftkit's own entries again
            setattr(worker, name, functools.partial(method, inner))
    result: dict[str, Any] = {"tp": 1, "rows": rows}
    if breakdown:
        result["breakdown"] = pieces_rows
        result["probe_us"] = probe_cost_us()
    return result


def _bare(call: Callable[[Any], Any], arg: Any) -> Any:
    return call(arg)


def _run(session: EngineSession, probe: OwnTime, batch: int, repeats: int,
         sampling: SamplingSpec) -> list[dict[str, float]]:
    steps: list[dict[str, float]] = []
    for _ in range(repeats):
        out = session.generate(prompts(batch), sampling)
        if out.error:
            raise RuntimeError(f"ftkit: {out.error}")
        steps.extend(_steps(probe.take()))
    return steps


# --- the tables -----------------------------------------------------------------------------------

def own_time_table(own: dict[str, Any]) -> str:
    rows = []
    for row in own["rows"]:
        share = Summary.from_dict(row["share"])
        rows.append([own["tp"], row["batch"], row["steps"],
                     fmt_summary(Summary.from_dict(row["runner_us"]), 0),
                     fmt_summary(Summary.from_dict(row["ftkit_us"]), 1),
                     f"{share.median * 100:.2f} % ({share.low * 100:.2f}-{share.high * 100:.2f})"])
    table = markdown_table(["TP", "batch", "steps", "runner us/step", "ftkit us/step",
                            "ftkit / runner"], rows)
    if own.get("breakdown"):
        table += "\n\n" + breakdown_table(own)
    return table


def breakdown_table(own: dict[str, Any]) -> str:
    """Where ftkit's microseconds per step go: the headline median split into the timer
    floor, the timed pieces (medians of runs of their own) and the rest, in us."""
    rows = []
    for head, row in zip(own["rows"], own["breakdown"]):
        total = Summary.from_dict(head["ftkit_us"]).median
        parts = {k: Summary.from_dict(row[f"{k}_us"]).median for k in ("floor", *PIECES)}
        rows.append([row["batch"], f"{total:.1f}",
                     *(f"{parts[k]:.1f}" for k in ("floor", *PIECES)),
                     f"{total - sum(parts.values()):.1f}"])
    headers = ["batch", "ftkit us/step", "timer floor us",
               *(f"{_LABELS[k]} us" for k in PIECES), "rest us"]
    note = (f"Where it goes (us per step; pieces timed in runs of their own, each timer adding "
            f"about {own.get('probe_us', 0):.2f} us to its piece; rest: the wrapper's own "
            f"code):")
    return note + "\n\n" + markdown_table(headers, rows)
