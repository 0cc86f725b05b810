"""Classification of raised errors into fault kinds: type first, torch_npu's texts second."""

from __future__ import annotations

import pytest
import torch

from ftkit.faults import (CommunicationStopped, FaultKind, ForceStopError, LinkError,
                          OperatorTimeout, UceError, classify, is_peer_stop)


@pytest.mark.parametrize("text, kind", [
    ("FORCE STOP. device 3 was stopped", FaultKind.DEVICE_RESET),
    ("SUSPECT REMOTE ERROR: hccl link down", FaultKind.LINK_BREAK),
    ("HCCL OP RETRY FAILED after 3 retries", FaultKind.LINK_BREAK),
    ("UCE ERROR at address 0x1000", FaultKind.UCE),
    ("SUSPECT MEM ERROR on device 1", FaultKind.UCE),
    ("ECC ERROR detected", FaultKind.UCE),
    ("task queue status: SUSPECT_REMOTE_EXIT", FaultKind.LINK_BREAK),
    ("task queue status: HCCL_OP_RETRY_EXIT", FaultKind.LINK_BREAK),
    ("task queue status: UCE_EXIT", FaultKind.UCE),
    ("task queue status: HCCS_LINK_EXIT", FaultKind.LINK_BREAK),
])
def test_torch_npu_error_texts(text, kind):
    assert classify(RuntimeError(text)) is kind


def test_type_decides_before_text():
    # A simulated link error is a link fault whatever its message says.
    assert classify(LinkError("FORCE STOP in the message")) is FaultKind.LINK_BREAK
    assert classify(torch.OutOfMemoryError("CPU out of memory")) is FaultKind.OOM
    assert classify(MemoryError()) is FaultKind.OOM


def test_the_cpu_fault_model_raises_what_torch_npu_raises():
    # The simulated errors carry torch_npu's texts: classified alike by type and by text.
    for exc, kind in ((ForceStopError("device 1"), FaultKind.DEVICE_RESET),
                      (UceError("kv at 0x10"), FaultKind.UCE),
                      (LinkError("down"), FaultKind.LINK_BREAK)):
        assert classify(exc) is kind
        assert classify(RuntimeError(str(exc))) is kind
    assert classify(OperatorTimeout("operator did not finish")) is FaultKind.HANG


def test_texts_are_matched_case_sensitively_and_only_on_runtime_errors():
    assert classify(RuntimeError("force stop")) is None
    assert classify(ValueError("FORCE STOP")) is None
    assert classify(RuntimeError("shape mismatch")) is None
    assert classify(KeyError("x")) is None


def test_a_peer_stop_is_not_a_fault_of_this_rank():
    exc = CommunicationStopped("stopped")
    assert is_peer_stop(exc)
    assert classify(exc) is None
    assert not is_peer_stop(LinkError("x"))


def test_kind_catalogue():
    assert {k.value for k in FaultKind} == {"link_break", "link_flap", "device_reset", "uce",
                                            "hang", "oom", "process_kill", "ray_worker_kill",
                                            "node_loss"}
    assert str(FaultKind.LINK_FLAP) == "link_flap"
