"""The CUDA backend's probing of torch and NCCL, and how it takes over a communicator, in one
process. No GPU exists here: the tests that need torch to report CUDA and NCCL make it do so
with monkeypatch (a fake of what cannot exist), the rest runs on this CPU build as it is."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftkit.backends import cuda
from ftkit.backends.base import RECOVERY_STEPS
from ftkit.backends.cuda import CudaBackend, TorchCudaApi
from ftkit.faults import CommunicationStopped, LinkError


def ftkit_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ftkit" and r.levelno == logging.WARNING]


def test_on_a_torch_without_cuda_the_steps_that_need_it_are_unsupported(caplog):
    assert not torch.cuda.is_available()  # this machine; the test tells its truth
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        backend = CudaBackend(0)
    caps = backend.capabilities()
    assert set(caps) == set(RECOVERY_STEPS)
    assert not any(cap.supported for cap in caps.values())
    for step in ("stop", "comm_rebuild", "op_timeout", "rng_state"):
        assert caps[step].detail == "CUDA is not available to this torch"
    assert "in-process device restart" in caps["device_restart"].detail
    assert "without its address" in caps["uce_detect"].detail
    [warning] = ftkit_warnings(caplog)
    assert "CUDA is not available" in warning and "device_restart" in warning


def test_on_gloo_the_collective_steps_are_supported():
    caps = CudaBackend(0, device_backend="gloo", warn=False).capabilities()
    assert {s for s, cap in caps.items() if cap.supported} == {"stop", "comm_rebuild",
                                                               "op_timeout"}
    assert "ProcessGroup.abort" in caps["comm_rebuild"].detail


@pytest.fixture
def cuda_and_nccl(monkeypatch):
    """torch reports CUDA and NCCL (``version``: what torch.cuda.nccl.version() says)."""

    def make(version: Any) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)

    return make


@pytest.mark.parametrize("version, supported", [
    ((2, 21, 5), True), ((2, 4, 0), True), ((2, 3, 7), False), (21803, True), (2308, False)])
def test_communicator_rebuild_is_gated_by_the_nccl_version(cuda_and_nccl, version, supported):
    cuda_and_nccl(version)
    caps = TorchCudaApi.probe().capabilities()
    assert caps["comm_rebuild"].supported is supported
    assert caps["stop"].supported is supported
    if not supported:
        assert "older than 2.4.0" in caps["comm_rebuild"].detail
    assert caps["rng_state"].supported


def test_an_unknown_nccl_version_is_not_fatal():
    assert cuda._nccl_version() is None  # no NCCL in this build: unknown, not fatal


@pytest.mark.parametrize("encoded, expected", [(2708, (2, 7, 8)), (21803, (2, 18, 3))])
def test_an_integer_nccl_version_is_decoded(monkeypatch, encoded, expected):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: encoded)
    assert cuda._nccl_version() == expected


def test_without_an_abort_api_the_rebuild_is_unsupported(cuda_and_nccl, monkeypatch):
    cuda_and_nccl((2, 21, 5))
    monkeypatch.delattr(dist.ProcessGroup, "abort")
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    caps = TorchCudaApi.probe().capabilities()
    assert not caps["comm_rebuild"].supported
    assert "neither ProcessGroup.abort nor _abort_process_group" in caps["comm_rebuild"].detail
    assert caps["stop"].supported


class FakeCommunicator:
    """The attributes of vLLM's CudaCommunicator the backend touches (no process group)."""

    world_size = 2
    rank_in_group = 0
    ranks = [0, 1]
    cpu_group = device_group = None

    def __init__(self) -> None:
        self.entered: list[str] = []

    def all_gatherv(self, *args: Any, **kwargs: Any) -> None:
        self.entered.append("all_gatherv")

    def send(self, *args: Any, **kwargs: Any) -> None:
        self.entered.append("send")


class FakeGroup:
    name = "tp"
    ranks = [0, 1]

    def __init__(self) -> None:
        self.communicator = FakeCommunicator()

    def current_groups(self) -> tuple[Any, Any]:
        return None, None

    def replace_groups(self, cpu_group: Any, device_group: Any) -> None:
        raise AssertionError("not in this test")


def test_take_over_replaces_the_tp_collectives_and_guards_the_rest(monkeypatch, caplog):
    monkeypatch.delenv(cuda.ASYNC_ERROR_HANDLING_ENV, raising=False)
    group = FakeGroup()
    backend = CudaBackend(0, warn=False)
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        backend.take_over([group])
        backend.take_over([group])  # a second take-over wraps nothing twice
    comm = group.communicator
    for name in ("all_reduce", "all_gather", "reduce_scatter", "gather", "broadcast"):
        assert getattr(comm, name).__qualname__.startswith("_abortable_collectives")
    comm.all_gatherv()
    assert comm.entered == ["all_gatherv"]
    backend.break_link("ftkit injected link_break")
    with pytest.raises(LinkError, match="SUSPECT REMOTE ERROR"):
        comm.send()
    with pytest.raises(LinkError):
        comm.all_reduce(torch.ones(2))  # never issued: no collective entered
    assert comm.entered == ["all_gatherv"] and backend.collectives_issued == 0
    backend.faults.repaired_links()
    backend.stop_communication()
    with pytest.raises(CommunicationStopped):
        comm.send()
    # The NCCL watchdog would act on its own: the operator is told, once per take-over.
    assert sum(cuda.ASYNC_ERROR_HANDLING_ENV in m for m in ftkit_warnings(caplog)) == 2


def test_with_the_watchdog_left_to_ftkit_no_warning(monkeypatch, caplog):
    monkeypatch.setenv(cuda.ASYNC_ERROR_HANDLING_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        CudaBackend(0, warn=False).take_over([FakeGroup()])
    assert ftkit_warnings(caplog) == []
