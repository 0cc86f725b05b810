"""Real vLLM engines for the integration tests, started once per session.

Only one in-process engine is alive at a time (vLLM's in-process engine owns the process's
default process group): the fault-free baselines of every workload are computed first on a
plain engine, which is then closed. Engines with faults that end them get their own fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ftkit.config import RecoveryConfig
from ftkit.contracts.eventlog import (
    FaultFired,
    KvRecomputed,
    ParamsReloaded,
    RecoveryRound,
    StepRecovered,
    only,
    read_events,
)
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.model import build_tiny_model
from ftkit.procs import is_process_helper
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession

from _feature_run import ENGINE_STARTS  # noqa: F401 - the key of a feature run's engine count

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "link fault in the cluster",
    "one two three four five six seven",
    "river mountain city ocean forest",
]
GREEDY = SamplingSpec(max_tokens=48)
SEEDED = SamplingSpec(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
#: Long enough to cross a third KV block (position 64), where a duplicated block id bites.
LONG = SamplingSpec(max_tokens=88)
WORKLOADS = {"greedy": GREEDY, "seeded": SEEDED, "long": LONG}
#: Other modules' fault-free runs that only pick their faults' settings (a stop string, a bad
#: word): prompts and sampling, run on the baseline's engine instead of an engine of their own.
RESUME_PROMPTS = ["A small boat crossed the quiet lake at night.",
                  "Write a short story about a river and a mountain."]
FEATURE_PROMPTS = [*RESUME_PROMPTS, "The old clock in the hall struck twelve."]
#: test_sample_phase's workloads: the features that change the logits in place.
SAMPLE_PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logprobs": 2,
                    "logit_bias": {"17": 1.5, "40": -2.0}}
SAMPLE_WORKLOADS = {
    "greedy": SamplingSpec(max_tokens=24, extra=SAMPLE_PENALTIES),
    "seeded": SamplingSpec(max_tokens=24, temperature=0.9, top_p=0.95, seed=77,
                           extra=SAMPLE_PENALTIES)}
PLAIN_RUNS = {"resume_stop": (RESUME_PROMPTS, SamplingSpec(max_tokens=30)),
              "resume_features": (FEATURE_PROMPTS, SamplingSpec.from_mapping({
                  "max_tokens": 28,
                  "requests": [{}, {"frequency_penalty": 0.8, "presence_penalty": 0.8},
                               {"n": 2, "temperature": 0.8, "seed": 7}]})),
              **{f"sample_{name}": (PROMPTS, sampling)
                 for name, sampling in SAMPLE_WORKLOADS.items()},
              # test_pipeline's oracle: one rank.
              "pipeline": (["the quick brown fox jumps over the lazy dog",
                            "one two three four five"],
                           SamplingSpec.from_mapping({"max_tokens": 48, "requests": [
                               {}, {"temperature": 0.8, "seed": 1234}]}))}


@dataclass
class Baseline:
    tokens: dict[str, list[list[int]]]
    prompt_lens: list[int]
    #: Per name of ``PLAIN_RUNS``: each completion's tokens, text, sampled tokens' logprobs
    #: and top logprobs, in request order.
    plain_runs: dict[str, list[dict]]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(build_tiny_model())


@pytest.fixture(scope="session")
def baseline(tiny_model: str) -> Baseline:
    """Fault-free tokens of every workload on a plain vLLM engine (ftkit not installed)."""
    tokens = {}
    with EngineSession(EngineSpec(model=tiny_model)) as engine:
        for name, sampling in WORKLOADS.items():
            out = engine.generate(PROMPTS, sampling)
            assert out.error is None, out.error
            tokens[name] = [r.token_ids for r in out.requests]
        plain_runs = {}
        for name, (prompts, sampling) in PLAIN_RUNS.items():
            out = engine.generate(prompts, sampling)
            assert out.error is None, out.error
            plain_runs[name] = [{"tokens": r.token_ids, "text": r.text, "logprobs": r.logprobs,
                                 "top_logprobs": None if r.top_logprobs is None else
                                 [[list(p) for p in pos] for pos in r.top_logprobs]}
                                for r in out.requests]
        tokenizer = engine.llm.get_tokenizer()
        lens = [len(tokenizer.encode(p)) for p in PROMPTS]
    return Baseline(tokens, lens, plain_runs)


def recovery_config(event_log_dir: str, **overrides) -> RecoveryConfig:
    return RecoveryConfig(**{"enabled": True, "max_reinference": 3, "round_timeout_s": 20.0,
                             "event_log_dir": event_log_dir, **overrides})


@pytest.fixture(scope="session")
def tp1_engine(tiny_model: str, baseline: Baseline, tmp_path_factory) -> EngineSession:
    event_log = tmp_path_factory.mktemp("event-log-tp1")
    with EngineSession(EngineSpec(model=tiny_model),
                       recovery=recovery_config(str(event_log))) as engine:
        yield engine


@pytest.fixture(scope="session")
def tp2_engine(tiny_model: str, baseline: Baseline, tmp_path_factory) -> EngineSession:
    event_log = tmp_path_factory.mktemp("event-log-tp2")
    engine = EngineSession(EngineSpec(model=tiny_model, tensor_parallel_size=2),
                           recovery=recovery_config(str(event_log)))
    with engine:
        yield engine
    assert_reaped(engine.pids)


def assert_reaped(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"


def new_block_token(prompt_len: int, block_size: int = 32) -> int:
    """The output token whose step is the first to need a second KV block."""
    return block_size + 1 - prompt_len


@pytest.fixture(autouse=True, scope="session")
def _no_orphans():
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    yield
    left = [p for p in psutil.Process(os.getpid()).children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
            and not is_process_helper(p)]
    assert not left, f"processes left behind by the test session: {[p.pid for p in left]}"


@dataclass
class FaultRun:
    tokens: list[list[int]]
    token_times: list[list[float]]
    error: str | None
    fired: list[FaultFired]
    rounds: list[RecoveryRound]
    recovered: list[StepRecovered]
    #: Lost KV rebuilt before a re-run, of every rank.
    kv: list[KvRecomputed]
    #: Weights reloaded from the checkpoint.
    reloaded: list[ParamsReloaded]
    #: The sampled token's logprob at each position of each request.
    logprobs: list[list[float]]


def streams(run: dict) -> list[tuple[list[int], list[float]]]:
    """Each completion's tokens and logprobs, of one run of a ``feature_run`` result."""
    return [(o["tokens"], o["logprobs"]) for o in run["outputs"]]


def feature_run(config: dict, timeout_s: float) -> dict:
    """Run ``_feature_run.py`` with ``config`` in a child process and return its ``RESULT``
    (per run name: completions, error, restarts, ...); the child must succeed."""
    return child_run("_feature_run.py", config, timeout_s)


def child_run(script: str, config: dict, timeout_s: float) -> dict:
    """Run ``script`` (beside this file) with ``config`` in a child process and return the
    last ``RESULT`` line it prints; the child must succeed."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)),
                           json.dumps(config)], capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def run_with_faults(engine: EngineSession, sampling: SamplingSpec, faults: list[FaultSpec],
                    timeout_s: float = 120.0, submit_after_steps: list[int] | None = None
                    ) -> FaultRun:
    """Run the test prompts under ``faults`` and collect what the ranks recorded."""
    import time

    run_id = engine.new_run_id()
    engine.set_fault_plan(FaultPlan.from_specs(run_id, faults))
    started = time.time()
    out = engine.generate(PROMPTS, sampling, run_id=run_id,
                          deadline=time.monotonic() + timeout_s,
                          submit_after_steps=submit_after_steps)
    events = [e for e in read_events(engine.recovery.event_log_dir) if e.time >= started]
    return FaultRun(
        tokens=[r.token_ids for r in out.requests],
        token_times=[r.token_times for r in out.requests],
        error=out.error,
        fired=[e for e in only(events, FaultFired) if e.run_id == run_id],
        rounds=only(events, RecoveryRound),
        recovered=only(events, StepRecovered),
        kv=only(events, KvRecomputed),
        reloaded=only(events, ParamsReloaded),
        logprobs=[list(r.logprobs) for r in out.requests],
    )


def fault(kind: str, rank, request: int, token: int, phase: str = "forward",
          times: int = 1, **params) -> FaultSpec:
    return FaultSpec.model_validate({"kind": kind, "rank": rank,
                                     "at": {"request": request, "token": token},
                                     "phase": phase, "times": times, "params": params})
