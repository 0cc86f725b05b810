"""The recovery engine across real processes: real gloo collectives that really block, a real
stop that really unblocks them, real group rebuilds, and the side channel over the job's
TCP store, exactly as ``ftkit/vllm/worker.py`` assembles them, without vLLM.

The rig is in ``_harness.py``. Every run is bounded: processes that outlive the run's deadline
are killed, and every scenario asserts on values (each step's outputs equal the fault-free
oracle), on the number of rollbacks, on the decision, and on timings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import _harness as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

#: Bound on one scenario's processes, start-up (torch import, gloo) included.
RUN_TIMEOUT_S = 45.0


def run(world: int, scenario: dict[str, Any], tmp_path: Path,
        expect_exit: dict[int, int] | None = None) -> list[dict[str, Any]]:
    results, codes, wall = h.run_world(world, scenario, tmp_path / "ranks", RUN_TIMEOUT_S)
    expect_exit = expect_exit or {}
    for r in range(world):
        code = expect_exit.get(r, 0)
        assert codes[r] == code, (f"rank {r} exit code {codes[r]} (expected {code}; None or "
                                  f"negative: it hung and was killed); record: {results[r]}")
        assert results[r] is not None, f"rank {r} left no record"
        assert "setup_error" not in results[r], results[r]["setup_error"]
    assert wall < RUN_TIMEOUT_S
    return results  # type: ignore[return-value]


def no_error(res: dict[str, Any]) -> None:
    assert res["error"] is None, res["error"]["traceback"]


def raised(res: dict[str, Any], cls: str) -> dict[str, Any]:
    err = res["error"]
    assert err is not None, f"rank {res['rank']} did not raise"
    assert cls in err["mro"], err["traceback"]
    return err


def link_fault(rank: int, step: int, *, at: int = 1, attempts: list[int] | None = None,
               delay_s: float = 0.0, action: str = "link") -> dict[str, Any]:
    return {"rank": rank, "rpc": "execute", "step": step, "at": at,
            "attempts": attempts or [0], "delay_s": delay_s, "action": action}


# --- a. a link break --------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_link_break_blocks_peer_stops_it_and_both_rerun(tmp_path, transport):
    steps = 5
    delay = 0.3  # rank 1 breaks its link this long after rank 0 entered the collective
    r0, r1 = run(2, {"steps": steps, "transport": transport,
                     "faults": [link_fault(1, 3, delay_s=delay)]}, tmp_path)
    no_error(r0)
    no_error(r1)
    expected = h.expected_outputs(2, steps)
    assert r0["outputs"] == expected
    assert r1["outputs"] == expected

    # Rank 1 failed without entering the collective; rank 0 was really blocked in it.
    assert [(e["step"], e["index"]) for e in r1["link_errors"]] == [(3, 1)]
    assert r1["stops"] == []
    assert [(s["step"], s["attempt"], s["index"]) for s in r0["stops"]] == [(3, 0, 1)]
    # Its monitor's stop ended its wait (not the check before a collective, not a deadline),
    # after rank 1's link error.
    assert "stopped while blocked" in r0["stops"][0]["error"], r0["stops"][0]["error"]
    assert r1["link_errors"][0]["at"] <= r0["stops"][0]["at"]

    for res, state in ((r0, "stopped"), (r1, "failed")):
        assert res["rollbacks"] == [["execute", 3]]
        assert len(res["rounds"]) == 1
        rnd = res["rounds"][0]
        assert rnd["decision"] == "recompute"
        assert rnd["state"] == state and rnd["thread"] == "MainThread"
        assert rnd["states"] == {"0": "stopped", "1": "failed"}
        assert [b["kinds"] for b in res["rebuilds"]] == [["link_break"]]
        assert len(res["replacements"]) == 1 and res["replacements"][0]["new_objects"]
        assert res["groups_replaced"]
        assert [(x["step"], x["failures"]) for x in res["recovered"]] == [(3, 1)]
    # Each rank rebuilt after its own part of the fault: rank 1's error, rank 0's stop.
    assert r1["link_errors"][0]["at"] <= r1["rebuilds"][0]["at"]
    assert r0["stops"][0]["at"] <= r0["rebuilds"][0]["at"]


# --- b. a link flap ---------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_flap_within_max_reinference_recovers(tmp_path, transport):
    steps = 4
    fault = link_fault(1, 2, attempts=[0, 1, 2], delay_s=0.05)
    r0, r1 = run(2, {"steps": steps, "max_reinference": 3, "faults": [fault],
                     "transport": transport}, tmp_path)
    no_error(r0)
    no_error(r1)
    expected = h.expected_outputs(2, steps)
    assert r0["outputs"] == expected and r1["outputs"] == expected
    assert len(r1["fired"]) == 3 and len(r0["stops"]) == 3
    for res in (r0, r1):
        assert res["rollbacks"] == [["execute", 2]] * 3
        assert [r["decision"] for r in res["rounds"]] == ["recompute"] * 3
        assert [r["failures"] for r in res["rounds"]] == [1, 2, 3]
        assert [r["epoch"] for r in res["rounds"]] == [0, 1, 2]
        assert len(res["replacements"]) == 3
        assert [(x["step"], x["failures"]) for x in res["recovered"]] == [(2, 3)]


def test_flap_beyond_max_reinference_raises_on_every_rank(tmp_path):
    fault = link_fault(1, 2, attempts=[0, 1, 2, 3], delay_s=0.05)
    r0, r1 = run(2, {"steps": 4, "max_reinference": 3, "faults": [fault]}, tmp_path)
    expected = h.expected_outputs(2, 4)
    for res in (r0, r1):
        err = raised(res, "ReinferenceExhausted")
        assert "max_reinference is 3" in err["message"]
        assert res["outputs"] == expected[:1]
        assert [r["decision"] for r in res["rounds"]] == ["recompute"] * 3 + ["raise"]
        assert res["rollbacks"] == [["execute", 2]] * 3
        # No hang: the rank gave up within a bound of the last fault firing.
        assert err["at"] - r1["fired"][-1]["at"] < 3.0
    assert len(r1["fired"]) == 4


# --- c. the peer is idle between steps --------------------------------------------------------

def test_sample_fault_while_peer_idle_monitor_takes_part(tmp_path):
    steps = 4
    scenario = {
        "steps": steps,
        # Rank 0's sampling of step 2 fails, well after rank 1 finished its own step 2 ...
        "faults": [{"rank": 0, "rpc": "sample", "step": 2, "action": "oom", "delay_s": 0.4}],
        # ... and while rank 1 waits for its next RPC.
        "idle_gaps": [{"rank": 1, "step": 3, "seconds": 1.5}],
    }
    r0, r1 = run(2, scenario, tmp_path)
    no_error(r0)
    no_error(r1)
    expected = h.expected_outputs(2, steps)
    assert r0["outputs"] == expected and r1["outputs"] == expected

    (rnd0,) = r0["rounds"]
    (rnd1,) = r1["rounds"]
    assert rnd0["thread"] == "MainThread" and rnd0["state"] == "failed"
    assert rnd0["kind"] == "oom" and rnd0["rpc_kind"] == "sample"
    # Rank 1's monitor thread answered for it, as idle after the same RPC.
    assert rnd1["thread"] == "ftkit-monitor" and rnd1["state"] == "idle"
    assert rnd1["rpc"] == rnd0["rpc"]
    assert rnd0["decision"] == rnd1["decision"] == "recompute"
    assert rnd0["states"] == rnd1["states"] == {"0": "failed", "1": "idle"}

    # The step is re-run from its forward pass on both ranks: on rank 1, which had sampled
    # it already, in its monitor thread.
    assert r0["rollbacks"] == r1["rollbacks"] == [["sample", 2], ["execute", 2]]
    # Both ranks lay their batch out afresh before the first execute after the round (not
    # before the re-run step, whose undo emptied it): TP ranks must order their rows alike.
    assert r0["resets"] == r1["resets"] == [3]
    assert [x["rpc"] for x in r0["recovered"]] == ["sample"]
    # The rebuild happened on both ranks: on rank 1 in its monitor thread.
    assert [b["thread"] for b in r0["rebuilds"]] == ["MainThread"]
    assert [b["thread"] for b in r1["rebuilds"]] == ["ftkit-monitor"]
    for res in (r0, r1):
        assert [b["kinds"] for b in res["rebuilds"]] == [["oom"]]
        assert len(res["replacements"]) == 1
        assert res["replacements"][0]["new_objects"] and res["replacements"][0]["distinct"]
        assert res["groups_replaced"]
        assert res["stops"] == []


# --- d. a non-transient error -----------------------------------------------------------------

def test_non_transient_error_raises_everywhere(tmp_path):
    fault = link_fault(1, 3, delay_s=0.3, action="value_error")
    r0, r1 = run(2, {"steps": 5, "faults": [fault]}, tmp_path)
    expected = h.expected_outputs(2, 5)
    fired = r1["fired"][0]["at"]

    err1 = raised(r1, "ValueError")
    assert err1["type"] == "ValueError"  # the original error, not a wrapper
    assert err1["message"] == "injected bug at step 3"
    err0 = raised(r0, "RecoveryError")
    assert "not a transient fault" in err0["message"] and "rank 1" in err0["message"]
    assert "ValueError" in err0["message"]
    assert [(s["step"], s["index"]) for s in r0["stops"]] == [(3, 1)]
    for res, err in ((r0, err0), (r1, err1)):
        assert res["outputs"] == expected[:2]
        assert [r["decision"] for r in res["rounds"]] == ["raise"]
        assert res["rollbacks"] == [] and res["rebuilds"] == []
        assert err["at"] - fired < 3.0


# --- e. a peer dies ---------------------------------------------------------------------------

@pytest.mark.parametrize("death, code, reason", [
    ("exit_before_report", h.EXIT_BEFORE_REPORT, "did not report"),
    ("exit_in_rebuild", h.EXIT_IN_REBUILD, "recovery round 0 failed"),
])
def test_dead_peer_makes_survivor_raise_within_round_timeout(tmp_path, death, code, reason):
    round_timeout = 3.0
    scenario = {"steps": 4, "round_timeout_s": round_timeout, "exit_barrier_s": 0.0,
                "faults": [link_fault(1, 2, delay_s=0.1, action=death)]}
    r0, r1 = run(2, scenario, tmp_path, expect_exit={1: code})
    fired = r1["fired"][0]["at"]
    err = raised(r0, "RecoveryError")
    assert reason in err["message"], err["message"]
    assert r0["outputs"] == h.expected_outputs(2, 4)[:1]
    assert [r["decision"] for r in r0["rounds"]] == ["raise"]
    assert r0["rollbacks"] == []
    # Rank 0 was stopped out of its collective after the fault, then gave up when a wait of
    # the round ran out of its bound (round_timeout_s): the wait the message names.
    assert [s["step"] for s in r0["stops"]] == [2]
    assert fired <= r0["stops"][0]["at"] <= err["at"]
    bound = {"exit_before_report": f"rank(s) [1] did not report within {round_timeout:g} s",
             "exit_in_rebuild": f"wait timeout after {round_timeout * 1000:.0f}ms"}[death]
    assert bound in err["message"], err["message"]


# --- f. three ranks, two faults in one step ---------------------------------------------------

def test_three_ranks_two_faults_in_one_step_then_a_sample_fault(tmp_path):
    steps = 5
    scenario = {"steps": steps, "faults": [
        # Collective 1 follows collective 0 of the same step, so every rank is in the step:
        # rank 1 breaks at once; rank 2 breaks later, after its monitor was told of rank 1's
        # fault (its own failure still counts as a failure, not as a stop).
        link_fault(1, 2, at=1),
        link_fault(2, 2, at=1, delay_s=0.1),
        # Later, rank 0's sampling fails while ranks 1 and 2 already block in the next execute.
        {"rank": 0, "rpc": "sample", "step": 4, "action": "oom", "delay_s": 0.5},
    ]}
    results = run(3, scenario, tmp_path)
    expected = h.expected_outputs(3, steps)
    for res in results:
        no_error(res)
        assert res["outputs"] == expected
        assert [r["decision"] for r in res["rounds"]] == ["recompute", "recompute"]
        assert [r["epoch"] for r in res["rounds"]] == [0, 1]
        assert res["rounds"][0]["states"] == {"0": "stopped", "1": "failed", "2": "failed"}
        assert res["rounds"][1]["states"] == {"0": "failed", "1": "stopped", "2": "stopped"}
        assert len(res["replacements"]) == 2 and res["groups_replaced"]
        assert [b["kinds"] for b in res["rebuilds"]] == [["link_break"], ["oom"]]
    r0, r1, r2 = results
    # Step 4 is re-run from its forward pass on every rank: rank 0 undoes its sampling
    # and its forward; ranks 1 and 2, stopped in step 5's collectives, undo that attempt,
    # step 4's sampling and its forward, then run all three again.
    assert r0["rollbacks"] == [["execute", 2], ["sample", 4], ["execute", 4]]
    assert r1["rollbacks"] == r2["rollbacks"] == [["execute", 2], ["execute", 5], ["sample", 4],
                                                  ["execute", 4]]
    # Every rank emptied its batch before its first execute after each round: rank 0 before
    # step 5's first attempt, ranks 1 and 2 before its re-run.
    assert r0["resets"] == r1["resets"] == r2["resets"] == [2, 5]
    assert len(r1["link_errors"]) == len(r2["link_errors"]) == 1
    assert [(s["step"], s["index"]) for s in r0["stops"]] == [(2, 1)]
    assert [(s["step"], s["index"]) for s in r1["stops"]] == [(5, 0)]


# --- the stop check of a blocked collective (in-process) --------------------------------------

class _SliceWork:
    """A collective's work whose wait slices run out; ``completes`` says whether the peers
    finish it during the slice in which a peer's fault stops this rank."""

    def __init__(self, backend: Any, completes: bool) -> None:
        self._backend = backend
        self._completes = completes
        self.done = False
        self.waits = 0

    def wait(self, timeout: Any) -> bool:
        self.waits += 1
        if self.done:
            return True
        if self.waits == 3:  # a peer fails while this rank is blocked
            self._backend.stop_communication()
            self.done = self._completes
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting")

    def is_completed(self) -> bool:
        return self.done


def test_stop_abandons_a_blocked_collective_but_not_a_completed_one():
    from ftkit.backends.cpu import CpuBackend
    from ftkit.faults import CommunicationStopped

    backend = CpuBackend(0)
    blocked = _SliceWork(backend, completes=False)
    with pytest.raises(CommunicationStopped):
        backend.run_collective("all_reduce", lambda: blocked)
    assert blocked.waits == 3

    # The peers completed the collective just as the stop came: this rank took part in it
    # and must carry on, not re-run it alone (its next collective raises instead).
    backend = CpuBackend(0)
    late = _SliceWork(backend, completes=True)
    backend.run_collective("all_reduce", lambda: late)
    assert late.waits == 4
    with pytest.raises(CommunicationStopped):
        backend.run_collective("all_reduce", lambda: pytest.fail("issued after a stop"))
