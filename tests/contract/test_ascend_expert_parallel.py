"""The Ascend backend on the expert-parallel (EP) all-to-all path of vllm-ascend's MoE layers,
across real processes on the torch_npu stand-in (its HCCL is real gloo).

vllm-ascend picks a MoE communication method per step (``select_moe_comm_method`` in
``vllm_ascend/ascend_forward_context.py``): all-gather without expert parallelism; with it,
MC2 while the tokens fit the MC2 capacity, else all-to-all (``vllm_ascend/ops/fused_moe/
token_dispatcher.py``). Both paths run here, as two MoE layers of one step:

* all-to-all (``TokenDispatcherWithAll2AllV``): the token counts are all-gathered
  (``all_gather_into_tensor``) and the tokens sent with ``all_to_all_single(...,
  async_op=True)`` then ``wait()``, on ``get_ep_group().device_group``, vLLM's EP group,
  which ftkit takes over; the combine sends the experts' outputs back the same way;
* MC2 (``TokenDispatcherWithMC2``): the fused ``torch_npu.npu_moe_distribute_dispatch_v2``
  and ``npu_moe_distribute_combine_v2``, which name their communicator: ``group_ep`` is
  ``get_hccl_comm_name`` of vllm-ascend's own MC2 group (``vllm_ascend/distributed/
  parallel_state.py``), read once when the dispatcher is built and again only by its
  ``refresh_hccl_group``. ftkit does not take that group over.

The rig is ``tests/multiprocess/_harness.py`` with ``backend: ascend`` (the real recovery
engine), whose step is replaced by the MoE step below. Neither path goes through the device
communicator that ftkit wraps, so the rig meets the injector's emulated link break at the
EP collectives itself (``faults.check_link``), as the wrapper meets it at the TP all-reduce.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import _harness as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

RUN_TIMEOUT_S = 60.0
WORLD = 2
STEPS = 4
TOKENS = 3          # per rank, after the sequence split of the TP all-reduce's output
HIDDEN = h.VECTOR   # the recording state's vector is one hidden row
EXPERTS = 4         # two per EP rank
TOP_K = 2
#: The EP and MC2 groups' HCCL operator timeout: what ends a wait that nothing stops.
HCCL_TIMEOUT_S = 6.0

#: The step's collectives, by index (the ``at`` of a fault).
TP_ALL_REDUCE, EP_COUNTS, EP_DISPATCH, EP_COMBINE, MC2_DISPATCH, MC2_COMBINE = range(6)
EP_GROUP, MC2_GROUP = 1, 2  # the stand-in's hccl groups: 0 is the TP device group


# --- the MoE step, shared by the rig and the oracle -------------------------------------------

def tp_partial(step: int, rank: int) -> torch.Tensor:
    """This rank's partial sum of the hidden states the TP all-reduce completes."""
    rows = TOKENS * WORLD
    return (torch.arange(rows * HIDDEN, dtype=torch.float64).reshape(rows, HIDDEN)
            * (rank + 1) + 10.0 * step + rank)


def route(layer_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, expert weights) of this rank's tokens: two distinct experts each."""
    first = [(t + layer_step + rank) % EXPERTS for t in range(TOKENS)]
    ids = [[e, (e + 1 + t % (EXPERTS - 1)) % EXPERTS] for t, e in enumerate(first)]
    weights = [[0.75, 0.25] if t % 2 else [0.5, 0.5] for t in range(TOKENS)]
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float32))


def expert(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s output for each row (``ids``: one global expert id per row)."""
    e = ids.to(torch.float64).reshape(-1, 1)
    return rows * (e + 1) + 0.5 * e


def moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for k in range(TOP_K):  # in k order, as both combines sum
        out += weights[:, k].to(x.dtype).unsqueeze(-1) * expert(ids[:, k], x)
    return out


def expected_outputs() -> dict[int, list[dict[str, Any]]]:
    """Every rank's fault-free outputs: the oracle."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(WORLD):
        acc = torch.zeros(HIDDEN, dtype=torch.float64)
        out[rank] = []
        for s in range(1, STEPS + 1):
            acc += 1.0
            x = sum((tp_partial(s, r) for r in range(1, WORLD)), tp_partial(s, 0))
            x = x[rank * TOKENS:(rank + 1) * TOKENS]
            h1 = moe_reference(x, *route(s, rank))
            h2 = moe_reference(h1 * 0.5, *route(s + 1, rank))
            acc += h2.sum(0)
            executed = h2.flatten().tolist()
            acc -= 0.25
            out[rank].append({"step": s, "execute": executed, "sample": float(acc.sum())})
    return out


# --- the rig ----------------------------------------------------------------------------------

class ExpertParallelRig(h.Rig):
    """The harness's rig, with an EP group taken over beside TP, vllm-ascend's MC2 group
    beside them (not taken over), and a step of two MoE layers, one per dispatch path.

    Scenario keys of its own: ``refresh_mc2_name`` (after each round's rebuild, read the MC2
    communicator's name again, as ``TokenDispatcherWithMC2.refresh_hccl_group`` does) and
    ``cripple`` (switch one ftkit behaviour off, by name: ``CRIPPLES``).
    """

    def __init__(self, rank: int, world: int, scenario: dict[str, Any], outdir: str) -> None:
        super().__init__(rank, world, scenario, outdir)
        import torch.distributed as dist

        ranks = list(range(world))
        timeout = timedelta(seconds=HCCL_TIMEOUT_S)
        self.ep = h.StandInGroup("ep", ranks, h.NpuCommunicator(
            dist.new_group(ranks, backend="gloo", timeout=timeout),
            dist.new_group(ranks, backend="hccl", timeout=timeout)))
        self.mc2_device_group = dist.new_group(ranks, backend="hccl", timeout=timeout)
        self.backend.take_over([self.group, self.ep])
        self.initial_ep_groups = self.ep.current_groups()
        self.mc2_name = self._mc2_comm_name()  # as the MC2 dispatcher reads it when built
        self.record["collective_errors"] = []
        CRIPPLES[scenario.get("cripple", "none")](self)

    def _mc2_comm_name(self) -> str:
        import torch.distributed as dist

        group = self.mc2_device_group
        return group._get_backend("npu").get_hccl_comm_name(dist.get_rank(group=group))

    def _repairs(self, decision: Any) -> None:
        super()._repairs(decision)
        if self.scenario.get("refresh_mc2_name"):
            self.mc2_name = self._mc2_comm_name()

    # --- the step ------------------------------------------------------------------------

    def execute(self, step: int) -> Any:
        self.state.execute_starts(step)
        self.state.acc += 1.0
        x = self._collective(TP_ALL_REDUCE, "all_reduce",
                             lambda: self.comm.all_reduce(tp_partial(step, self.rank)))
        x = x[self.rank * TOKENS:(self.rank + 1) * TOKENS]
        h1 = self._moe_all_to_all(x, *route(step, self.rank))
        h2 = self._moe_mc2(h1 * 0.5, *route(step + 1, self.rank))
        self.state.acc += h2.sum(0)
        return h2.flatten().clone()

    def _moe_all_to_all(self, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """``TokenDispatcherWithAll2AllV``'s dispatch, experts and combine."""
        import torch.distributed as dist

        group = self.ep.communicator.device_group  # get_ep_group().device_group, per call
        local = EXPERTS // self.world
        counts = torch.bincount(ids.reshape(-1).long(), minlength=EXPERTS)
        gathered = torch.empty(self.world * EXPERTS, dtype=counts.dtype)
        self._collective(EP_COUNTS, "all_gather_into_tensor",
                         lambda: dist.all_gather_into_tensor(gathered, counts, group=group))
        per_source = gathered.view(self.world, EXPERTS)[
            :, self.rank * local:(self.rank + 1) * local]
        send = counts.view(self.world, local).sum(1).tolist()
        recv = per_source.sum(1).tolist()
        order = torch.argsort(ids.reshape(-1).long(), stable=True)  # token copies by expert
        received = x.new_empty((sum(recv), HIDDEN))
        self._collective(EP_DISPATCH, "all_to_all_single", lambda: dist.all_to_all_single(
            received, x[order // TOP_K], recv, send, group=group, async_op=True).wait())
        local_ids = torch.arange(local).repeat(self.world).repeat_interleave(
            per_source.reshape(-1))
        outputs = expert(local_ids + self.rank * local, received)
        back = x.new_empty((len(order), HIDDEN))
        self._collective(EP_COMBINE, "all_to_all_single", lambda: dist.all_to_all_single(
            back, outputs, send, recv, group=group, async_op=True).wait())
        out = torch.zeros_like(x)
        for k in range(TOP_K):
            mine = order % TOP_K == k
            tokens = order[mine] // TOP_K
            out[tokens] += weights[tokens, k].to(x.dtype).unsqueeze(-1) * back[mine]
        return out

    def _moe_mc2(self, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """``TokenDispatcherWithMC2``'s fused dispatch, experts and fused combine."""
        import torch_npu

        local = EXPERTS // self.world
        domain = {"group_ep": self.mc2_name, "ep_world_size": self.world,
                  "ep_rank_id": self.rank, "moe_expert_num": EXPERTS}
        expand_x, _, assist_info, _, ep_recv_counts, _, _ = self._collective(
            MC2_DISPATCH, "npu_moe_distribute_dispatch_v2",
            lambda: torch_npu.npu_moe_distribute_dispatch_v2(
                x=x, expert_ids=ids, quant_mode=0, global_bs=0, expert_token_nums_type=0,
                **domain))
        outputs = expert(assist_info[:, 0] + self.rank * local, expand_x)
        return self._collective(
            MC2_COMBINE, "npu_moe_distribute_combine_v2",
            lambda: torch_npu.npu_moe_distribute_combine_v2(
                expand_x=outputs, expert_ids=ids, assist_info_for_combine=assist_info,
                ep_send_counts=ep_recv_counts, expert_scales=weights, **domain))

    def _collective(self, index: int, op: str, call: Callable[[], Any]) -> Any:
        """Run one collective of the step, with the fault planned for it, and record how a
        failed one failed."""
        from ftkit.faults import LinkError

        self._maybe_fault("execute", index)
        entered = time.monotonic()
        try:
            if index != TP_ALL_REDUCE:
                self.backend.faults.check_link(op)  # the TP all-reduce's wrapper checks itself
            return call()
        except Exception as exc:
            _, step, attempt = self.current
            where = {"step": step, "attempt": attempt, "index": index,
                     "blocked_s": time.monotonic() - entered, "error": str(exc)[:300]}
            if isinstance(exc, LinkError):
                self.record["link_errors"].append(where)
            else:
                stop = self.backend.is_stop_error(exc)
                self.record["collective_errors"].append({**where, "stop": stop})
                if stop:
                    self.record["stops"].append(where)
            raise

    def finish(self) -> None:
        super().finish()
        self.record["ep_cpu_group_replaced"] = \
            self.ep.current_groups()[0] is not self.initial_ep_groups[0]


def _no_stop_device(rig: ExpertParallelRig) -> None:
    """``stop_communication`` without ``torch_npu.npu.stop_device``."""
    rig.backend._call_stop_device = lambda: None


def _resume_tp_only(rig: ExpertParallelRig) -> None:
    """A round that resumes the communicator of the TP group alone, not every HCCL group of
    the device as ``reinit_process_group(group=None, rebuild_link=False)`` does."""
    reinit = rig.backend.api.reinit_process_group
    tp_device_group = rig.initial_groups[1]

    def resume_tp_only(group: Any = None, rebuild_link: bool = True) -> Any:
        if rebuild_link:
            return reinit(group=group, rebuild_link=rebuild_link)
        tp_device_group.resume()
        return None

    rig.backend.api.reinit_process_group = resume_tp_only


def _no_ep_links(rig: ExpertParallelRig) -> None:
    """A link round that leaves the EP group's links alone."""
    groups = rig.backend._device_groups
    ep_device_group = rig.ep.current_groups()[1]
    rig.backend._device_groups = lambda: [g for g in groups() if g is not ep_device_group]


def _taken_over_groups_only(rig: ExpertParallelRig) -> None:
    """A link round that rebuilds the links of the groups ftkit took over only (ftkit before
    it rebuilt every HCCL group torch knows)."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    rig.backend._device_groups = lambda: rig.backend._taken_over_device_groups(default)


CRIPPLES: dict[str, Callable[[ExpertParallelRig], None]] = {
    "none": lambda rig: None,
    "no_stop_device": _no_stop_device,
    "resume_tp_only": _resume_tp_only,
    "no_ep_links": _no_ep_links,
    "taken_over_groups_only": _taken_over_groups_only,
}


def ep_rank_main(rank: int, world: int, port: int, scenario: dict[str, Any],
                 outdir: str) -> None:
    """One rank: the harness's ``rank_main`` with this module's rig (the harness builds the
    rig it finds under its own name, in this spawned process only)."""
    h.Rig = ExpertParallelRig
    h.rank_main(rank, world, port, scenario, outdir)


# --- running and reading ----------------------------------------------------------------------

def run(tmp_path: Path, *faults: dict[str, Any], **scenario: Any) -> tuple[dict[str, Any], ...]:
    """Both ranks' records; every wait bounded by ``RUN_TIMEOUT_S``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    outdir = tmp_path / "ranks"
    outdir.mkdir(parents=True)
    port = h.free_port()
    scenario = {"backend": "ascend", "steps": STEPS, "faults": list(faults), **scenario}
    procs = [ctx.Process(target=ep_rank_main, args=(r, WORLD, port, scenario, str(outdir)),
                         name=f"ftkit-test-rank{r}", daemon=True) for r in range(WORLD)]
    h.run_processes(procs, time.monotonic() + RUN_TIMEOUT_S)
    records = []
    for r, p in enumerate(procs):
        path = outdir / f"rank{r}.json"
        assert p.exitcode == 0 and path.exists(), f"rank {r} exit code {p.exitcode}"
        record = json.loads(path.read_text())
        assert "setup_error" not in record, record["setup_error"]
        records.append(record)
    return tuple(records)


def fault(rank: int, at: int, action: str, *, step: int = 3, delay_s: float = 0.3,
          **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "rpc": "execute", "step": step, "at": at, "attempts": [0],
            "delay_s": delay_s, "action": action, **extra}


def recovered(*records: dict[str, Any]) -> None:
    """Every rank's outputs equal the oracle's, after one round each."""
    expected = expected_outputs()
    for res in records:
        assert res["error"] is None, res["error"]["traceback"]
        assert res["outputs"] == expected[res["rank"]]
        assert [r["decision"] for r in res["rounds"]] == ["recompute"]
        assert [e for e in res["collective_errors"] if e["attempt"] > 0] == []


def calls(res: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [c for c in res["device"]["calls"] if c["call"] == name]


def group(res: dict[str, Any], index: int) -> dict[str, Any]:
    [found] = [g for g in res["device"]["groups"] if g["index"] == index]
    return found


def rerun_error(res: dict[str, Any]) -> dict[str, Any]:
    """The first error of the step's re-run (attempt 1)."""
    return next(e for e in res["collective_errors"] if e["attempt"] == 1)


# --- the EP group is taken over beside TP -----------------------------------------------------

def coordinator(name: str, world: int) -> SimpleNamespace:
    """What ``ftkit.vllm.comms`` reads of a vLLM ``GroupCoordinator``."""
    return SimpleNamespace(ranks=list(range(world)), world_size=world,
                           device_communicator=SimpleNamespace(cpu_group=f"{name}-cpu",
                                                              device_group=f"{name}-device"),
                           cpu_group=f"{name}-cpu", device_group=f"{name}-device")


def vllm_groups_of_an_ep_job(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``vllm_groups()`` of a rank of a TP 2 job with expert parallelism on: vLLM's EP group
    spans the TP ranks, with a device group of its own."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from ftkit.vllm import comms

    for name in comms._COORDINATOR_NAMES:
        monkeypatch.setattr(parallel_state, name, None, raising=False)
    for name in ("_WORLD", "_TP", "_EP"):
        monkeypatch.setattr(parallel_state, name, coordinator(name.strip("_").lower(), 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return comms.vllm_groups()


def test_vllms_ep_group_is_among_the_groups_ftkit_takes_over(monkeypatch):
    groups = {g.name: g for g in vllm_groups_of_an_ep_job(monkeypatch)}
    assert list(groups) == ["world", "tp", "ep"]
    ep = groups["ep"]
    assert ep.current_groups() == ("ep-cpu", "ep-device")
    # A rebuilt group reaches the coordinator, whose device_group the all-to-all
    # dispatcher reads at every call (get_ep_group().device_group), and its communicator.
    from vllm.distributed import parallel_state

    ep.replace_groups("ep-cpu-2", "ep-device")
    assert (parallel_state._EP.cpu_group, parallel_state._EP.device_group) == (
        "ep-cpu-2", "ep-device")
    assert parallel_state._EP.device_communicator.cpu_group == "ep-cpu-2"


def test_crippled_without_the_ep_coordinator_the_ep_group_is_not_taken_over(monkeypatch):
    from ftkit.vllm import comms

    monkeypatch.setattr(comms, "_COORDINATOR_NAMES",
                        tuple(n for n in comms._COORDINATOR_NAMES if n != "_EP"))
    assert [g.name for g in vllm_groups_of_an_ep_job(monkeypatch)] == ["world", "tp"]


# --- a rank blocked in an EP collective is stopped; the round resumes every HCCL group --------

def test_a_rank_blocked_in_the_ep_dispatch_is_stopped_and_the_round_resumes_ep_and_mc2(
        tmp_path):
    delay = 0.3
    r0, r1 = run(tmp_path, fault(1, EP_DISPATCH, "oom", delay_s=delay))
    recovered(r0, r1)
    # Rank 0 waited in the EP all_to_all_single for rank 1, which failed before it; the stop
    # (stop_device, from its monitor) ended the wait, long before the HCCL timeout.
    [stop] = r0["stops"]
    assert (stop["step"], stop["index"]) == (3, EP_DISPATCH)
    assert stop["error"].startswith("FORCE STOP.")
    assert delay - 0.1 <= stop["blocked_s"] < HCCL_TIMEOUT_S / 2
    for res in (r0, r1):
        # No link fault: one resume of every HCCL group of the device, the EP group and
        # the MC2 group (which ftkit did not take over) included; no link was rebuilt.
        assert [(c["kwargs"]["group"], c["kwargs"]["rebuild_link"])
                for c in calls(res, "reinit_process_group")] == [(None, False)]
        for index in (EP_GROUP, MC2_GROUP):
            assert (group(res, index)["resumed"], group(res, index)["links_rebuilt"]) == (1, 0)
        # A resumed communicator is the same one: the MC2 name read at start still works.
        names = {c["kwargs"]["group_ep"] for c in calls(res, "npu_moe_distribute_dispatch_v2")}
        assert names == {f"hccl_group{MC2_GROUP}_comm0"}
        assert len(calls(res, "npu_moe_distribute_dispatch_v2")) == STEPS


def test_crippled_without_stop_device_the_blocked_rank_waits_for_the_hccl_timeout(tmp_path):
    r0, _ = run(tmp_path, fault(1, EP_DISPATCH, "oom"), cripple="no_stop_device")
    [error] = [e for e in r0["collective_errors"] if e["attempt"] == 0]
    assert (error["step"], error["index"], error["stop"]) == (3, EP_DISPATCH, False)
    assert "timed out" in error["error"]
    assert error["blocked_s"] >= HCCL_TIMEOUT_S - 0.5
    assert r0["stops"] == []


def test_crippled_a_round_that_resumes_the_tp_group_alone_leaves_the_ep_group_suspended(
        tmp_path):
    r0, r1 = run(tmp_path, fault(1, TP_ALL_REDUCE, "oom"), cripple="resume_tp_only")
    # Rank 0, stopped in the round, re-runs through the TP all-reduce and fails at the
    # first EP collective; rank 1 waits in it for rank 0 until the next round stops it.
    rerun_meets_a_suspended_group(r0, r1, EP_COUNTS)
    for res in (r0, r1):
        assert res["error"] is not None
        assert len(res["outputs"]) == 2


# --- a link fault in the EP path: the links of every HCCL group are rebuilt -------------------

@pytest.mark.parametrize("at", [TP_ALL_REDUCE, EP_COMBINE, MC2_COMBINE])
def test_a_link_break_rebuilds_the_links_of_the_ep_and_mc2_groups_and_the_step_reruns(
        tmp_path, at):
    delay = 0.3
    r0, r1 = run(tmp_path, fault(1, at, "link", delay_s=delay), refresh_mc2_name=True)
    recovered(r0, r1)
    [stop] = r0["stops"]
    assert (stop["step"], stop["index"]) == (3, at)
    assert stop["error"].startswith("FORCE STOP.")
    assert stop["blocked_s"] >= delay - 0.1
    assert [(e["step"], e["index"]) for e in r1["link_errors"]] == [(3, at)]
    for res in (r0, r1):
        # The default group's links, then each HCCL group's: TP and EP (taken over), MC2.
        assert [(c["kwargs"]["group"], c["kwargs"]["rebuild_link"])
                for c in calls(res, "reinit_process_group")] == [(None, True)] + [
                    ("hccl", True)] * 3
        assert [g["links_rebuilt"] for g in res["device"]["groups"]] == [1, 1, 1]
        assert res["ep_cpu_group_replaced"]  # the EP group's gloo group, rebuilt by ftkit
        # The fused operators took the rebuilt MC2 communicator's name after the round.
        names = [c["kwargs"]["group_ep"] for c in calls(res, "npu_moe_distribute_dispatch_v2")]
        old, new = f"hccl_group{MC2_GROUP}_comm0", f"hccl_group{MC2_GROUP}_comm1"
        assert names == [old] * (3 if at == MC2_COMBINE else 2) + [new] * (STEPS - 2)
        assert group(res, MC2_GROUP)["comm_name"] == new


# The crippled link rounds break the link at the TP all-reduce: the stopped rank 0 then has
# sent nothing on the EP and MC2 groups that rank 1 (not stopped) has not received, which the
# stand-in's gloo would take for a mismatched collective when rank 1 reuses that group.

def rerun_meets_a_suspended_group(r0: dict, r1: dict, index: int) -> None:
    """The re-run of step 3 fails at operation ``index`` on a group ``stop_device`` left
    suspended (rank 0); rank 1 is stopped there by the round that failure starts."""
    error = rerun_error(r0)
    assert (error["step"], error["index"]) == (3, index)
    assert "suspended by stop_device" in error["error"]
    error = rerun_error(r1)
    assert (error["step"], error["index"], error["stop"]) == (3, index, True)


def test_crippled_a_link_round_that_skips_the_ep_group_leaves_it_suspended(tmp_path):
    r0, r1 = run(tmp_path, fault(1, TP_ALL_REDUCE, "link"), refresh_mc2_name=True,
                 cripple="no_ep_links")
    error = rerun_error(r0)
    assert (error["step"], error["index"]) == (3, EP_COUNTS)
    assert "suspended by stop_device" in error["error"]
    error = rerun_error(r1)
    assert (error["step"], error["index"], error["stop"]) == (3, EP_COUNTS, True)
    for res in (r0, r1):
        assert group(res, EP_GROUP)["links_rebuilt"] == 0
        assert res["error"] is not None


def test_crippled_rebuilding_only_the_groups_ftkit_took_over_leaves_mc2_suspended(tmp_path):
    r0, r1 = run(tmp_path, fault(1, TP_ALL_REDUCE, "link"), refresh_mc2_name=True,
                 cripple="taken_over_groups_only")
    # TP and EP were rebuilt and pass; the fused dispatch meets the MC2 communicator that
    # stop_device suspended and nothing resumed or rebuilt.
    rerun_meets_a_suspended_group(r0, r1, MC2_DISPATCH)
    for res in (r0, r1):
        assert [g["links_rebuilt"] for g in res["device"]["groups"]] == [1, 1, 0]
        assert res["error"] is not None


def test_after_a_link_round_an_mc2_name_read_before_it_no_longer_resolves(tmp_path):
    """What ftkit's vLLM layer must add before expert parallelism is allowed on Ascend: a
    link round rebuilds the MC2 communicator, and a dispatcher that keeps the name it read
    when it was built (nothing calls its ``refresh_hccl_group``) fails the re-run."""
    r0, r1 = run(tmp_path, fault(1, EP_COMBINE, "link"))
    stale = f"'hccl_group{MC2_GROUP}_comm0' not found"
    errors = [rerun_error(res) for res in (r0, r1)]
    assert {e["step"] for e in errors} == {3}
    # The first rank there fails on the stale name. A slower one may be stopped by the round
    # that failure starts before it gets there: at the fused dispatch, or still in the
    # combine before it (its all-to-all can return on one rank before the other's).
    failed_on_the_name = [e for e in errors if stale in e["error"]]
    assert failed_on_the_name and all(e["index"] == MC2_DISPATCH for e in failed_on_the_name)
    assert all(stale in e["error"] or (e["stop"] and e["index"] in (EP_COMBINE, MC2_DISPATCH))
               for e in errors)
    for res in (r0, r1):
        assert group(res, MC2_GROUP)["links_rebuilt"] == 1
        assert res["error"] is not None
