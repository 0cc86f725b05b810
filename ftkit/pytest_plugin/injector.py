"""Fault injection in a downstream project's own tests: the ``ftkit_fault`` markers, the
``FaultInjector``, the fault-free runs on plain engines (``FaultFreeRuns``) and the fixtures
``ftkit_engine``, ``ftkit_injector`` and ``ftkit_baseline`` (see the package docstring)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ftkit.errors import FtkitError
from ftkit.pytest_plugin.settings import (
    FtkitSettingError,
    FtkitSettings,
    _marker_settings,
    resolve_settings,
)

if TYPE_CHECKING:  # imported lazily: the plugin loads in every pytest run
    from ftkit.contracts.eventlog import FaultFired
    from ftkit.contracts.job import SamplingSpec
    from ftkit.results import FaultRecord, RecoveryRecord, RequestOutput
    from ftkit.scenario import EngineSpec, FaultSpec
    from ftkit.vllm.engine import EngineSession
    from ftkit.vllm.workload import GenerateResult


@dataclass
class GenerateRecord:
    """What one ``FaultInjector.generate`` call produced and what ftkit recorded for it."""

    run_id: str
    tokens: list[list[int]]
    #: Every completion (``n`` per request): token ids, the sampled tokens' logprobs, finish
    #: and stop reason, text.
    outputs: list[RequestOutput]
    #: The workload, for the fault-free run ``assert_exact`` compares with.
    prompts: list[str]
    sampling: SamplingSpec
    #: The engine's error if the call ended with one (the fault was surfaced), else None.
    error: str | None
    #: Every ``FaultFired`` event of this call, one per rank and failing attempt.
    fired: list[FaultFired]
    #: One record per planned fault (marker order): fired, attempts, recovered.
    faults: list[FaultRecord]
    #: One record per coordinated recovery round, as the ranks agreed on it.
    rounds: list[RecoveryRecord]


class FaultFreeRuns:
    """The session's fault-free runs, each on a plain vLLM engine: ftkit's recovery engine is
    not in it, so a fault-free run never depends on the code under test (as the scenario
    runner's baseline). One plain engine per model and tensor parallel size, started on
    first use with the settings of the engine under test, its engine core in a process of
    its own (an in-process engine under test may live beside it), closed with the session;
    the tokens of each workload are kept for the session."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, int], EngineSession] = {}
        #: Each workload's completions, by its engine settings, prompts and sampling (JSON).
        self._outputs: dict[str, list[RequestOutput]] = {}

    def tokens(self, spec: EngineSpec, prompts: list[str], sampling: SamplingSpec, *,
               timeout_s: float) -> list[list[int]]:
        """Each request's fault-free token ids; a failed or timed-out run fails the test."""
        return [list(r.token_ids)
                for r in self.outputs(spec, prompts, sampling, timeout_s=timeout_s)]

    def outputs(self, spec: EngineSpec, prompts: list[str], sampling: SamplingSpec, *,
                timeout_s: float) -> list[RequestOutput]:
        """Every fault-free completion (token ids, logprobs, finish reason, text); a failed
        or timed-out run fails the test."""
        key = json.dumps([spec.model, spec.tensor_parallel_size, prompts,
                          sampling.to_mapping()], sort_keys=True)
        if key not in self._outputs:
            self._outputs[key] = self._run(spec, prompts, sampling, timeout_s).requests
        return [dataclasses.replace(r) for r in self._outputs[key]]

    def engine_for(self, spec: EngineSpec) -> EngineSession:
        """The plain engine for ``spec`` (the engine under test's settings), started if need
        be."""
        from ftkit.vllm.engine import EngineSession

        key = (spec.model, spec.tensor_parallel_size)
        engine = self.engines.get(key)
        if engine is None or engine.dead is not None or engine.llm is None:
            if engine is not None:
                engine.close()
            engine = self.engines[key] = EngineSession(spec, recovery=None,
                                                       multiprocess=True).start()
        return engine

    def _run(self, spec: EngineSpec, prompts: list[str], sampling: SamplingSpec,
             timeout_s: float) -> GenerateResult:
        from ftkit.errors import RunTimeout

        engine = _or_fail(lambda: self.engine_for(spec))
        try:
            out = engine.generate(prompts, sampling, deadline=time.monotonic() + timeout_s)
        except RunTimeout:
            self._drop(spec)
            pytest.fail(f"ftkit: the fault-free run did not finish within {timeout_s:g} s "
                        "(--ftkit-timeout)", pytrace=False)
        if out.error is not None:
            self._drop(spec)
            pytest.fail(f"ftkit: the fault-free run failed: {out.error}", pytrace=False)
        return out

    def _drop(self, spec: EngineSpec) -> None:
        engine = self.engines.pop((spec.model, spec.tensor_parallel_size), None)
        if engine is not None:
            engine.close()

    def close(self) -> None:
        engines, self.engines = list(self.engines.values()), {}
        for engine in engines:
            engine.close()


class FaultInjector:
    """Runs workloads on an ftkit engine under a fixed fault plan (the test's markers)."""

    def __init__(self, engine: EngineSession, faults: Sequence[FaultSpec], *,
                 timeout_s: float, fault_free: FaultFreeRuns) -> None:
        from ftkit.contracts.plan import FaultPlan

        self.engine = engine
        #: The faults every ``generate`` call runs under, from the test's markers (each call
        #: plans them for its own run id).
        self.plan = FaultPlan.from_specs(None, faults)
        self.timeout_s = timeout_s
        #: Where ``baseline`` comes from: plain engines with this engine's settings.
        self.fault_free = fault_free
        self.last: GenerateRecord | None = None

    def generate(self, prompts: list[str], *, max_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[list[int]]:
        """Run ``prompts`` under the fault plan (re-armed for this call); return each request's
        token ids. An engine error does not raise: it is in ``error`` (and the engine is
        restarted before its next use); a call past the timeout fails the test."""
        from ftkit.contracts.eventlog import FaultFired, only, read_events
        from ftkit.contracts.job import SamplingSpec
        from ftkit.runner.events import collect_events, events_of_run

        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed)
        self._check_plan(prompts, sampling)
        _ensure_running(self.engine)
        run_id = self.engine.new_run_id()
        self.engine.set_fault_plan(dataclasses.replace(self.plan, run_id=run_id))
        started = time.time()
        out = self._run(prompts, sampling, run_id)
        assert self.engine.recovery is not None and self.engine.recovery.event_log_dir
        events = events_of_run(read_events(self.engine.recovery.event_log_dir), run_id,
                               started)
        records, rounds = collect_events(events, [f.spec for f in self.plan.faults],
                                         origin=out.started_at)
        self.last = GenerateRecord(
            run_id=run_id, tokens=[r.token_ids for r in out.requests if r.sample == 0],
            outputs=out.requests, prompts=list(prompts), sampling=sampling, error=out.error,
            fired=only(events, FaultFired), faults=records, rounds=rounds)
        return self.last.tokens

    def assert_exact(self) -> None:
        """Fail the test unless the last ``generate`` call ended without an error and every
        completion is the fault-free run's, field by field as the scenario runner's oracle
        compares them (``ftkit.verify``): the sampled tokens' logprobs bit for bit, the token
        ids, the finish and stop reasons and the text. The message names the first
        difference ("logprob drift at request 0, token 7: ..."). A recovery that changed a
        logprob fails here even when every token survived."""
        from ftkit.verify import compare_completion

        last = self._last()
        if last.error is not None:
            pytest.fail(f"ftkit: the run ended with an error: {last.error}", pytrace=False)
        want = self.fault_free.outputs(self.engine.spec, last.prompts, last.sampling,
                                       timeout_s=self.timeout_s)
        got = {r.key: r for r in last.outputs}
        if sorted(got) != sorted(r.key for r in want):
            pytest.fail(f"ftkit: the run has completions {sorted(got)}, the fault-free run "
                        f"{sorted(r.key for r in want)}", pytrace=False)
        for expected in want:
            comparison = compare_completion(expected, got[expected.key])
            if comparison.detail is not None:
                pytest.fail(f"ftkit: not the fault-free run: {comparison.detail}",
                            pytrace=False)

    def baseline(self, prompts: list[str], *, max_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[list[int]]:
        """The fault-free tokens of the same workload on a plain vLLM engine with this
        engine's settings (``FaultFreeRuns``; cached per session)."""
        from ftkit.contracts.job import SamplingSpec

        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed)
        return self.fault_free.tokens(self.engine.spec, prompts, sampling,
                                      timeout_s=self.timeout_s)

    def _run(self, prompts: list[str], sampling: SamplingSpec, run_id: str) -> GenerateResult:
        from ftkit.errors import RunTimeout

        try:
            return self.engine.generate(prompts, sampling, run_id=run_id,
                                        deadline=time.monotonic() + self.timeout_s)
        except RunTimeout:
            self.engine.close()  # a hung engine is restarted before its next use
            self.engine.dead = f"stopped after the ftkit timeout of {self.timeout_s:g} s"
            pytest.fail(f"ftkit: generate did not finish within {self.timeout_s:g} s "
                        "(--ftkit-timeout)", pytrace=False)

    def _check_plan(self, prompts: list[str], sampling: SamplingSpec) -> None:
        """The checks a scenario gets: the rank, request and token of each fault exist ..."""
        from ftkit.scenario import Scenario, ScenarioErrors

        try:
            Scenario.model_validate({
                "name": "pytest",
                "engine": {"model": self.engine.spec.model,
                           "tensor_parallel_size": self.engine.spec.tensor_parallel_size},
                "workload": {"prompts": list(prompts), "max_tokens": sampling.max_tokens,
                             "temperature": float(sampling.temperature),
                             "top_p": float(sampling.top_p), "seed": sampling.seed},
                "faults": [f.spec.model_dump(mode="json") for f in self.plan.faults],
                # Whether the fault is recovered is for the test to assert, not a rule here.
                "expect": {"outcome": "failed"},
            })
        except ScenarioErrors as exc:
            problems = "\n".join(f"  {_marker_field(e.field)}: {e.message}" for e in exc.errors)
            raise FtkitSettingError(f"this generate call cannot run the fault plan:\n"
                                    f"{problems}") from None
        except ValueError as exc:  # pydantic: a prompt or sampling value of the wrong type
            raise FtkitSettingError(f"bad generate arguments: {exc}") from None

    # What ftkit recorded for the last call.

    def _last(self) -> GenerateRecord:
        if self.last is None:
            raise AttributeError("ftkit_injector: call generate() first")
        return self.last

    @property
    def error(self) -> str | None:
        return self._last().error

    @property
    def fired(self) -> list[FaultFired]:
        return self._last().fired

    @property
    def rounds(self) -> list[RecoveryRecord]:
        return self._last().rounds

    @property
    def faults(self) -> list[FaultRecord]:
        return self._last().faults

    @property
    def tokens(self) -> list[list[int]]:
        return self._last().tokens

    @property
    def outputs(self) -> list[RequestOutput]:
        return self._last().outputs

    @property
    def logprobs(self) -> list[list[float]]:
        """Each request's sampled tokens' logprobs (its first completion's)."""
        return [list(r.logprobs or []) for r in self._last().outputs if r.sample == 0]


def _marker_field(field: str | None) -> str:
    # "faults[1].at.token" -> "ftkit_fault marker 1: at.token"
    if field and (m := re.match(r"faults\[(\d+)\]\.?(.*)", field)):
        return f"ftkit_fault marker {m.group(1)}" + (f" {m.group(2)}" if m.group(2) else "")
    return field or "workload"


def fault_plan(node: pytest.Item) -> list[FaultSpec]:
    """The test's ``ftkit_fault`` markers as validated faults: outermost first, then top to
    bottom."""
    from pydantic import ValidationError

    from ftkit.scenario import FaultSpec

    marks = list(node.iter_markers("ftkit_fault"))[::-1]
    faults = []
    for index, mark in enumerate(marks):
        if mark.args:
            raise FtkitSettingError(f"ftkit_fault marker {index}: give the fault fields as "
                                    "keywords (kind=..., rank=..., at=...)")
        try:
            faults.append(FaultSpec.model_validate(dict(mark.kwargs)))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'fault'}: {e['msg']}"
                                 for e in exc.errors(include_url=False))
            raise FtkitSettingError(f"ftkit_fault marker {index}: {problems}") from None
    return faults


def _ensure_running(engine: EngineSession) -> None:
    """Restart an engine that an earlier fault or timeout ended."""
    if engine.dead is not None or engine.llm is None:
        engine.close()
        engine.dead = None
        engine.start()


def _start_engine(settings: FtkitSettings, event_log_dir: Path, *,
                  multiprocess: bool | None = None) -> EngineSession:
    from ftkit.config import RecoveryConfig
    from ftkit.model import resolve_model
    from ftkit.scenario import EngineSpec
    from ftkit.vllm.engine import EngineSession

    spec = EngineSpec(model=str(resolve_model(settings.model)),
                      tensor_parallel_size=settings.tensor_parallel_size)
    recovery = RecoveryConfig(enabled=True, max_reinference=settings.max_reinference,
                              event_log_dir=str(event_log_dir))
    return EngineSession(spec, recovery=recovery, multiprocess=multiprocess).start()


def _or_fail(func: Callable[[], Any]) -> Any:
    try:
        return func()
    except FtkitError as exc:  # FtkitSettingError, EngineError, a model that cannot be found
        pytest.fail(f"ftkit: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def ftkit_engine(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSession]:
    """The session's vLLM engine with recovery on (one per xdist worker)."""
    settings = _or_fail(lambda: resolve_settings(request.config))
    event_log = tmp_path_factory.mktemp("ftkit-event-log")
    engine = _or_fail(lambda: _start_engine(settings, event_log))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def _ftkit_fault_free() -> Iterator[FaultFreeRuns]:
    runs = FaultFreeRuns()
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture
def ftkit_injector(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   _ftkit_fault_free: FaultFreeRuns) -> Iterator[FaultInjector]:
    """Runs ``generate`` under the test's ``ftkit_fault`` markers (see ``FaultInjector``)."""
    node = request.node
    faults = _or_fail(lambda: fault_plan(node))
    session = _or_fail(lambda: resolve_settings(request.config))
    mine = _or_fail(lambda: resolve_settings(request.config, _marker_settings(node)))
    own_engine = None
    if mine.engine_key() == session.engine_key():
        engine = request.getfixturevalue("ftkit_engine")
    else:
        # Another in-process engine may be alive: this one runs in its own process.
        event_log = tmp_path_factory.mktemp("ftkit-event-log")
        engine = own_engine = _or_fail(
            lambda: _start_engine(mine, event_log, multiprocess=True))
    try:
        yield FaultInjector(engine, faults, timeout_s=mine.timeout, fault_free=_ftkit_fault_free)
    finally:
        if own_engine is not None:
            own_engine.close()


@pytest.fixture
def ftkit_baseline(ftkit_injector: FaultInjector) -> Callable[..., list[list[int]]]:
    """``ftkit_baseline(prompts, max_tokens=..., temperature=..., top_p=..., seed=...)``: the
    fault-free tokens of the workload on a plain vLLM engine (ftkit's recovery engine not in
    it) with the settings of ``ftkit_injector``'s engine."""
    return ftkit_injector.baseline
