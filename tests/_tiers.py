"""The suite's tiers, and the exhaustive tier's shards.

- **fast**: every test not marked ``exhaustive``. ``make test`` runs it before every commit:
  every fault kind, process death and resume, the live server, Ray, pipeline, MoE, explore,
  the pytest plugin, the reports, and one negative test of every repair, on real engines.
- **exhaustive**: the tests marked ``exhaustive``: repeats across tensor-parallel sizes, the
  bundled scenario library, long campaigns, the further negative tests. ``make test-all`` runs
  it with the fast tier; CI runs the fast tier and one of its shards, chosen from the commit.

Options (``pytest --help``, group "ftkit tiers"):

- ``--tier fast|exhaustive|all`` (default ``all``: a run of a file or folder runs all of it);
- ``--shard K/N``: of the exhaustive tier, only shard ``K`` of ``N``.

A shard holds whole files (a module's engines are started once), except a test marked
``exhaustive(alone=True)``: a long test with engines of its own, which may go to a shard apart
from its file's other tests. The shards are balanced by each such unit's recorded seconds in
the exhaustive tier (``DURATIONS``; a unit not in it counts ``UNKNOWN_UNIT_S``): units are
taken from the longest, each into the shard with the least so far. ``--record-durations``
writes the seconds of the units the run took whole back into ``DURATIONS``.

Tests left out by the tier or the shard are reported as deselected, and the CI gate
(``conftest.py``) knows them: under CI it asks only that every test of the selected tiers ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

TIERS = ("fast", "exhaustive", "all")
MARKER = "exhaustive"
#: Each shard unit's seconds in the exhaustive tier, as last recorded.
DURATIONS = Path(__file__).with_name("durations.json")
#: The seconds counted for a unit with no recorded time: a few engine starts.
UNKNOWN_UNIT_S = 120.0

#: On the config: the run's tier and shard.
SELECTION = pytest.StashKey["Selection"]()
#: On an item, set when the tier or the shard left it out (the CI gate reads it).
OUT_OF_TIER = pytest.StashKey[bool]()


@dataclass(frozen=True)
class Selection:
    tier: str
    #: (K, N) or None: every shard.
    shard: tuple[int, int] | None

    def describe(self) -> str:
        shard = "" if self.shard is None else " (shard %d of %d)" % self.shard
        if self.tier == "fast":
            return "fast"
        if self.tier == "exhaustive":
            return "exhaustive" + shard
        return "fast + exhaustive" + shard


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {text!r}: expected K/N, e.g. 2/4") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {text!r}: K must be between 1 and N")
    return k, n


def assign_shards(weights: dict[str, float], count: int) -> dict[str, int]:
    """Each unit's shard (1 to ``count``): units in order of weight, heaviest first (ties by
    name), each into the shard with the least weight so far (ties: the lowest shard)."""
    loads = [0.0] * count
    shards = {}
    for unit in sorted(weights, key=lambda u: (-weights[u], u)):
        shard = min(range(count), key=lambda i: (loads[i], i))
        shards[unit] = shard + 1
        loads[shard] += weights[unit]
    return shards


def recorded_durations() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


def is_exhaustive(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def shard_unit(item: pytest.Item) -> str:
    """What a shard holds whole: the item's file, or the item alone (``alone=True``)."""
    marker = item.get_closest_marker(MARKER)
    alone = marker is not None and marker.kwargs.get("alone", False)
    return item.nodeid if alone else file_of(item.nodeid)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ftkit tiers")
    group.addoption("--tier", choices=TIERS, default="all",
                    help="which tier to run: fast (what make test runs), exhaustive, or all "
                         "(default)")
    group.addoption("--shard", default=None, metavar="K/N",
                    help="run only shard K of N of the exhaustive tier")
    group.addoption("--record-durations", action="store_true",
                    help="write the seconds of the exhaustive tests run to "
                         f"tests/{DURATIONS.name}, per shard unit")


def configure(config: pytest.Config) -> None:
    """Called by ``conftest.py``'s ``pytest_configure``."""
    config.addinivalue_line("markers", f"{MARKER}: in the exhaustive tier (make test-all and "
                                       "CI's shards run it; make test does not)")
    shard = config.getoption("--shard")
    config.stash[SELECTION] = Selection(config.getoption("--tier"),
                                        parse_shard(shard) if shard else None)
    if config.getoption("--record-durations") and not config.option.collectonly:
        config.pluginmanager.register(DurationRecorder(), "ftkit-durations")


def pytest_report_header(config: pytest.Config) -> str:
    return f"ftkit tiers: {config.stash[SELECTION].describe()}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selection = config.stash[SELECTION]
    shards = {}
    if selection.shard is not None:
        weights = recorded_durations()
        units = {shard_unit(i) for i in items if is_exhaustive(i)}
        shards = assign_shards({u: weights.get(u, UNKNOWN_UNIT_S) for u in units},
                               selection.shard[1])

    def wanted(item: pytest.Item) -> bool:
        if not is_exhaustive(item):
            return selection.tier != "exhaustive"
        if selection.tier == "fast":
            return False
        return selection.shard is None or shards[shard_unit(item)] == selection.shard[0]

    kept, left = [], []
    for item in items:
        (kept if wanted(item) else left).append(item)
    if left:
        for item in left:
            item.stash[OUT_OF_TIER] = True
        config.hook.pytest_deselected(items=left)
        items[:] = kept


class DurationRecorder:
    """With ``--record-durations``: each exhaustive test's seconds (setup, call, teardown),
    summed per shard unit and merged into ``DURATIONS`` at the end, for the units whose every
    exhaustive test ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        #: node id -> shard unit, of the run's exhaustive tests.
        self.units: dict[str, str] = {}
        self.ran: set[str] = set()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.units = {item.nodeid: shard_unit(item) for item in session.items
                      if is_exhaustive(item)}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        unit = self.units.get(report.nodeid)
        if unit is not None:
            self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration
            if report.when == "call" or report.skipped:
                self.ran.add(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        complete = {unit for unit in self.seconds
                    if all(n in self.ran for n, u in self.units.items() if u == unit)}
        merged = recorded_durations()
        merged.update({f: round(self.seconds[f], 1) for f in complete})
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
