"""The fault plan: the faults of one run, on their way from the scenario to every injector.

The scenario's ``FaultSpec`` is the source of truth: a ``PlannedFault`` carries it whole,
with only what the journey adds (its place in the scenario, and how many of its failing
attempts already fired before an engine restart). The plan travels as one JSON string
(``to_json`` / ``from_json``) through vLLM's ``collective_rpc`` to every rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ftkit.errors import InjectionError
from ftkit.scenario.model import FaultSpec

#: The version of the plan's JSON form.
VERSION = 1


@dataclass(frozen=True)
class PlannedFault:
    """One fault of a plan."""

    #: Its place in the scenario's ``faults`` (fault records and events refer to it).
    index: int
    spec: FaultSpec
    #: Failing attempts that already fired before the engine restarted.
    fired: int = 0
    #: A fault planned in a live server (``ftkit inject``) names its request by the id its
    #: client sent (``X-Request-Id``), not by an index into a workload: ``spec.at.token`` is
    #: then that request's output token and ``spec.at.request`` is unused.
    request_key: str | None = None
    #: ... or fires in the engine step that runs ``after_steps`` steps after the one that
    #: follows its arrival (0: the next step), whatever that step computes.
    after_steps: int | None = None

    @property
    def live(self) -> bool:
        return self.request_key is not None or self.after_steps is not None

    def on_rank(self, rank: int) -> bool:
        return self.spec.rank == "all" or self.spec.rank == rank


@dataclass(frozen=True)
class FaultPlan:
    """The faults of run ``run_id``. ``max_reinference``, if set, applies from this run on
    (engines are shared between scenarios that differ only there)."""

    run_id: str | None
    faults: tuple[PlannedFault, ...] = ()
    max_reinference: int | None = None

    @classmethod
    def from_specs(cls, run_id: str | None, specs: Iterable[FaultSpec],
                   max_reinference: int | None = None) -> FaultPlan:
        return cls(run_id, tuple(PlannedFault(i, s) for i, s in enumerate(specs)),
                   max_reinference)

    def with_fired(self, fired: Mapping[int, int]) -> FaultPlan:
        """This plan with the attempts that already fired (by fault index)."""
        return replace(self, faults=tuple(replace(f, fired=fired.get(f.index, f.fired))
                                          for f in self.faults))

    def to_json(self) -> str:
        return json.dumps({
            "v": VERSION, "run_id": self.run_id, "max_reinference": self.max_reinference,
            "faults": [{"index": f.index, "fired": f.fired, "request_key": f.request_key,
                        "after_steps": f.after_steps,
                        "spec": f.spec.model_dump(mode="json")} for f in self.faults],
        })

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        raw = json.loads(text)
        if raw.get("v") != VERSION:
            raise InjectionError(f"fault plan of version {raw.get('v')!r}; this ftkit reads "
                                 f"version {VERSION}")
        return cls(raw["run_id"],
                   tuple(PlannedFault(int(f["index"]), FaultSpec.model_validate(f["spec"]),
                                      int(f["fired"]), f.get("request_key"),
                                      f.get("after_steps")) for f in raw["faults"]),
                   raw["max_reinference"])
