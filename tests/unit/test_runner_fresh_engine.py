"""``ScenarioRunner`` keeps engines between scenarios, but not after a faulty run that did not
pass: a failed recovery may have left the engine damaged (weights not reloaded, KV not
rebuilt), and the next scenario on it would fail for a reason that is not its own (seen by
``ftkit explore`` with weight reload crippled). The runner's hosts are stood in for here; the
engine host's side (``EngineJob.fresh_engine`` starts a new engine) is in
``ftkit.vllm.host`` and runs in the end-to-end tests."""

from __future__ import annotations

from ftkit.results import FaultRecord, RequestOutput, RunOutput
from ftkit.runner.core import ScenarioRunner
from ftkit.scenario import load_scenario

GOOD = [5, 6, 7, 8]


class StandInHost:
    """Answers each job with the next tokens of ``answers`` and records the job."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers, self.jobs, self.alive = answers, [], True

    def run(self, job, name, on_event, timeout_s, planned):
        self.jobs.append(job)
        tokens = self.answers.pop(0)
        faults = [FaultRecord(kind=str(f.kind), rank=f.rank, request=f.at.request,
                              token=f.at.token, phase=f.phase, times=f.times, fired=True,
                              attempts=f.times, recovered=True) for f in planned]
        return RunOutput(requests=[RequestOutput(0, tokens, logprobs=[-1.0] * len(tokens),
                                                 finish_reason="length")],
                         faults=faults)


def test_the_job_after_a_failed_run_starts_a_new_engine(monkeypatch):
    scenario = load_scenario("scenarios/oom_sampling.yaml").model_copy(deep=True)
    scenario.faults = []  # a determinism check: the verdict is the tokens alone
    scenario.workload.prompts = ["one"]
    scenario.workload.max_tokens = len(GOOD)
    host = StandInHost([GOOD, [5, 6, 9, 8], GOOD, GOOD])
    baseline = RunOutput(requests=[RequestOutput(0, GOOD, logprobs=[-1.0] * len(GOOD),
                                                 finish_reason="length")])
    runner = ScenarioRunner(use_cache=False)
    monkeypatch.setattr(runner, "_host_for", lambda job: host)
    monkeypatch.setattr(runner, "baseline_for", lambda *a, **k: baseline)
    verdicts = [runner.run(scenario, file="x").verdict.value for _ in range(4)]
    assert verdicts == ["pass", "fail", "pass", "pass"]
    # The job after the failed one asks for a new engine; the others keep theirs.
    assert [job.fresh_engine for job in host.jobs] == [False, False, True, False]
    # Asked for by the caller, a new engine whatever ran before.
    host.answers.append(GOOD)
    runner.run(scenario, file="x", fresh_engine=True)
    assert host.jobs[-1].fresh_engine is True
