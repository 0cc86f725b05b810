"""What a fault kind registers (``KindSpec``), and the small types both sides of it share.

A kind's module in ``ftkit.kinds`` fills in one ``KindSpec``. Its parts are read by:

* ``ftkit.scenario`` (validation): ``params`` and ``rules``;
* ``ftkit.inject`` (the injector in every worker): ``injection``;
* ``ftkit.recovery`` (a rank assessing its own fault): ``assess_damage``, which returns a
  ``Repair``;
* ``ftkit.doctor``: ``doctor``;
* the scenario runner and the engine session: ``ends_process``, ``collective``.

This module imports neither of its readers, nor torch or vLLM: the injector's view of the
device (``FaultModel``, ``MemoryTargets``) and the recovery engine's (``DamageSource``,
``MemoryMap``) are protocols declared here, so the kinds depend only on what sits below them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, Union

from pydantic import BaseModel, ConfigDict

from ftkit.contracts.requests import request_matcher, served_request_matches
from ftkit.errors import InjectionError
from ftkit.faults import FaultKind

if TYPE_CHECKING:
    import torch

    from ftkit.backends.base import MemoryFault
    from ftkit.scenario.model import EngineSpec, FaultSpec

# --- params ---------------------------------------------------------------------------------


class Params(BaseModel):
    """Base of every kind's ``params`` model: strict, unknown keys rejected, defaults here
    only (the scenario rules and the injector read params through the same model)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class NoParams(Params):
    """This kind takes no params."""


# --- rules ----------------------------------------------------------------------------------

#: A field path inside a scenario (as ``ftkit.scenario.errors.Loc``).
Loc = tuple[Union[str, int], ...]
#: A broken rule: the field to change, and why.
Problem = tuple[Loc, str]
#: A kind's semantic rule: ``rule(at, fault, params, engine)`` where ``at`` is the fault's
#: own path (``("faults", i)``), ``params`` its parsed params, or ``None`` when they are
#: invalid (the params' problems are reported already), and ``engine`` the engine it is
#: injected in: a scenario's, or a live server's (``ftkit.serve.control``).
Rule = Callable[[Loc, "FaultSpec", Any, "EngineSpec"], list[Problem]]

# --- injection ------------------------------------------------------------------------------


class FaultModel(Protocol):
    """What the injector needs of the device it fails (the CPU backend's fault model)."""

    def break_link(self, detail: str) -> None: ...
    def force_stop(self, detail: str, on_restart: Callable[[], None] | None = None) -> None: ...
    def hang(self, detail: str, timeout_s: float) -> Any: ...
    def report_memory_fault(self, fault: Any) -> None: ...
    def set_op_timeout(self, seconds: float | None) -> None: ...


class MemoryTargets(Protocol):
    """Where the injector's memory errors land (``ftkit.vllm.memory.RunnerMemory``)."""

    def poison_kv(self) -> None: ...
    def request_blocks(self, match: Callable[[str], bool]) -> list[int]: ...
    def block_region(self, block_id: int, layer: int = 0) -> tuple[torch.Tensor, Any]: ...
    def param_region(self, name: str) -> tuple[torch.Tensor, Any]: ...
    def default_uce_parameter(self) -> str: ...
    def parameter_names(self) -> list[str]: ...
    def not_reloadable(self, name: str) -> str | None: ...
    def activation_region(self) -> tuple[torch.Tensor, Any]: ...


@dataclass(frozen=True)
class InjectionSite:
    """What a fault acts on in one worker. ``device`` and ``memory`` are ``None`` where the
    backend has no fault model for them; ``kill_target(target)`` gives the pid a killed
    process has (``None``: no process may be killed here)."""

    rank: int
    #: The run whose requests the faults are planned at.
    run_id: str | None
    device: FaultModel | None = None
    memory: MemoryTargets | None = None
    kill_target: Callable[[str], int] | None = None


@dataclass(frozen=True)
class Firing:
    """One firing of a planned fault, as its kind's injection sees it."""

    kind: FaultKind
    #: The request (its index in the run) the fault is planned at.
    request: int
    phase: str
    #: The fault's params, parsed by its kind's model.
    params: Any
    step: int
    #: A fault planned in a live server names its request by its client's id instead
    #: (``PlannedFault.request_key``).
    request_key: str | None = None

    def request_matches(self, run_id: str | None) -> Callable[[str], bool]:
        """A test for the engine's ids of the request the fault is planned at."""
        if self.request_key is not None:
            key = self.request_key
            return lambda engine_id: served_request_matches(engine_id, key)
        return request_matcher(run_id or "", self.request)


class Injection:
    """What a kind's fault does in a worker; a kind subclasses it and overrides ``act``.

    The injector calls ``check`` when the fault is planned, ``arm`` when it fires (before it
    acts), and ``act`` where it acts: at the start of the step (phase ``before``), or from
    the hook of phase ``forward`` or ``sample``.
    """

    def check(self, kind: FaultKind, params: Any, site: InjectionSite) -> None:
        """Raise ``InjectionError`` if the fault cannot be injected at ``site``."""

    def arm(self, firing: Firing, site: InjectionSite) -> bool:
        """Prepare the firing; ``True`` when the fault now acts by itself (the injector then
        does not call ``act``)."""
        return False

    def act(self, firing: Firing, site: InjectionSite) -> NoReturn:
        """Do what the fault does. Raises (or ends the process)."""
        raise InjectionError(f"no injector for fault kind {firing.kind}")


def require_device(kind: FaultKind, site: InjectionSite) -> None:
    """The fault needs the backend's fault model."""
    if site.device is None:
        raise InjectionError(f"{kind} cannot be injected here: this backend has no "
                             "fault model for it")


def require_memory(kind: FaultKind, site: InjectionSite) -> None:
    """The fault needs the map of the runner's memory."""
    if site.memory is None:
        raise InjectionError(f"{kind} cannot be injected here: no map of the "
                             "runner's memory")


def detail_of(firing: Firing, site: InjectionSite) -> str:
    """The text that names an injected fault in the error it raises."""
    return f"ftkit injected {firing.kind} on rank {site.rank}"


# --- damage ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Repair:
    """What a rank reports about the damage of its own fault (fields of ``RankStatus``)."""

    kv_lost: tuple[int, ...] = ()
    kv_lost_all: bool = False
    reload_params: tuple[str, ...] = ()
    #: Why the damage cannot be repaired (the round then raises), or "".
    unrecoverable: str = ""


class MemoryHitsLike(Protocol):
    kv_blocks: set[int]
    params: set[str]
    other: int


class MemoryMap(Protocol):
    """Tells what lives at device addresses (``ftkit.vllm.memory.RunnerMemory``)."""

    def classify(self, faults: list[MemoryFault]) -> MemoryHitsLike: ...


class DamageSource(Protocol):
    """The backend, as far as the damage assessment asks it (the reported memory errors)."""

    def memory_faults(self) -> list[MemoryFault]: ...


#: A kind's damage assessment: what this rank's own fault destroyed.
AssessDamage = Callable[[DamageSource, Union[MemoryMap, None]], Repair]


def no_damage(backend: DamageSource, memory: MemoryMap | None) -> Repair:
    """Nothing on the device is lost: the round's rebuild and the re-run are the repair."""
    return Repair()


# --- doctor ---------------------------------------------------------------------------------

REAL = "real"
EMULATED = "emulated"


@dataclass(frozen=True)
class DoctorRow:
    """What ``ftkit doctor`` says about a kind: how it is injected on each platform."""

    #: Platform (``cpu``, ``cuda``, ``npu``; ``*``: any other) -> (``real`` or
    #: ``emulated``, how).
    ways: Mapping[str, tuple[str, str]]
    #: The method the injector calls on the backend's fault model to cause the fault
    #: (``FaultModel``); ``None`` when it needs nothing of the backend.
    fault_model_method: str | None = None

    def on(self, platform: str) -> tuple[str, str]:
        """(mode, how) on ``platform``."""
        return self.ways.get(platform, self.ways.get("*", (EMULATED, "")))


# --- device recovery ------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRecovery:
    """What a backend does to the device in a round where some rank had this kind of fault,
    before the communicators are rebuilt (``Backend.recover_device``)."""

    #: The error leaves the device's task queue in an exit state that only a device restart
    #: clears (torch_npu's SUSPECT_REMOTE_EXIT, HCCL_OP_RETRY_EXIT, UCE_EXIT ...): restart it
    #: even on a rank that was not stopped.
    restart: bool
    #: A restart rebuilds the device's streams too (``rebuild_all_resources``).
    rebuild_streams: bool = False
    #: Release the memory the runner can spare (the caching allocator; garbage in cycles).
    release_memory: bool = False


def any_kind(kinds: Iterable[str], needs: Callable[[KindSpec], bool]) -> bool:
    """Whether any of ``kinds`` (names, as a round's decision lists them) ``needs`` it."""
    from ftkit.kinds import kind_spec

    return any(needs(kind_spec(k)) for k in kinds)


# --- the spec -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KindSpec:
    """Everything ftkit knows about one fault kind. Every part is given: none has a default,
    so a new kind decides each."""

    kind: FaultKind
    summary: str
    #: ``False`` until it is injected end to end: validation then rejects scenarios that use
    #: it, so no scenario can look as if it tested a fault that is never injected.
    implemented: bool
    #: The fault is about a collective link (it needs a peer; the links are rebuilt).
    collective: bool
    #: The fault kills a process: no recovery round runs, the engine is restarted.
    ends_process: bool
    #: The strict model of the fault's ``params``.
    params: type[Params]
    #: The kind's own semantic rules (the generic ones are in ``ftkit.scenario.rules``).
    rules: tuple[Rule, ...]
    injection: Injection
    assess_damage: AssessDamage
    #: What the backends do to the device after a round with this kind.
    device: DeviceRecovery
    doctor: DoctorRow
