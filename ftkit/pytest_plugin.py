"""ftkit's pytest plugin: scenario files as tests, and fault injection inside your own tests.

Installed with ftkit (entry point ``pytest11: ftkit``). It stays inert until used: importing it
loads neither vLLM nor torch, and no engine starts unless a test asks for one.

**Scenario files as tests.** ``pytest scenarios/`` runs each scenario YAML file as one test
item, named after the scenario, whose outcome is the verdict of
``ftkit.runner.run_scenario``: ``pass`` passes; ``fail`` fails with the reason and the first
divergence; ``not_applied`` and ``error`` are reported as errors (never as a pass). A file that
does not load is a collection error naming ``FILE:LINE: FIELD: problem``.

A ``*.yaml`` or ``*.yml`` file is collected as a scenario when

1. it is named on the command line (``pytest scenarios/link_flap.yaml``): always, so a file
   that is not a scenario is reported as one that does not load; or
2. it lies *directly* in a directory named on the command line or in ``testpaths`` (not in
   its subdirectories, as with ``ftkit run DIR``), or its path relative to the rootdir matches
   a pattern of the ini key ``ftkit_scenario_glob`` (``fnmatch``: ``*`` also matches ``/``),
   *and* it looks like a scenario: it has top-level ``name:`` and ``faults:`` lines.

So ``pytest tests/`` never collects ``tests/data/scenarios/bad/*.yaml``, and a
``docker-compose.yml`` next to your scenarios is left alone.

**Faults in your own tests.** ::

    @pytest.mark.ftkit_fault(kind="oom", rank=0, at={"request": 0, "token": 5}, times=2)
    def test_oom_is_recovered(ftkit_injector, ftkit_baseline):
        prompts = ["the quick brown fox", "a small boat"]
        tokens = ftkit_injector.generate(prompts, max_tokens=16)
        assert ftkit_injector.error is None
        assert tokens == ftkit_baseline(prompts, max_tokens=16)
        assert [f.attempts for f in ftkit_injector.faults] == [2]

``ftkit_fault`` takes the fields of a scenario fault (``kind``, ``rank``, ``at``, ``phase``,
``times``, ``params``); several markers make several faults, outermost (module, class) first,
then top to bottom. Fixtures:

* ``ftkit_engine`` (session): a vLLM engine with the recovery engine on, one per xdist worker,
  closed at the end of the session.
* ``ftkit_injector`` (function): a :class:`FaultInjector` that runs every ``generate`` call
  under the test's ``ftkit_fault`` markers and keeps what ftkit recorded for the last call.
* ``ftkit_baseline`` (function): ``ftkit_baseline(prompts, max_tokens=...)`` gives the
  fault-free tokens of the same workload on the same engine (an empty fault plan).

**Settings**, with one precedence: ``ftkit_settings`` marker > command line > ini >
environment > default (each as marker keyword: option, ini key, environment variable):

* ``model``: ``--ftkit-model``, ``ftkit_model``, ``FTKIT_MODEL``; default ``tiny`` (the
  embedded test model), or a local model directory;
* ``tensor_parallel_size``: ``--ftkit-tp``, ``ftkit_tensor_parallel_size``,
  ``FTKIT_TENSOR_PARALLEL_SIZE``; default 1;
* ``max_reinference``: ``--ftkit-max-reinference``, ``ftkit_max_reinference``,
  ``FTKIT_MAX_REINFERENCE``; default 3;
* ``timeout`` (seconds, per ``generate`` call): ``--ftkit-timeout``, ``ftkit_timeout``,
  ``FTKIT_TIMEOUT``; default 300.

``ftkit_engine`` uses the session's settings (everything but the marker). A test whose
``ftkit_settings`` marker asks for another model, size or ``max_reinference`` gets an engine of
its own from ``ftkit_injector`` (a separate engine process, closed after the test).

Exceptions::

    pytest.fail.Exception
     +-- ScenarioVerdict        a scenario's verdict was not pass (carries ``.result``)
          +-- ScenarioFailed    verdict fail: the test fails
          +-- ScenarioNotJudged verdict not_applied or error: raised in setup, so an error
    ftkit.errors.FtkitError
     +-- FtkitSettingError      a bad setting or ftkit_fault marker (names where it came from)
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ftkit.errors import FtkitError

if TYPE_CHECKING:  # imported lazily: the plugin loads in every pytest run
    from ftkit.results import FaultRecord, RecoveryRecord, ScenarioResult
    from ftkit.scenario import FaultSpec, Scenario
    from ftkit.vllm.engine import EngineSession

# --- help texts, shared by --help, the ini keys and the markers -------------------------------

MODEL_HELP = ("model of the ftkit engine: 'tiny' (the embedded test model) or a local model "
              "directory (default: tiny)")
TENSOR_PARALLEL_SIZE_HELP = "tensor parallel size of the ftkit engine (default: 1)"
MAX_REINFERENCE_HELP = ("re-runs of one failed step before the recovery engine surfaces the "
                        "fault (default: 3)")
TIMEOUT_HELP = ("bound in seconds on one ftkit_injector.generate call; a call past it fails "
                "the test and the engine is restarted (default: 300)")
SCENARIO_GLOB_HELP = ("patterns, relative to the rootdir, of scenario YAML files to collect "
                      "besides those directly in directories named on the command line")
FAULT_MARKER_HELP = (
    "ftkit_fault(kind, rank, at={'request': i, 'token': t}, phase='forward', times=1, "
    "params={}): inject this fault in every ftkit_injector.generate call of the test; "
    "several markers make several faults")
SETTINGS_MARKER_HELP = (
    "ftkit_settings(model=..., tensor_parallel_size=..., max_reinference=..., timeout=...): "
    "ftkit settings for this test; they take precedence over command line, ini and environment")
SCENARIO_MARKER_HELP = "ftkit_scenario: a test item made from an ftkit scenario file"

SCENARIO_SUFFIXES = (".yaml", ".yml")
#: How much of a YAML file is read to decide whether it looks like a scenario.
SNIFF_BYTES = 65536
_TOP_LEVEL_NAME = re.compile(r"^name\s*:", re.MULTILINE)
_TOP_LEVEL_FAULTS = re.compile(r"^faults\s*:", re.MULTILINE)


# --- exceptions -------------------------------------------------------------------------------

class FtkitSettingError(FtkitError):
    """A setting or an ``ftkit_fault`` marker has a value ftkit cannot use."""


class ScenarioVerdict(pytest.fail.Exception):
    """A scenario's verdict was not pass; pytest shows the message without a traceback."""

    def __init__(self, result: ScenarioResult) -> None:
        self.result = result
        super().__init__(describe_result(result), pytrace=False)


class ScenarioFailed(ScenarioVerdict):
    """Verdict fail: the run contradicted the scenario's ``expect``."""


class ScenarioNotJudged(ScenarioVerdict):
    """Verdict not_applied or error: no pass/fail could be reached. Raised during setup, so
    pytest reports it as an error."""


# --- settings ---------------------------------------------------------------------------------

def _text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected a non-empty string, got {raw!r}")
    return raw.strip()


def _integer(minimum: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        value = int(raw) if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?\d+\s*", raw) \
            else raw
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {raw!r}")
        return value
    return parse


def _positive_seconds(raw: Any) -> float:
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"expected a number of seconds > 0, got {raw!r}")
    return float(value)


@dataclass(frozen=True)
class Setting:
    """One ftkit setting and the names it goes by in each place it can be given."""

    key: str  # also the ftkit_settings marker keyword
    option: str
    ini: str
    env: str
    help: str
    default: Any
    parse: Callable[[Any], Any]

    @property
    def dest(self) -> str:
        return "ftkit_" + self.key


SETTINGS = (
    Setting("model", "--ftkit-model", "ftkit_model", "FTKIT_MODEL", MODEL_HELP, "tiny", _text),
    Setting("tensor_parallel_size", "--ftkit-tp", "ftkit_tensor_parallel_size",
            "FTKIT_TENSOR_PARALLEL_SIZE", TENSOR_PARALLEL_SIZE_HELP, 1, _integer(1)),
    Setting("max_reinference", "--ftkit-max-reinference", "ftkit_max_reinference",
            "FTKIT_MAX_REINFERENCE", MAX_REINFERENCE_HELP, 3, _integer(0)),
    Setting("timeout", "--ftkit-timeout", "ftkit_timeout", "FTKIT_TIMEOUT", TIMEOUT_HELP,
            300.0, _positive_seconds),
)
_SETTING_BY_KEY = {s.key: s for s in SETTINGS}


def resolve_setting(setting: Setting, *, marker: Any = None, cli: Any = None, ini: Any = None,
                    env: str | None = None) -> Any:
    """The value of ``setting``: marker > command line > ini > environment > default.

    A source counts as given unless it is ``None`` or an empty string. The winning value is
    parsed and checked; a bad one raises ``FtkitSettingError`` naming its source (a bad value
    is never skipped in favour of a lower source).
    """
    sources = (("ftkit_settings marker", marker), (setting.option, cli),
               (f"ini {setting.ini}", ini), (f"environment {setting.env}", env))
    for where, raw in sources:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        try:
            return setting.parse(raw)
        except ValueError as exc:
            raise FtkitSettingError(f"{where} ({setting.key}): {exc}") from None
    return setting.default


@dataclass(frozen=True)
class FtkitSettings:
    model: str
    tensor_parallel_size: int
    max_reinference: int
    timeout: float

    def engine_key(self) -> tuple[str, int, int]:
        """What decides the engine (the timeout is per call)."""
        return (self.model, self.tensor_parallel_size, self.max_reinference)


def resolve_settings(config: pytest.Config, marker: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] = os.environ) -> FtkitSettings:
    """Every setting for one test (``marker``: the merged ``ftkit_settings`` keywords) or,
    without ``marker``, for the session."""
    marker = dict(marker or {})
    unknown = sorted(set(marker) - set(_SETTING_BY_KEY))
    if unknown:
        raise FtkitSettingError(f"ftkit_settings marker: unknown keyword(s) {', '.join(unknown)}"
                                f"; known: {', '.join(_SETTING_BY_KEY)}")
    values = {}
    for setting in SETTINGS:
        ini = config.getini(setting.ini)
        if setting.key == "model" and isinstance(ini, str):
            ini = _relative_to_inifile(config, ini)
        values[setting.key] = resolve_setting(
            setting, marker=marker.get(setting.key), cli=config.getoption(setting.dest),
            ini=ini, env=environ.get(setting.env))
    return FtkitSettings(**values)


def _relative_to_inifile(config: pytest.Config, model: str) -> str:
    # A model directory written in an ini file means the directory next to that file.
    if not model.strip() or model.strip() == "tiny" or config.inipath is None:
        return model
    path = Path(model.strip()).expanduser()
    return model if path.is_absolute() else str(config.inipath.parent / path)


def _marker_settings(node: pytest.Item) -> dict[str, Any]:
    """``ftkit_settings`` keywords of a test; a closer marker wins per keyword."""
    merged: dict[str, Any] = {}
    for mark in node.iter_markers("ftkit_settings"):
        if mark.args:
            raise FtkitSettingError("ftkit_settings takes keywords only, e.g. "
                                    "ftkit_settings(max_reinference=1)")
        for key, value in mark.kwargs.items():
            merged.setdefault(key, value)
    return merged


# --- hooks ------------------------------------------------------------------------------------

_NAMED_PATHS = pytest.StashKey[frozenset]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ftkit", "ftkit fault injection")
    for setting in SETTINGS:
        group.addoption(setting.option, dest=setting.dest, default=None,
                        help=f"{setting.help}; ini {setting.ini}, environment {setting.env}")
        parser.addini(setting.ini, setting.help, default=None)
    parser.addini("ftkit_scenario_glob", SCENARIO_GLOB_HELP, type="linelist", default=[])


_SCENARIO_RUNNER = pytest.StashKey[Any]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", FAULT_MARKER_HELP)
    config.addinivalue_line("markers", SETTINGS_MARKER_HELP)
    config.addinivalue_line("markers", SCENARIO_MARKER_HELP)
    base = config.invocation_params.dir
    config.stash[_NAMED_PATHS] = frozenset(
        (base / str(arg).split("::")[0]).resolve() for arg in config.args)


def _scenario_runner(config: pytest.Config) -> Any:
    """One ``ScenarioRunner`` for the session (per xdist worker): scenario items with alike
    engines share them; every engine is shut down when the session ends."""
    runner = config.stash.get(_SCENARIO_RUNNER, None)
    if runner is None:
        from ftkit.runner import ScenarioRunner

        runner = config.stash[_SCENARIO_RUNNER] = ScenarioRunner()
    return runner


def pytest_sessionfinish(session: pytest.Session) -> None:
    runner = session.config.stash.get(_SCENARIO_RUNNER, None)
    if runner is not None:
        del session.config.stash[_SCENARIO_RUNNER]
        runner.close()


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> ScenarioFile | None:
    if file_path.suffix in SCENARIO_SUFFIXES and is_scenario_file(parent.config, file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


def is_scenario_file(config: pytest.Config, path: Path) -> bool:
    """The collection rule of the module docstring."""
    named = config.stash.get(_NAMED_PATHS, frozenset())
    resolved = path.resolve()
    if resolved in named:
        return True
    in_named_dir = resolved.parent in named
    try:
        relative = resolved.relative_to(config.rootpath.resolve()).as_posix()
    except ValueError:
        relative = None
    globbed = relative is not None and any(
        fnmatch.fnmatch(relative, pattern) for pattern in config.getini("ftkit_scenario_glob"))
    return (in_named_dir or globbed) and looks_like_scenario(path)


def looks_like_scenario(path: Path) -> bool:
    """True if the file has top-level ``name:`` and ``faults:`` lines (parse errors or not)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return False
    return bool(_TOP_LEVEL_NAME.search(head) and _TOP_LEVEL_FAULTS.search(head))


# --- scenario files as test items -------------------------------------------------------------

class ScenarioFile(pytest.File):
    def collect(self) -> Iterator[ScenarioItem]:
        from ftkit.scenario import load_scenario_text

        shown = self.config.invocation_params.dir
        file = os.path.relpath(self.path, shown) if self.path.is_relative_to(shown) \
            else str(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise self.CollectError(f"{file}: cannot read the scenario: {exc}") from None
        try:
            scenario = load_scenario_text(text, file=file)
        except FtkitError as exc:  # ScenarioErrors: one "FILE:LINE: FIELD: message" per line
            raise self.CollectError(str(exc)) from None
        yield ScenarioItem.from_parent(self, name=scenario.name, scenario=scenario, file=file)


class ScenarioItem(pytest.Item):
    """One scenario run. The run happens in setup, so a run without a verdict is an error."""

    def __init__(self, *, scenario: Scenario, file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.file = file
        self.result: ScenarioResult | None = None
        self.add_marker("ftkit_scenario")

    def setup(self) -> None:
        from ftkit.results import Verdict

        progress: list[str] = []
        try:
            runner = _scenario_runner(self.config)
            self.result = runner.run(self.scenario, file=self.file,
                                     on_event=lambda e: progress.append(
                                         f"{e.stage}: {e.message}" if e.message else e.stage))
        finally:
            if progress:
                self.add_report_section("setup", "ftkit progress", "\n".join(progress))
        self.user_properties.append(("ftkit_verdict", str(self.result.verdict)))
        if self.result.verdict in (Verdict.NOT_APPLIED, Verdict.ERROR):
            raise ScenarioNotJudged(self.result)

    def runtest(self) -> None:
        from ftkit.results import Verdict

        assert self.result is not None
        if self.result.verdict is not Verdict.PASS:
            raise ScenarioFailed(self.result)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        line = self.scenario.line_of("name")
        return self.path, None if line is None else line - 1, f"scenario {self.scenario.name}"


def describe_result(result: ScenarioResult) -> str:
    """What a failed or unjudged scenario shows in the pytest report."""
    from ftkit.verify import describe_divergence

    lines = [f"ftkit verdict {result.verdict}: {result.reason}"]
    diverged = next((r for r in result.requests if r.first_divergence is not None), None)
    if diverged is not None:
        lines.append(f"first divergence: {describe_divergence(diverged)}")
    for fault in result.faults:
        state = (f"fired {fault.attempts}x" if fault.fired else "never fired")
        if fault.recovered:
            state += f", recovered in {fault.recovery_s or 0.0:.3f} s"
        lines.append(f"fault: {fault.kind} on rank {fault.rank} at request {fault.request} "
                     f"token {fault.token} ({fault.phase}, times {fault.times}): {state}")
    if result.recoveries:
        decisions = ", ".join(r.decision for r in result.recoveries)
        lines.append(f"recovery rounds: {len(result.recoveries)} ({decisions})")
    if result.error:
        lines.append(f"engine error: {result.error}")
    return "\n".join(lines)


# --- fault injection in tests -----------------------------------------------------------------

@dataclass
class GenerateRecord:
    """What one ``FaultInjector.generate`` call produced and what ftkit recorded for it."""

    run_id: str
    tokens: list[list[int]]
    #: The engine's error if the call ended with one (the fault was surfaced), else None.
    error: str | None
    #: Every ``fault_fired`` event of this call, one per rank and failing attempt.
    fired: list[dict[str, Any]]
    #: One record per planned fault (marker order): fired, attempts, recovered.
    faults: list[FaultRecord]
    #: One record per coordinated recovery round, as the ranks agreed on it.
    rounds: list[RecoveryRecord]


class FaultInjector:
    """Runs workloads on an ftkit engine under a fixed fault plan (the test's markers)."""

    def __init__(self, engine: EngineSession, plan: list[FaultSpec], *, timeout_s: float,
                 baselines: dict[Any, list[list[int]]]) -> None:
        self.engine = engine
        #: The faults every ``generate`` call runs under, from the test's markers.
        self.plan = plan
        self.timeout_s = timeout_s
        self._baselines = baselines
        self.last: GenerateRecord | None = None

    def generate(self, prompts: list[str], *, max_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[list[int]]:
        """Run ``prompts`` under the fault plan (re-armed for this call); return each request's
        token ids. An engine error does not raise: it is in ``error`` (and the engine is
        restarted before its next use); a call past the timeout fails the test."""
        from ftkit.recovery.events import read_events
        from ftkit.runner import collect_events
        from ftkit.vllm.engine import SamplingSpec

        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed)
        self._check_plan(prompts, sampling)
        _ensure_running(self.engine)
        run_id = self.engine.new_run_id()
        self.engine.set_fault_plan(run_id, [f.model_dump(mode="json") for f in self.plan])
        started = time.time()
        out = self._run(prompts, sampling, run_id)
        events = [e for e in read_events(self.engine.recovery["event_log_dir"])
                  if e["time"] >= started
                  and (e["event"] != "fault_fired" or e.get("run_id") == run_id)]
        records, rounds = collect_events(events, self.plan, origin=out.started_at)
        self.last = GenerateRecord(
            run_id=run_id, tokens=[r.token_ids for r in out.requests], error=out.error,
            fired=[e for e in events if e["event"] == "fault_fired"], faults=records,
            rounds=rounds)
        return self.last.tokens

    def baseline(self, prompts: list[str], *, max_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[list[int]]:
        """The fault-free tokens of the same workload on this engine (cached per session)."""
        from ftkit.vllm.engine import SamplingSpec

        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed)
        key = (self.engine.spec.model, self.engine.spec.tensor_parallel_size, tuple(prompts),
               sampling)
        if key not in self._baselines:
            _ensure_running(self.engine)
            run_id = self.engine.new_run_id()
            self.engine.set_fault_plan(run_id, [])
            out = self._run(prompts, sampling, run_id)
            if out.error is not None:
                pytest.fail(f"ftkit: the fault-free run failed: {out.error}", pytrace=False)
            self._baselines[key] = [r.token_ids for r in out.requests]
        return [list(tokens) for tokens in self._baselines[key]]

    def _run(self, prompts: list[str], sampling: Any, run_id: str) -> Any:
        from ftkit.errors import RunTimeout

        try:
            return self.engine.generate(prompts, sampling, run_id=run_id,
                                        deadline=time.monotonic() + self.timeout_s)
        except RunTimeout:
            self.engine.close()  # a hung engine is restarted before its next use
            self.engine.dead = f"stopped after the ftkit timeout of {self.timeout_s:g} s"
            pytest.fail(f"ftkit: generate did not finish within {self.timeout_s:g} s "
                        "(--ftkit-timeout)", pytrace=False)

    def _check_plan(self, prompts: list[str], sampling: Any) -> None:
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
                "faults": [f.model_dump(mode="json") for f in self.plan],
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
    def fired(self) -> list[dict[str, Any]]:
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


def _start_engine(settings: FtkitSettings, journal_dir: Path, *,
                  multiprocess: bool | None = None) -> EngineSession:
    from ftkit.model import resolve_model
    from ftkit.vllm.engine import EngineSession, EngineSpec

    spec = EngineSpec(model=str(resolve_model(settings.model)),
                      tensor_parallel_size=settings.tensor_parallel_size)
    recovery = {"enabled": True, "max_reinference": settings.max_reinference,
                "event_log_dir": str(journal_dir)}
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
    journal = tmp_path_factory.mktemp("ftkit-journal")
    engine = _or_fail(lambda: _start_engine(settings, journal))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def _ftkit_baselines() -> dict[Any, list[list[int]]]:
    return {}


@pytest.fixture
def ftkit_injector(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   _ftkit_baselines: dict[Any, list[list[int]]]) -> Iterator[FaultInjector]:
    """Runs ``generate`` under the test's ``ftkit_fault`` markers (see ``FaultInjector``)."""
    node = request.node
    faults = _or_fail(lambda: fault_plan(node))
    session = _or_fail(lambda: resolve_settings(request.config))
    mine = _or_fail(lambda: resolve_settings(request.config,
                                                           _marker_settings(node)))
    own_engine = None
    if mine.engine_key() == session.engine_key():
        engine = request.getfixturevalue("ftkit_engine")
    else:
        # Another in-process engine may be alive: this one runs in its own process.
        journal = tmp_path_factory.mktemp("ftkit-journal")
        engine = own_engine = _or_fail(
            lambda: _start_engine(mine, journal, multiprocess=True))
    try:
        yield FaultInjector(engine, faults, timeout_s=mine.timeout, baselines=_ftkit_baselines)
    finally:
        if own_engine is not None:
            own_engine.close()


@pytest.fixture
def ftkit_baseline(ftkit_injector: FaultInjector) -> Callable[..., list[list[int]]]:
    """``ftkit_baseline(prompts, max_tokens=..., temperature=..., top_p=..., seed=...)``: the
    fault-free tokens on ``ftkit_injector``'s engine."""
    return ftkit_injector.baseline
