"""The fault injector: fires a plan's faults at the step of their token, on their rank and
phase, writes each firing to the event log, and does what each kind does."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ftkit.contracts.eventlog import EventLog, FaultFired, StepRecovered
from ftkit.contracts.plan import FaultPlan
from ftkit.contracts.step import RpcKind
from ftkit.errors import InjectionError
from ftkit.faults import FaultKind, ForceStopError, LinkError, OperatorTimeout, UceError
from ftkit.inject import Injector, parse_request_id, request_id
from ftkit.kinds import KIND_SPECS
from ftkit.scenario import FaultSpec

RUN = "r1"


def spec(kind, rank=0, request=0, token=2, phase="forward", times=1, **params):
    return FaultSpec.model_validate({"kind": kind, "rank": rank,
                                     "at": {"request": request, "token": token},
                                     "phase": phase, "times": times, "params": params})


def plan(*specs, fired=None):
    made = FaultPlan.from_specs(RUN, specs)
    return made.with_fired(fired) if fired else made


class Device:
    """The fault model, recording what the injector asked of it."""

    def __init__(self):
        self.calls = []

    def break_link(self, detail):
        self.calls.append(("break_link", detail))

    def force_stop(self, detail, on_restart=None):
        self.calls.append(("force_stop", detail, on_restart))

    def hang(self, detail, timeout_s):
        self.calls.append(("hang", detail, timeout_s))
        raise OperatorTimeout(f"did not finish within {timeout_s:g} s: {detail}")

    def report_memory_fault(self, fault):
        self.calls.append(("report_memory_fault", fault))

    def set_op_timeout(self, seconds):
        pass


class Memory:
    """The runner's memory: one KV block of request 0, one parameter, one activation."""

    def __init__(self):
        self.kv = torch.zeros(4)
        self.weight = torch.zeros(4)
        self.activation = torch.zeros(4)
        self.poisoned = 0
        self.asked = []

    def poison_kv(self):
        self.poisoned += 1

    def request_blocks(self, match):
        ids = [request_id(RUN, 0) + "-abc", request_id(RUN, 1) + "-def"]
        self.asked += [rid for rid in ids if match(rid)]
        return [7] if match(ids[0]) else []

    def block_region(self, block_id, layer=0):
        return self.kv, SimpleNamespace(address=0x1000 + block_id, size=16)

    def param_region(self, name):
        return self.weight, SimpleNamespace(address=0x2000, size=16)

    def default_uce_parameter(self):
        return "model.norm.weight"

    def parameter_names(self):
        return ["model.norm.weight", "model.experts.w13_weight"]

    def not_reloadable(self, name):
        return "built from several tensors" if "experts" in name else None

    def activation_region(self):
        return self.activation, SimpleNamespace(address=0x3000, size=16)


def injector(rank=0, *, device=True, memory=True, kill_target=None, tokens=None):
    """An injector whose scheduler output is the dict of request ids to token indices."""
    return Injector(rank, EventLog(rank, None), token_indices=lambda out: out,
                    device=Device() if device else None, memory=Memory() if memory else None,
                    kill_target=kill_target)


def at_token(token, index=0, offset=0):
    return {request_id(RUN, index, offset) + "-suffix": token - offset}


def fired(inj):
    return [e for e in inj.events.events if isinstance(e, FaultFired)]


# --- planning ---------------------------------------------------------------------------------

def test_a_rank_keeps_its_own_faults_with_attempts_left():
    inj = injector(rank=1)
    inj.set_plan(plan(spec("oom", rank=0), spec("oom", rank=1), spec("oom", rank="all"),
                      spec("oom", rank=1, times=2), fired={3: 2}))
    assert [f.planned.index for f in inj.faults] == [1, 2]
    assert inj.run_id == RUN


@pytest.mark.parametrize("kind, kwargs, message", [
    ("hang", {"device": False}, "hang cannot be injected here: this backend has no fault "
                                "model for it"),
    ("device_reset", {"memory": False}, "device_reset cannot be injected here: no map of the "
                                        "runner's memory"),
    ("process_kill", {}, "process_kill cannot be injected here: the engine core runs in the "
                         "caller's process"),
])
def test_a_fault_this_worker_cannot_inject_is_refused_when_planned(kind, kwargs, message):
    inj = injector(**kwargs)
    inj.set_plan(plan(spec("oom")))
    with pytest.raises(InjectionError, match=message):
        inj.set_plan(FaultPlan.from_specs("r2", [spec(kind)]))
    assert inj.run_id == RUN and len(inj.faults) == 1  # the previous plan stays


def test_an_unknown_parameter_is_refused_when_planned():
    with pytest.raises(InjectionError, match="uce: the model has no parameter 'x.weight' that "
                                             "holds its data here; known: "
                                             "model.experts.w13_weight, model.norm.weight"):
        injector().set_plan(plan(spec("uce", region="weights", parameter="x.weight")))


def test_a_parameter_that_could_not_be_reloaded_is_refused_when_planned():
    with pytest.raises(InjectionError, match="uce: parameter 'model.experts.w13_weight' could "
                                             "not be reloaded after the fault: built from "
                                             "several tensors; hit another one"):
        injector().set_plan(plan(spec("uce", region="weights",
                                      parameter="model.experts.w13_weight")))
    injector().set_plan(plan(spec("uce", region="weights", parameter="model.norm.weight")))


def test_a_kind_not_implemented_is_refused(monkeypatch):
    monkeypatch.setitem(KIND_SPECS, FaultKind.OOM,
                        dataclasses.replace(KIND_SPECS[FaultKind.OOM], implemented=False))
    with pytest.raises(InjectionError, match="fault kind oom is not implemented yet"):
        injector().set_plan(plan(spec("oom")))


def test_faults_of_other_ranks_are_checked_too_but_not_for_this_worker():
    # A process_kill of rank 1 is no concern of rank 0's worker, which cannot kill.
    inj = injector(rank=0)
    inj.set_plan(plan(spec("process_kill", rank=1)))
    assert inj.faults == []


# --- when a fault fires -----------------------------------------------------------------------

def test_a_fault_fires_at_the_step_of_its_token_and_is_logged_first():
    inj = injector()
    inj.set_plan(plan(spec("oom", token=2)))
    inj.on_attempt(RpcKind.EXECUTE, 4, 0, at_token(1))
    inj.forward_hook()
    assert fired(inj) == []
    inj.on_attempt(RpcKind.EXECUTE, 5, 0, at_token(2))
    [event] = fired(inj)
    assert (event.run_id, event.index, event.kind, event.request, event.token, event.phase,
            event.step, event.attempt, event.pid) == (RUN, 0, "oom", 0, 2, "forward", 5, 1,
                                                       os.getpid())
    with pytest.raises(torch.OutOfMemoryError, match="ftkit injected oom on rank 0: CPU out "
                                                     "of memory"):
        inj.forward_hook()
    inj.forward_hook()  # fired once: the next forward is left alone


def test_a_resumed_request_counts_its_tokens_from_where_it_resumed():
    inj = injector()
    inj.set_plan(plan(spec("oom", token=5, phase="before")))
    with pytest.raises(torch.OutOfMemoryError):
        inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(5, offset=3))
    assert parse_request_id(request_id(RUN, 0, 3) + "-x") == (RUN, 0, 3, 0)
    assert parse_request_id("1_" + request_id(RUN, 0, 3) + "-x") == (RUN, 0, 3, 1)


def test_requests_of_another_run_are_not_targeted():
    inj = injector()
    inj.set_plan(plan(spec("oom", phase="before")))
    inj.on_attempt(RpcKind.EXECUTE, 1, 0, {request_id("other", 0): 2})
    assert fired(inj) == []


def test_a_flap_fails_times_attempts_of_its_step_and_a_restart_counts_what_fired():
    inj = injector()
    inj.set_plan(plan(spec("link_flap", phase="before", times=3)))
    for attempt in range(3):
        with pytest.raises(LinkError, match="ftkit injected link_flap on rank 0"):
            inj.on_attempt(RpcKind.EXECUTE, 7, attempt, at_token(2))
    inj.on_attempt(RpcKind.EXECUTE, 7, 3, at_token(2))
    assert [e.attempt for e in fired(inj)] == [1, 2, 3]

    inj = injector()
    inj.set_plan(plan(spec("link_flap", phase="before", times=3), fired={0: 2}))
    with pytest.raises(LinkError):
        inj.on_attempt(RpcKind.EXECUTE, 7, 0, at_token(2))
    inj.on_attempt(RpcKind.EXECUTE, 7, 1, at_token(2))
    assert [e.attempt for e in fired(inj)] == [3]


def test_a_link_break_in_the_forward_breaks_the_link_and_lets_the_collective_raise():
    inj = injector()
    inj.set_plan(plan(spec("link_break")))
    inj.on_attempt(RpcKind.EXECUTE, 3, 0, at_token(2))
    inj.forward_hook()  # nothing raised here: the step's first collective will
    assert inj._site.device.calls == [("break_link", "ftkit injected link_break at step 3")]


def test_a_sample_fault_fires_in_the_sample_rpc_after_the_sampler():
    inj = injector()
    inj.set_plan(plan(spec("link_break", phase="sample")))
    inj.on_attempt(RpcKind.EXECUTE, 3, 0, at_token(2))
    inj.forward_hook()
    inj.sample_hook()
    assert fired(inj) == []
    inj.on_attempt(RpcKind.SAMPLE, 3, 0, None)
    inj.forward_hook()  # armed for the sampler, not the forward
    with pytest.raises(LinkError):
        inj.sample_hook()


def test_a_new_attempt_disarms_a_fault_that_did_not_act():
    inj = injector()
    inj.set_plan(plan(spec("oom")))
    inj.on_attempt(RpcKind.EXECUTE, 3, 0, at_token(2))
    inj.on_attempt(RpcKind.EXECUTE, 3, 1, at_token(2))  # the fault has no attempts left
    inj.forward_hook()


def test_a_recovered_step_is_logged():
    inj = injector()
    inj.on_recovered(RpcKind.SAMPLE, 9, 2, 1.5, rollback_s=0.25, rerun_s=0.5)
    [event] = inj.events.events
    assert event == StepRecovered(rank=0, time=event.time, step=9, rpc_kind="sample",
                                  failures=2, recovery_s=1.5, rollback_s=0.25, rerun_s=0.5)


# --- what each kind does ----------------------------------------------------------------------

def test_a_device_reset_force_stops_the_device_and_poisons_the_kv_on_restart():
    inj = injector()
    inj.set_plan(plan(spec("device_reset", phase="before")))
    with pytest.raises(ForceStopError, match="FORCE STOP. ftkit injected device_reset on rank 0"):
        inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(2))
    [(name, _, on_restart)] = inj._site.device.calls
    assert name == "force_stop"
    on_restart()
    assert inj._site.memory.poisoned == 1


@pytest.mark.parametrize("params, tensor, where", [
    ({}, "kv", "kv at 0x1007 (16 bytes)"),
    ({"region": "weights"}, "weight", "weights at 0x2000 (16 bytes)"),
    ({"region": "activation"}, "activation", "activation at 0x3000 (16 bytes)"),
])
def test_a_uce_corrupts_its_region_and_reports_its_address(params, tensor, where):
    inj = injector()
    inj.set_plan(plan(spec("uce", **params)))
    inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(2))
    with pytest.raises(UceError, match=re.escape(f"ftkit injected uce on rank 0: {where}")):
        inj.forward_hook()
    memory = inj._site.memory
    assert getattr(memory, tensor).abs().sum() > 0
    [(name, reported)] = inj._site.device.calls
    assert name == "report_memory_fault" and reported.size == 16


def test_a_kv_uce_needs_a_block_of_its_request():
    inj = injector()
    inj.set_plan(plan(spec("uce", request=1)))
    inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(2, index=1))
    with pytest.raises(InjectionError, match="uce: request 1 holds no KV block yet"):
        inj.forward_hook()
    # Only request 1's blocks are looked for.
    assert inj._site.memory.asked == [request_id(RUN, 1) + "-def"]


def test_a_hang_waits_for_its_operator_timeout():
    inj = injector()
    inj.set_plan(plan(spec("hang", op_timeout_s=0.5)))
    inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(2))
    with pytest.raises(OperatorTimeout):
        inj.forward_hook()
    assert inj._site.device.calls[0][2] == 0.5


def test_a_process_kill_sends_sigkill_to_its_target(monkeypatch):
    monkeypatch.setattr("ftkit.kinds.process_kill.KILL_WAIT_S", 0.1)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        targets = []
        inj = injector(kill_target=lambda target: targets.append(target) or victim.pid)
        inj.set_plan(plan(spec("process_kill", phase="before", target="engine")))
        with pytest.raises(InjectionError, match=f"process {victim.pid} was sent SIGKILL but "
                                                 "this worker lives on"):
            inj.on_attempt(RpcKind.EXECUTE, 1, 0, at_token(2))
        assert victim.wait(timeout=10) == -9
        assert targets == ["engine"]
    finally:
        victim.kill()
        victim.wait()
