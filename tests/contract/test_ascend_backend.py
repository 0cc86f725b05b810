"""The Ascend backend against the torch_npu stand-in, in one process: capability probing,
the stop and its errors, the restart signature variants, UCE reports, the operator timeout,
the generator, and the binding of a recovering thread to the rank's NPU.

The stand-in is a fake of torch_npu (no NPU exists here), faithful to its documented API; see
``standin/torch_npu/__init__.py``.
"""

from __future__ import annotations

import logging
import sys
import threading

import pytest
import torch

from ftkit.backends.ascend import AscendBackend
from ftkit.backends.base import RECOVERY_STEPS, MemoryFault
from ftkit.errors import FtkitError
from ftkit.faults import CommunicationStopped, FaultKind, OperatorTimeout, SimulatedFault

DEVICE = 3


def startup_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ftkit" and r.levelno == logging.WARNING]


def test_every_step_is_supported_on_a_complete_torch_npu(load_torch_npu, caplog):
    load_torch_npu()
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        backend = AscendBackend(0, device_id=DEVICE)
    caps = backend.capabilities()
    assert set(caps) == set(RECOVERY_STEPS)
    assert all(cap.supported for cap in caps.values()), caps
    assert "disable_tensor_unsafe_check" in caps["device_restart"].detail
    assert startup_warnings(caplog) == []


@pytest.mark.parametrize("missing, steps, api", [
    (("stop_device",), {"stop"}, "torch_npu.npu.stop_device"),
    (("restart_device",), {"device_restart"}, "torch_npu.npu.restart_device"),
    (("reinit_process_group",), {"comm_rebuild"}, "torch.distributed.reinit_process_group"),
    (("set_op_timeout_ms",), {"op_timeout"}, "torch_npu.npu.set_op_timeout_ms"),
    (("_get_uce_addr",), {"uce_detect"}, "torch_npu.npu.utils._get_uce_addr"),
    (("check_uce_in_memory",), {"uce_detect"}, "torch_npu.npu.check_uce_in_memory"),
    (("get_rng_state", "set_rng_state"), {"rng_state"}, "torch_npu.npu.get_rng_state"),
])
def test_a_missing_api_disables_its_step_with_one_warning(load_torch_npu, caplog, missing,
                                                          steps, api):
    load_torch_npu(missing=missing)
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        backend = AscendBackend(0, device_id=DEVICE)
    caps = backend.capabilities()
    assert {s for s, cap in caps.items() if not cap.supported} == steps
    for step in steps:
        assert api in caps[step].detail
    warnings = startup_warnings(caplog)
    assert len(warnings) == 1
    assert api in warnings[0].getMessage()
    assert all(step in warnings[0].getMessage() for step in steps)


def test_without_torch_npu_every_step_is_unsupported_and_nothing_crashes(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        backend = AscendBackend(0, device_id=0)
    caps = backend.capabilities()
    assert not any(cap.supported for cap in caps.values())
    assert all("torch_npu cannot be imported" in cap.detail for cap in caps.values())
    assert len(startup_warnings(caplog)) == 1
    backend.stop_communication()  # logged, not raised: the monitor thread must go on
    with pytest.raises(FtkitError, match="cannot restart the NPU: torch_npu cannot be imported"):
        backend.recover_device(("link_break",))


def test_the_steps_a_missing_api_disabled_fail_clearly_when_a_round_needs_them(load_torch_npu,
                                                                              caplog):
    load_torch_npu(missing=("restart_device", "reinit_process_group", "set_op_timeout_ms",
                            "check_uce_in_memory", "get_rng_state"))
    backend = AscendBackend(0, device_id=DEVICE)
    with pytest.raises(FtkitError, match="cannot restart the NPU: .*restart_device"):
        backend.recover_device(("device_reset",))
    with pytest.raises(FtkitError, match="cannot rebuild the HCCL .*reinit_process_group"):
        backend.rebuild_communicators(5.0, ("link_break",))
    with caplog.at_level(logging.ERROR, logger="ftkit"):
        backend.set_op_timeout(2.0)
        assert backend.memory_faults() == []
    assert any("set_op_timeout_ms" in r.getMessage() for r in caplog.records)
    assert any("check_uce_in_memory" in r.getMessage() for r in caplog.records)
    state = backend.get_rng_state()  # the fault-free step still records
    with pytest.raises(FtkitError, match="random generator"):
        backend.set_rng_state(state)


class InjectedForceStop(SimulatedFault):
    """An error ftkit raises as this rank's own device reset (the text of a stop)."""


def test_force_stop_is_a_stop_only_after_this_ranks_own_stop(load_torch_npu):
    torch_npu = load_torch_npu()
    torch_npu.npu.set_device(DEVICE)
    backend = AscendBackend(0)
    assert backend.device_id == DEVICE  # from the thread bound to the NPU
    force_stop = RuntimeError("FORCE STOP.\n[ERROR] ... ERR00100 PTA call acl api failed")
    assert not backend.is_stop_error(force_stop)  # before a stop: the device failed by itself

    backend.stop_communication()
    calls = torch_npu._standin.DEVICE.calls
    assert [(c["call"], c["args"]) for c in calls] == [("stop_device", [DEVICE])]
    with pytest.raises(RuntimeError, match="^FORCE STOP"):
        torch_npu._standin.launch("matmul")
    assert backend.is_stop_error(force_stop)
    assert backend.is_stop_error(CommunicationStopped("stopped"))
    assert not backend.is_stop_error(InjectedForceStop("FORCE STOP. injected"))
    assert not backend.is_stop_error(RuntimeError("SUSPECT REMOTE ERROR"))

    backend.recover_device(())
    backend.rebuild_communicators(5.0, ())
    torch_npu._standin.launch("matmul")  # the restart cleared the stop
    assert not backend.is_stop_error(force_stop)


@pytest.mark.parametrize("signature", ["new", "old"])
def test_restart_uses_the_signature_the_installed_torch_npu_has(load_torch_npu, signature):
    torch_npu = load_torch_npu(restart_signature=signature)
    backend = AscendBackend(0, device_id=DEVICE)
    backend.recover_device(("device_reset",))
    backend.recover_device(("link_flap",))
    restarts = [c["kwargs"] for c in torch_npu._standin.DEVICE.calls
                if c["call"] == "restart_device"]
    if signature == "new":
        assert restarts == [
            {"rebuild_all_resources": True, "disable_tensor_unsafe_check": True},
            {"rebuild_all_resources": False, "disable_tensor_unsafe_check": False}]
    else:
        # Rebuilding the streams would mark every tensor unsafe: not done on the old one.
        assert restarts == [{"rebuild_all_resources": False}, {"rebuild_all_resources": False}]
        assert "older signature" in backend.capabilities()["device_restart"].detail
    assert not torch_npu._standin.DEVICE.tensors_unsafe
    torch_npu._standin.launch("matmul")


def test_an_oom_restarts_no_device_that_was_not_stopped(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    backend.recover_device(("oom",))
    assert [c["call"] for c in torch_npu._standin.DEVICE.calls] == ["empty_cache"]
    backend.stop_communication()  # a peer's oom stopped this rank: now its device restarts
    backend.recover_device(("oom",))
    assert [c["call"] for c in torch_npu._standin.DEVICE.calls] == [
        "empty_cache", "stop_device", "restart_device", "empty_cache"]


def test_memory_errors_are_reported_with_their_address_until_the_restart(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    assert backend.memory_faults() == []
    torch_npu._standin.inject_uce(0x7F00_0000_1000, 2 << 20)
    assert backend.memory_faults() == [MemoryFault(0x7F00_0000_1000, 2 << 20)]
    backend.report_memory_fault(MemoryFault(0x2000, 64))  # an emulated one adds to it
    assert backend.memory_faults() == [MemoryFault(0x2000, 64),
                                       MemoryFault(0x7F00_0000_1000, 2 << 20)]
    backend.recover_device(("uce",))
    assert backend.memory_faults() == []


def test_the_operator_timeout_is_set_in_milliseconds(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    backend.set_op_timeout(2.5)
    assert torch_npu._standin.DEVICE.op_timeout_ms == 2500
    # No op_timeout_s in the settings: ftkit's documented default of 120 s, not CANN's.
    backend.set_op_timeout(None)
    assert torch_npu._standin.DEVICE.op_timeout_ms == 120_000
    assert [c["args"] for c in torch_npu._standin.DEVICE.calls
            if c["call"] == "set_op_timeout_ms"] == [[2500], [120_000]]


def test_a_uce_the_device_recorded_is_this_ranks_own_fault_until_the_restart(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    assert backend.recorded_fault() is None
    torch_npu._standin.inject_uce(0x7F00_0000_1000, 4096)
    backend.stop_communication()  # a peer's fault stops this rank: the record stays
    assert backend.recorded_fault() is FaultKind.UCE
    backend.recover_device(())
    assert backend.recorded_fault() is None
    backend.report_memory_fault(MemoryFault(0x2000, 64))  # an emulated one counts too
    assert backend.recorded_fault() is FaultKind.UCE


def test_the_device_generator_is_saved_and_restored(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    generator = torch_npu._standin.DEVICE.rng
    state = backend.get_rng_state()
    first = torch.rand(4, generator=generator)
    backend.set_rng_state(state)
    assert torch.equal(torch.rand(4, generator=generator), first)


def test_a_round_on_another_thread_resumes_the_communicators_of_this_ranks_npu(
        load_torch_npu):
    """The monitor thread runs the round of a rank between steps; torch_npu's current device
    is per thread, and reinit_process_group(rebuild_link=False) resumes the communicators of
    the current device only."""
    torch_npu = load_torch_npu()
    torch_npu.npu.set_device(DEVICE)
    backend = AscendBackend(0)
    assert backend.device_id == DEVICE
    errors: list[BaseException] = []

    def monitor_round() -> None:
        try:
            backend.recover_device(("oom",))
            backend.rebuild_communicators(5.0, ("oom",))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=monitor_round, name="ftkit-monitor")
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and errors == []
    reinit = [c for c in torch_npu._standin.DEVICE.calls if c["call"] == "reinit_process_group"]
    assert [(c["kwargs"]["rebuild_link"], c["thread"], c["current_device"]) for c in reinit] \
        == [(False, "ftkit-monitor", DEVICE)]


def test_an_injected_device_reset_is_a_real_stop_device_and_its_own_fault(load_torch_npu):
    torch_npu = load_torch_npu()
    backend = AscendBackend(1, device_id=DEVICE)
    restarted: list[str] = []
    backend.force_stop("ftkit injected device_reset", on_restart=lambda: restarted.append("kv"))
    assert [c["call"] for c in torch_npu._standin.DEVICE.calls] == ["stop_device"]
    with pytest.raises(RuntimeError, match="^FORCE STOP") as raised:
        torch_npu._standin.launch("matmul")
    assert not backend.is_stop_error(raised.value)  # this rank's fault, not a peer's
    assert restarted == []
    backend.recover_device(("device_reset",))
    assert restarted == ["kv"]  # what the reset destroyed, at the restart
    torch_npu._standin.launch("matmul")


def test_an_emulated_hang_ends_when_the_rank_is_stopped(load_torch_npu):
    load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    timer = threading.Timer(0.2, backend.stop_communication)
    timer.start()
    try:
        with pytest.raises(CommunicationStopped, match="hung operator stopped"):
            backend.hang("ftkit injected hang", timeout_s=30)
    finally:
        timer.cancel()


def test_an_emulated_hang_ends_at_the_operator_timeout(load_torch_npu):
    load_torch_npu()
    backend = AscendBackend(0, device_id=DEVICE)
    backend.set_op_timeout(0.1)
    with pytest.raises(OperatorTimeout, match="operator timeout of 0.1 s"):
        backend.hang("ftkit injected hang")
