"""The pytest plugin as a user meets it: collected scenario files, the markers and fixtures,
settings and their precedence. Runs pytest inside pytest (``pytester``).

Anything that may start an engine runs pytest in a subprocess (``runpytest_subprocess``):
only one in-process engine may live in a process. The fast tests (no engine) never reach
``ftkit_engine``: collection, markers, settings, and verdicts from a stand-in runner.
"""

from __future__ import annotations

import pytest

from ftkit.model.tiny import cache_root
from ftkit.pytest_plugin import (
    SETTINGS,
    FtkitSettingError,
    fault_plan,
    resolve_setting,
    resolve_settings,
)

pytest_plugins = ["pytester"]

#: Pytester points HOME at a fresh directory; engines should still find the built tiny model.
CACHE_DIR = str(cache_root())
SETTING = {s.key: s for s in SETTINGS}

OOM_RECOVERED = """\
name: oom_recovered
engine: {model: tiny, tensor_parallel_size: 1}
workload:
  prompts: ["the quick brown fox jumps over the lazy dog", "a small boat crossed the lake"]
  max_tokens: 16
recovery: {enabled: true, max_reinference: 3}
faults:
  - kind: oom
    rank: 0
    at: {request: 0, token: 5}
    phase: forward
    times: 2
expect: {outcome: recovered, tokens: identical, timeout_s: 240}
"""
#: The same run, expected to surface the fault: it recovers, so the verdict is fail.
OOM_WRONGLY_EXPECTED = OOM_RECOVERED.replace("oom_recovered", "oom_wrongly_expected").replace(
    "outcome: recovered", "outcome: failed")
MALFORMED = """\
name: malformed
workload:
  prompts: ["a prompt"]
  max_tokens: 16
faults:
  - kind: oom
    rank: zero
    at: {request: 0, token: 5}
"""
NOT_A_SCENARIO = "services:\n  web:\n    image: nginx\n"


def scenario(name: str) -> str:
    return OOM_RECOVERED.replace("oom_recovered", name)


@pytest.fixture
def engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTKIT_CACHE_DIR", CACHE_DIR)


# --- which files are collected ---------------------------------------------------------------

def test_a_directory_on_the_command_line_collects_its_scenarios_only(pytester):
    pytester.makefile(".yaml", **{"scenarios/one": scenario("one"),
                                  "scenarios/compose": NOT_A_SCENARIO,
                                  "scenarios/nested/deeper": scenario("deeper")})
    pytester.makefile(".yml", **{"scenarios/two": scenario("two")})
    result = pytester.runpytest("--collect-only", "-q", "scenarios")
    result.stdout.fnmatch_lines(["scenarios/one.yaml::one", "scenarios/two.yml::two",
                                 "2 tests collected*"])
    result.stdout.no_fnmatch_line("*deeper*")
    result.stdout.no_fnmatch_line("*compose*")


def test_yaml_below_a_test_directory_is_not_collected(pytester):
    # ftkit's own tests/data/scenarios/bad must not become failing items of `pytest tests`.
    pytester.makefile(".yaml", **{"tests/data/scenarios/bad/broken": MALFORMED})
    pytester.makepyfile(**{"tests/test_plain": "def test_plain():\n    pass\n"})
    result = pytester.runpytest("tests")
    result.assert_outcomes(passed=1)


def test_an_ini_glob_collects_scenarios_in_subdirectories(pytester):
    pytester.makeini("[pytest]\nftkit_scenario_glob = tests/scenarios/*.yaml\n")
    pytester.makefile(".yaml", **{"tests/scenarios/one": scenario("one"),
                                  "tests/scenarios/compose": NOT_A_SCENARIO,
                                  "tests/other/two": scenario("two")})
    result = pytester.runpytest("--collect-only", "-q", "tests")
    result.stdout.fnmatch_lines(["tests/scenarios/one.yaml::one", "1 test collected*"])


def test_a_malformed_scenario_is_a_collection_error_naming_file_line_and_field(pytester):
    pytester.makefile(".yaml", **{"scenarios/malformed": MALFORMED})
    result = pytester.runpytest("scenarios")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([
        "*ERROR collecting scenarios/malformed.yaml*",
        "scenarios/malformed.yaml:7: faults?0?.rank: rank must be an integer >= 0 or *",
        "*1 error*"])


def test_a_yaml_file_named_explicitly_must_be_a_scenario(pytester):
    pytester.makefile(".yml", compose=NOT_A_SCENARIO)
    result = pytester.runpytest("compose.yml")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["compose.yml:1: *unknown key 'services'*"])


# --- verdicts -> outcomes (a stand-in runner, no engine) -------------------------------------

FAKE_RUNNER = """
import ftkit.runner
from ftkit.results import FaultRecord, RequestComparison, ScenarioResult, Verdict

def fake_run(self, scenario, *, file, on_event=None):
    verdict = Verdict(scenario.description)
    diverged = [RequestComparison(0, [1, 2, 3], [1, 2, 9], first_divergence=2)]
    fault = FaultRecord("oom", 0, 0, 5, "forward", 2, fired=verdict is not Verdict.NOT_APPLIED,
                        attempts=2)
    return ScenarioResult(
        scenario.name, file, verdict, f"stand-in reason for {verdict}", 0.1,
        requests=diverged if verdict is Verdict.FAIL else [], faults=[fault])

ftkit.runner.ScenarioRunner.run = fake_run
"""


def test_each_verdict_maps_to_its_pytest_outcome(pytester):
    pytester.makeconftest(FAKE_RUNNER)
    for verdict in ("pass", "fail", "not_applied", "error"):
        name = verdict.replace("_", "-")
        text = scenario(name).replace("name: ", f"description: {verdict}\nname: ", 1)
        pytester.makefile(".yaml", **{f"scenarios/{name}": text})
    # A subprocess: the stand-in runner patches ftkit.runner for that process only.
    result = pytester.runpytest_subprocess("scenarios", "-rA")
    result.assert_outcomes(passed=1, failed=1, errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of scenario error*", "ftkit verdict error: stand-in reason for error",
        "*ERROR at setup of scenario not-applied*",
        "ftkit verdict not_applied: stand-in reason for not_applied",
        "fault: oom on rank 0 at request 0 token 5 (forward, times 2): never fired",
    ])
    result.stdout.fnmatch_lines([
        "*_ scenario fail _*", "ftkit verdict fail: stand-in reason for fail",
        "first divergence: request 0 diverges at token 2: expected 3, got 9",
    ])


def test_scenarios_are_collected_and_judged_on_xdist_workers(pytester):
    pytester.makeconftest(FAKE_RUNNER)
    for verdict in ("pass", "fail", "error"):
        text = scenario(verdict).replace("name: ", f"description: {verdict}\nname: ", 1)
        pytester.makefile(".yaml", **{f"scenarios/{verdict}": text})
    result = pytester.runpytest_subprocess("-n", "2", "scenarios")
    result.assert_outcomes(passed=1, failed=1, errors=1)


# --- the fault-free baseline (stand-in engines, no vLLM) --------------------------------------

STAND_IN_ENGINES = """
import ftkit.vllm.engine
from ftkit.results import RequestOutput
from ftkit.vllm.workload import GenerateResult


class StandInEngine:
    \"\"\"Stands for EngineSession. With ftkit in it (``recovery``) it is crippled: even
    without a fault its tokens are not a plain engine's.\"\"\"

    def __init__(self, spec, *, recovery=None, multiprocess=None, leftovers_file=None):
        self.spec, self.recovery, self.multiprocess = spec, recovery, multiprocess
        self.llm = self.dead = None
        self.runs = 0

    def start(self):
        self.llm = object()
        return self

    def close(self):
        self.llm = None

    def generate(self, prompts, sampling, *, run_id=None, deadline=None, **kwargs):
        self.runs += 1
        token = 7 if self.recovery is None else 666
        return GenerateResult([RequestOutput(i, [token] * sampling.max_tokens)
                               for i in range(len(prompts))], None, 0.1)


ftkit.vllm.engine.EngineSession = StandInEngine
"""

BASELINE_TESTS = """
def test_the_baseline_comes_from_a_plain_engine(ftkit_injector, ftkit_baseline):
    assert ftkit_baseline(["a b", "c d"], max_tokens=3) == [[7, 7, 7], [7, 7, 7]]
    assert ftkit_baseline(["a b", "c d"], max_tokens=3) == [[7, 7, 7], [7, 7, 7]]
    [plain] = ftkit_injector.fault_free.engines.values()
    assert plain.recovery is None and plain.multiprocess
    assert plain.spec == ftkit_injector.engine.spec
    assert plain.runs == 1  # kept for the session
    assert ftkit_injector.engine.recovery is not None and ftkit_injector.engine.runs == 0
"""


def test_the_baseline_comes_from_a_plain_engine_never_the_engine_under_test(pytester):
    pytester.makeconftest(STAND_IN_ENGINES)
    pytester.makepyfile(test_baseline=BASELINE_TESTS)
    pytester.makefile(".json", **{"model/config": "{}"})
    result = pytester.runpytest_subprocess(f"--ftkit-model={pytester.path / 'model'}")
    result.assert_outcomes(passed=1)


#: The engine under test gives the plain engine's tokens, with one logprob changed (as a
#: recovery that changed a logprob but no token would).
DRIFTING_ENGINES = """
import ftkit.vllm.engine
from ftkit.results import RequestOutput
from ftkit.vllm.workload import GenerateResult


class StandInEngine:
    def __init__(self, spec, *, recovery=None, multiprocess=None, leftovers_file=None):
        self.spec, self.recovery = spec, recovery
        self.llm = self.dead = None

    def start(self):
        self.llm = object()
        return self

    def close(self):
        self.llm = None

    def new_run_id(self):
        return "r1"

    def set_fault_plan(self, plan):
        pass

    def generate(self, prompts, sampling, *, run_id=None, deadline=None, **kwargs):
        outputs = []
        for i in range(len(prompts)):
            logprobs = [-1.25] * sampling.max_tokens
            if self.recovery is not None and i == 1:
                logprobs[2] = -1.2500001
            outputs.append(RequestOutput(i, [7] * sampling.max_tokens, logprobs=logprobs,
                                         finish_reason="length", text="x"))
        return GenerateResult(outputs, None, 0.1)


ftkit.vllm.engine.EngineSession = StandInEngine
"""

DRIFT_TESTS = """
def test_tokens_alone_miss_the_drift(ftkit_injector, ftkit_baseline):
    tokens = ftkit_injector.generate(["a b", "c d"], max_tokens=4)
    assert tokens == ftkit_baseline(["a b", "c d"], max_tokens=4)
    assert ftkit_injector.logprobs[1][2] == -1.2500001


def test_assert_exact_sees_the_drift(ftkit_injector):
    ftkit_injector.generate(["a b", "c d"], max_tokens=4)
    ftkit_injector.assert_exact()
"""


def test_assert_exact_fails_on_a_logprob_drift_that_the_tokens_do_not_show(pytester):
    pytester.makeconftest(DRIFTING_ENGINES)
    pytester.makepyfile(test_drift=DRIFT_TESTS)
    pytester.makefile(".json", **{"model/config": "{}"})
    result = pytester.runpytest_subprocess(f"--ftkit-model={pytester.path / 'model'}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*_ test_assert_exact_sees_the_drift _*",
                                 "*not the fault-free run: logprob drift at request 1, token 2: "
                                 "-1.25 vs -1.2500001*"])


# --- markers --------------------------------------------------------------------------------

def test_markers_are_registered_for_strict_markers(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.ftkit_settings(max_reinference=1)
        @pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 0, "token": 5})
        def test_marked():
            pass
    """)
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1)


def test_fault_markers_make_the_plan_outermost_first_then_top_to_bottom(pytester):
    item = pytester.getitem("""
        import pytest

        pytestmark = pytest.mark.ftkit_fault(kind="oom", rank="all", at={"request": 0, "token": 1})

        @pytest.mark.ftkit_fault(kind="link_flap", rank=1, at={"request": 1, "token": 2}, times=2)
        @pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 0, "token": 3}, phase="sample")
        def test_func():
            pass
    """)
    plan = fault_plan(item)
    assert [(str(f.kind), f.rank, f.at.token, f.phase, f.times) for f in plan] == [
        ("oom", "all", 1, "forward", 1), ("link_flap", 1, 2, "forward", 2),
        ("oom", 0, 3, "sample", 1)]


def test_a_bad_fault_marker_is_an_error_before_any_engine_starts(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.ftkit_fault(kind="meteor", rank=0, at={"request": 0, "token": 5})
        def test_bad(ftkit_injector):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ftkit: ftkit_fault marker 0: kind: *"])


def test_a_bad_setting_names_where_it_was_given(pytester):
    pytester.makepyfile("def test_it(ftkit_injector):\n    pass\n")
    result = pytester.runpytest_subprocess("--ftkit-tp=two")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*ftkit: --ftkit-tp (tensor_parallel_size): expected an integer >= 1, got 'two'*"])


def test_options_are_listed_in_help_with_their_ini_keys(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--ftkit-model=*", "*--ftkit-tp=*",
                                 "*--ftkit-max-reinference=*", "*--ftkit-timeout=*"])
    result.stdout.fnmatch_lines(["*ftkit_tensor_parallel_size (string):*",
                                 "*ftkit_scenario_glob (linelist):*"])


def test_the_plugin_is_inert_when_unused(pytester):
    pytester.makepyfile("""
        import sys

        def test_nothing_heavy_imported():
            assert not {"vllm", "torch", "ftkit.vllm.engine"} & set(sys.modules)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["plugins:*ftkit-*"])  # loaded through its entry point
    assert [line for line in result.outlines
            if "ftkit" in line and not line.startswith("plugins:")] == []


# --- settings precedence ----------------------------------------------------------------------

def test_precedence_is_marker_then_command_line_then_ini_then_environment_then_default():
    tp = SETTING["tensor_parallel_size"]
    assert resolve_setting(tp, marker=4, cli="3", ini="2", env="5") == 4
    assert resolve_setting(tp, cli="3", ini="2", env="5") == 3
    assert resolve_setting(tp, ini="2", env="5") == 2
    assert resolve_setting(tp, env="5") == 5
    assert resolve_setting(tp) == 1
    # Empty values count as not given.
    assert resolve_setting(tp, cli="", ini=" ", env="") == 1


def test_a_bad_value_wins_and_is_reported_with_its_source():
    with pytest.raises(FtkitSettingError, match=r"ini ftkit_max_reinference \(max_reinference\)"
                                                r": expected an integer >= 0, got '-1'"):
        resolve_setting(SETTING["max_reinference"], ini="-1", env="2")
    with pytest.raises(FtkitSettingError, match="environment FTKIT_TIMEOUT"):
        resolve_setting(SETTING["timeout"], env="soon")
    with pytest.raises(FtkitSettingError, match="ftkit_settings marker"):
        resolve_setting(SETTING["tensor_parallel_size"], marker=True)


def test_settings_read_from_a_real_config(pytester):
    pytester.makeini("[pytest]\nftkit_max_reinference = 2\nftkit_model = models/mine\n"
                     "ftkit_timeout = 30\n")
    config = pytester.parseconfig("--ftkit-timeout=45")
    env = {"FTKIT_TENSOR_PARALLEL_SIZE": "2", "FTKIT_MAX_REINFERENCE": "7"}
    settings = resolve_settings(config, {"timeout": 10}, environ=env)
    assert settings.timeout == 10                    # marker over command line and ini
    assert settings.max_reinference == 2             # ini over environment
    assert settings.tensor_parallel_size == 2        # environment over default
    # A relative model directory in an ini file is relative to that file.
    assert settings.model == str(pytester.path / "models" / "mine")
    assert resolve_settings(config, environ={}).timeout == 45
    with pytest.raises(FtkitSettingError, match="unknown keyword.*tp"):
        resolve_settings(config, {"tp": 2}, environ={})


# --- real engines -----------------------------------------------------------------------------

FIXTURE_TESTS = """
import pytest

PROMPTS = ["the quick brown fox jumps over the lazy dog", "a small boat crossed the lake"]
OOM = dict(kind="oom", rank=0, at={"request": 0, "token": 5})


@pytest.mark.ftkit_fault(**OOM)
def test_recovered_tokens_equal_the_baseline(ftkit_injector, ftkit_baseline):
    tokens = ftkit_injector.generate(PROMPTS, max_tokens=16)
    assert ftkit_injector.error is None
    assert tokens == ftkit_baseline(PROMPTS, max_tokens=16)
    # The fault-free tokens came from a plain engine, not the one under test.
    assert [e.recovery for e in ftkit_injector.fault_free.engines.values()] == [None]
    assert len(tokens[0]) == 16
    assert [e.kind for e in ftkit_injector.fired] == ["oom"]
    assert ftkit_injector.faults[0].recovered
    assert [r.decision for r in ftkit_injector.rounds] == ["recompute"]
    # Logprobs, finish reasons and text too, as the scenario runner's oracle sees them.
    assert len(ftkit_injector.logprobs[0]) == 16
    ftkit_injector.assert_exact()


@pytest.mark.ftkit_fault(**OOM)
def test_wrong_expectation(ftkit_injector, ftkit_baseline):
    tokens = ftkit_injector.generate(PROMPTS, max_tokens=16)
    assert tokens != ftkit_baseline(PROMPTS, max_tokens=16), "WRONG EXPECTATION"


@pytest.mark.ftkit_settings(max_reinference=0)
@pytest.mark.ftkit_fault(**OOM)
def test_marker_setting_beats_the_command_line(ftkit_injector):
    ftkit_injector.generate(PROMPTS, max_tokens=16)
    assert ftkit_injector.error is not None
    assert len(ftkit_injector.fired) == 1
    assert not ftkit_injector.faults[0].recovered
"""


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_scenario_files_marker_and_fixtures_on_a_real_engine(pytester, engine_env):
    """One inner run (its engines shared, as a downstream suite's are): scenario files that
    pass and fail, and tests that use the marker and the fixtures."""
    pytester.makefile(".yaml", **{"scenarios/oom_recovered": OOM_RECOVERED,
                                  "scenarios/oom_wrongly_expected": OOM_WRONGLY_EXPECTED})
    pytester.makepyfile(test_faults=FIXTURE_TESTS)
    result = pytester.runpytest_subprocess("--strict-markers", "--ftkit-max-reinference=3",
                                           "scenarios", "test_faults.py", timeout=800)
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*_ scenario oom_wrongly_expected _*",
                                 "ftkit verdict fail: *",
                                 "fault: oom on rank 0 at request 0 token 5 (forward, times 2): "
                                 "fired 2x, recovered in *"])
    result.stdout.fnmatch_lines(["*_ test_wrong_expectation _*", "*WRONG EXPECTATION*"])
