"""The engine job contract between the scenario runner and an engine host: the records
survive their JSON form whole, the engine key says which jobs may share an engine, and the
host answers requests on its standard streams with these records only."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from ftkit.config import RecoveryConfig
from ftkit.contracts.job import (
    EngineJob,
    EngineRestart,
    HostMessage,
    HostRequest,
    JobResult,
    SHOWN_STAGES,
    SamplingSpec,
    Stage,
)
from ftkit.contracts.plan import FaultPlan
from ftkit.errors import EngineError
from ftkit.results import RequestOutput
from ftkit.scenario import EngineSpec, FaultSpec

OOM = FaultSpec.model_validate({"kind": "oom", "rank": 0, "at": {"request": 1, "token": 5},
                                "times": 2})


def job(**changes) -> EngineJob:
    base = EngineJob(
        engine=EngineSpec(model="/models/tiny", tensor_parallel_size=2, args={"max_num_seqs": 4}),
        sampling=SamplingSpec(max_tokens=8, temperature=0.5, top_p=0.9, seed=3),
        prompts=("a b c", "d e"),
        recovery=RecoveryConfig(enabled=True, max_reinference=2, event_log_dir="/tmp/log"),
        plan=FaultPlan.from_specs(None, [OOM], max_reinference=2),
        max_restarts=1, multiprocess=True, result_path="/tmp/result.json")
    return dataclasses.replace(base, **changes)


def test_a_job_survives_its_json_form():
    j = job()
    back = EngineJob.from_json(j.to_json())
    assert back == j
    assert back.plan.faults[0].spec == OOM
    assert EngineJob.from_json(job(recovery=None).to_json()).recovery is None
    assert EngineJob.from_json(job(fresh_engine=True).to_json()).fresh_engine is True


def test_the_engine_key_leaves_out_what_a_run_sets_itself():
    j = job()
    recovery = j.recovery
    assert job(recovery=recovery.replace(event_log_dir=None)).engine_key() == j.engine_key()
    # max_reinference is the run's, except where it decides the engine's execute timeout: at
    # tensor parallel 2 and more, through the bound of one recovered step.
    one = EngineSpec(model="/models/tiny", tensor_parallel_size=1)
    assert job(engine=one, recovery=recovery.replace(max_reinference=0)).engine_key() \
        == job(engine=one).engine_key()
    assert job(recovery=recovery.replace(max_reinference=0)).engine_key() != j.engine_key()
    assert job(plan=FaultPlan(None), prompts=("x",), max_restarts=0).engine_key() \
        == j.engine_key()


@pytest.mark.parametrize("changes", [
    {"recovery": None},
    {"multiprocess": False},
    {"engine": EngineSpec(model="/models/tiny", tensor_parallel_size=1,
                          args={"max_num_seqs": 4})},
    {"engine": EngineSpec(model="/models/other", tensor_parallel_size=2,
                          args={"max_num_seqs": 4})},
])
def test_the_engine_key_tells_engines_apart(changes):
    assert job(**changes).engine_key() != job().engine_key()


def test_a_result_survives_its_json_form():
    result = JobResult(
        requests=(RequestOutput(0, [1, 2], [0.1, 0.2], "length"), RequestOutput(1, [])),
        error="boom", engine_start_s=3.0, generate_s=1.5, started_at=1700000000.0,
        run_id="r1.2",
        restarts=(EngineRestart(error="dead", died_at_s=0.5, restart_s=2.0, resumed_at_s=2.6,
                                resumed_requests=(0, 1)),))
    assert JobResult.from_json(result.to_json()) == result


def test_host_lines_survive_their_json_form():
    for message in (HostMessage(Stage.TOKENS, tokens_done=3, tokens_total=8),
                    HostMessage(Stage.ENGINE_READY, "engine reused")):
        assert HostMessage.from_json(message.to_json()) == message
    for request in (HostRequest("/tmp/job.json"), HostRequest()):
        assert HostRequest.from_json(request.to_json()) == request


def test_a_record_of_another_version_is_refused():
    raw = json.loads(job().to_json())
    raw["v"] = 99
    with pytest.raises(EngineError, match="another version"):
        EngineJob.from_json(json.dumps(raw))
    with pytest.raises(EngineError):
        HostMessage.from_json(json.dumps({"stage": "tokens"}))


def test_the_host_answers_a_job_with_its_result_then_exits(tmp_path: Path, monkeypatch,
                                                            capsys):
    from ftkit.vllm import host

    ran: list[EngineJob] = []

    def run_job(self, j: EngineJob) -> JobResult:
        ran.append(j)
        return JobResult(requests=(RequestOutput(0, [7]),), run_id="r1.1")

    monkeypatch.setattr(host.Host, "run_job", run_job)
    j = job(result_path=str(tmp_path / "result.json"))
    (tmp_path / "job.json").write_text(j.to_json())
    stdin = io.StringIO(HostRequest(str(tmp_path / "job.json")).to_json() + "\n"
                        + HostRequest().to_json() + "\n")
    assert host.serve(stdin) == 0
    assert ran == [j]
    assert JobResult.from_json((tmp_path / "result.json").read_text()).run_id == "r1.1"
    stages = [HostMessage.from_json(line).stage
              for line in capsys.readouterr().out.splitlines()]
    assert stages == [Stage.JOB_DONE, Stage.EXIT]


def test_a_replaced_engine_is_shown_as_the_host_resumes_its_requests(monkeypatch, capsys):
    from types import SimpleNamespace

    from ftkit.vllm import host

    restart = EngineRestart(error="dead", died_at_s=1.0, restart_s=17.25, resumed_at_s=18.5,
                            resumed_requests=(0, 2))

    class Session:
        start_s = 1.0

        def new_run_id(self) -> str:
            return "r1.1"

        def set_fault_plan(self, plan) -> None:
            pass

        def generate(self, prompts, sampling, **kw):
            kw["on_restart"](restart)
            return SimpleNamespace(error=None, generate_s=2.0, started_at=0.0,
                                   restarts=[restart], requests=[])

    monkeypatch.setattr(host.Host, "_engine_for", lambda self, j: (Session(), False))
    result = host.Host().run_job(job(max_restarts=1))
    assert result.error is None and result.restarts == (restart,)
    said = [HostMessage.from_json(line) for line in capsys.readouterr().out.splitlines()]
    assert said[-1] == HostMessage(Stage.RECOVERED, "engine replaced 17.2 s after it died; "
                                                    "2 request(s) resumed")
    assert Stage.RECOVERED in SHOWN_STAGES
