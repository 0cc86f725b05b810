"""A scenario against a server (``engine.mode: serve``): vLLM's OpenAI server with ftkit's
plugin, driven by streaming ``openai`` clients, judged by the same oracle as an offline run.

``run_serve_scenario`` does, within the scenario's ``expect.timeout_s``:

1. start one server (``ftkit.serve.launch.plan_serve``: the command and environment of
   ``ftkit serve``) with the scenario's engine settings, recovery on, injection on with a fresh
   secret, one engine restart per fault that kills a process, and the ranks' event log in a
   folder of the run;
2. the fault-free run: every request (and ``workload.background_streams`` extra streams) at
   once, each on its own connection with ``X-Request-Id: <run>-ref-<request index>``;
3. plan each scenario fault through the injection route for request ``<run>-run-<index>``
   and its token, before any of those requests is sent;
4. the faulted run, alike, as ``<run>-run-<index>``;
5. the verdict: ``ftkit.verify`` compares each completion of the faulted run (a request with
   ``n > 1`` has several: the stream's choices) with the fault-free run's: token ids, the
   sampled tokens' logprobs, the top-k and prompt logprobs where asked
   (``ftkit.scenario.rules.unstreamable`` says which a stream can carry), finish reasons;
   the faults' records come from the ranks' event log (``ftkit.runner.events``), so a fault
   that never fired is ``not_applied``, as offline; a killed process is recovered by the
   server's replacement of its engine (``EngineReplaced``, ``server_restarts``).

The oracle is the same server's fault-free run, not vLLM's batch-invariant mode: concurrent
streams make each step's batch depend on arrival times, and the scenario passes only where the
model's outputs do not depend on the batch (measured on CPU float32 with the tiny model:
``benchmarks/serve_batch_invariance.py``, docs/serving.md "The oracle under concurrency").

The server and every process below it are killed and reaped however the run ends, and the
shared memory its engine held is removed; the clients never retry (a retry would hide a
failure).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ftkit import procs
from ftkit.bounds import (
    REAP_GRACE_S,
    SERVE_HEALTH_POLL_S,
    SERVE_RUN_TIMEOUT_S,
    SERVE_START_TIMEOUT_S,
    scenario_round_timeout_s,
)
from ftkit.config import CONFIG_KEY
from ftkit.contracts.eventlog import EngineReplaced, Event, only, read_events
from ftkit.contracts.job import EngineRestart
from ftkit.errors import FtkitError
from ftkit.kinds import kind_spec
from ftkit.progress import EventSink, ProgressEvent, ignore_events
from ftkit.results import (ClientView, FaultRecord, PositionLogprobs, RecoveryRecord,
                           RequestOutput, RunOutput, ScenarioResult, StreamView)
from ftkit.runner.events import collect_events, events_of_run
from ftkit.scenario.model import FaultSpec, Scenario
from ftkit.serve.control import SECRET_ENV
from ftkit.verify import compare_completion, verify

log = logging.getLogger("ftkit")

#: The ``X-Request-Id`` of request ``i`` of a run is ``<run tag>-<i>``; a background stream's
#: ``<run tag>-bg<j>``.
BACKGROUND_PREFIX = "bg"
#: The prefix vLLM's OpenAI server gives a token when asked ``return_tokens_as_token_ids``.
TOKEN_ID_PREFIX = "token_id:"


# --- one stream ---------------------------------------------------------------------------

@dataclass
class StreamedCompletion:
    """One completion (one choice, ``index`` in vLLM's chunks) of a stream as the client got
    it, in the shapes of the offline mode's ``RequestOutput``."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Each position's top-k ``[token id, logprob]`` pairs, in vLLM's order.
    top_logprobs: list[PositionLogprobs] = field(default_factory=list)
    #: Each prompt position's pairs (``None`` for the first), once the echo carried them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: When each token arrived, seconds after the run's streams were released.
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    #: The text as the client got it, chunk by chunk (with the echo, the prompt's first).
    text: str = ""
    #: vLLM's ``stop_reason`` (the stop string or token id that ended it), from its chunks.
    stop_reason: int | str | None = None


@dataclass
class Stream:
    """One request's stream as the client got it: its ``samples`` completions (the request's
    ``n``), with the top-k logprobs when ``top_k`` and the prompt logprobs when ``prompt``."""

    request: int
    samples: int = 1
    top_k: bool = False
    prompt: bool = False
    background: bool = False
    completions: list[StreamedCompletion] = field(default_factory=list)
    sent_at: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.completions:
            self.completions = [StreamedCompletion() for _ in range(self.samples)]

    @classmethod
    def of(cls, request: int, sampling: dict[str, Any], *, background: bool = False) -> Stream:
        """The stream of request ``request`` with vLLM's sampling fields ``sampling``: what it
        records is what the offline mode records for them (``ftkit.vllm.workload``)."""
        return cls(request, samples=int(sampling.get("n") or 1),
                   top_k=int(sampling.get("logprobs") or 0) > 0,
                   prompt=sampling.get("prompt_logprobs") is not None, background=background)

    def completion(self, index: int) -> StreamedCompletion:
        """The completion of choice ``index``; ``FtkitError`` for one the request has not."""
        if not 0 <= index < len(self.completions):
            raise FtkitError(f"the server sent choice {index} of a request with n = "
                             f"{len(self.completions)}")
        return self.completions[index]

    def missing(self) -> str | None:
        """What a finished stream lacks of what it asked for: the prompt logprobs of a
        completion that has tokens (the echo did not carry them)."""
        for sample, completion in enumerate(self.completions):
            if self.prompt and completion.token_ids and completion.prompt_logprobs is None:
                return f"the server sent no prompt logprobs for choice {sample}"
        return None

    def outputs(self) -> list[RequestOutput]:
        """One ``RequestOutput`` per completion (``sample`` = its choice index)."""
        return [RequestOutput(index=self.request, sample=sample, token_ids=c.token_ids,
                              token_times=c.token_times, finish_reason=c.finish_reason,
                              logprobs=c.logprobs,
                              top_logprobs=c.top_logprobs if self.top_k else None,
                              prompt_logprobs=c.prompt_logprobs,
                              # (the oracle compares the text of a finished completion)
                              text=c.text if c.finish_reason is not None else None,
                              stop_reason=c.stop_reason)
                for sample, c in enumerate(self.completions)]

    def view(self) -> StreamView:
        """The client's view: time to the first token of any completion, and the longest
        gap between two tokens of one completion (each is a stream its reader waits on)."""
        firsts = [c.token_times[0] for c in self.completions if c.token_times]
        ttft = min(firsts) - self.sent_at if firsts and self.sent_at is not None else None
        gaps = [b - a for c in self.completions
                for a, b in zip(c.token_times, c.token_times[1:])]
        return StreamView(request=self.request,
                          tokens=sum(len(c.token_ids) for c in self.completions),
                          ttft_s=ttft, max_gap_s=max(gaps) if gaps else None,
                          background=self.background, error=self.error)


def token_id(token: str) -> int:
    """The id in a token vLLM returned as ``token_id:<id>``."""
    if not token.startswith(TOKEN_ID_PREFIX):
        raise FtkitError(f"the server returned token {token!r}, not {TOKEN_ID_PREFIX}<id>: "
                         f"does it honour return_tokens_as_token_ids?")
    return int(token[len(TOKEN_ID_PREFIX):])


def request_arguments(api: str, prompt: str, sampling: dict[str, Any]) -> dict[str, Any]:
    """The ``openai`` client's arguments for one streamed request of ``api``: the prompt, and
    the sampling fields (vLLM's names, as ``SamplingSpec.for_request`` gives them) in the body,
    with token ids, the sampled tokens' logprobs and what ``Stream.of(sampling)`` records asked
    for (``ftkit.scenario.rules.unstreamable`` refuses what they cannot ask: a scenario never
    holds such a request)."""
    body = dict(sampling)
    body["return_tokens_as_token_ids"] = True
    if body.get("logit_bias"):
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    # The recorded top k; -1 (the whole vocabulary) records none offline (ftkit.vllm.workload).
    top = max(0, int(body.pop("logprobs", None) or 0))
    if api == "chat":
        # The chat API returns the first k entries of vLLM's position (the sampled token
        # first, then by rank: chat_completion/serving.py _get_top_logprobs), one fewer than
        # vLLM's and the offline mode's when the sampled token is outside the top k; asked
        # for k + 1, it returns every entry the offline mode records (and, when the sampled
        # token is inside the top k, rank k + 1 besides).
        arguments: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                                     "logprobs": True}
        if top:
            arguments["top_logprobs"] = top + 1
        return {**arguments, "stream": True, "extra_body": body}
    arguments = {"prompt": prompt, "logprobs": top}
    asked = body.pop("prompt_logprobs", None)
    if asked is not None:
        # Streamed only by the echo (``rules.unstreamable``); the prompt's token ids in the
        # echo's chunk tell its prompt positions from its first output tokens.
        arguments["echo"] = True
        body["return_token_ids"] = True
        if asked == 0:
            body["prompt_logprobs"] = 0
        else:  # vLLM asks for prompt_logprobs = logprobs
            arguments["logprobs"] = asked
    return {**arguments, "stream": True, "extra_body": body}


def _position(top: Any) -> PositionLogprobs:
    """One position's top logprobs as the client got them (a completions chunk's ``{token:
    logprob}``, in vLLM's order; a chat chunk's ``TopLogprob`` list) as ``[token id,
    logprob]`` pairs."""
    if isinstance(top, dict):
        return [[token_id(token), float(logprob)] for token, logprob in top.items()]
    return [[token_id(entry.token), float(entry.logprob)] for entry in top]


def _read_chunk(api: str, chunk: Any, stream: Stream, now: float) -> None:
    """Take one streamed chunk: each of its choices goes to the completion of its index."""
    for choice in chunk.choices or []:
        completion = stream.completion(choice.index)
        logprobs = choice.logprobs
        if logprobs is not None:
            if api == "chat":
                positions = [(t.token, t.logprob, t.top_logprobs)
                             for t in logprobs.content or []]
            else:
                tokens = logprobs.tokens or []
                positions = list(zip(tokens, logprobs.token_logprobs or [],
                                     logprobs.top_logprobs or [None] * len(tokens)))
                # The echo (asked for with prompt_token_ids): the prompt's positions, then
                # the first output tokens.
                echoed = getattr(choice, "prompt_token_ids", None)
                if echoed is not None:
                    if stream.prompt:
                        completion.prompt_logprobs = [None if top is None else _position(top)
                                                      for _, _, top in positions[:len(echoed)]]
                    positions = positions[len(echoed):]
            for token, logprob, top in positions:
                completion.token_ids.append(token_id(token))
                completion.logprobs.append(float(logprob))
                completion.token_times.append(now)
                if stream.top_k:
                    if top is None:
                        raise FtkitError(f"the server sent no top logprobs for token "
                                         f"{len(completion.token_ids) - 1} of choice "
                                         f"{choice.index}")
                    completion.top_logprobs.append(_position(top))
        completion.finish_reason = choice.finish_reason or completion.finish_reason
        text = (getattr(choice.delta, "content", None) if api == "chat" else choice.text)
        completion.text += text or ""
        stop = getattr(choice, "stop_reason", None)  # vLLM's field, kept by the client
        if stop is not None:
            completion.stop_reason = stop


def stream_one(base_url: str, model: str, api: str, key: str, prompt: str,
               sampling: dict[str, Any], stream: Stream, start: threading.Event,
               t0: list[float], deadline: float) -> None:
    """Send one request with ``X-Request-Id: key`` on a connection of its own, once ``start``
    is set, and read its stream into ``stream``; an error ends it (no retry), and so does a
    stream that lacks what it asked for (``Stream.missing``)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0,
                           timeout=max(1.0, deadline - time.monotonic()))
    arguments = request_arguments(api, prompt, sampling)
    try:
        start.wait(max(0.0, deadline - time.monotonic()))
        stream.sent_at = time.monotonic() - t0[0]
        create = client.chat.completions.create if api == "chat" else client.completions.create
        chunks = create(model=model, extra_headers={"X-Request-Id": key}, **arguments)
        for chunk in chunks:
            _read_chunk(api, chunk, stream, time.monotonic() - t0[0])
        stream.error = stream.missing()
    except Exception as exc:  # noqa: BLE001 - any end of a stream is the client's result
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


@dataclass
class DrivenRun:
    """One run of the workload against the server."""

    output: RunOutput
    streams: list[Stream]


def drive(base_url: str, model: str, scenario: Scenario, tag: str,
          deadline: float) -> DrivenRun:
    """Every request of ``scenario`` and its background streams, released at once, each on
    its own connection as ``<tag>-<i>``; within ``deadline`` (``time.monotonic()``)."""
    workload = scenario.workload
    prompts = scenario.prompts()
    spec = scenario.sampling_spec()
    per_request = [spec.for_request(i) for i in range(len(prompts))]
    jobs: list[tuple[str, str, dict[str, Any], Stream]] = [
        (f"{tag}-{i}", prompt, per_request[i], Stream.of(i, per_request[i]))
        for i, prompt in enumerate(prompts)]
    # Background streams: the workload's prompts and sampling, in turn.
    for j in range(workload.background_streams):
        i = j % len(prompts)
        jobs.append((f"{tag}-{BACKGROUND_PREFIX}{j}", prompts[i], per_request[i],
                     Stream.of(i, per_request[i], background=True)))
    start = threading.Event()
    t0 = [time.monotonic()]
    threads = [threading.Thread(target=stream_one, daemon=True,
                                args=(base_url, model, workload.api, key, prompt, sampling,
                                      stream, start, t0, deadline),
                                name=f"ftkit-stream-{key}")
               for key, prompt, sampling, stream in jobs]
    for thread in threads:
        thread.start()
    started_at = time.time()
    t0[0] = time.monotonic()
    start.set()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(thread.is_alive() for thread in threads)
    streams = [stream for _, _, _, stream in jobs]
    compared = [s for s in streams if not s.background]
    errors = [f"request {s.request}: {s.error}" for s in compared if s.error is not None]
    output = RunOutput(requests=[o for s in compared for o in s.outputs()],
                       error="; ".join(errors) or None, timed_out=timed_out,
                       generate_s=time.monotonic() - t0[0], started_at=started_at)
    return DrivenRun(output, streams)


# --- the server ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cli_option(name: str, value: Any) -> list[str]:
    """An ``LLM`` keyword argument (``engine.args``) as the server's command-line option."""
    option = "--" + name.replace("_", "-")
    if value is True:
        return [option]
    if value is False:
        return ["--no-" + name.replace("_", "-")]
    if value is None:
        return []
    return [option, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def server_options(scenario: Scenario, port: int, event_log_dir: str) -> list[str]:
    """The options of ``ftkit serve MODEL OPTIONS...`` for ``scenario``: its engine settings,
    recovery with injection on (and one engine restart per fault that kills a process), the
    ranks' event log in ``event_log_dir``, loopback ``port``."""
    engine = scenario.engine
    recovery = {"enabled": True, "injection": True,
                "max_reinference": scenario.recovery.max_reinference,
                "round_timeout_s": scenario_round_timeout_s(scenario.expect.timeout_s),
                "event_log_dir": event_log_dir}
    kills = sum(1 for f in scenario.faults if kind_spec(f.kind).ends_process)
    if kills:  # the server replaces its engine once per kill, and resumes every stream
        recovery["max_restarts"] = kills
    options = ["--tensor-parallel-size", str(engine.tensor_parallel_size),
               "--dtype", engine.dtype, "--max-model-len", str(engine.max_model_len),
               "--block-size", str(engine.block_size), "--seed", str(engine.seed),
               "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
               "--additional-config", json.dumps({CONFIG_KEY: recovery})]
    args = {"enforce_eager": True, **engine.args}  # ftkit's default, as offline
    for name, value in args.items():
        options += _cli_option(name, value)
    return options


class ScenarioServer:
    """One server of a serve scenario: started in a session of its own, its output in
    ``log``; ``close()`` kills and reaps its whole tree and removes the shared memory its
    engine held."""

    def __init__(self, scenario: Scenario, model_dir: str, work: Path) -> None:
        from ftkit.serve.launch import plan_serve  # reads the platform only where needed

        self.secret = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.event_log_dir = work / "event-log"
        self.event_log_dir.mkdir()
        self.log = work / "server.log"
        # vLLM leaves its file store and IPC sockets in the temporary folder, which nothing
        # removes when its processes are killed: they go into the run's folder, removed whole.
        tmp = work / "tmp"
        tmp.mkdir()
        environ = {**os.environ, SECRET_ENV: self.secret, "PYTHONUNBUFFERED": "1",
                   "TMPDIR": str(tmp)}
        self.launch = plan_serve(model_dir, server_options(scenario, self.port,
                                                           str(self.event_log_dir)),
                                 environ, python=sys.executable)
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: Any = None
        self._root: psutil.Process | None = None
        self._seen: list[psutil.Process] = []
        self._shm: set[str] = set()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, deadline: float) -> None:
        """Start the server and wait until its ``/health`` answers 200, until ``deadline``
        (``time.monotonic()``); ``FtkitError`` with its output's tail otherwise."""
        with open(self.log, "wb") as out:
            self.process = procs.spawn(self.launch.argv, stdout=out, stderr=out,
                                       env=dict(self.launch.env))
        self._root = psutil.Process(self.process.pid)
        while True:
            if self.process.poll() is not None:
                raise FtkitError(f"the server exited with {self.process.returncode} while "
                                 f"starting:\n{self.output_tail()}")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                raise FtkitError(f"the server did not answer /health in time:\n"
                                 f"{self.output_tail()}")
            time.sleep(SERVE_HEALTH_POLL_S)
        # What the engine's processes hold, to remove should they be killed.
        self._seen = [self._root, *procs.descendants(self._root)]
        self._shm = procs.shared_memory_files(self._seen)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def model(self) -> str:
        """The model name the server serves (its ``/v1/models``)."""
        with urllib.request.urlopen(self.base_url + "/models", timeout=10.0) as answer:
            return str(json.loads(answer.read())["data"][0]["id"])

    def close(self) -> None:
        """Ask the server to stop (SIGTERM), then kill and reap what is left of its tree."""
        if self.process is None or self._root is None:
            return
        # A recovery round builds new shared memory segments: note what the tree holds now.
        alive = [self._root, *procs.descendants(self._root)] if procs.alive(self._root) else []
        self._seen += [p for p in alive if p not in self._seen]
        self._shm |= procs.shared_memory_files(alive)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=REAP_GRACE_S)
            except Exception:  # noqa: BLE001 - killed below
                pass
        procs.kill_tree(self._root, also=self._seen, session=self.process.pid)
        try:
            self.process.wait(timeout=REAP_GRACE_S)
        except Exception:  # noqa: BLE001 - kill_tree waited for it already
            pass
        procs.remove_files(self._shm)
        self.process = None


def plan_faults(server: ScenarioServer, scenario: Scenario, tag: str) -> None:
    """Plan every scenario fault through the server's injection route, in scenario order, for
    request ``<tag>-<at.request>`` and its token; the server must number them as the scenario
    does (its first faults), since the ranks' events name a fault by that number."""
    from ftkit.serve.client import inject_live_fault

    for position, fault in enumerate(scenario.faults):
        body = {"kind": fault.kind.value, "rank": fault.rank, "phase": fault.phase,
                "times": fault.times, "params": dict(fault.params),
                "request_id": f"{tag}-{fault.at.request}", "token": fault.at.token}
        answer = inject_live_fault(server.url, body, server.secret)
        index = answer.get("planned", {}).get("index")
        if index != position:
            raise FtkitError(f"the server planned fault {position} as its fault {index}: it "
                             f"is not a fresh server")


def server_restarts(events: list[Event], origin: float | None) -> list[EngineRestart]:
    """The server's engine replacements (``EngineReplaced``), times from ``origin``."""
    zero = origin or 0.0
    return [EngineRestart(error=e.error, died_at_s=e.time - e.restart_s - zero,
                          restart_s=e.restart_s, resumed_at_s=e.time - zero)
            for e in only(events, EngineReplaced)]


def served_fault_records(events: list[Event], planned: list[FaultSpec], *,
                         origin: float | None, restarts: list[EngineRestart]
                         ) -> tuple[list[FaultRecord], list[RecoveryRecord]]:
    """``collect_events`` for a server's run. The workers know a served request only by the
    id its client sent, not by its place in the scenario (their ``FaultFired`` says request
    0 for every one); the route planned each fault for its request's id alone, so a fault
    that fired, fired for the request the scenario planned it for."""
    records, rounds = collect_events(events, planned, origin=origin, restarts=restarts)
    for record in records:
        if record.fired_at is not None:
            record.fired_at = dataclasses.replace(record.fired_at, request=record.request)
    return records, rounds


# --- the scenario -------------------------------------------------------------------------

def run_serve_scenario(scenario: Scenario, *, file: str, model_dir: str,
                       on_event: EventSink = ignore_events,
                       run_tag: str | None = None) -> ScenarioResult:
    """Run ``scenario`` (``engine.mode: serve``) on a server of its own and return its
    verdict. Never leaves a process behind."""
    if scenario.engine.mode != "serve":
        raise FtkitError(f"{scenario.name} is not a serve scenario (engine.mode is "
                         f"{scenario.engine.mode})")
    started = time.monotonic()
    deadline = started + scenario.expect.timeout_s
    tag = run_tag or f"ftkit-{secrets.token_hex(4)}"
    work = Path(tempfile.mkdtemp(prefix="ftkit-serve-"))
    server: ScenarioServer | None = None
    try:
        server = ScenarioServer(scenario, model_dir, work)
        on_event(ProgressEvent(scenario.name, "engine_start", f"server on {server.url}"))
        server.start(min(deadline, time.monotonic() + SERVE_START_TIMEOUT_S))
        on_event(ProgressEvent(scenario.name, "engine_ready", "server ready"))
        model = server.model()
        on_event(ProgressEvent(scenario.name, "baseline", "fault-free run on the server"))
        baseline = drive(server.base_url, model, scenario, f"{tag}-ref", deadline)
        plan_faults(server, scenario, f"{tag}-run")
        since = time.time()
        on_event(ProgressEvent(scenario.name, "tokens", "faulted run"))
        run = drive(server.base_url, model, scenario, f"{tag}-run", deadline)
        events = events_of_run(read_events(server.event_log_dir), None, since)
        origin = run.output.started_at
        run.output.restarts = server_restarts(events, origin)
        run.output.faults, run.output.recoveries = served_fault_records(
            events, scenario.faults, origin=origin, restarts=run.output.restarts)
    except FtkitError as exc:
        detail = str(exc)
        if server is not None:
            log.debug("ftkit: serve scenario %s: server output:\n%s", scenario.name,
                      server.output_tail())
        failed = RunOutput(requests=[], error=detail)
        result = verify(scenario, failed, failed, file=file,
                        duration_s=time.monotonic() - started)
        on_event(ProgressEvent(scenario.name, "done", f"{result.verdict}: {result.reason}"))
        return result
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    result = verify(scenario, baseline.output, run.output, file=file,
                    duration_s=time.monotonic() - started)
    result.client = ClientView(api=scenario.workload.api,
                               run=[s.view() for s in run.streams],
                               baseline=[s.view() for s in baseline.streams])
    on_event(ProgressEvent(scenario.name, "done", f"{result.verdict}: {result.reason}"))
    return result


# --- the oracle under concurrency ---------------------------------------------------------

@dataclass
class OracleMeasurement:
    """How often a server's fault-free run differed from its first (``measure_serve_oracle``):
    run index -> what differed, one sentence per stream, for each run that differed."""

    scenario: str
    runs: int
    streams_per_run: int
    compared_per_run: int
    tokens_per_run: int
    differences: dict[int, list[str]]
    seconds: float

    @property
    def differing_runs(self) -> int:
        return len(self.differences)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "differing_runs": self.differing_runs}


def _differences(first: RunOutput, run: RunOutput) -> list[str]:
    if run.error is not None or run.timed_out:
        return [f"the run did not finish: {run.error or 'timed out'}"]
    found = []
    for expected, actual in zip(first.requests, run.requests):
        comparison = compare_completion(expected, actual)
        if not comparison.matches:
            found.append(f"request {expected.index}: {comparison.detail}")
    return found


def measure_serve_oracle(scenario: Scenario, runs: int, *, model_dir: str,
                         run_timeout_s: float = SERVE_RUN_TIMEOUT_S) -> OracleMeasurement:
    """Start one server of ``scenario`` (its faults are not planned), send its workload
    (requests and background streams at once) ``runs`` times, and compare each run's
    compared streams with the first's as a serve scenario's oracle does (each completion's
    token ids, logprobs bit for bit, finish reasons). ``FtkitError`` if the first run
    did not finish."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ftkit-oracle-"))
    server = ScenarioServer(scenario, model_dir, work)
    try:
        server.start(started + SERVE_START_TIMEOUT_S)
        model = server.model()
        driven = [drive(server.base_url, model, scenario, f"oracle{i}",
                        time.monotonic() + run_timeout_s) for i in range(runs)]
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    first = driven[0].output
    if first.error is not None or first.timed_out:
        raise FtkitError(f"the first run did not finish: {first.error or 'timed out'}")
    differences = {i: found for i, run in enumerate(driven)
                   if i and (found := _differences(first, run.output))}
    return OracleMeasurement(scenario.name, runs, len(driven[0].streams), len(first.requests),
                             first.total_tokens, differences,
                             round(time.monotonic() - started, 1))


__all__ = ["OracleMeasurement", "ScenarioServer", "drive", "measure_serve_oracle",
           "plan_faults", "request_arguments", "run_serve_scenario", "server_options",
           "token_id"]
