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
  under the test's ``ftkit_fault`` markers and keeps what ftkit recorded for the last call;
  its ``assert_exact()`` compares every completion of that call with the fault-free run, as
  the scenario runner's oracle does (logprobs bit for bit, finish reasons, text).
* ``ftkit_baseline`` (function): ``ftkit_baseline(prompts, max_tokens=...)`` gives the
  fault-free tokens of the same workload on a plain vLLM engine with the same settings:
  ftkit's recovery engine is not in it, so the oracle never depends on the code under test.
  One such engine per model and size, started on first use (its engine core in a process of
  its own) and closed at the end of the session; each workload's tokens are kept for it.

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

The hooks are here; ``settings`` holds the settings and their precedence, ``items`` the
scenario files as test items, ``injector`` the markers, ``FaultInjector`` and the fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The fixtures are registered by being names of this module (the pytest11 entry point).
from ftkit.pytest_plugin.injector import (  # noqa: F401
    FaultFreeRuns,
    FaultInjector,
    GenerateRecord,
    _ftkit_fault_free,
    fault_plan,
    ftkit_baseline,
    ftkit_engine,
    ftkit_injector,
)
from ftkit.pytest_plugin.items import (
    NAMED_PATHS,
    SCENARIO_SUFFIXES,
    ScenarioFailed,
    ScenarioFile,
    ScenarioItem,
    ScenarioNotJudged,
    ScenarioVerdict,
    close_scenario_runner,
    describe_result,
    is_scenario_file,
    looks_like_scenario,
)
from ftkit.pytest_plugin.settings import (
    FAULT_MARKER_HELP,
    SCENARIO_GLOB_HELP,
    SCENARIO_MARKER_HELP,
    SETTINGS,
    SETTINGS_MARKER_HELP,
    FtkitSettingError,
    FtkitSettings,
    Setting,
    resolve_setting,
    resolve_settings,
)

# --- hooks ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ftkit", "ftkit fault injection")
    for setting in SETTINGS:
        group.addoption(setting.option, dest=setting.dest, default=None,
                        help=f"{setting.help}; ini {setting.ini}, environment {setting.env}")
        parser.addini(setting.ini, setting.help, default=None)
    parser.addini("ftkit_scenario_glob", SCENARIO_GLOB_HELP, type="linelist", default=[])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", FAULT_MARKER_HELP)
    config.addinivalue_line("markers", SETTINGS_MARKER_HELP)
    config.addinivalue_line("markers", SCENARIO_MARKER_HELP)
    base = config.invocation_params.dir
    config.stash[NAMED_PATHS] = frozenset(
        (base / str(arg).split("::")[0]).resolve() for arg in config.args)


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_scenario_runner(session.config)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> ScenarioFile | None:
    if file_path.suffix in SCENARIO_SUFFIXES and is_scenario_file(parent.config, file_path):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


__all__ = [
    "FaultFreeRuns", "FaultInjector", "GenerateRecord", "fault_plan", "ftkit_engine",
    "ftkit_injector", "ftkit_baseline", "ScenarioVerdict", "ScenarioFailed", "ScenarioNotJudged", "ScenarioFile",
    "ScenarioItem", "describe_result", "is_scenario_file", "looks_like_scenario",
    "FtkitSettingError", "FtkitSettings", "Setting", "SETTINGS", "resolve_setting",
    "resolve_settings",
]
