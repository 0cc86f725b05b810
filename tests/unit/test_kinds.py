"""The fault-kind registry: every kind is registered once, with every part decided."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from ftkit.faults import FaultKind
from ftkit.kinds import KIND_SPECS, kind_spec
from ftkit.kinds.base import (
    EMULATED,
    DeviceRecovery,
    any_kind,
    REAL,
    DoctorRow,
    Injection,
    KindSpec,
    Params,
    Repair,
)

KINDS_DIR = Path(__file__).resolve().parents[2] / "ftkit" / "kinds"


def test_every_fault_kind_is_registered_once_in_declaration_order():
    assert list(KIND_SPECS) == list(FaultKind)
    for kind in FaultKind:
        assert kind_spec(kind) is KIND_SPECS[kind]
        assert kind_spec(kind.value) is KIND_SPECS[kind]
    with pytest.raises(ValueError):
        kind_spec("bogus")


@pytest.mark.parametrize("kind", list(FaultKind), ids=str)
def test_every_registered_kind_has_every_part(kind):
    spec = kind_spec(kind)
    assert isinstance(spec, KindSpec) and spec.kind is kind
    assert spec.summary.strip()
    assert isinstance(spec.implemented, bool)
    assert isinstance(spec.collective, bool)
    assert isinstance(spec.ends_process, bool)
    # params: a strict model whose defaults make a valid params object.
    assert issubclass(spec.params, Params) and issubclass(spec.params, BaseModel)
    assert spec.params.model_config.get("extra") == "forbid"
    spec.params.model_validate({})
    # rules: a tuple of callables (possibly empty: a kind may need none of its own).
    assert isinstance(spec.rules, tuple) and all(callable(rule) for rule in spec.rules)
    # injection: an Injection that overrides act (the base one only says there is none).
    assert isinstance(spec.injection, Injection)
    assert type(spec.injection).act is not Injection.act
    # damage assessment: answers a Repair for a backend that reported nothing.
    assert callable(spec.assess_damage)

    class Quiet:
        def memory_faults(self):
            return []

    assert isinstance(spec.assess_damage(Quiet(), None), Repair)
    # device recovery: what the backends do to the device after a round with this kind.
    assert isinstance(spec.device, DeviceRecovery)
    assert not (spec.device.rebuild_streams and not spec.device.restart)
    # doctor row: how it is injected, real or emulated, on every platform ftkit serves.
    assert isinstance(spec.doctor, DoctorRow)
    for platform in ("cpu", "cuda", "npu"):
        mode, how = spec.doctor.on(platform)
        assert mode in (REAL, EMULATED) and how.strip(), (kind, platform)


def test_which_kinds_need_what_of_the_device():
    """Ascend restarts the device after the kinds whose error leaves its task queue in an
    exit state, and also rebuilds its streams after a reset or a hang; an oom releases
    memory (the backends read these, ``ftkit.backends``)."""
    restart = {k.value for k, s in KIND_SPECS.items() if s.device.restart}
    streams = {k.value for k, s in KIND_SPECS.items() if s.device.rebuild_streams}
    release = {k.value for k, s in KIND_SPECS.items() if s.device.release_memory}
    assert restart == {"link_break", "link_flap", "device_reset", "uce", "hang"}
    assert streams == {"device_reset", "hang"}
    assert release == {"oom"}
    assert any_kind(["oom", "link_break"], lambda spec: spec.device.release_memory)
    assert not any_kind(["process_kill"], lambda spec: spec.device.restart)


def test_what_the_kinds_say_about_themselves():
    collective = {k for k, s in KIND_SPECS.items() if s.collective}
    assert collective == {FaultKind.LINK_BREAK, FaultKind.LINK_FLAP}
    ends_process = {k for k, s in KIND_SPECS.items() if s.ends_process}
    assert ends_process == {FaultKind.PROCESS_KILL, FaultKind.RAY_WORKER_KILL,
                            FaultKind.NODE_LOSS}
    assert all(s.implemented for s in KIND_SPECS.values())


def test_every_module_of_the_package_registers_kinds():
    modules = {p.stem for p in KINDS_DIR.glob("*.py")} - {"__init__", "base"}
    registered = {type(s.injection).__module__.rsplit(".", 1)[1] for s in KIND_SPECS.values()}
    assert modules == registered


def test_the_kinds_import_nothing_above_them():
    # The kinds sit below the recovery engine, the injector and the vLLM adapter.
    forbidden = ("ftkit.recovery", "ftkit.inject", "ftkit.vllm", "vllm", "torch")
    for path in KINDS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: torch may be imported where a fault fires
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"


def test_loading_scenarios_and_the_kinds_imports_no_torch():
    code = ("import sys, ftkit.kinds, ftkit.scenario; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- damage assessments -----------------------------------------------------------------------

def test_the_damage_of_each_kind():
    from types import SimpleNamespace

    from ftkit.backends.base import MemoryFault
    from ftkit.recovery.damage import assess_damage

    class Device:
        def __init__(self, faults):
            self.faults = faults

        def memory_faults(self):
            return self.faults

    class Memory:
        def classify(self, faults):
            return SimpleNamespace(kv_blocks={f.address for f in faults if f.address < 100},
                                   params={"w"} if any(f.address >= 100 for f in faults)
                                   else set(), other=0)

    none = Device([])
    for kind in (FaultKind.LINK_BREAK, FaultKind.LINK_FLAP, FaultKind.HANG, FaultKind.OOM,
                 FaultKind.PROCESS_KILL):
        assert kind_spec(kind).assess_damage(none, Memory()) == Repair()
    assert kind_spec("device_reset").assess_damage(none, None) == Repair(kv_lost_all=True)
    uce = kind_spec("uce").assess_damage
    assert uce(Device([MemoryFault(5, 8), MemoryFault(200, 8)]), Memory()) == \
        Repair(kv_lost=(5,), reload_params=("w",))
    assert uce(none, Memory()).unrecoverable.startswith("the device reported no address")
    assert uce(Device([MemoryFault(5, 8)]), None).unrecoverable == \
        "no map of the device memory to classify the error"
    # The recovery engine reaches each kind's assessment through one dispatcher.
    assert assess_damage(FaultKind.DEVICE_RESET, none, Memory()) == Repair(kv_lost_all=True)
    assert assess_damage(FaultKind.LINK_BREAK, none, Memory()) == Repair()
    assert assess_damage(FaultKind.UCE, Device([MemoryFault(5, 8), MemoryFault(200, 8)]),
                         Memory()) == Repair(kv_lost=(5,), reload_params=("w",))
    assert "no address" in assess_damage(FaultKind.UCE, none, Memory()).unrecoverable
