"""StepWrapper: what a step that fails surfaces as, chosen by the round's cause (never by the
text of its reason), and the re-run of a step that a round lets recompute."""

from __future__ import annotations

from typing import Any

import pytest

from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError, RecoveryInconsistent, ReinferenceExhausted
from ftkit.faults import CommunicationStopped, LinkError
from ftkit.recovery import Action, Cause, Decision, RankState, RankStatus, StepWrapper
from ftkit.recovery.coordinator import Replay
from ftkit.recovery.monitor import IdleReplayStopped


class Gate:
    """A stand-in for ``RecoveryMonitor``: every round decides ``decisions`` in turn."""

    def __init__(self, *decisions: Decision, joined: Decision | None = None) -> None:
        self.decisions = list(decisions)
        self.joined = joined
        self.reports: list[Any] = []

    def enter_step(self, rpc: int, rpc_kind: Any, step: int) -> int:
        return 0

    def exit_step_ok(self) -> Decision | None:
        return self.joined

    def join_after_failure(self, status: Any) -> Decision:
        self.reports.append(status)
        return self.decisions.pop(0)


class State:
    def __init__(self) -> None:
        self.rollbacks = 0
        self.repair_pending = False
        self.repairs: list[Any] = []

    def rollback_execute(self, record: Any) -> None:
        self.rollbacks += 1

    def begin_sample(self, scheduler_output: Any) -> Any:
        return None

    def rollback_sample(self, record: Any) -> None:
        self.rollbacks += 1

    def reset_batch(self) -> None:
        pass

    def prepare(self, scheduler_output: Any) -> Any:
        return scheduler_output

    def before_attempt(self, scheduler_output: Any, call: Any) -> None:
        self.repairs.append(scheduler_output)
        self.repair_pending = False

    def pending_kv(self) -> tuple[int, ...]:
        return (3, 9) if self.repair_pending else ()


def wrapper(gate: Gate, state: State | None = None) -> StepWrapper:
    return StepWrapper(rank=0, monitor=gate, state=state or State(),  # type: ignore[arg-type]
                       is_stop_error=lambda exc: False)


def link_break(_: Any) -> Any:
    raise LinkError("injected link break")


# The reasons say the opposite of the cause on purpose: only the cause may decide.
@pytest.mark.parametrize("cause, reason, error", [
    (Cause.REINFERENCE_EXHAUSTED, "ranks are out of step", ReinferenceExhausted),
    (Cause.OUT_OF_STEP, "max_reinference is 3", RecoveryInconsistent),
    (Cause.PEER_SILENT, "max_reinference is 3", RecoveryError),
])
def test_a_refused_rerun_raises_the_error_its_cause_names(cause, reason, error):
    gate = Gate(Decision(Action.RAISE, cause, reason))
    with pytest.raises(RecoveryError) as raised:
        wrapper(gate).execute_model(link_break, "batch")
    assert type(raised.value) is error
    assert reason in str(raised.value)
    assert isinstance(raised.value.__cause__, LinkError)


def test_a_peers_unrecoverable_fault_raises_the_error_its_cause_names():
    gate = Gate(joined=Decision(Action.RAISE, Cause.REINFERENCE_EXHAUSTED, "budget spent"))
    with pytest.raises(ReinferenceExhausted, match="a peer's fault could not be recovered"):
        wrapper(gate).execute_model(lambda batch: "out", "batch")


def test_an_error_that_is_no_fault_surfaces_as_itself():
    def bug(_: Any) -> Any:
        raise ValueError("a bug")

    gate = Gate(Decision(Action.RAISE, Cause.NOT_A_FAULT, "not a transient fault"))
    with pytest.raises(ValueError, match="a bug"):
        wrapper(gate).execute_model(bug, "batch")


def test_a_recompute_rolls_back_and_reruns_the_step():
    calls = []

    def flaky(batch: Any) -> Any:
        calls.append(batch)
        if len(calls) == 1:
            raise LinkError("injected link break")
        return "tokens"

    state = State()
    gate = Gate(Decision(Action.RECOMPUTE, Cause.RERUN, "rank 0 failed"))
    assert wrapper(gate, state).execute_model(flaky, "batch") == "tokens"
    assert calls == ["batch", "batch"] and state.rollbacks == 1
    (status,) = gate.reports
    assert status.kind == "link_break" and status.failures == 1


class Hook:
    def __init__(self, wanted: bool) -> None:
        self.attempts_wanted = wanted
        self.attempts: list[tuple[str, int, int]] = []
        self.recovered: list[tuple[str, int, int]] = []

    def on_attempt(self, rpc_kind: Any, step: int, attempt: int, payload: Any) -> None:
        self.attempts.append((rpc_kind.value, step, attempt))

    def on_recovered(self, rpc_kind: Any, step: int, failures: int, recovery_s: float,
                     **_: float) -> None:
        self.recovered.append((rpc_kind.value, step, failures))


def test_hooks_see_attempts_only_while_they_want_them():
    idle, busy = Hook(False), Hook(True)
    step = StepWrapper(rank=0, monitor=Gate(), state=State(),  # type: ignore[arg-type]
                       hooks=[idle, busy], is_stop_error=lambda exc: False)
    step.execute_model(lambda batch: "out", "batch")
    step.sample_tokens(lambda grammar: "tokens", None)
    assert idle.attempts == [] and busy.attempts == [("execute", 1, 0), ("sample", 1, 0)]
    idle.attempts_wanted, busy.attempts_wanted = True, False
    step.execute_model(lambda batch: "out", "batch")  # not re-read yet
    assert idle.attempts == []
    step.hooks_changed()
    step.execute_model(lambda batch: "out", "batch")
    assert idle.attempts == [("execute", 3, 0)] and len(busy.attempts) == 3


def test_every_hook_hears_of_a_recovery_and_rerun_attempts_are_counted():
    idle, busy = Hook(False), Hook(True)
    calls = []

    def flaky(batch: Any) -> Any:
        calls.append(batch)
        if len(calls) < 3:
            raise LinkError("injected link break")
        return "tokens"

    rerun = Decision(Action.RECOMPUTE, Cause.RERUN, "rank 0 failed")
    step = StepWrapper(rank=0, monitor=Gate(rerun, rerun), state=State(),  # type: ignore[arg-type]
                       hooks=[idle, busy], is_stop_error=lambda exc: False)
    assert step.sample_tokens(flaky, None) == "tokens"
    assert busy.attempts == [("sample", 0, 0), ("sample", 0, 1), ("sample", 0, 2)]
    assert idle.recovered == busy.recovered == [("sample", 0, 2)]


def test_lost_state_is_repaired_before_the_attempt_only_while_a_repair_is_pending():
    state = State()
    step = wrapper(Gate(), state)
    step.execute_model(lambda batch: "out", "first")
    state.repair_pending = True
    step.execute_model(lambda batch: "out", "second")
    step.execute_model(lambda batch: "out", "third")
    assert state.repairs == ["second"]


def test_a_rank_whose_repair_was_interrupted_reports_what_it_still_has_to_rebuild():
    # A fault inside the lost KV's rebuild (its forward passes) leaves this rank with blocks
    # still to recompute, which a peer may have finished: the round hears of them, so that
    # every rank rebuilds them again before the next attempt.
    state = State()
    interrupted = {"left": 1}

    def before_attempt(scheduler_output: Any, call: Any) -> None:
        if interrupted["left"]:
            interrupted["left"] -= 1
            raise LinkError("link down during the rebuild")
        state.repair_pending = False

    state.before_attempt = before_attempt  # type: ignore[method-assign]
    state.repair_pending = True
    rerun = Decision(Action.RECOMPUTE, Cause.RERUN, "rank 0 failed")
    gate = Gate(rerun)
    assert wrapper(gate, state).execute_model(lambda batch: "out", "step") == "out"
    [status] = gate.reports
    assert status.kv_lost == (3, 9)
    # Crippled: without the pending blocks in its report the round would not know of them.
    state.repair_pending, interrupted["left"] = True, 1
    state.pending_kv = lambda: ()  # type: ignore[method-assign]
    gate = Gate(rerun)
    wrapper(gate, state).execute_model(lambda batch: "out", "step")
    assert gate.reports[0].kv_lost == ()


# --- a failed sampling RPC: the step is re-run from its forward pass -------------------------

class Journal(State):
    """A state that logs each undo, and each RPC the worker runs, in one list."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def rollback_execute(self, record: Any) -> None:
        self.log.append(f"undo {record}")

    def begin_sample(self, scheduler_output: Any) -> Any:
        return f"sample of {scheduler_output}"

    def rollback_sample(self, record: Any) -> None:
        self.log.append(f"undo {record}")


def worker(state: Journal, fail: dict[str, int]):
    """The worker's two step methods; ``fail[name]`` attempts of the RPC named raise first."""
    def execute(batch: Any) -> Any:
        state.log.append(f"run {batch}")
        if fail.get(batch, 0):
            fail[batch] -= 1
            raise LinkError("injected link break")
        return None

    def sample(grammar: Any) -> Any:
        state.log.append(f"run {grammar}")
        if fail.get(grammar, 0):
            fail[grammar] -= 1
            raise LinkError("injected link break")
        return f"tokens of {grammar} #{state.log.count(f'run {grammar}')}"
    return execute, sample


def replay_of(step: int) -> Decision:
    return Decision(Action.RECOMPUTE, Cause.RERUN, "a sampling RPC failed",
                    replay=Replay(rpc=2 * step - 1, step=step))


def test_a_failed_sampling_rpc_reruns_the_step_from_its_forward_pass():
    state = Journal()
    execute, sample = worker(state, {"g1": 1})
    step = wrapper(Gate(replay_of(1)), state)
    step.execute_model(execute, "s1")
    assert step.sample_tokens(sample, "g1") == "tokens of g1 #2"
    assert state.log == ["run s1", "run g1", "undo sample of s1", "undo s1", "run s1", "run g1"]


def test_a_rank_in_the_next_forward_undoes_it_and_the_step_then_reruns_all():
    # The peer failed sampling step 1; this rank sampled it and is stopped in step 2's forward.
    state = Journal()
    execute, sample = worker(state, {"s2": 1})
    step = wrapper(Gate(replay_of(1)), state)
    step.execute_model(execute, "s1")
    step.sample_tokens(sample, "g1")
    assert step.execute_model(execute, "s2") is None
    assert state.log == ["run s1", "run g1", "run s2",
                         "undo s2", "undo sample of s1", "undo s1",
                         "run s1", "run g1", "run s2"]
    # The step's sampling returned once to the engine; its re-run output is dropped, and
    # the next sampling record is that of step 2.
    assert step.sample_tokens(sample, "g2") == "tokens of g2 #1"


def test_a_rank_that_completed_the_sampling_returns_the_rerun_output():
    # This rank's sampling returned while the round was pending: it joins at exit.
    state = Journal()
    execute, sample = worker(state, {})
    gate = Gate()
    step = wrapper(gate, state)
    step.execute_model(execute, "s1")
    exits = iter([replay_of(1), None, None])
    gate.exit_step_ok = lambda: next(exits)
    assert step.sample_tokens(sample, "g1") == "tokens of g1 #2"
    assert state.log == ["run s1", "run g1", "undo sample of s1", "undo s1", "run s1", "run g1"]


def test_an_idle_rank_reruns_the_step_it_completed_in_its_monitor_thread():
    state = Journal()
    execute, sample = worker(state, {})
    gate = Gate()
    step = wrapper(gate, state)
    assert gate.replay_when_idle == step.replay_when_idle  # the monitor's callback
    step.execute_model(execute, "s1")
    step.sample_tokens(sample, "g1")
    status = RankStatus(0, RankState.IDLE, 2)
    step.replay_when_idle(replay_of(1), status)
    assert state.log == ["run s1", "run g1", "undo sample of s1", "undo s1", "run s1", "run g1"]
    # Idle after the forward only: that forward is re-run, sampling comes as its own RPC.
    state.log.clear()
    step.execute_model(execute, "s2")
    step.replay_when_idle(replay_of(2), RankStatus(0, RankState.IDLE, 3))
    assert state.log == ["run s2", "undo s2", "run s2"]
    # Idle after a next step without a forward pass (it only forgot finished requests):
    # that one is undone and run again too.
    state.log.clear()
    step.sample_tokens(sample, "g2")
    step.execute_model(execute, "s3")
    step.replay_when_idle(replay_of(2), RankStatus(0, RankState.IDLE, 5))
    assert state.log == ["run g2", "run s3", "undo s3", "undo sample of s2", "undo s2",
                         "run s2", "run g2", "run s3"]
    # A round that re-runs no forward needs nothing from an idle rank.
    state.log.clear()
    step.replay_when_idle(Decision(Action.RECOMPUTE, Cause.RERUN, "x"), RankStatus(0, RankState.IDLE, 3))
    assert state.log == []


def test_an_idle_rerun_a_further_round_stops_goes_on_from_where_it_stopped():
    """The peer fails again in the forward this idle rank re-runs (a pipeline's next stage):
    the stop ends the re-run with the status to report (stopped in RPC 1), and after that
    round the rank undoes the stopped attempt and runs on to the RPC the engine had seen,
    even where that round re-runs no forward of its own (the peer just runs RPC 1 again)."""
    state = Journal()
    stops = {"s1": 1}

    def execute(batch: Any) -> Any:
        state.log.append(f"run {batch}")
        if stops.get(batch, 0) and len([x for x in state.log if x == f"run {batch}"]) == 2:
            stops[batch] -= 1
            raise CommunicationStopped("rank 0: stopped while blocked: a peer failed")
        return None

    _, sample = worker(state, {})
    step = StepWrapper(rank=0, monitor=Gate(), state=state,  # type: ignore[arg-type]
                       is_stop_error=lambda exc: isinstance(exc, CommunicationStopped))
    step.execute_model(execute, "s1")
    step.sample_tokens(sample, "g1")
    with pytest.raises(IdleReplayStopped) as stopped:
        step.replay_when_idle(replay_of(1), RankStatus(0, RankState.IDLE, 2))
    report = stopped.value.status
    assert (report.state, report.rpc, report.rpc_kind, report.step) == (
        RankState.STOPPED, 1, RpcKind.EXECUTE, 1)
    assert state.log == ["run s1", "run g1", "undo sample of s1", "undo s1", "run s1"]
    state.log.clear()
    step.replay_when_idle(Decision(Action.RECOMPUTE, Cause.RERUN, "rank 1 failed"), report)
    assert state.log == ["undo s1", "run s1", "run g1"]
    # Done: a later round that re-runs no forward needs nothing from it.
    state.log.clear()
    step.replay_when_idle(Decision(Action.RECOMPUTE, Cause.RERUN, "x"),
                          RankStatus(0, RankState.IDLE, 2))
    assert state.log == []


def test_a_flapping_sampling_fault_counts_every_attempt_across_the_reruns():
    hook = Hook(True)
    state = Journal()
    execute, sample = worker(state, {"g1": 2})
    step = StepWrapper(rank=0, monitor=Gate(replay_of(1), replay_of(1)),  # type: ignore[arg-type]
                       state=state, hooks=[hook], is_stop_error=lambda exc: False)
    step.execute_model(execute, "s1")
    assert step.sample_tokens(sample, "g1") == "tokens of g1 #3"
    assert hook.attempts == [("execute", 1, 0), ("sample", 1, 0), ("execute", 1, 1),
                             ("sample", 1, 1), ("execute", 1, 2), ("sample", 1, 2)]
    assert hook.recovered == [("sample", 1, 2)]
    reports = step.monitor.reports
    assert [(r.rpc, r.rpc_kind.value, r.step, r.failures) for r in reports] == \
        [(2, "sample", 1, 1), (2, "sample", 1, 2)]


def test_a_failure_while_rerunning_the_forward_reports_that_rpc():
    state = Journal()
    execute, sample = worker(state, {"g1": 1})
    gate = Gate(replay_of(1), Decision(Action.RECOMPUTE, Cause.RERUN, "forward failed"))
    step = wrapper(gate, state)
    step.execute_model(execute, "s1")
    # The forward's re-run fails once: the round after it re-runs that forward alone.
    step._calls[RpcKind.EXECUTE], _ = worker(state, {"s1": 1})
    assert step.sample_tokens(sample, "g1") == "tokens of g1 #2"
    assert [(r.rpc, r.rpc_kind.value) for r in gate.reports] == [(2, "sample"), (1, "execute")]
    assert state.log == ["run s1", "run g1", "undo sample of s1", "undo s1", "run s1",
                         "undo s1", "run s1", "run g1"]
