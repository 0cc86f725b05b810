"""Serving numbers: vLLM's OpenAI server with ftkit's plugin, driven by many concurrent
streaming ``openai`` clients (each on a connection of its own, greedy, ``ignore_eos``).

Servers of the default tiny model at tensor parallel 2, eager, all started the way ``ftkit
serve`` starts them (``ftkit.runner.serve.ScenarioServer`` with the engine settings of
``scenarios/serve_link_flap.yaml``), differing only in their ``fault_tolerance`` settings:

* ``off`` ``{"enabled": false}`` and ``on`` ``{"enabled": true}``, both up at once: the
  same workload on each in turn, ``repeats`` times (alternating which goes first; the
  server not measured stopped with ``SIGSTOP`` meanwhile, ``BenchServer.frozen``: idle, it
  took 2-3 % of a core; for the second half of the repeats both servers are started anew,
  in the other order, ``halves``, as the server started second ran faster), every
  stream released into the paused engine at once (``drive_paused``); tokens per second in
  the engine (vLLM's own series on ``/metrics``: tokens generated, per second of the
  requests' mean time from first scheduled to last token; the target is checked on this,
  on the geometric mean of the two halves' medians, ``order_balanced``) and
  at the clients (tokens read / seconds from the release to the last token read), the ratio
  on/off per repeat. The clients read slower than the engine makes tokens (the API server
  and the clients share the two cores with it: measured, 16 streams of 128 tokens, the
  clients read 660-1090 tokens/s while the engine made 1500-2630), so their rate is the
  clients' and the server's front end's (its on/off ratio spread 0.73-2.24 over five
  repeats of an earlier run, released unpaused). A run is 16 streams of 512 tokens: of
  128, a run was about a second in the engine, and the engine's ratio spread 0.77-1.47.
* The same, on an ``on`` and an ``off`` server of the wide model (``ftkit.model.wide``: the
  layer widths of a 7B-class Llama, two layers; part ``wide``): the tiny model's step takes a
  few milliseconds, and the server's front end and the clients, on the same two cores, take
  as much CPU as the engine, so its on/off ratio spread 0.64-1.18 over seven repeats (the
  engine's rate moves with how the front end's work falls between the two ranks' steps),
  far more than recovery's cost per step (about 1 % of a tiny step at TP 2: the step
  wrapper's 12 us and ftkit's collectives). The wide model's step is long enough for the
  engine to weigh most, as it does with a real model.
* On a ``faults`` server ``{"enabled": true, "injection": true, "max_restarts": 1}``, per
  fault kind, one fault planned through the injection route
  (``POST /ftkit/inject`` with the secret, what ``ftkit inject`` sends) for one client's
  ``X-Request-Id`` and token, before the streams start; then the streams. Reported: whether it
  fired (the server's log), the largest gap between two tokens any client saw (beside the
  fault-free run's), and whether every stream's token ids and logprobs equal the same
  server's fault-free run.
* Then SIGKILL of the serving engine's ``Worker_TP1`` while the streams run (``cold``: the
  ``faults`` server replaces its engine with a new one), and the same on a server with
  ``{"enabled": true, "injection": true, "max_restarts": 1, "standby": true}`` (``standby``:
  the warm standby takes over). The kill is timed on the server's own progress, with every
  stream at the same point: the engine is paused (vLLM's development route ``POST
  /pause?mode=keep``) until the server logged every request
  received, then a ``process_kill`` is planned through the injection route for rank 1,
  ``KILL_AFTER_STEPS`` of the server's steps on, and the engine resumes (``POST /resume``):
  the worker SIGKILLs itself there, every stream ``KILL_AFTER_STEPS`` tokens in; its
  ``FaultFired`` event gives the kill's time. A kill timed on what the clients had read came
  after the streams had finished at the engine (the clients share the two cores and read
  seconds late), and vLLM's ``vllm:generation_tokens_total`` moves in batches, reaching a
  run's tokens only after the clients had them all; without the pause, the starved clients
  sent their requests up to 25 s apart, and the streams had different lengths at the kill
  (a resumed stream's prompt, the tokens it had, is computed again on the new engine: its
  cost on the CPU grows faster than its length). Reported, from the kill until every stream the server resumed had its
  first output from the new engine: on the server (ftkit's ``RequestResumed`` events, written
  as that output goes into the stream; the targets are checked on this), and at the clients
  (the new engine's first token read: tokens made before the kill but read after it do not
  count); the streams that failed, and whether the finished streams equal the same
  server's fault-free run. The engine start the cold target is checked against is the
  ``faults`` server's own, from its log: from the line the server logs before it starts its
  engine to the engine core's "init engine ... took" line (on the standby server the same,
  and the standby's start, from the first engine's line to its own).
* On the standby server, before the kill: the idle cost of each engine (its engine core and
  workers): RSS, USS (memory no other process shares) and CPU (per cent of one core) over
  ``idle_s`` seconds of no requests.

Every run also notes when the clients' own process was not run (``Stalls``: a thread that
sleeps 10 ms at a time and notes each wake-up more than 0.1 s late). On this machine the
processes beside the server were measured not running for up to 6-9 s at a time while the
engine's workers ran flat out, and the server sent each stream's tokens on time meanwhile
(its own log; the clients' sockets held the unread data): where a gap the clients read
falls within such a stall, it is theirs, and the tables say how much of it.

Every server is killed and reaped with its whole tree however the suite ends (also on SIGTERM,
which ``python -m benchmarks`` sends a suite that runs out of time).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import REPO, SETTLE_S, prompts, settle, tiny_model
from benchmarks.stats import fmt_summary, markdown_table, paired_ratios, summarize
from ftkit import (CONFIG_KEY, INJECT_SECRET_ENV, FaultFired, RequestResumed, Scenario,
                   ScenarioServer, Stream, StreamedCompletion, build_wide_model,
                   inject_live_fault, load_scenario, only, read_events, server_options,
                   stream_one)

SCENARIO = REPO / "scenarios" / "serve_link_flap.yaml"
#: Long enough for the kill streams (prompt + tokens), small enough to start fast.
MAX_MODEL_LEN = 2048
#: The serving engine's process a kill ends (vLLM names its processes).
KILL_TARGET = "Worker_TP1"
ENGINE_CORE = "EngineCore"
#: A stream's token at which a planned fault fires, and the stream it is planned for.
FAULT_TOKEN = 8
FAULT_REQUEST = 1
#: The kill: the serving engine's rank 1 (its ``Worker_TP1``) kills itself with SIGKILL
#: (a ``process_kill`` planned through the injection route) this many of the server's steps
#: after it resumed with every stream's request in (paused until then): timed on the server's
#: own progress. The clients share the two cores with the engine and the server and are
#: starved: measured, three of six clients sent their requests 7 s after the release, and a
#: stream's 1200 tokens reached its client within the last half second of a 23 s run. A kill
#: timed on what they read came after the streams had finished at the engine; one timed on
#: the first stream's tokens found the others not yet sent; one planned for the last-sent
#: stream's token came after that token (the plan itself left the starved client late).
KILL_RANK = 1
KILL_AFTER_STEPS = 100
#: What vLLM's server logs for each request it received (``--enable-log-requests``).
RECEIVED_LOG = "Received request "
RUN_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0
#: What the server logs (ftkit.vllm.restart, ftkit's injector).
RESTART_LOG = "ftkit: this server replaces a dead engine"
STANDBY_READY_LOG = "ftkit: the standby engine is ready"
#: What vLLM's engine core logs once it is up (after this, only its handshake).
ENGINE_UP_LOG = "init engine (profile, create kv cache, warmup model) took"
#: What the server logs as a cold replacement starts its new engine (the dead one ended).
COLD_START_LOG = "ftkit: the dead engine ended in"
WATCHED_LOGS = (RESTART_LOG, ENGINE_UP_LOG, STANDBY_READY_LOG, COLD_START_LOG)
NEW_ENGINE_LOG = re.compile(r"ftkit: the new engine serves after ([0-9.]+) s")
FIRED_LOG = re.compile(r"ftkit: injecting (\w+) on rank (\d+)")
RESUMED_LOG = re.compile(r"ftkit: resuming request (\S+) on the new engine after (\d+) token")


@dataclass(frozen=True)
class FaultCase:
    name: str
    kind: str
    rank: int
    times: int = 1
    params: tuple[tuple[str, Any], ...] = ()

    def body(self, request_id: str, token: int) -> dict[str, Any]:
        """The injection route's JSON for this fault, planned for ``request_id``'s token."""
        return {"kind": self.kind, "rank": self.rank, "phase": "forward", "times": self.times,
                "params": dict(self.params), "request_id": request_id, "token": token}


FAULTS = (
    FaultCase("link_flap x2", "link_flap", 1, times=2),
    FaultCase("link_break", "link_break", 0),
    FaultCase("device_reset", "device_reset", 0),
    FaultCase("uce kv", "uce", 1, params=(("region", "kv"),)),
    FaultCase("uce weights", "uce", 0, params=(("region", "weights"),)),
    FaultCase("hang", "hang", 1, params=(("op_timeout_s", 1.0),)),
)


@dataclass(frozen=True)
class Plan:
    repeats: int = 7
    streams: int = 16
    max_tokens: int = 512
    fault_streams: int = 8
    fault_tokens: int = 48
    faults: tuple[str, ...] = tuple(f.name for f in FAULTS)
    kill_streams: int = 8
    kill_tokens: int = 1600
    idle_s: float = 10.0
    #: On and off with the wide model (``WIDE``).
    #: (Measured, with the idle server stopped: per-repeat engine ratios 0.965-1.045 around a
    #: median of 1.006 over seven repeats; more repeats narrow the median.)
    wide_repeats: int = 9
    wide_streams: int = 16
    wide_max_tokens: int = 64


QUICK = Plan(repeats=3, streams=8, max_tokens=64, fault_streams=6, fault_tokens=32,
             faults=("link_flap x2", "device_reset", "uce kv"), kill_streams=6,
             kill_tokens=1200, idle_s=4.0, wide_repeats=3, wide_streams=8, wide_max_tokens=16)
#: The suite's parts: on and off with the tiny model, the same with the wide one, and the
#: faults, kills and the standby's idle cost (tiny model).
PARTS = ("throughput", "wide", "faults")


# --- pure helpers (tested in tests/unit/test_bench_serve.py) ----------------------------------

def tokens_per_s(token_times: Sequence[Sequence[float]]) -> float | None:
    """Tokens streamed per second, from the release of the streams (time 0) to the last token."""
    count = sum(len(t) for t in token_times)
    last = max((t[-1] for t in token_times if t), default=0.0)
    return count / last if count and last > 0 else None


#: vLLM's Prometheus series the engine-side tokens per second is computed from: tokens the
#: engine generated, and each finished request's time from its first scheduling to its last
#: token (engine-core timestamps, taken as the engine makes the outputs: they do not depend
#: on how fast the clients read).
GENERATED = "vllm:generation_tokens_total"
INFERENCE_SUM = "vllm:request_inference_time_seconds_sum"
INFERENCE_COUNT = "vllm:request_inference_time_seconds_count"
ENGINE_SERIES = (GENERATED, INFERENCE_SUM, INFERENCE_COUNT)


def metric_totals(text: str, names: Sequence[str] = ENGINE_SERIES) -> dict[str, float]:
    """Each of ``names`` from a Prometheus text page, summed over its label sets (0 where
    the page has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {name: 0.0 for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def engine_tokens_per_s(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Tokens the engine generated between two readings of its series, per second of the
    finished requests' mean inference time (first scheduled to last token). With every
    request of a run released into the engine at once, of one length, the mean is the
    run's time in the engine."""
    tokens = after[GENERATED] - before[GENERATED]
    count = after[INFERENCE_COUNT] - before[INFERENCE_COUNT]
    seconds = after[INFERENCE_SUM] - before[INFERENCE_SUM]
    if tokens <= 0 or count <= 0 or seconds <= 0:
        return None
    return tokens / (seconds / count)


def largest_gap(token_times: Sequence[Sequence[float]]) -> float | None:
    """The largest time between two successive tokens of any one stream."""
    span = largest_gap_span(token_times)
    return None if span is None else span[1] - span[0]


def largest_gap_span(token_times: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """When the largest gap of ``largest_gap`` began and ended."""
    spans = [(a, b) for times in token_times for a, b in zip(times, times[1:])]
    return max(spans, key=lambda span: span[1] - span[0]) if spans else None


def mismatched(reference: Sequence[tuple[list[int], list[float]]],
               run: Sequence[tuple[list[int], list[float]]]) -> list[int]:
    """The streams (indices) whose token ids or logprobs differ from the reference's."""
    if len(reference) != len(run):
        raise ValueError(f"{len(run)} streams for {len(reference)} in the reference")
    return [i for i, (ref, got) in enumerate(zip(reference, run)) if tuple(ref) != tuple(got)]


def resumed_after(log_text: str, tag: str) -> dict[int, int]:
    """Stream index -> the tokens it had delivered when the server resumed it on the new
    engine, from the server's log lines for the requests ``<tag>-<index>``."""
    found: dict[int, int] = {}
    index = re.compile(re.escape(tag) + r"-(\d+)(?!\d)")
    for request, tokens in RESUMED_LOG.findall(log_text):
        match = index.search(request)
        if match:
            found[int(match.group(1))] = int(tokens)
    return found


def resume_delays(kill_at: float, token_times: Sequence[Sequence[float]],
                  resumed: dict[int, int]) -> list[float | None]:
    """For each resumed stream, from the kill to its first token of the new engine (its
    token number ``resumed[i]``; ``None`` where that never came). Tokens that arrive after
    the kill but were made before it do not count."""
    delays: list[float | None] = []
    for i, delivered in sorted(resumed.items()):
        times = token_times[i]
        delays.append(times[delivered] - kill_at if delivered < len(times) else None)
    return delays


def resume_gaps(kill_at: float, token_times: Sequence[Sequence[float]],
                resumed: dict[int, int]) -> tuple[float | None, float | None]:
    """What the clients saw of a kill, over the streams the server resumed after at least one
    token: the largest gap between a stream's last token of the dead engine and its first of
    the new one, as read; and the latest a client read its last token of the dead engine,
    from the kill (above 0: the client was that far behind the server when the engine
    died, and read the backlog it had while the new engine started)."""
    gaps, late = [], []
    for i, delivered in resumed.items():
        times = token_times[i]
        if 0 < delivered < len(times):
            gaps.append(times[delivered] - times[delivered - 1])
            late.append(times[delivered - 1] - kill_at)
    return (max(gaps) if gaps else None), (max(late) if late else None)


def server_resume_delays(kill_at: float, events: Sequence[RequestResumed], tag: str
                         ) -> dict[int, float]:
    """Stream index -> from the kill (``time.time()``) until the server sent its first output
    from the new engine, from the ``RequestResumed`` events of the requests ``<tag>-<index>``
    written after the kill."""
    index = re.compile(re.escape(tag) + r"-(\d+)(?!\d)")
    found: dict[int, float] = {}
    for event in events:
        match = index.search(event.request_id)
        if match and event.time >= kill_at:
            found.setdefault(int(match.group(1)), event.time - kill_at)
    return found


def engine_starts(begun: float | None, ups: Sequence[float]) -> list[float]:
    """Engine start times from the log: the first engine from ``begun`` (the server's line
    before it) to the first "up" line; each later engine, started once the one before was up
    (a standby), from that "up" line to its own."""
    if begun is None or not ups:
        return []
    marks = [begun, *ups]
    return [b - a for a, b in zip(marks, marks[1:])]


def stalled_within(stalls: Sequence[tuple[float, float]], begin: float, end: float
                   ) -> tuple[float, float]:
    """Of the intervals ``stalls`` (``(from, to)``, one clock), those within ``begin..end``:
    (their total seconds there, the longest one's seconds there)."""
    parts = [min(to, end) - max(at, begin) for at, to in stalls]
    parts = [p for p in parts if p > 0]
    return sum(parts), max(parts, default=0.0)


def cpu_percent(cpu_before: float, cpu_after: float, wall_s: float) -> float:
    """CPU seconds used over ``wall_s`` as per cent of one core."""
    return 100.0 * (cpu_after - cpu_before) / wall_s


def spread(values: Sequence[float]) -> float:
    """``max - min`` relative to the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


# --- servers ----------------------------------------------------------------------------------

class LogWatch:
    """When each of ``lines`` appeared in a growing log file (``time.time()``, every
    appearance, polled every 0.1 s by a thread of its own until ``stop()``)."""

    def __init__(self, path: Path, lines: Sequence[str]) -> None:
        self.path = path
        self.seen: dict[str, list[float]] = {line: [] for line in lines}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="bench-log")
        self._thread.start()

    def _poll(self) -> None:
        offset, rest = 0, b""
        while True:
            stopping = self._stop.is_set()
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                data = b""
            if data:
                offset += len(data)
                *complete, rest = (rest + data).split(b"\n")
                now = time.time()
                for raw in complete:
                    text = raw.decode(errors="replace")
                    for line, times in self.seen.items():
                        if line in text:
                            times.append(now)
            if stopping:
                return
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class Stalls:
    """When this process (the clients) was not run: a thread of its own sleeps ``TICK_S`` at
    a time and notes each wake-up more than ``STALL_S`` late, as a ``time.monotonic()``
    interval, until ``stop()``.

    On this machine (two virtual cores), while the engine's workers run flat out, the
    processes beside the server (these clients, and as well ``top`` or ``py-spy`` started
    next to them) were measured not running for 6-9 s at a time, while the server sent
    every stream's tokens on time (its log, every 100 tokens of a stream; the clients'
    sockets held 100-145 KB unread): a gap the clients read is theirs, not the server's,
    where it falls within such a stall."""

    TICK_S = 0.01
    STALL_S = 0.1

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="bench-stalls")
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(self.TICK_S)
            after = time.monotonic()
            if after - before - self.TICK_S > self.STALL_S:
                self.intervals.append((before + self.TICK_S, after))

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(5.0)
        return list(self.intervals)


class BenchServer(ScenarioServer):
    """A ``ScenarioServer`` of the scenario's engine settings with ``fault_tolerance`` as
    given (the ranks' event log in the server's folder) in place of the scenario's."""

    def __init__(self, scenario: Scenario, model_dir: str, work: Path,
                 fault_tolerance: dict[str, Any]) -> None:
        from ftkit import plan_serve

        work.mkdir(parents=True)
        super().__init__(scenario, model_dir, work)
        options = server_options(scenario, self.port, str(self.event_log_dir))
        at = options.index("--additional-config") + 1
        settings = {**fault_tolerance}
        if settings.get("enabled"):
            settings["event_log_dir"] = str(self.event_log_dir)
        options[at] = json.dumps({CONFIG_KEY: settings})
        options.append("--no-async-scheduling")  # as recovery needs it, on both sides
        environ = {**os.environ, INJECT_SECRET_ENV: self.secret, "PYTHONUNBUFFERED": "1",
                   "TMPDIR": str(work / "tmp")}
        # vLLM's development routes /pause and /resume, and each request received logged
        # (``drive_paused``).
        options.append("--enable-log-requests")
        environ["VLLM_SERVER_DEV_MODE"] = "1"
        self.launch = plan_serve(model_dir, options, environ, python=sys.executable)
        self.start_s: float | None = None
        self.watch: LogWatch | None = None

    def start(self, deadline: float) -> None:
        began = time.monotonic()
        self.log.touch()
        self.watch = LogWatch(self.log, WATCHED_LOGS)
        super().start(deadline)
        self.start_s = time.monotonic() - began

    def close(self) -> None:
        super().close()
        if self.watch is not None:
            self.watch.stop()

    def engine_starts(self) -> list[float]:
        """Each engine's start seen in the log: the first from the line the server logs
        before it starts its engine to the engine core's "up" line, each later one (the
        standby, a replacement) from the one before's "up" line (or a restart's begin)."""
        assert self.watch is not None
        begun = self.watch.seen[RESTART_LOG][:1]
        ups = self.watch.seen[ENGINE_UP_LOG]
        return engine_starts(begun[0] if begun else None, ups)

    def text(self) -> str:
        return self.output_tail(chars=10**8)

    def wait_for(self, line: str, deadline: float) -> None:
        """Wait until the server's log has ``line``; ``RuntimeError`` past ``deadline``."""
        while line not in self.text():
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"the server ended before logging {line!r}:\n"
                                   f"{self.output_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not log {line!r} in time")
            time.sleep(0.1)

    def post(self, path: str) -> None:
        """``POST path`` (vLLM's development routes); ``RuntimeError`` unless it answers 200."""
        request = urllib.request.Request(self.url + path, method="POST")
        with urllib.request.urlopen(request, timeout=60) as answer:
            if answer.status != 200:
                raise RuntimeError(f"POST {path}: {answer.status}")

    def engine_series(self) -> dict[str, float]:
        """``ENGINE_SERIES`` from the server's ``/metrics`` now."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as answer:
            return metric_totals(answer.read().decode())

    def engine_series_after(self, before: dict[str, float], finished: int,
                            deadline: float) -> dict[str, float]:
        """``ENGINE_SERIES`` once ``finished`` more requests than at ``before`` were counted
        (the server records a request's statistics as it finishes it: by then its client
        may have read its last token); ``RuntimeError`` past ``deadline``."""
        while True:
            now = self.engine_series()
            if now[INFERENCE_COUNT] - before[INFERENCE_COUNT] >= finished:
                return now
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server counted {now[INFERENCE_COUNT]} finished "
                                   f"requests, not {before[INFERENCE_COUNT] + finished}")
            time.sleep(0.1)

    def wait_received(self, tag: str, count: int, deadline: float) -> None:
        """Wait until the server logged the requests ``<tag>-0 .. <tag>-<count - 1>``
        received."""
        wanted = {f"{tag}-{i}" for i in range(count)}
        received = re.compile(re.escape(RECEIVED_LOG) + r"\S*?(" + re.escape(tag) + r"-\d+)")
        while not wanted <= set(received.findall(self.text())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not receive every {tag} request in time")
            time.sleep(0.1)

    def engines(self) -> list[list[psutil.Process]]:
        """Each engine's processes (its engine core and everything below it), oldest first."""
        root = psutil.Process(self.process.pid)
        cores = [p for p in root.children(recursive=True) if _named(p, ENGINE_CORE)]
        cores.sort(key=lambda p: p.create_time())
        return [[core, *core.children(recursive=True)] for core in cores]

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server's processes (it and everything below it) stopped (``SIGSTOP``) for the
        block, and continued after it, however it ends: an idle server beside the one
        measured takes no core time from it (measured, an idle engine of two ranks took 2-3 %
        of a core, as much as the on/off difference sought)."""
        root = psutil.Process(self.process.pid)
        processes = [root, *root.children(recursive=True)]
        stopped = []
        try:
            for proc in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.suspend()
                    stopped.append(proc)
            yield
        finally:
            for proc in stopped:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.resume()

    def resumed_events(self) -> list[RequestResumed]:
        return only(read_events(self.event_log_dir), RequestResumed)


def _named(proc: psutil.Process, name: str) -> bool:
    try:
        return name in proc.name() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def serving(work: Path, label: str, fault_tolerance: dict[str, Any],
            scenario: Scenario, model_dir: str) -> Iterator[BenchServer]:
    server = BenchServer(scenario, model_dir, work / label, fault_tolerance)
    try:
        print(f"serve: starting the {label} server", flush=True)
        server.start(time.monotonic() + START_TIMEOUT_S)
        print(f"serve: {label} server up after {server.start_s:.1f} s", flush=True)
        yield server
    finally:
        server.close()


# --- the clients ------------------------------------------------------------------------------

def first(stream: Stream) -> StreamedCompletion:
    """A bench stream's one completion (``n`` 1)."""
    return stream.completions[0]


@dataclass
class Driven:
    streams: list[Stream]
    timed_out: bool
    #: When the streams were released, on the wall clock (``time.time()``: the server's
    #: events carry it), and on ``time.monotonic()`` (the clients' token times count from it).
    released_wall: float = 0.0
    released: float = 0.0
    #: When the clients' process was not run during the run (``Stalls``, monotonic).
    stalls: list[tuple[float, float]] = field(default_factory=list)

    def stalled(self, begin: float, end: float) -> tuple[float, float]:
        """``stalled_within`` the clients' own times ``begin..end`` (from the release)."""
        return stalled_within(self.stalls, self.released + begin, self.released + end)

    def times(self) -> list[list[float]]:
        return [first(s).token_times for s in self.streams]

    def outputs(self) -> list[tuple[list[int], list[float]]]:
        return [(first(s).token_ids, first(s).logprobs) for s in self.streams]

    def errors(self) -> list[str]:
        return [s.error for s in self.streams if s.error is not None]


def drive(server: BenchServer, model: str, tag: str, texts: list[str], max_tokens: int,
          during: Callable[[], None] | None = None) -> Driven:
    """Every prompt of ``texts`` streamed at once as ``<tag>-<i>`` (greedy, ``max_tokens``
    tokens each, ``ignore_eos``); ``during()`` runs once every stream's request was
    sent (or one stream ended). Bounded by ``RUN_TIMEOUT_S``."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    stalls = Stalls()
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    streams = [Stream(i) for i in range(len(texts))]
    start = threading.Event()
    t0 = [time.monotonic()]
    threads = [threading.Thread(target=stream_one, daemon=True, name=f"bench-{tag}-{i}",
                                args=(server.base_url, model, "completions", f"{tag}-{i}",
                                      text, sampling, streams[i], start, t0, deadline))
               for i, text in enumerate(texts)]
    for thread in threads:
        thread.start()
    t0[0] = time.monotonic()
    released_wall = time.time()
    start.set()
    if during is not None:
        while time.monotonic() < deadline:
            if any(not t.is_alive() for t in threads) or all(
                    s.sent_at is not None for s in streams):
                break
            time.sleep(0.005)
        during()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return Driven(streams, any(t.is_alive() for t in threads), released_wall, t0[0],
                  stalls.stop())


def drive_paused(server: BenchServer, model: str, tag: str, texts: list[str], max_tokens: int,
                 before_resume: Callable[[], None] | None = None) -> Driven:
    """``drive`` with the engine paused (vLLM's development route ``POST /pause?mode=keep``,
    every bench server has it) until the server logged every stream's request received, so
    that every stream goes into the engine at once, whenever its starved client sent it;
    ``before_resume()`` runs then, just before ``POST /resume``."""

    def release() -> None:
        server.wait_received(tag, len(texts), time.monotonic() + RUN_TIMEOUT_S)
        time.sleep(0.5)  # (each handed to the paused engine)
        if before_resume is not None:
            before_resume()
        server.post("/resume")

    server.post("/pause?mode=keep")
    try:
        return drive(server, model, tag, texts, max_tokens, during=release)
    finally:
        server.post("/resume")  # (no-op when resumed)


# --- 1. tokens per second, recovery on and off ------------------------------------------------

def measure_throughput(servers: dict[str, tuple[BenchServer, str]], repeats: int,
                       streams: int, max_tokens: int, first_repeat: int = 0) -> dict[str, Any]:
    """Each of ``repeats``, ``streams`` streams of ``max_tokens`` tokens on each server in
    turn, released into its paused engine at once (``drive_paused``): tokens per second in
    the engine (``engine_tokens_per_s``, from vLLM's own series: the target is checked on
    these) and as the clients read them (from the release to the last token read).
    ``first_repeat``: the first repeat's number (its tag, and which server goes first)."""
    texts = prompts(streams)
    per_side: dict[str, list[float]] = {name: [] for name in servers}
    in_engine: dict[str, list[float]] = {name: [] for name in servers}
    failures: dict[str, int] = {name: 0 for name in servers}
    stalled: dict[str, list[float]] = {name: [] for name in servers}
    names = list(servers)
    for name, (server, model) in servers.items():  # warm each server up once
        drive(server, model, f"warm-{name}", texts[:2], 8)
    for r in range(first_repeat, first_repeat + repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            server, model = servers[name]
            settle()
            with contextlib.ExitStack() as others:
                for other in names:
                    if other != name:
                        others.enter_context(servers[other][0].frozen())
                before = server.engine_series()
                run = drive_paused(server, model, f"tps-{name}-{r}", texts, max_tokens)
                after = server.engine_series_after(before, len(texts),
                                                   time.monotonic() + RUN_TIMEOUT_S)
            failures[name] += len(run.errors()) + int(run.timed_out)
            rate = tokens_per_s(run.times())
            engine_rate = engine_tokens_per_s(before, after)
            per_side[name].append(rate or 0.0)
            in_engine[name].append(engine_rate or 0.0)
            stalled[name].append(run.stalled(0.0, float("inf"))[0])
            print(f"serve: {name} repeat {r}: {engine_rate or 0:.0f} tokens/s in the engine, "
                  f"{rate or 0:.0f} read by the clients (their process not run for "
                  f"{stalled[name][-1]:.2f} s)", flush=True)
    return with_ratios({"engine_tokens_per_s": in_engine, "tokens_per_s": per_side,
                        "failed_streams": failures,
                        # Per repeat, the seconds the clients' process was not run (``Stalls``).
                        "clients_stalled_s": stalled})


def with_ratios(measured: dict[str, Any]) -> dict[str, Any]:
    """``measured`` (its per-repeat rates, in the engine and at the clients) with the on/off
    ratio of each repeat and their spreads, in the engine and at the clients."""
    engine_ratios = paired_ratios(measured["engine_tokens_per_s"]["on"],
                                  measured["engine_tokens_per_s"]["off"])
    ratios = paired_ratios(measured["tokens_per_s"]["on"], measured["tokens_per_s"]["off"])
    return {**measured, "engine_ratios": engine_ratios,
            "engine_ratio_spread": spread(engine_ratios), "ratios": ratios,
            "ratio_spread": spread(ratios)}


# --- 2. faults through the live route ---------------------------------------------------------

def measure_faults(server: BenchServer, model: str, plan: Plan) -> dict[str, Any]:
    texts = prompts(plan.fault_streams, seed=11)
    reference = drive(server, model, "ref", texts, plan.fault_tokens)
    check = drive(server, model, "ref2", texts, plan.fault_tokens)
    rows = []
    for case in (f for f in FAULTS if f.name in plan.faults):
        settle()
        tag = "f-" + re.sub(r"\W+", "-", case.name)
        before = len(FIRED_LOG.findall(server.text()))
        answer = inject_live_fault(server.url, case.body(f"{tag}-{FAULT_REQUEST}", FAULT_TOKEN),
                                   server.secret)
        run = drive(server, model, tag, texts, plan.fault_tokens)
        time.sleep(0.2)  # the log line of the last firing
        fired = FIRED_LOG.findall(server.text())[before:]
        rows.append({"case": case.name, "kind": case.kind, "rank": case.rank,
                     "planned": case.times, "fired": len(fired),
                     "planned_index": answer.get("planned", {}).get("index"),
                     "largest_gap_s": largest_gap(run.times()),
                     "largest_gap_stalled_s": gap_stalled(run),
                     "failed_streams": len(run.errors()), "timed_out": run.timed_out,
                     "errors": run.errors()[:3],
                     "mismatched": mismatched(reference.outputs(), run.outputs())})
        print(f"serve: {case.name}: largest gap {rows[-1]['largest_gap_s']}, "
              f"{len(rows[-1]['mismatched'])} streams differ", flush=True)
    return {"streams": len(texts), "max_tokens": plan.fault_tokens,
            "token": FAULT_TOKEN, "request": FAULT_REQUEST,
            "reference_gap_s": largest_gap(reference.times()),
            "reference_gap_stalled_s": gap_stalled(reference),
            "reference_errors": len(reference.errors()),
            "reference_repeat_mismatched": mismatched(reference.outputs(), check.outputs()),
            "rows": rows}


def gap_stalled(run: Driven) -> float | None:
    """Seconds of the run's largest gap (``largest_gap_span``) in which the clients' process
    itself was not run (``Stalls``)."""
    span = largest_gap_span(run.times())
    return None if span is None else run.stalled(*span)[0]


# --- 3. SIGKILL of a worker -------------------------------------------------------------------

def measure_kill(server: BenchServer, model: str, plan: Plan, standby: bool) -> dict[str, Any]:
    texts = prompts(plan.kill_streams, seed=13)
    reference = drive(server, model, "kill-ref", texts, plan.kill_tokens)
    settle()
    assert server.watch is not None
    ups_before = len(server.watch.seen[ENGINE_UP_LOG])
    cold_before = len(server.watch.seen[COLD_START_LOG])

    def kill() -> None:
        # Planned on the server's own progress once the paused engine has every request:
        # the serving engine's Worker_TP1 kills itself (SIGKILL) KILL_AFTER_STEPS steps
        # after it resumed.
        inject_live_fault(server.url, {
            "kind": "process_kill", "rank": KILL_RANK, "phase": "forward", "times": 1,
            "params": {}, "after_steps": KILL_AFTER_STEPS}, server.secret)

    run = drive_paused(server, model, "kill-run", texts, plan.kill_tokens, before_resume=kill)
    time.sleep(0.2)  # the server's last lines
    text = server.text()
    fired = [e for e in only(read_events(server.event_log_dir), FaultFired)
             if e.kind == "process_kill" and e.time >= run.released_wall]
    killed_at = fired[0].time if fired else None
    # On the clients' clock: seconds after the streams' release.
    kill_at = None if killed_at is None else killed_at - run.released_wall
    by_server = resumed_after(text, "kill-run")
    on_server = ({} if killed_at is None else
                 server_resume_delays(killed_at, server.resumed_events(), "kill-run"))
    running = [] if kill_at is None else [
        i for i, s in enumerate(run.streams)
        if sum(1 for t in first(s).token_times if t <= kill_at) < plan.kill_tokens]
    times = run.times()
    delays = [] if kill_at is None else resume_delays(kill_at, times, by_server)
    resumed = [d for d in delays if d is not None]
    gap, behind = (None, None) if kill_at is None else resume_gaps(kill_at, times, by_server)
    # The clients' process not run between the kill and their last resumed stream's read.
    stalled = (None if kill_at is None or not resumed else
               run.stalled(kill_at, kill_at + max(resumed)))
    complete = [i for i, s in enumerate(run.streams) if s.error is None
                and len(first(s).token_ids) == plan.kill_tokens]
    ran, expected = run.outputs(), reference.outputs()
    differ = [i for i in complete if ran[i] != expected[i]]
    found = NEW_ENGINE_LOG.findall(text)
    ups = server.watch.seen[ENGINE_UP_LOG][ups_before:]
    cold_starts = server.watch.seen[COLD_START_LOG][cold_before:]
    print(f"serve: {'standby' if standby else 'cold'} kill: "
          f"{'fired' if fired else 'NOT fired'}, {len(resumed)}/{len(delays)} "
          f"resumed, slowest {max(resumed) if resumed else None} at the clients, "
          f"{max(on_server.values()) if on_server else None} on the server, "
          f"{len(run.errors())} failed", flush=True)
    return {"mode": "standby" if standby else "cold", "streams": len(texts),
            "max_tokens": plan.kill_tokens, "killed_pid": fired[0].pid if fired else None,
            "kill_after_steps": KILL_AFTER_STEPS, "kill_at_s": kill_at,
            "running_at_kill": len(running),
            "resumed": len(resumed),
            # Every stream the server resumed delivered the new engine's first token.
            "all_resumed_s": (max(resumed) if resumed and len(resumed) == len(delays)
                              else None),
            "resumed_by_server": len(delays),
            "slowest_resumed_s": max(resumed) if resumed else None,
            # The largest gap a client read across the resume, and how far behind the
            # server the clients were at the kill (``resume_gaps``).
            "client_resume_gap_s": gap, "clients_behind_s": behind,
            # Of that time, how long the clients' own process was not run (``Stalls``): in
            # all, and its longest stall.
            "clients_stalled_s": None if stalled is None else stalled[0],
            "clients_longest_stall_s": None if stalled is None else stalled[1],
            # The same on the server: every resumed stream's first output from the new
            # engine sent (the target's measure).
            "server_resumed": len(on_server),
            "server_all_resumed_s": (max(on_server.values()) if on_server
                                     and sorted(on_server) == sorted(by_server) else None),
            "server_resumed_s": {str(i): d for i, d in sorted(on_server.items())},
            "failed_streams": len(run.errors()) + int(run.timed_out),
            "errors": run.errors()[:3], "complete": len(complete), "differ": differ,
            "reference_errors": len(reference.errors()),
            "server_restart_s": float(found[-1]) if found else None,
            # A cold replacement's engine core up (in the log), after the kill.
            "new_engine_up_s": (ups[0] - killed_at if ups and killed_at is not None
                                and not standby else None),
            # The cold replacement's own engine start: from the line the server logs as it
            # starts it (the dead engine ended) to its engine core's "up" line.
            "replacement_start_s": (ups[0] - cold_starts[0] if ups and cold_starts
                                    and not standby else None)}


# --- 4. the standby's idle cost ---------------------------------------------------------------

def measure_idle(server: BenchServer, idle_s: float) -> dict[str, Any]:
    """RSS, USS and CPU of each engine's processes over ``idle_s`` seconds without requests."""
    time.sleep(SETTLE_S)
    engines = server.engines()
    labels = ["serving", "standby"] if len(engines) == 2 else [f"engine {i}" for i in
                                                               range(len(engines))]

    def cpu(procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    before = [cpu(procs) for procs in engines]
    began = time.monotonic()
    time.sleep(idle_s)
    wall = time.monotonic() - began
    after = [cpu(procs) for procs in engines]
    rows = []
    for label, procs, b, a in zip(labels, engines, before, after):
        rss = uss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                info = p.memory_full_info()
                rss += info.rss
                uss += info.uss
        rows.append({"engine": label, "processes": len(procs), "rss_bytes": rss,
                     "uss_bytes": uss, "cpu_percent": cpu_percent(b, a, wall)})
    return {"idle_s": wall, "engines": rows}


# --- the suite --------------------------------------------------------------------------------

def _scenario() -> Scenario:
    scenario = load_scenario(SCENARIO)
    return scenario.model_copy(update={"engine": scenario.engine.model_copy(
        update={"max_model_len": MAX_MODEL_LEN})})


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the servers are closed on the way out


def run(quick: bool = False, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    plan = QUICK if quick else Plan()
    signal.signal(signal.SIGTERM, _on_sigterm)
    scenario = _scenario()
    model_dir = tiny_model()
    off, on = SIDES["off"], SIDES["on"]
    faults = {"enabled": True, "injection": True, "max_restarts": 1}
    standby = {"enabled": True, "injection": True, "max_restarts": 1, "standby": True}
    result: dict[str, Any] = {"plan": asdict(plan), "tp": scenario.engine.tensor_parallel_size,
                              "parts": list(parts),
                              "settings": {"off": off, "on": on, "faults": faults,
                                           "standby": standby}}
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-serve-") as tmp:
        work = Path(tmp)
        starts: dict[str, float | None] = {}
        engines: dict[str, list[float]] = {}
        if "throughput" in parts:
            result["throughput"] = on_and_off(work, "", scenario, model_dir, starts, plan.repeats,
                                              plan.streams, plan.max_tokens)
        if "wide" in parts:
            result["wide_throughput"] = on_and_off(
                work, "wide-", scenario, str(build_wide_model()), starts, plan.wide_repeats,
                plan.wide_streams, plan.wide_max_tokens)
        if "faults" in parts:
            with serving(work, "faults", faults, scenario, model_dir) as f_server:
                starts["faults"] = f_server.start_s
                engines["faults"] = f_server.engine_starts()[:1]
                model = f_server.model()
                result["faults"] = measure_faults(f_server, model, plan)
                settle()
                result["kills"] = [measure_kill(f_server, model, plan, standby=False)]
            with serving(work, "standby", standby, scenario, model_dir) as sb_server:
                starts["standby"] = sb_server.start_s
                sb_server.wait_for(STANDBY_READY_LOG, time.monotonic() + START_TIMEOUT_S)
                # The serving engine's start, then the standby's (begun once the first was up).
                engines["standby"] = sb_server.engine_starts()[:2]
                result["idle"] = measure_idle(sb_server, plan.idle_s)
                result["kills"].append(measure_kill(sb_server, sb_server.model(), plan,
                                                    standby=True))
        result["server_start_s"] = starts
        result["engine_starts_s"] = engines
    result["engine_start_s"] = engine_start_s(engines)
    return result


def on_and_off(work: Path, prefix: str, scenario: Scenario, model_dir: str,
               starts: dict[str, float | None], repeats: int, streams: int, max_tokens: int
               ) -> dict[str, Any]:
    """``measure_throughput`` on an ``on`` and an ``off`` server of ``model_dir``, both up at
    once, in two halves of the repeats (``halves``): for the second half both servers are
    started anew, in the other order, so that whatever the order of their starts does to
    their rates falls on each side alike. Their start times go into ``starts`` (``prefix``
    before each name, the half's number after it)."""
    parts = []
    done = 0
    for number, (order, count) in enumerate(halves(repeats), 1):
        with contextlib.ExitStack() as stack:
            servers = {}
            for name in order:
                label = f"{prefix}{name}-{number}"
                server = stack.enter_context(serving(work, label, SIDES[name], scenario,
                                                     model_dir))
                starts[label] = server.start_s
                servers[name] = (server, server.model())
            measured = measure_throughput({name: servers[name] for name in SIDES}, count,
                                          streams, max_tokens, first_repeat=done)
        measured["started"] = list(order)
        parts.append(measured)
        done += count
    return merged_halves(parts)


#: The two sides of an on/off measurement, by name: their ``fault_tolerance`` settings.
SIDES: dict[str, dict[str, Any]] = {"on": {"enabled": True}, "off": {"enabled": False}}


def halves(repeats: int) -> list[tuple[tuple[str, str], int]]:
    """The order in which the on/off servers start, and the repeats measured on them: the
    first half (the larger, for an odd count) with ``on`` started first, then the rest with
    ``off`` first."""
    first = (repeats + 1) // 2
    planned = [(("on", "off"), first), (("off", "on"), repeats - first)]
    return [(order, count) for order, count in planned if count]


def order_balanced(halves_: Sequence[dict[str, Any]]) -> float | None:
    """The on/off engine ratio with the order of the servers' starts cancelled: the geometric
    mean of the medians of the two halves' engine ratios (one half with each server started
    first: measured, in three runs on the wide model, the server started second ran 1.5-4 %
    faster than the one started first, whichever it was); ``None`` without both halves."""
    if len(halves_) != 2 or not all(h["engine_ratios"] for h in halves_):
        return None
    first, second = (statistics.median(h["engine_ratios"]) for h in halves_)
    return math.sqrt(first * second)


#: A throughput measurement's lists, one entry per repeat (``with_ratios`` derives the rest).
_PER_REPEAT = ("engine_tokens_per_s", "tokens_per_s", "clients_stalled_s")


def merged_halves(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One throughput result of the halves' ``measure_throughput`` results, in order: their
    repeats one after another, failures added, ratios and spreads over all (``with_ratios``);
    ``halves`` says each half's start order and its engine ratios."""
    merged: dict[str, Any] = {key: {"on": [], "off": []} for key in _PER_REPEAT}
    merged["failed_streams"] = {"on": 0, "off": 0}
    for part in parts:
        for key in _PER_REPEAT:
            for side in ("on", "off"):
                merged[key][side] += part[key][side]
        for side in ("on", "off"):
            merged["failed_streams"][side] += part["failed_streams"][side]
    merged["halves"] = [{"started": part["started"], "engine_ratios": part["engine_ratios"]}
                        for part in parts]
    return with_ratios(merged)


def engine_start_s(engines: dict[str, list[float]]) -> float | None:
    """The engine start the cold replacement is measured against: the ``faults`` server's
    own engine's, at its launch (the server that is then killed)."""
    first = engines.get("faults") or []
    return first[0] if first else None


# --- the tables -------------------------------------------------------------------------------

#: Each on/off measurement of a result: its key, the model, and the plan's fields of it.
THROUGHPUTS = (("throughput", "tiny", "streams", "max_tokens", "repeats"),
               ("wide_throughput", "wide", "wide_streams", "wide_max_tokens", "wide_repeats"))


def throughput_table(result: dict[str, Any]) -> str:
    plan = result["plan"]
    rows = []
    for key, model, streams, tokens, repeats in THROUGHPUTS:
        t = result.get(key)
        if not t:
            continue
        for where, rates, ratios in (("engine", "engine_tokens_per_s", "engine_ratios"),
                                     ("clients", "tokens_per_s", "ratios")):
            if rates not in t:  # (results from before the engine's series were read)
                continue
            rows.append([model, where, f"{plan[streams]} x {plan[tokens]}", plan[repeats],
                         fmt_summary(summarize(t[rates]["off"])),
                         fmt_summary(summarize(t[rates]["on"])),
                         fmt_summary(summarize(t[ratios]), 3),
                         f"{t['failed_streams']['off']}/{t['failed_streams']['on']}"])
    return markdown_table(["model", "tokens/s measured in", "streams x tokens", "repeats",
                           "off tokens/s", "on tokens/s", "on/off",
                           "failed streams (off/on)"], rows)


def fault_table(result: dict[str, Any]) -> str:
    f = result["faults"]
    rows = [["none (fault-free)", "-", "-", _ms(f["reference_gap_s"]),
             _ms(f.get("reference_gap_stalled_s")), "-",
             f["reference_errors"], "yes" if not f["reference_repeat_mismatched"] else
             f"NO ({len(f['reference_repeat_mismatched'])} of {f['streams']} differ)"]]
    for r in f["rows"]:
        same = ("yes" if not r["mismatched"] and not r["failed_streams"] else
                f"NO ({len(r['mismatched'])} of {f['streams']} differ)")
        rows.append([r["case"], r["rank"], f"{r['fired']}/{r['planned']}",
                     _ms(r["largest_gap_s"]), _ms(r.get("largest_gap_stalled_s")),
                     _ratio(r["largest_gap_s"], f["reference_gap_s"]),
                     r["failed_streams"], same])
    return markdown_table(["fault", "rank", "fired", "largest gap ms",
                           "of it, the clients' process not run ms", "x fault-free",
                           "failed streams", "every stream identical"], rows)


def kill_table(result: dict[str, Any]) -> str:
    rows = []
    start = result.get("engine_start_s")
    for k in result["kills"]:
        rows.append([k["mode"], k["running_at_kill"],
                     f"{k['resumed']}/{k.get('resumed_by_server', k['resumed'])}",
                     _s(k.get("server_all_resumed_s")),
                     _s(k["slowest_resumed_s"]), _s(k.get("client_resume_gap_s")),
                     _s(k.get("clients_behind_s")), _s(k.get("clients_stalled_s")),
                     _s(k.get("new_engine_up_s")),
                     _s(k.get("replacement_start_s")),
                     _s(k["server_restart_s"]),
                     k["failed_streams"],
                     f"{k['complete'] - len(k['differ'])}/{k['streams']}"])
    engines = result.get("engine_starts_s", {})
    return (f"Engine start (server log, from the line the server logs before it starts its "
            f"engine to the engine core's `init engine ... took`): {_s(start)} s on the "
            f"`faults` server, the cold target's base; on the standby server "
            + " and ".join(f"{_s(v)} s" for v in engines.get("standby", [])) + " (serving "
            f"engine, then the standby, started once the first was up). Server starts (launch "
            f"to `/health`): " + ", ".join(f"{name} {_s(v)} s" for name, v in
                                          result["server_start_s"].items()) + ".\n\n"
            + markdown_table(["replacement", "running at the kill (client)",
                              "resumed streams with a new token / resumed by the server",
                              "kill to every resumed stream's next output, server s",
                              "kill to every resumed stream's next token, clients s",
                              "largest gap across the resume, clients s",
                              "clients behind the server at the kill s",
                              "clients' own process not run meanwhile s",
                              "kill to new engine up s", "the new engine's own start s",
                              "server's replacement s", "failed streams",
                              "complete and identical"], rows))


def idle_table(result: dict[str, Any]) -> str:
    idle = result["idle"]
    return markdown_table(
        ["engine (idle)", "processes", "RSS MiB", "USS MiB", "CPU % of a core"],
        [[e["engine"], e["processes"], f"{e['rss_bytes'] / 2**20:.0f}",
          f"{e['uss_bytes'] / 2**20:.0f}", f"{e['cpu_percent']:.1f}"]
         for e in idle["engines"]])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.1f}"


def main(argv: list[str]) -> int:
    """``python -m benchmarks.serve [--part PART ...] [--quick] [--out F]``
    (``benchmarks.suite.main_with_parts``)."""
    from benchmarks.suite import main_with_parts

    return main_with_parts("serve", run, PARTS, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
