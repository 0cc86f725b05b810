"""Scenario fields set for a whole run (``ftkit run --set`` / ``--set-file``): what they set,
how they are validated, how their errors are named, and that the baseline cache keys the
overridden scenario."""

from __future__ import annotations

import textwrap

import pytest

from ftkit.errors import ScenarioError
from ftkit.runner.baseline import baseline_key
from ftkit.scenario import Overrides, ScenarioErrors, load_scenario, override_lines
from ftkit.scenario.overrides import parse_set_argument

SCENARIO = textwrap.dedent("""\
    name: flap
    engine:
      tensor_parallel_size: 2
      dtype: float32
      block_size: 32
    workload:
      prompts: ["the quick brown fox", "a lazy dog"]
      max_tokens: 32
    recovery: {max_reinference: 3}
    faults:
      - kind: link_flap
        rank: 1
        at: {request: 0, token: 17}
        times: 3
    """)


@pytest.fixture
def scenario_file(tmp_path):
    path = tmp_path / "flap.yaml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture
def scenario(scenario_file):
    return load_scenario(scenario_file)


def errors_of(call) -> list[str]:
    with pytest.raises(ScenarioErrors) as caught:
        call()
    return [str(e) for e in caught.value.errors]


# --- what an override sets --------------------------------------------------------------

def test_engine_and_workload_fields_are_set_and_the_rest_kept(scenario, scenario_file):
    overrides = Overrides.parse(sets=["engine.block_size=128", "engine.dtype=bfloat16",
                                      "workload.max_tokens=24"])
    overridden = overrides.apply(scenario)
    assert overridden.engine.block_size == 128 and overridden.engine.dtype == "bfloat16"
    assert overridden.workload.max_tokens == 24
    assert overridden.engine.tensor_parallel_size == 2
    assert overridden.faults == scenario.faults and overridden.name == "flap"
    # The original is untouched; the result still knows its file and lines.
    assert scenario.engine.dtype == "float32" and scenario.workload.max_tokens == 32
    assert overridden.source == str(scenario_file)
    assert overridden.line_of("engine.dtype") == 4


def test_values_are_yaml_and_a_mapping_merges_into_the_field(scenario):
    overridden = Overrides.parse(sets=[
        "engine.args={enforce_eager: true, max_num_seqs: 4}", "engine.args.swap_space=0",
        "workload.prompts=[one prompt, 'two']", "expect.max_recovery_s=2.5"]).apply(scenario)
    assert overridden.engine.args == {"enforce_eager": True, "max_num_seqs": 4,
                                      "swap_space": 0}
    assert overridden.workload.prompts == ["one prompt", "two"]
    assert overridden.expect.max_recovery_s == 2.5


def test_the_last_one_given_wins_and_files_come_before_sets(tmp_path, scenario):
    first = tmp_path / "first.yaml"
    first.write_text("engine:\n  dtype: float16\n  block_size: 64\n")
    second = tmp_path / "second.yaml"
    second.write_text("engine.block_size: 128\nworkload.max_tokens: 20\n")
    overrides = Overrides.parse(sets=["engine.dtype=bfloat16", "workload.max_tokens=24"],
                                files=[first, second])
    assert overrides.to_dict() == {"engine.block_size": 128, "engine.dtype": "bfloat16",
                                   "workload.max_tokens": 24}
    overridden = overrides.apply(scenario)
    assert (overridden.engine.dtype, overridden.engine.block_size,
            overridden.workload.max_tokens) == ("bfloat16", 128, 24)


def test_no_overrides_leave_the_scenario_as_it_is(scenario):
    overrides = Overrides.parse()
    assert not overrides and overrides.to_dict() == {}
    assert overrides.apply(scenario) is scenario


@pytest.mark.parametrize("value", [128, 2.5, "bfloat16", "128", "true", "", "a: b", True,
                                   None, ["a b", "c"], {}, "with space", " padded"])
def test_override_lines_read_back_as_the_same_value(value):
    [line] = override_lines({"engine.args.key": value})
    [override] = parse_set_argument(line)
    assert (override.field, override.value) == ("engine.args.key", value)


# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("argument, expected", [
    ("engine.dtype=bfloat17",
     "--set engine.dtype=bfloat17: engine.dtype: input should be 'auto'"),
    ("engine.blok_size=128",
     "--set engine.blok_size=128: engine.blok_size: unknown key 'blok_size'; did you mean "
     "'block_size'?"),
    ("engine.block_size=100", "--set engine.block_size=100: engine.block_size: input should "
                              "be a multiple of 16"),
    ("engine.block_size=big", "--set engine.block_size=big: engine.block_size: input should "
                              "be a valid integer"),
    ("workload.max_tokens.x=1", "--set workload.max_tokens.x=1: workload.max_tokens.x: "
                                "workload.max_tokens is a value, not a mapping"),
    ("workload.random_prompts.count=3", "--set workload.random_prompts.count=3: "
                                        "workload.random_prompts: give either prompts or "
                                        "random_prompts, not both"),
])
def test_a_bad_value_names_the_argument_and_the_field(scenario, argument, expected):
    [error] = errors_of(lambda: Overrides.parse(sets=[argument]).apply(scenario))
    assert error.startswith(expected), error


@pytest.mark.parametrize("argument, expected", [
    ("faults[0].at.token=3", "--set faults[0].at.token=3: faults[0].at.token: 'faults' cannot "
                             "be overridden"),
    ("workload.prompts[0]=x", "--set workload.prompts[0]=x: workload.prompts[0]: an override "
                              "applies to every scenario of the run, so it cannot index into "
                              "a list"),
    ("name=other", "--set name=other: name: 'name' cannot be overridden"),
    ("engin.dtype=float16", "--set engin.dtype=float16: engin.dtype: unknown section 'engin'; "
                            "did you mean 'engine'?"),
    ("engine.dtype", "--set engine.dtype: expected FIELD=VALUE"),
    ("=3", "--set =3: expected FIELD=VALUE"),
    ("engine..dtype=x", "--set engine..dtype=x: engine..dtype: a field path is names joined"),
    ("engine.dtype=[oops", "--set engine.dtype=[oops: invalid YAML"),
])
def test_a_malformed_argument_is_refused_before_any_scenario(argument, expected):
    [error] = errors_of(lambda: Overrides.parse(sets=[argument]))
    assert error.startswith(expected), error


def test_an_error_the_override_causes_elsewhere_names_the_scenario_line(scenario,
                                                                         scenario_file):
    # The fault is at token 17: 8 tokens never reach it.
    [error] = errors_of(lambda: Overrides.parse(sets=["workload.max_tokens=8"]).apply(scenario))
    assert error.startswith(f"{scenario_file}:13: faults[0].at.token: token 17 is never "
                            f"computed")
    assert error.endswith("(with the overrides workload.max_tokens=8)")


def test_override_file_errors_name_the_file_and_line(tmp_path, scenario):
    path = tmp_path / "npu.yaml"
    path.write_text("# NPU settings\nengine:\n  dtype: bfloat17\n  block_size: 128\n"
                    "faults.0.times: 2\n")
    [refused] = errors_of(lambda: Overrides.parse(files=[path]))
    assert refused.startswith(f"{path}:5: faults.0.times: 'faults' cannot be overridden")
    path.write_text("# NPU settings\nengine:\n  dtype: bfloat17\n  block_size: 128\n")
    [bad] = errors_of(lambda: Overrides.parse(files=[path]).apply(scenario))
    assert bad.startswith(f"{path}:3: engine.dtype: input should be")


@pytest.mark.parametrize("text, expected", [
    ("", "an override file holds one non-empty mapping"),
    ("- engine.dtype: x\n", "an override file holds one non-empty mapping"),
    ("engine: {dtype: x}\nengine: {seed: 1}\n", "duplicate key 'engine'"),
    ("engine: [\n", "invalid YAML"),
])
def test_a_malformed_override_file_is_refused(tmp_path, text, expected):
    path = tmp_path / "o.yaml"
    path.write_text(text)
    [error] = errors_of(lambda: Overrides.parse(files=[path]))
    assert error.startswith(str(path)) and expected in error, error


def test_a_missing_override_file_is_an_error(tmp_path):
    [error] = errors_of(lambda: Overrides.parse(files=[tmp_path / "nope.yaml"]))
    assert error == f"{tmp_path / 'nope.yaml'}: cannot read the override file: No such file " \
                    f"or directory"


def test_every_problem_is_reported_and_an_override_error_once_for_all_scenarios(tmp_path):
    loaded = []
    for name in ("one", "two"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(SCENARIO.replace("name: flap", f"name: {name}"))
        loaded.append((str(path), load_scenario(path)))
    # Both break semantic rules (type errors would hide those, as in a file).
    errors = errors_of(lambda: Overrides.parse(
        sets=["workload.random_prompts.count=3", "workload.max_tokens=8"]).apply_all(loaded))
    assert sum(e.startswith("--set workload.random_prompts.count=3") for e in errors) == 1
    # The consequence lies in each scenario's own file.
    assert sorted(e.split(":")[0] for e in errors if "never computed" in e) == \
        sorted(file for file, _ in loaded)
    with pytest.raises(ScenarioError):
        Overrides.parse(sets=["bad", "engine.x[1]=2"])
    assert len(errors_of(lambda: Overrides.parse(sets=["bad", "engine.x[1]=2"]))) == 2


# --- the baseline cache keys the overridden scenario -----------------------------------

def test_an_override_changes_the_baseline_key(scenario):
    plain = baseline_key(scenario, "unused-for-tiny")
    bf16 = baseline_key(Overrides.parse(sets=["engine.dtype=bfloat16"]).apply(scenario),
                        "unused-for-tiny")
    shorter = baseline_key(Overrides.parse(sets=["workload.max_tokens=24"]).apply(scenario),
                           "unused-for-tiny")
    assert len({plain, bf16, shorter}) == 3
    # Setting what the file already says changes nothing: the key is of the values.
    same = baseline_key(Overrides.parse(sets=["engine.dtype=float32"]).apply(scenario),
                        "unused-for-tiny")
    assert same == plain
