"""``ftkit.vllm.pipeline``: one step in flight with recovery on, and the pipeline group's
transfers routed through the backend (the real transfers: tests/multiprocess/
test_stage_transfer.py; a real pipeline under faults: tests/vllm/test_pipeline.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ftkit.errors import FtkitError
from ftkit.vllm.pipeline import take_over_stage_transfers
from ftkit.vllm.plugin import _one_step_in_flight_with_recovery


def _config(stages: int, fault_tolerance: dict | None) -> SimpleNamespace:
    extra = {} if fault_tolerance is None else {"fault_tolerance": fault_tolerance}
    return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=stages),
                           scheduler_config=SimpleNamespace(async_scheduling=False),
                           use_v2_model_runner=False, additional_config=extra)


@pytest.mark.parametrize(("stages", "fault_tolerance", "batches"), [
    (2, {"enabled": True}, 1),      # recovery rolls one step back: one in flight
    (2, {"enabled": False}, 2),     # recovery off: vLLM's batch queue, one step per stage
    (2, None, 2),
    (1, {"enabled": True}, 1),
])
def test_an_engine_with_recovery_on_keeps_one_step_in_flight(stages, fault_tolerance, batches):
    from vllm.config import VllmConfig

    _one_step_in_flight_with_recovery()
    _one_step_in_flight_with_recovery()  # idempotent: wrapped once
    getter = VllmConfig.__dict__["max_concurrent_batches"].fget
    assert getter(_config(stages, fault_tolerance)) == batches
    assert getter.__wrapped__(_config(stages, fault_tolerance)) == stages  # vLLM's own


class _Backend:
    name = "cpu"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def send_tensor_dict(self, group, tensor_dict, dst):
        self.calls.append(("send", group, dict(tensor_dict), dst))

    def recv_tensor_dict(self, group, src):
        self.calls.append(("recv", group, src))
        return {"hidden_states": src}


@pytest.mark.parametrize("stage", [0, 1])
def test_the_pipeline_groups_transfers_go_through_the_backend(stage):
    coordinator = SimpleNamespace(world_size=2, rank_in_group=stage)
    backend, group = _Backend(), SimpleNamespace(coordinator=coordinator)
    take_over_stage_transfers(group, backend)
    peer = 1 - stage
    # vLLM's worker: an asynchronous send whose handles it waits for at its next step, and a
    # receive whose handles and post-processing it runs before the forward pass.
    assert coordinator.isend_tensor_dict({"x": 1}, all_gather_group=object()) == []
    assert coordinator.irecv_tensor_dict(all_gather_group=object()) == (
        {"hidden_states": peer}, [], [])
    assert coordinator.send_tensor_dict({"y": 2}) is None
    assert coordinator.recv_tensor_dict() == {"hidden_states": peer}
    assert backend.calls == [("send", group, {"x": 1}, peer), ("recv", group, peer),
                             ("send", group, {"y": 2}, peer), ("recv", group, peer)]


def test_a_backend_that_cannot_stop_a_transfer_is_refused():
    class Cuda:
        name = "cuda"

    with pytest.raises(FtkitError, match="cuda backend cannot stop a pipeline stage"):
        take_over_stage_transfers(SimpleNamespace(coordinator=SimpleNamespace(
            world_size=2, rank_in_group=0)), Cuda())
