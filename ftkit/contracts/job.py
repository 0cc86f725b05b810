"""The engine job: what the scenario runner asks of an engine host process, and the answer.

The runner (``ftkit.runner``) writes an ``EngineJob`` as a file and names it in a
``HostRequest`` line on the host's standard input; the host (``ftkit.vllm.host``) answers with
``HostMessage`` lines on its standard output (progress, then ``job_done``) and writes the
``JobResult`` to the job's ``result_path`` before it says ``job_done``, so that what was
produced survives whatever happens next. Each record serialises itself (``to_json`` /
``from_json``) with a version; no other module reads these payloads by key strings.

``EngineJob.engine_key()`` is what decides which engine a job needs: jobs with the same key
can run one after the other on one engine.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

from ftkit.config import RecoveryConfig
from ftkit.contracts.plan import FaultPlan
from ftkit.contracts.sampling import SamplingSpec
from ftkit.errors import EngineError
from ftkit.results import RequestOutput
from ftkit.scenario.model import EngineSpec

#: The version of the job's, the result's and the host lines' JSON form (2: sampling
#: fields beyond v1 and per-request overrides; logprobs, text and samples in the outputs).
VERSION = 2


def _check_version(raw: dict[str, Any], what: str) -> dict[str, Any]:
    if raw.pop("v", None) != VERSION:
        raise EngineError(f"{what} of another version; this ftkit reads version {VERSION}")
    return raw


@dataclass(frozen=True)
class EngineJob:
    """One workload on one engine.

    ``engine.model`` is the model directory (already resolved). ``recovery`` is None for a
    plain engine (ftkit not installed: the fault-free baseline), and its ``event_log_dir`` is
    the host's. ``plan`` has no run id yet: the host gives the run one. ``max_restarts``: new
    engines the run may start after one of the engine's processes died (a kill), resuming the
    requests. ``multiprocess``: the engine core runs in a process of its own.
    ``fresh_engine``: start a new engine even if the host's fits (the last run on it failed,
    and a failed recovery may have left it damaged).
    """

    engine: EngineSpec
    sampling: SamplingSpec
    prompts: tuple[str, ...]
    recovery: RecoveryConfig | None = None
    plan: FaultPlan = field(default_factory=lambda: FaultPlan(None))
    max_restarts: int = 0
    multiprocess: bool = False
    result_path: str | None = None
    fresh_engine: bool = False

    def engine_key(self) -> str:
        """What decides the engine this job needs. Not in it: ``max_reinference`` (set per run
        through the fault plan) and ``event_log_dir`` (each host has its own); but, at tensor
        parallel 2 and more, the bound on one recovered step that ``max_reinference`` gives is
        (the engine is started with vLLM's execute timeout raised to it:
        ``ftkit.vllm.environment``)."""
        recovery = None
        if self.recovery is not None:
            recovery = self.recovery.replace(max_reinference=0, event_log_dir=None).to_mapping()
            if self.engine.world_size > 1:  # (vLLM bounds a step only there)
                recovery["step_bound_s"] = self.recovery.step_bound().needed_s
        return json.dumps({"engine": self.engine.model_dump(mode="json"), "recovery": recovery,
                           "multiprocess": self.multiprocess}, sort_keys=True)

    def replace(self, **changes: Any) -> EngineJob:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps({
            "v": VERSION,
            "engine": self.engine.model_dump(mode="json"),
            "sampling": self.sampling.to_mapping(),
            "prompts": list(self.prompts),
            "recovery": None if self.recovery is None else self.recovery.to_mapping(),
            "plan": self.plan.to_json(),
            "max_restarts": self.max_restarts,
            "multiprocess": self.multiprocess,
            "result_path": self.result_path,
            "fresh_engine": self.fresh_engine,
        })

    @classmethod
    def from_json(cls, text: str) -> EngineJob:
        raw = _check_version(json.loads(text), "an engine job")
        return cls(
            engine=EngineSpec.model_validate(raw["engine"]),
            sampling=SamplingSpec.from_mapping(raw["sampling"]),
            prompts=tuple(raw["prompts"]),
            recovery=(None if raw["recovery"] is None
                      else RecoveryConfig.from_mapping(raw["recovery"])),
            plan=FaultPlan.from_json(raw["plan"]),
            max_restarts=raw["max_restarts"],
            multiprocess=raw["multiprocess"],
            result_path=raw["result_path"],
            fresh_engine=raw.get("fresh_engine", False),
        )


@dataclass(frozen=True)
class EngineRestart:
    """One engine restart inside a run, after one of the engine's processes died. Times are
    seconds from the workload's submission, except ``restart_s`` (a duration)."""

    #: The error the dead engine surfaced.
    error: str
    died_at_s: float
    #: From the death until the new engine was up (and the old one reaped).
    restart_s: float
    #: When the unfinished requests were submitted again on the new engine.
    resumed_at_s: float
    resumed_requests: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line for a progress display."""
        return (f"engine replaced {self.restart_s:.1f} s after it died; "
                f"{len(self.resumed_requests)} request(s) resumed")


@dataclass(frozen=True)
class JobResult:
    """What one job produced; ``error`` is the engine's error (or why there was no run)."""

    requests: tuple[RequestOutput, ...] = ()
    error: str | None = None
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    #: ``time.time()`` when the workload was submitted (the zero of every token time).
    started_at: float | None = None
    #: The run id the host gave the workload (its fault events carry it).
    run_id: str | None = None
    restarts: tuple[EngineRestart, ...] = ()

    def replace(self, **changes: Any) -> JobResult:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps({"v": VERSION, **d})

    @classmethod
    def from_json(cls, text: str) -> JobResult:
        raw = _check_version(json.loads(text), "an engine job's result")
        return cls(
            requests=tuple(RequestOutput(**r) for r in raw.pop("requests")),
            restarts=tuple(EngineRestart(**{**r, "resumed_requests":
                                            tuple(r["resumed_requests"])})
                           for r in raw.pop("restarts")),
            **raw)


#: In the parent's folder for an engine host (``python -m ftkit.vllm.host --work FOLDER``):
#: the files the host's engines hold in shared memory, one path per line, which the parent
#: removes after it had to kill the host.
LEFTOVERS_FILE = "leftovers"


@dataclass(frozen=True)
class HostRequest:
    """One line to an engine host: run the job in ``job_path``, or (``None``) exit."""

    job_path: str | None = None

    def to_json(self) -> str:
        return json.dumps({"v": VERSION, "job_path": self.job_path})

    @classmethod
    def from_json(cls, text: str) -> HostRequest:
        return cls(**_check_version(json.loads(text), "a host request"))


class Stage(str, enum.Enum):
    """What an engine host says it is doing."""

    ENGINE_START = "engine_start"
    ENGINE_READY = "engine_ready"
    TOKENS = "tokens"
    #: A dead engine was replaced and the unfinished requests resumed (``EngineRestart``).
    RECOVERED = "recovered"
    #: The job's result is written.
    JOB_DONE = "job_done"
    CLOSING = "closing"
    EXIT = "exit"


#: The stages a front end shows (as ``ftkit.progress.ProgressEvent`` stages of the same name).
SHOWN_STAGES = frozenset({Stage.ENGINE_START, Stage.ENGINE_READY, Stage.TOKENS,
                          Stage.RECOVERED})


@dataclass(frozen=True)
class HostMessage:
    """One line from an engine host: its stage, with a message or the token progress."""

    stage: Stage
    message: str = ""
    tokens_done: int = 0
    tokens_total: int = 0

    def to_json(self) -> str:
        return json.dumps({"v": VERSION, "stage": self.stage.value, "message": self.message,
                           "tokens_done": self.tokens_done, "tokens_total": self.tokens_total})

    @classmethod
    def from_json(cls, text: str) -> HostMessage:
        raw = _check_version(json.loads(text), "a host message")
        return cls(**{**raw, "stage": Stage(raw["stage"])})
