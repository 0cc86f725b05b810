"""The Ascend backend's whole recovery sequence across real processes, on the torch_npu
stand-in (its HCCL is real gloo): detect, stop_device, restart_device, reinit_process_group,
rebuild of ftkit's gloo groups, re-run; every step's outputs equal the fault-free oracle.

The rig is ``tests/multiprocess/_harness.py`` with ``backend: ascend``: the real
RecoveryMonitor, Coordinator and StepWrapper, with a recording step state in place of vLLM's
runner. Only torch_npu is a stand-in (no NPU here); everything else is what runs in
production.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import _harness as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

RUN_TIMEOUT_S = 45.0
STEPS = 5


def run(scenario: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    results, codes, wall = h.run_world(2, {"backend": "ascend", "steps": STEPS, **scenario},
                                       tmp_path / "ranks", RUN_TIMEOUT_S)
    for r, res in enumerate(results):
        assert codes[r] == 0, f"rank {r} exit code {codes[r]}; record: {res}"
        assert res is not None and "setup_error" not in res, res
    assert wall < RUN_TIMEOUT_S
    return results  # type: ignore[return-value]


def recovered(*results: dict[str, Any]) -> None:
    expected = h.expected_outputs(2, STEPS)
    for res in results:
        assert res["error"] is None, res["error"]["traceback"]
        assert res["outputs"] == expected


def calls(res: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [c for c in res["device"]["calls"] if c["call"] == name]


def reinits(res: dict[str, Any]) -> list[tuple[Any, bool]]:
    return [(c["kwargs"]["group"], c["kwargs"]["rebuild_link"])
            for c in calls(res, "reinit_process_group")]


def fault(rank: int, step: int, action: str, *, at: int = 1, attempts: list[int] | None = None,
          delay_s: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "rpc": "execute", "step": step, "at": at,
            "attempts": attempts or [0], "delay_s": delay_s, "action": action, **extra}


def test_link_break_stops_the_blocked_peer_restarts_and_rebuilds_the_links(tmp_path):
    delay = 0.3
    r0, r1 = run({"faults": [fault(1, 3, "link", delay_s=delay)]}, tmp_path)
    recovered(r0, r1)
    # Rank 0 really blocked in the HCCL collective, and stop_device (its monitor) ended it.
    assert [(s["step"], s["index"]) for s in r0["stops"]] == [(3, 1)]
    assert r0["stops"][0]["error"].startswith("FORCE STOP.")
    assert r0["stops"][0]["blocked_s"] >= delay - 0.1
    assert [(e["step"], e["index"]) for e in r1["link_errors"]] == [(3, 1)]
    assert [(c["args"], c["thread"]) for c in calls(r0, "stop_device")] == [([0], "ftkit-monitor")]
    assert calls(r1, "stop_device") == []
    for rank, res in enumerate((r0, r1)):
        # Both devices restart (a link error leaves the task queue in an exit state), and
        # the links are rebuilt: the default group's and the device group's.
        assert [(c["args"], c["kwargs"]) for c in calls(res, "restart_device")] == [
            ([rank], {"rebuild_all_resources": False, "disable_tensor_unsafe_check": False})]
        assert reinits(res) == [(None, True), ("hccl", True)]
        [group] = res["device"]["groups"]
        assert (group["state"], group["links_rebuilt"], group["channels"]) == ("ok", 1, 2)
        # reinit leaves gloo groups alone: ftkit gave the cpu group a fresh one.
        assert res["cpu_group_replaced"] and not res["device_group_replaced"]
        assert not res["device"]["stopped"]


def test_a_peer_fault_without_a_link_resumes_the_communicators(tmp_path):
    r0, r1 = run({"faults": [fault(1, 2, "oom", at=1)]}, tmp_path)
    recovered(r0, r1)
    assert [s["step"] for s in r0["stops"]] == [2]
    # Only the stopped rank restarts its device; an oom needs no restart.
    assert [c["args"] for c in calls(r0, "restart_device")] == [[0]]
    assert calls(r1, "restart_device") == []
    assert len(calls(r1, "empty_cache")) == 1
    for res in (r0, r1):
        assert reinits(res) == [(None, False)]
        [group] = res["device"]["groups"]
        assert (group["state"], group["resumed"], group["links_rebuilt"]) == ("ok", 1, 0)
        assert res["cpu_group_replaced"] and not res["device_group_replaced"]


@pytest.mark.parametrize("signature, restart_kwargs", [
    ("new", {"rebuild_all_resources": True, "disable_tensor_unsafe_check": True}),
    ("old", {"rebuild_all_resources": False}),
])
def test_a_device_that_fails_by_itself_is_restarted_with_what_the_signature_allows(
        tmp_path, signature, restart_kwargs):
    # Rank 1's device fails 0.3 s into the step, while rank 0 waits in the collective.
    r0, r1 = run({"torch_npu": {"restart_signature": signature},
                  "faults": [fault(1, 3, "device_error", at=0, delay_s=0.3,
                                   text="FORCE STOP.")]}, tmp_path)
    recovered(r0, r1)
    # Rank 1's FORCE STOP came from its own device, not from a stop of ftkit: its fault.
    assert [(r["state"], r["kind"]) for r in r1["rounds"]] == [("failed", "device_reset")]
    assert [r["state"] for r in r0["rounds"]] == ["stopped"]
    for res in (r0, r1):
        assert [c["kwargs"] for c in calls(res, "restart_device")] == [restart_kwargs]
        assert not res["device"]["tensors_unsafe"]


def test_a_rank_between_steps_recovers_on_its_monitor_thread_bound_to_its_npu(tmp_path):
    """Rank 1 waits for its next RPC while rank 0 fails: rank 1's monitor runs the round. If
    it resumed the communicators of the wrong NPU (the thread's default device 0), rank 1
    would keep its old channel while rank 0 starts a fresh one, and the re-run would fail."""
    r0, r1 = run({"faults": [fault(0, 3, "oom", at=0, delay_s=0.3)],
                  "idle_gaps": [{"rank": 1, "step": 3, "seconds": 1.5}]}, tmp_path)
    recovered(r0, r1)
    assert [r["state"] for r in r1["rounds"]] == ["idle"]
    [reinit] = calls(r1, "reinit_process_group")
    assert (reinit["thread"], reinit["current_device"]) == ("ftkit-monitor", 1)
    assert [g["resumed"] for g in r0["device"]["groups"] + r1["device"]["groups"]] == [1, 1]


def test_a_flap_is_recovered_on_every_attempt(tmp_path):
    r0, r1 = run({"max_reinference": 3,
                  "faults": [fault(1, 2, "link", attempts=[0, 1, 2], delay_s=0.1)]}, tmp_path)
    recovered(r0, r1)
    assert [s["attempt"] for s in r0["stops"]] == [0, 1, 2]
    for res in (r0, r1):
        assert len(calls(res, "restart_device")) == 3
        assert [g["links_rebuilt"] for g in res["device"]["groups"]] == [3]


def test_a_torch_npu_without_reinit_warns_once_at_start_and_fails_the_round_clearly(tmp_path):
    r0, r1 = run({"torch_npu": {"missing": ["reinit_process_group"]},
                  "faults": [fault(1, 3, "link", delay_s=0.2)]}, tmp_path)
    for res in (r0, r1):
        start = [w for w in res["warnings"] if "cannot do every recovery step" in w]
        assert len(start) == 1 and "reinit_process_group" in start[0]
        assert res["outputs"] == h.expected_outputs(2, STEPS)[:2]
        assert "RecoveryError" in res["error"]["mro"]
        assert "torch.distributed.reinit_process_group" in res["error"]["message"]


#: Where rank 1's device records a UCE: inside the weights of ``_harness.StandInMemory``.
WEIGHTS_UCE = {"ptr": h.StandInMemory.WEIGHTS[1] + 0x400, "size": 256}


def own_uce_while_stopped(tmp_path: Path, **scenario: Any) -> tuple[dict[str, Any], ...]:
    """Rank 0's link breaks at step 3 while rank 1 waits in the collective; 0.1 s into that
    wait, rank 1's device records a UCE in the weights, which nothing raises: the stop for
    rank 0's fault ends rank 1's step with FORCE STOP first."""
    return tuple(run({"faults": [
        fault(0, 3, "link", delay_s=0.6),
        fault(1, 3, "uce", recorded_after_s=0.1, **WEIGHTS_UCE),
    ], **scenario}, tmp_path))


def test_a_stopped_rank_reports_and_repairs_the_uce_its_device_recorded(tmp_path):
    r0, r1 = own_uce_while_stopped(tmp_path)
    recovered(r0, r1)
    assert r1["stops"][0]["error"].startswith("FORCE STOP.")  # the stop hid the UCE
    # Rank 1 reported the UCE as its own fault, and the round reloaded its weights.
    assert [(r["state"], r["kind"]) for r in r1["rounds"]] == [("failed", "uce")]
    assert [(r["state"], r["kind"]) for r in r0["rounds"]] == [("failed", "link_break")]
    assert r1["reloaded"] == [["model.norm.weight"]] and r0["reloaded"] == []
    # It asked before restart_device repaired the memory and cleared the record.
    asked = [c["call"] for c in r1["device"]["calls"]
             if c["call"] in ("check_uce_in_memory", "_get_uce_addr", "restart_device")]
    assert asked[-1] == "restart_device" and "_get_uce_addr" in asked[:-1]
    assert [r["device_uce"] for r in r1["rebuilds"]] == [[WEIGHTS_UCE]]
    assert r1["device"]["uce"] == []


def test_without_the_question_the_restart_clears_the_record_and_nothing_is_reloaded(tmp_path):
    r0, r1 = own_uce_while_stopped(tmp_path, recorded_fault_check=False)
    # The harness's step has no weights to compute with, so its outputs still match: the
    # damage is the repair that did not happen.
    recovered(r0, r1)
    assert [(r["state"], r["kind"]) for r in r1["rounds"]] == [("stopped", None)]
    assert r1["reloaded"] == []
    # The UCE was recorded when the round brought the device back, and the restart cleared
    # it without anyone asking where it was.
    assert [r["device_uce"] for r in r1["rebuilds"]] == [[WEIGHTS_UCE]]
    calls = [c["call"] for c in r1["device"]["calls"]]
    assert "restart_device" in calls and "_get_uce_addr" not in calls
    assert "check_uce_in_memory" not in calls
    assert r1["device"]["uce"] == []
