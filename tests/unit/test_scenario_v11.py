"""Scenario format 1.1: per-request sampling fields, checked by vLLM's own SamplingParams.

Fast: no engine. vLLM's ``SamplingParams`` is imported (seconds, once) where a scenario uses
fields beyond version 1.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from ftkit.config import RecoveryConfig
from ftkit.contracts.job import EngineJob
from ftkit.contracts.plan import FaultPlan
from ftkit.contracts.sampling import SamplingSpec
from ftkit.results import RunOutput
from ftkit.runner.core import ScenarioRunner
from ftkit.scenario import (
    FORMAT_VERSION,
    Overrides,
    ScenarioErrors,
    load_scenario,
    load_scenario_text,
)
from ftkit.scenario.model import SamplingFields
from ftkit.vllm import sampling as vllm_sampling
from ftkit.vllm.environment import engine_args
from ftkit_cli.main import ftkit

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "scenarios"
BAD = REPO / "tests" / "data" / "scenarios" / "bad"

#: A valid 1.1 scenario; tests below change it at known lines.
BASE = """\
name: t
workload:
  requests:
    - prompt: the first request
    - prompt: the second request
      sampling: {max_tokens: 6}
    - prompt: the third request
  max_tokens: 8
  sampling:
    repetition_penalty: 1.2
faults:
  - kind: oom
    rank: 0
    at: {request: 0, token: 3}
"""


def load(text: str) -> Any:
    return load_scenario_text(textwrap.dedent(text), file="s.yaml")


def errors(text: str) -> list[tuple[int | None, str | None, str]]:
    """(line, field, message) of every error loading ``text``."""
    with pytest.raises(ScenarioErrors) as info:
        load(text)
    return [(e.line, e.field, e.message) for e in info.value.errors]


def where(text: str) -> list[tuple[int | None, str | None]]:
    return [(line, field) for line, field, _ in errors(text)]


def with_lines(text: str, line: int, *new: str) -> str:
    """``text`` with ``new`` lines in place of line ``line`` (1-based)."""
    lines = text.splitlines()
    return "\n".join(lines[:line - 1] + list(new) + lines[line:]) + "\n"


# --- version -------------------------------------------------------------------------------

def test_the_format_is_version_1_1_and_version_1_files_stay_valid():
    assert FORMAT_VERSION == "1.1"
    for path in sorted(BUNDLED.glob("*.yaml")):
        load_scenario(path)
    published = json.loads((REPO / "ftkit" / "scenario" / "scenario.schema.json").read_text())
    assert published["$id"] == "urn:ftkit:scenario:1.1"


# --- what the job gets ---------------------------------------------------------------------

def test_a_version_1_workload_gives_the_version_1_sampling_spec():
    scenario = load("""\
        name: t
        workload:
          prompts: [a, b]
          max_tokens: 12
          temperature: 0.7
          top_p: 0.9
          seed: 5
        faults: []
        """)
    assert scenario.sampling_spec() == SamplingSpec(max_tokens=12, temperature=0.7, top_p=0.9,
                                                    seed=5)
    assert scenario.sampling_spec().for_request(1) == {
        "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True, "seed": 6}


def test_request_fields_override_workload_fields_which_override_version_1():
    scenario = load("""\
        name: t
        workload:
          requests:
            - prompt: first
              sampling: {seed: 100, repetition_penalty: 1.5, stop: river}
            - prompt: second
              sampling: {max_tokens: 4, seed: null, ignore_eos: false}
            - prompt: third
          max_tokens: 8
          temperature: 0.5
          seed: 7
          sampling: {repetition_penalty: 1.2, logprobs: 2}
        faults: []
        expect: {tokens: prefix}
        """)
    spec = scenario.sampling_spec()
    assert spec.for_request(0) == {
        "max_tokens": 8, "temperature": 0.5, "top_p": 1.0, "ignore_eos": True,
        "seed": 100, "repetition_penalty": 1.5, "logprobs": 2, "stop": "river"}
    assert spec.for_request(1) == {
        "max_tokens": 4, "temperature": 0.5, "top_p": 1.0, "ignore_eos": False,
        "seed": None, "repetition_penalty": 1.2, "logprobs": 2}
    # The third request sets nothing: the workload's seed plus its index.
    assert spec.for_request(2)["seed"] == 9
    assert scenario.prompts() == ["first", "second", "third"]


def test_the_runner_sends_the_scenario_sampling_spec(monkeypatch):
    scenario = load(BASE)
    sent: list[EngineJob] = []

    class Host:
        key = "k"
        alive = True

        def run(self, job, name, on_event, timeout_s, planned):
            sent.append(job)
            return RunOutput(requests=[])

    runner = ScenarioRunner(use_cache=False)
    monkeypatch.setattr(runner, "_host_for", lambda job: Host())
    runner.run_job(scenario, "/models/tiny", recovery=RecoveryConfig(), plan=FaultPlan(None),
                   on_event=lambda event: None, timeout_s=5)
    [job] = sent
    assert job.sampling.extra == {"repetition_penalty": 1.2}
    assert job.sampling.requests == ({}, {"max_tokens": 6}, {})
    assert job.prompts == ("the first request", "the second request", "the third request")
    # The job's JSON form carries the fields to the engine host.
    assert EngineJob.from_json(job.to_json()).sampling.for_request(1)["max_tokens"] == 6


# --- logit_bias keys -------------------------------------------------------------------------

def test_logit_bias_takes_integer_and_string_keys_and_vllm_gets_integers():
    from vllm import SamplingParams

    scenario = load("""\
        name: t
        workload:
          requests:
            - prompt: first
              sampling: {logit_bias: {"17": 2.5, 3: -100}}
            - prompt: second
              sampling: {logit_bias: {17: 2.5, "3": -100}}
        faults: []
        """)
    spec = scenario.sampling_spec()
    assert spec.requests[0] == spec.requests[1] == {"logit_bias": {"17": 2.5, "3": -100.0}}
    # After the job's JSON round trip too (JSON keys are strings).
    sent = EngineJob.from_json(EngineJob(engine=scenario.engine, sampling=spec,
                                         prompts=tuple(scenario.prompts())).to_json())
    kwargs = sent.sampling.for_request(0)
    assert kwargs["logit_bias"] == {17: 2.5, 3: -100.0}
    assert SamplingParams(**kwargs).logit_bias == {17: 2.5, 3: -100.0}


@pytest.mark.parametrize("bias, message", [
    ('{"x": 1}', "logit_bias keys are token ids (integers >= 0), not 'x'"),
    ("{-4: 1}", "logit_bias keys are token ids (integers >= 0), not -4"),
    ('{5: 1, "5": 2}', "logit_bias gives token 5 twice"),
    ("{5: 101}", "logit_bias of token 5 is 101.0: a bias is in [-100, 100]"),
    ("{1.5: 1}", "key '1.5' is not a string (quote it)"),
])
def test_bad_logit_bias_is_an_error_on_its_line(bias, message):
    text = with_lines(BASE, 10, f"    logit_bias: {bias}")
    [(line, field, found)] = errors(text)
    assert line == 10 and found.startswith(message)
    assert field == "workload.sampling.logit_bias"


# --- the prompt source ---------------------------------------------------------------------

def test_exactly_one_of_prompts_random_prompts_and_requests():
    both = with_lines(BASE, 3, "  prompts: [a, b, c]", "  requests:")
    assert errors(both) == [(4, "workload.requests", "give either prompts or requests, not "
                                                     "both")]
    none = "name: t\nworkload: {max_tokens: 8}\nfaults: []\n"
    assert errors(none) == [(2, "workload", "give the requests: prompts, random_prompts or "
                                            "requests")]
    assert where("name: t\nworkload:\n  requests: []\nfaults: []\n") == [(3, "workload.requests")]


def test_fault_request_indexes_the_requests_and_its_token_their_own_max_tokens():
    past = with_lines(BASE, 14, "    at: {request: 3, token: 3}")
    [(line, field, message)] = errors(past)
    assert (line, field) == (14, "faults[0].at.request")
    assert "the workload has 3 request(s)" in message
    beyond = with_lines(BASE, 14, "    at: {request: 1, token: 6}")
    [(line, field, message)] = errors(beyond)
    assert (line, field) == (14, "faults[0].at.token")
    assert message == ("token 6 is never computed: request 1's max_tokens "
                       "(workload.requests[1].sampling.max_tokens) is 6, tokens are numbered "
                       "from 0")
    load(with_lines(BASE, 14, "    at: {request: 1, token: 5}"))
    # The other requests have the workload's max_tokens.
    [(_, _, message)] = errors(with_lines(BASE, 14, "    at: {request: 2, token: 8}"))
    assert "workload.max_tokens is 8" in message


def test_a_fault_token_past_the_engines_longest_sequence_is_refused():
    """max_tokens may ask for more than the engine holds (vLLM stops the request at
    max_model_len): a fault at a token past it would never fire, and is refused."""
    text = (BASE.replace("  max_tokens: 8\n", "  max_tokens: 900\n")
            .replace("token: 3}", "token: 600}") + "engine: {max_model_len: 512}\n")
    [(line, field, message)] = errors(text)
    assert (line, field) == (14, "faults[0].at.token")
    assert message == ("token 600 is never computed: engine.max_model_len is 512 (the prompt "
                       "and the output together)")
    load(text.replace("token: 600}", "token: 500}"))


# --- workload.sampling holds no version 1 field ----------------------------------------------

@pytest.mark.parametrize("field, value", [("max_tokens", 4), ("temperature", 0.5),
                                          ("top_p", 0.9), ("seed", 3)])
def test_a_version_1_field_in_workload_sampling_names_the_field_to_use(field, value):
    text = with_lines(BASE, 10, "    repetition_penalty: 1.2", f"    {field}: {value}")
    [(line, where_, message)] = errors(text)
    assert (line, where_) == (11, f"workload.sampling.{field}")
    assert f"set workload.{field}" in message


# --- vLLM's own check --------------------------------------------------------------------------

def test_every_accepted_field_is_a_field_of_vllm_sampling_params():
    names = vllm_sampling.sampling_param_names()
    assert names is not None
    assert set(SamplingFields.model_fields) <= names


def test_every_accepted_field_reaches_vllm_and_builds_its_sampling_params():
    from vllm import SamplingParams

    scenario = load("""\
        name: t
        workload:
          requests:
            - prompt: first
              sampling:
                max_tokens: 6
                temperature: 0.8
                top_p: 0.9
                seed: 3
                n: 2
                presence_penalty: 0.5
                frequency_penalty: -0.5
                repetition_penalty: 1.3
                top_k: 20
                min_p: 0.05
                stop: [river, lake]
                stop_token_ids: [7, 9]
                include_stop_str_in_output: true
                ignore_eos: false
                min_tokens: 2
                logprobs: 3
                prompt_logprobs: 2
                logit_bias: {5: 1.5}
                allowed_token_ids: [1, 2, 3, 5, 7, 9]
                bad_words: [storm]
                skip_special_tokens: false
                spaces_between_special_tokens: false
        faults: []
        """)
    kwargs = scenario.sampling_spec().for_request(0)
    assert set(kwargs) == set(SamplingFields.model_fields)
    params = SamplingParams(**kwargs)
    assert (params.n, params.top_k, params.stop, params.logit_bias, params.bad_words,
            params.prompt_logprobs, params.ignore_eos) == \
        (2, 20, ["river", "lake"], {5: 1.5}, ["storm"], 2, False)


def test_the_bad_file_names_each_refused_field_and_its_line():
    path = str(BAD / "sampling_refused.yaml")
    with pytest.raises(ScenarioErrors) as info:
        load_scenario(path)
    found = [(Path(e.file).name, e.line, e.field) for e in info.value.errors]
    assert found == [("sampling_refused.yaml", 6, "workload.requests[1].sampling.min_tokens"),
                     ("sampling_refused.yaml", 10, "workload.requests[2].sampling.n")]
    min_tokens, n = info.value.errors
    assert min_tokens.message == ("vLLM refuses it: min_tokens must be less than or equal to "
                                  "max_tokens=8, got 12.")
    assert n.message == "vLLM refuses it: n must be 1 when using greedy sampling, got 2."


@pytest.mark.parametrize("lines, at, words", [
    # A workload-wide field fails every request: one error, where it is written.
    (["    repetition_penalty: 0"], (10, "workload.sampling.repetition_penalty"),
     "repetition_penalty must be greater than zero"),
    (["    repetition_penalty: 1.2", "    presence_penalty: 2.5"],
     (11, "workload.sampling.presence_penalty"), "presence_penalty must be in [-2, 2]"),
    (["    repetition_penalty: 1.2", "    stop: ['']"], (11, "workload.sampling.stop"),
     "stop cannot contain an empty string"),
    (["    repetition_penalty: 1.2", "    min_p: 1.5"], (11, "workload.sampling.min_p"),
     "min_p must be in [0, 1]"),
])
def test_a_field_vllm_refuses_is_an_error_on_its_line(lines, at, words):
    [(line, field, message)] = errors(with_lines(BASE, 10, *lines))
    assert (line, field) == at
    assert message.startswith("vLLM refuses it: ") and words in message


def test_a_request_temperature_vllm_refuses_names_the_request_field():
    text = with_lines(BASE, 6, "      sampling: {max_tokens: 6, temperature: 2.5, seed: 1}")
    assert where(text) == [(6, "workload.requests[1].sampling.temperature")]


def test_an_unknown_field_is_an_error_naming_it():
    [(line, field, message)] = errors(with_lines(BASE, 10, "    truncate_prompt_tokens: 4"))
    assert (line, field) == (10, "workload.sampling.truncate_prompt_tokens")
    assert message.startswith("unknown key 'truncate_prompt_tokens'")
    text = with_lines(BASE, 6, "      sampling: {max_tokens: 6, watermarking: true}")
    assert where(text) == [(6, "workload.requests[1].sampling.watermarking")]


def test_the_type_errors_file():
    path = str(BAD / "sampling_types.yaml")
    with pytest.raises(ScenarioErrors) as info:
        load_scenario(path)
    assert [(e.line, e.field, e.message.split(" (got")[0].split(" (known")[0])
            for e in info.value.errors] == [
        (5, "workload.sampling.logit_bias",
         "logit_bias keys are token ids (integers >= 0), not 'x'"),
        (6, "workload.sampling.stop", "stop must be a string or a list of strings"),
        (7, "workload.sampling.truncate_prompt_tokens", "unknown key 'truncate_prompt_tokens'"),
    ]


def test_without_vllm_only_the_types_are_checked(monkeypatch):
    monkeypatch.setattr(vllm_sampling, "_sampling_params", lambda: None)
    assert vllm_sampling.sampling_param_names() is None
    assert vllm_sampling.refusal({"repetition_penalty": 0}) is None
    # vLLM would refuse this value; without it the run's engine does.
    load(with_lines(BASE, 10, "    repetition_penalty: 0"))
    assert where(with_lines(BASE, 10, "    repetition_penalty: high")) == \
        [(10, "workload.sampling.repetition_penalty")]


def test_version_1_workloads_are_not_checked_by_vllm(monkeypatch):
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm_sampling, "refusal", lambda kwargs: asked.append(kwargs))
    load_scenario(BUNDLED / "link_flap.yaml")
    assert asked == []
    load(BASE)
    assert [kwargs["repetition_penalty"] for kwargs in asked] == [1.2, 1.2, 1.2]


# --- reproducibility, resume, engine arguments -----------------------------------------------

@pytest.mark.parametrize("sampling, ok", [
    ("{temperature: 0.7}", False),                 # no seed anywhere
    ("{temperature: 0.7, seed: 4}", True),
    ("{temperature: 0.7, seed: -1}", False),       # vLLM reads -1 as no seed
    ("{temperature: 0}", True),
])
def test_a_randomly_sampled_request_needs_a_seed_to_expect_identical_tokens(sampling, ok):
    text = with_lines(BASE, 6, f"      sampling: {sampling}")
    if ok:
        load(text)
        return
    [(line, field, message)] = errors(text)
    assert (line, field) == (6, "workload.requests[1].sampling.seed")
    assert "give workload.requests[1].sampling.seed, or expect tokens 'prefix'" in message
    load(text + "expect: {tokens: prefix}\n")


def test_a_request_that_unsets_the_workload_seed_is_unseeded():
    text = with_lines(BASE, 8, "  max_tokens: 8", "  temperature: 0.6", "  seed: 3")
    load(text)
    text = with_lines(text, 6, "      sampling: {seed: null}")
    assert where(text) == [(6, "workload.requests[1].sampling.seed")]


def test_unseeded_workload_temperature_is_one_error_at_workload_seed():
    text = with_lines(BASE, 8, "  max_tokens: 8", "  temperature: 0.6")
    [(line, field, message)] = errors(text)
    assert (line, field) == (2, "workload.seed")
    assert "give workload.seed" in message


@pytest.mark.parametrize("sampling", [
    "{max_tokens: 6, temperature: 0.8, seed: 1, n: 2}", "{frequency_penalty: 0.5}",
    "{presence_penalty: -0.2}", "{bad_words: [mountain]}"])
def test_a_process_kill_with_any_request_feature_validates(sampling):
    """A killed process's requests are resumed exactly whatever they sample with
    (tests/vllm/test_resume_features.py), so no feature is refused beside a kill."""
    text = with_lines(BASE, 6, f"      sampling: {sampling}")
    load(with_lines(text, 12, "  - kind: process_kill"))


@pytest.mark.parametrize("arg, value, fix", [
    ("pipeline_parallel_size", "3", "set it to 2 or 1"),
    ("data_parallel_size", "2",
     "set it to 1, or serve a dense model's replicas (engine.mode serve)"),
    ("enable_expert_parallel", "true", "set it to false"),
    ("speculative_config", "{method: ngram, num_speculative_tokens: 2}", "remove it"),
    ("async_scheduling", "true", "set it to false"),
])
def test_engine_args_that_recovery_cannot_recover_are_refused(arg, value, fix):
    text = f"engine:\n  args:\n    {arg}: {value}\n" + BASE
    [(line, field, message)] = errors(text)
    assert (line, field) == (3, f"engine.args.{arg}")
    assert message.startswith("ftkit's recovery does not support ")
    assert f": {fix} (or set recovery.enabled false" in message
    load(text + "recovery: {enabled: false}\nexpect: {outcome: failed}\n")


@pytest.mark.parametrize("arg, value", [("pipeline_parallel_size", "1"),
                                        ("async_scheduling", "false"),
                                        ("speculative_config", "null")])
def test_engine_args_that_turn_nothing_on_are_accepted(arg, value):
    load(f"engine:\n  args:\n    {arg}: {value}\n" + BASE)


def test_two_pipeline_stages_validate_and_count_their_ranks():
    text = "engine:\n  args:\n    pipeline_parallel_size: 2\n" + BASE
    scenario = load(text.replace("    rank: 0", "    rank: 1"))
    assert scenario.engine.world_size == 2 and scenario.engine.ranks == 2
    [(line, field, message)] = errors(text.replace("    rank: 0", "    rank: 2"))
    assert field == "faults[0].rank" and "pipeline_parallel_size) is 2" in message
    stages_of_two = text.replace("engine:\n", "engine:\n  tensor_parallel_size: 2\n")
    assert load(stages_of_two.replace("    rank: 0", "    rank: 3")).engine.world_size == 4


@pytest.mark.parametrize("engine, fix", [
    ("  mode: serve\n  args:\n    pipeline_parallel_size: 2\n", "set it to 1, or use "
                                                                 "engine.mode offline"),
])
def test_pipeline_stages_recovery_cannot_handle_yet_are_refused(engine, fix):
    [(line, field, message)] = errors("engine:\n" + engine + BASE)
    assert field == "engine.args.pipeline_parallel_size" and fix in message


@pytest.mark.parametrize("rank, refused", [
    (0, "rank 0 is on pipeline stage 0 of 2, which does not sample"),
    ("all", "rank all includes stages that do not sample"),
    (1, None),
])
def test_a_sampling_fault_names_a_rank_of_the_last_pipeline_stage(rank, refused):
    text = ("engine:\n  args:\n    pipeline_parallel_size: 2\n" + BASE
            + "    phase: sample\n").replace("    rank: 0", f"    rank: {rank}")
    if refused is None:
        load(text)
        return
    [(line, field, message)] = errors(text)
    assert field == "faults[0].phase" and refused in message
    assert "only the last stage does (rank 1)" in message


def test_engine_features_reach_vllm_through_engine_args():
    scenario = load_scenario(BUNDLED / "chunked_prefill_preemption.yaml")
    args = engine_args(scenario.engine, RecoveryConfig())
    assert {key: args[key] for key in ("enable_chunked_prefill", "max_num_batched_tokens",
                                       "num_gpu_blocks_override", "enable_prefix_caching",
                                       "max_model_len")} == {
        "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
        "num_gpu_blocks_override": 8, "enable_prefix_caching": True, "max_model_len": 128}
    extra = with_lines(BASE, 1, "name: t", "engine:", "  args: {max_num_seqs: 2}")
    assert engine_args(load(extra).engine, None)["max_num_seqs"] == 2


# --- expect.logprob_tolerance --------------------------------------------------------------------

def test_logprob_tolerance_defaults_to_bit_identical_and_is_not_negative():
    assert load(BASE).expect.logprob_tolerance == 0.0
    assert load(BASE + "expect: {logprob_tolerance: 0.001}\n").expect.logprob_tolerance == 0.001
    assert where(BASE + "expect: {logprob_tolerance: -0.1}\n") == \
        [(15, "expect.logprob_tolerance")]


# --- cache keys --------------------------------------------------------------------------------

def test_version_1_workload_keys_are_unchanged():
    scenario = load("""\
        name: t
        workload:
          prompts: [a, b]
          max_tokens: 12
          temperature: 0.7
          top_p: 0.9
          seed: 5
        faults: []
        """)
    assert scenario.workload_key() == {"prompts": ["a", "b"], "max_tokens": 12,
                                       "temperature": 0.7, "top_p": 0.9, "seed": 5}


def test_requests_without_fields_share_the_key_of_the_same_prompts():
    requests = load(BASE.replace("      sampling: {max_tokens: 6}\n", ""))
    prompts = load(BASE.replace("      sampling: {max_tokens: 6}\n", "").replace(
        "  requests:\n    - prompt: the first request\n    - prompt: the second request\n"
        "    - prompt: the third request\n",
        "  prompts: [the first request, the second request, the third request]\n"))
    assert requests.workload_key() == prompts.workload_key()
    assert requests.workload_key()["sampling"] == {"repetition_penalty": 1.2}
    assert "requests" not in requests.workload_key()


def test_workload_keys_change_with_every_sampling_field():
    variants = [
        BASE,
        BASE.replace("repetition_penalty: 1.2", "repetition_penalty: 1.3"),
        BASE.replace("repetition_penalty: 1.2", "frequency_penalty: 0.2"),
        BASE.replace("{max_tokens: 6}", "{max_tokens: 5}"),
        BASE.replace("{max_tokens: 6}", "{max_tokens: 6, stop: river}"),
        BASE.replace("{max_tokens: 6}", "{max_tokens: 6, logprobs: 1}"),
        BASE.replace("{max_tokens: 6}", "{max_tokens: 6, temperature: 0.5, seed: 2}"),
        BASE.replace("{max_tokens: 6}", "{max_tokens: 6, temperature: 0.5, seed: 3}"),
    ]
    keys = {json.dumps(load(text).workload_key(), sort_keys=True) for text in variants}
    assert len(keys) == len(variants)


def test_greedy_keys_ignore_top_p_and_seed_unless_a_request_samples():
    greedy = load(BASE)
    same = load(with_lines(BASE, 8, "  max_tokens: 8", "  top_p: 0.5", "  seed: 9"))
    assert same.workload_key() == greedy.workload_key()
    sampled = with_lines(BASE, 6, "      sampling: {max_tokens: 6, temperature: 0.5, seed: 1}")
    a = load(sampled)
    b = load(with_lines(sampled, 8, "  max_tokens: 8", "  top_p: 0.5", "  seed: 9"))
    assert a.workload_key() != b.workload_key()


# --- overrides and the command line -----------------------------------------------------------

def test_an_override_vllm_refuses_names_the_override(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(BASE)
    scenario = load_scenario(path)
    with pytest.raises(ScenarioErrors) as info:
        Overrides.parse(sets=["workload.sampling.repetition_penalty=0"]).apply(scenario)
    [error] = info.value.errors
    assert str(error).startswith("--set workload.sampling.repetition_penalty=0: "
                                 "workload.sampling.repetition_penalty: vLLM refuses it: ")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_command_line_exits_2_with_file_line_and_field(command):
    path = str(BAD / "sampling_refused.yaml")
    result = CliRunner().invoke(ftkit, [command, path], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"{path}:10: workload.requests[2].sampling.n: vLLM refuses it" in result.output


# --- the bundled 1.1 scenarios ------------------------------------------------------------------

def test_the_bundled_scenarios_use_the_features_they_are_named_after():
    penalties = load_scenario(BUNDLED / "penalties_sample_fault.yaml")
    assert penalties.sampling_spec().extra == {"repetition_penalty": 1.3,
                                               "frequency_penalty": 0.5, "logprobs": 2}
    assert penalties.workload.temperature == 0 and penalties.engine.tensor_parallel_size == 1
    assert [f.phase for f in penalties.faults] == ["sample"]

    stops = load_scenario(BUNDLED / "stop_strings_n2.yaml").sampling_spec()
    assert [stops.for_request(i).get("n", 1) for i in range(3)] == [2, 2, 1]
    assert all(stops.for_request(i)["stop"] and stops.for_request(i)["seed"] is not None
               for i in range(3))

    bias = load_scenario(BUNDLED / "logit_bias_prompt_logprobs.yaml").sampling_spec()
    assert bias.for_request(0)["logit_bias"] == {60: 2.5, 61: -1.5}
    assert bias.for_request(1)["logit_bias"] == {40: -100.0, 41: -100.0, 60: 2.5}
    assert bias.extra["prompt_logprobs"] == 3

    chunked = yaml.safe_load((BUNDLED / "chunked_prefill_preemption.yaml").read_text())
    assert chunked["engine"]["args"]["num_gpu_blocks_override"] * 32 < \
        8 * (chunked["workload"]["max_tokens"] + 16)  # eight requests cannot all fit
