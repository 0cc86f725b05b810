"""``ftkit.explore`` without engines: the search space, determinism, shrinking, grouping and
coverage, with a stand-in ``execute`` whose failures follow a rule the test states.

The campaign against real engines (and against a crippled recovery) is in
``tests/vllm/test_explore_campaign.py``.
"""

from __future__ import annotations

import pytest

from ftkit.errors import FtkitError
from ftkit.explore import (FEATURES, Budget, Campaign, CoverageCell, ExploredRun,
                           ExploreOptions, ExploreSpace, Failure, Outcome, coverage,
                           features_of, merge_subsumed, parse_kinds, parse_names)
from ftkit.explore.space import MIN_TOKENS, NOT_SEARCHED
from ftkit.faults import FaultKind
from ftkit.results import FaultRecord, RequestComparison, ScenarioResult, Verdict
from ftkit.scenario import load_scenario


def result_for(scenario, verdict=Verdict.PASS, field=None, reason="ok", error=None):
    faults = [FaultRecord(kind=str(f.kind), rank=f.rank, request=f.at.request,
                          token=f.at.token, phase=f.phase, times=f.times, fired=True)
              for f in scenario.faults]
    requests = []
    if field is not None:
        requests = [RequestComparison(index=0, expected=[1, 2], actual=[1, 3],
                                      first_divergence=1, diverged_field=field, position=1)]
    return ScenarioResult(name=scenario.name, file="x", verdict=verdict, reason=reason,
                          duration_s=0.0, requests=requests, faults=faults, error=error)


class Recorder:
    """A stand-in for the runner: fails the scenarios ``rule`` names (returning the field
    that differs), passes the rest, and records what it was given."""

    def __init__(self, rule=lambda scenario: None):
        self.rule = rule
        self.seen = []

    def __call__(self, scenario, file):
        self.seen.append(scenario)
        field = self.rule(scenario)
        if field is None:
            return result_for(scenario)
        return result_for(scenario, Verdict.FAIL, field, reason=f"{field} differ")


def campaign(execute, *, seed=0, budget=30, tmp_path=None, **space):
    options = ExploreOptions(seed=seed, budget=Budget(scenarios=budget),
                             space=ExploreSpace(**space), out_dir=tmp_path)
    return Campaign(options, execute=execute).run()


def faults_of(scenario):
    return [(str(f.kind), f.phase) for f in scenario.faults]


# --- options --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds, count", [
    ("90s", 90, None), ("5m", 300, None), ("1h", 3600, None), ("2.5m", 150, None),
    ("40", None, 40)])
def test_budget_parses_a_wall_time_or_a_count(text, seconds, count):
    budget = Budget.parse(text)
    assert (budget.seconds, budget.scenarios) == (seconds, count)


@pytest.mark.parametrize("text", ["", "0", "-3", "5 minutes", "m", "0s"])
def test_a_bad_budget_is_refused_with_its_value(text):
    with pytest.raises(FtkitError, match="--budget"):
        Budget.parse(text)


def test_space_refuses_unknown_names_and_link_faults_without_a_peer():
    with pytest.raises(FtkitError, match="unknown fault kind 'flood'"):
        parse_kinds("uce,flood")
    with pytest.raises(FtkitError, match="unknown feature speculative"):
        parse_names("n,speculative", tuple(FEATURES), "feature")
    with pytest.raises(FtkitError, match="need a peer"):
        ExploreSpace(tp=(1,), kinds=(FaultKind.LINK_BREAK,))
    with pytest.raises(FtkitError, match="unknown phase"):
        ExploreSpace(phases=("after",))
    assert parse_kinds("") == parse_kinds(None)
    assert set(parse_kinds(None)) == set(FaultKind) - set(NOT_SEARCHED)
    with pytest.raises(FtkitError, match="'node_loss' is not searched: it needs vLLM's Ray"):
        parse_kinds("oom,node_loss")


# --- generation -----------------------------------------------------------------------------

def test_the_same_seed_generates_the_same_scenarios_and_another_seed_others():
    def drawn(seed):
        recorder = Recorder()
        campaign(recorder, seed=seed, budget=25, tp=(1, 2))
        return [(s.model_dump(exclude={"name"})) for s in recorder.seen]

    first = drawn(5)
    assert len(first) == 25
    assert drawn(5) == first
    assert drawn(6) != first


def test_generated_scenarios_are_valid_and_cover_the_space():
    recorder = Recorder()
    result = campaign(recorder, seed=1, budget=150, tp=(1, 2))
    assert result.scenarios_run == 150 and result.stopped == "budget"
    assert result.rejected <= 15, "the generator should draw valid scenarios"
    kinds = {str(f.kind) for s in recorder.seen for f in s.faults}
    phases = {f.phase for s in recorder.seen for f in s.faults}
    features = {f for run in result.runs for f in run.features}
    assert kinds == {k.value for k in FaultKind if k not in NOT_SEARCHED}
    assert phases == {"before", "forward", "sample"}
    assert features == set(FEATURES)
    # Link faults only where a peer exists; requests within the engine's limits.
    for s in recorder.seen:
        if s.engine.tensor_parallel_size == 1:
            assert not {str(f.kind) for f in s.faults} & {"link_break", "link_flap"}
        assert 1 <= len(s.workload.requests) <= 4 and MIN_TOKENS <= s.workload.max_tokens <= 64


def test_a_restricted_space_draws_only_what_it_allows():
    recorder = Recorder()
    campaign(recorder, seed=2, budget=30, tp=(2,), kinds=(FaultKind.UCE,),
             features=("logprobs",), phases=("sample",))
    assert {s.engine.tensor_parallel_size for s in recorder.seen} == {2}
    assert {(str(f.kind), f.phase) for s in recorder.seen for f in s.faults} == \
        {("uce", "sample")}
    assert {f for s in recorder.seen for f in features_of(s.model_dump(mode="json",
                                                                         exclude_unset=True))
            } <= {"logprobs"}


# --- shrinking and grouping -----------------------------------------------------------------

def penalties_in_sampling(scenario):
    sampling = scenario.workload.sampling.given()
    if "repetition_penalty" in sampling and ("uce", "sample") in faults_of(scenario):
        return "logprobs"
    return None


def test_a_failure_is_shrunk_to_the_smallest_scenario_that_fails_the_same_way(tmp_path):
    recorder = Recorder(penalties_in_sampling)
    result = campaign(recorder, seed=3, budget=80, tmp_path=tmp_path, tp=(1, 2))
    (failure,) = result.failures
    assert failure.signature == "fail: logprobs after uce/sample"
    # The smallest: one request of the fewest tokens, one fault, one feature, tp 1.
    assert (failure.tp, failure.requests, failure.max_tokens) == (1, 1, MIN_TOKENS)
    assert failure.faults == ["uce/sample"] and failure.features == ["penalties"]
    assert failure.shrink_runs > 0
    # The file reproduces it: it loads, and the rule still fails it.
    shrunk = load_scenario(failure.file)
    assert faults_of(shrunk) == [("uce", "sample")]
    assert penalties_in_sampling(shrunk) == "logprobs"
    assert "fail: logprobs after uce/sample" in shrunk.description


def test_failures_are_grouped_by_signature_and_each_reported_once(tmp_path):
    def two_bugs(scenario):
        if ("oom", "before") in faults_of(scenario):
            return "token_ids"
        return penalties_in_sampling(scenario)

    recorder = Recorder(two_bugs)
    result = campaign(recorder, seed=4, budget=120, tmp_path=tmp_path, tp=(1,))
    signatures = sorted(f.signature for f in result.failures)
    assert signatures == ["fail: logprobs after uce/sample", "fail: token_ids after oom/before"]
    for failure in result.failures:
        assert len(failure.faults) == 1 and failure.requests == 1
    # Every failing run carries its signature; no other signature was reported.
    failing = {run.signature for run in result.runs if run.signature}
    assert failing <= {f.signature for f in result.failures} | {
        s for f in result.failures for s in f.also_seen_as}


def test_a_clean_campaign_reports_no_failure_and_counts_every_cell():
    result = campaign(Recorder(), seed=7, budget=40, tp=(1,))
    assert result.failures == [] and result.scenarios_run == 40
    assert sum(c.failures for c in result.coverage) == 0
    faults_seen = sum(len(run.faults) for run in result.runs)
    by_fault = {}
    for cell in result.coverage:
        by_fault.setdefault((cell.kind, cell.phase), []).append(cell.runs)
    # Each (kind, phase) of a run is counted once per feature it has (or under "none").
    assert sum(len(run.faults) * max(1, len(run.features)) for run in result.runs) >= \
        sum(sum(v) for v in by_fault.values()) >= faults_seen > 0


def test_merge_subsumed_keeps_the_failure_with_fewer_faults():
    def failure(sig, faults):
        return Failure(signature=sig, verdict="fail", what="token_ids", found_at=0,
                       reason="", file=None, tp=1, requests=1, max_tokens=4, faults=faults,
                       features=[])

    small = failure("fail: token_ids after oom/forward", ["oom/forward"])
    big = failure("fail: token_ids after oom/forward + uce/kv", ["oom/forward", "uce/sample"])
    other = failure("fail: token_ids after hang/forward", ["hang/forward"])
    kept = merge_subsumed([big, small, other])
    assert kept == [small, other] and small.also_seen_as == [big.signature]


def test_coverage_counts_a_run_once_per_cell():
    runs = [ExploredRun(0, "a", 1, ["uce/sample", "uce/sample"], ["n", "stop"], "pass", "",
                        None, "", 0.1),
            ExploredRun(1, "b", 1, ["uce/sample"], [], "fail", "logprobs", "sig", "", 0.1),
            ExploredRun(2, "c", 1, ["uce/sample"], [], "fail", "logprobs", "sig", "", 0.1,
                        shrinking=True)]
    cells = {(c.kind, c.phase, c.feature, c.tp): c for c in coverage(runs)}
    assert cells[("uce", "sample", "n", 1)] == CoverageCell("uce", "sample", "n", 1, 1, 0, 0)
    assert cells[("uce", "sample", "none", 1)] == CoverageCell("uce", "sample", "none", 1, 1,
                                                               1, 0)
    assert len(cells) == 3


# --- outcomes -------------------------------------------------------------------------------

def test_outcome_names_what_failed(tmp_path):
    scenario = load_scenario("scenarios/uce_activation.yaml")
    fired = f"{scenario.faults[0].kind}/{scenario.faults[0].phase}"
    cases = [
        (result_for(scenario), "pass", ""),
        (result_for(scenario, Verdict.FAIL, "logprobs", "logprob drift"), "fail", "logprobs"),
        (result_for(scenario, Verdict.FAIL, reason="expected recovery, but the run failed: "
                    "ReinferenceExhausted: step 3", error="ReinferenceExhausted: step 3"),
         "fail", "ReinferenceExhausted"),
        (result_for(scenario, Verdict.ERROR, reason="the run timed out after 120 s"),
         "error", "timeout"),
        (result_for(scenario, Verdict.FAIL, reason=f"fault 0 ({fired}) fired but no recovery "
                    "round ran"), "fail", "unrecovered"),
        (result_for(scenario, Verdict.NOT_APPLIED, reason="fault 0 did not fire"),
         "not_applied", "not_fired"),
    ]
    for result, verdict, what in cases:
        outcome = Outcome.of(result)
        assert (outcome.verdict, outcome.what) == (verdict, what), result.reason
        assert outcome.failed == (verdict in ("fail", "error"))
    assert Outcome.of(cases[1][0]).signature == f"fail: logprobs after {fired}"
    baseline = Outcome.of(result_for(scenario, Verdict.ERROR, reason="the fault-free baseline "
                                     "run failed: VLLMValidationError: too long"))
    # The fault-free run failing is one failure, whatever faults the scenario had.
    assert baseline.signature == "error: baseline VLLMValidationError after no fault"


def test_a_third_of_the_faults_hit_the_step_that_starts_a_new_kv_block():
    from ftkit.explore.space import new_block_token

    # The step computing output token t writes position prompt + t - 1.
    assert [new_block_token(n) for n in (18, 31, 32, 33, 64)] == [15, 2, 1, 32, 1]
    recorder = Recorder()
    counts = {}

    def words(prompt):  # a stand-in tokenizer: three tokens a word
        return 3 * len(prompt.split())

    options = ExploreOptions(seed=8, budget=Budget(scenarios=60),
                             space=ExploreSpace(prompt_tokens=words))
    Campaign(options, execute=recorder).run()
    for s in recorder.seen[15:]:  # after the simplest scenario of each kind and phase
        for f in s.faults:
            prompt = s.workload.requests[f.at.request].prompt
            edge = new_block_token(words(prompt))
            counts[f.at.token == edge] = counts.get(f.at.token == edge, 0) + 1
    # A third are drawn at the edge; those whose edge lies past the request's last token
    # keep their drawn token (and a drawn token may be an edge by chance).
    assert counts[True] >= 0.1 * (counts[True] + counts[False]), counts


def test_a_short_campaign_covers_every_kind_in_every_phase():
    recorder = Recorder()
    result = campaign(recorder, seed=9, budget=25, tp=(1, 2))
    cells = {(c.kind, c.phase) for c in result.coverage}
    assert cells == {(k.value, p) for k in FaultKind if k not in NOT_SEARCHED
                     for p in ("before", "forward", "sample")}
    # The first runs are the simplest scenario of each: link faults at tensor parallel 2.
    first = recorder.seen[:21]
    assert [(str(s.faults[0].kind), s.faults[0].phase) for s in first[:3]] == \
        [("oom", "forward"), ("oom", "before"), ("oom", "sample")]
    assert all(s.engine.tensor_parallel_size == 2 for s in first
               if str(s.faults[0].kind).startswith("link"))
    assert all(len(s.workload.requests) == 1 and len(s.faults) == 1 for s in first)
