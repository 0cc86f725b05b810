"""StepWrapper: what a step that fails surfaces as, chosen by the round's cause (never by the
text of its reason), and the re-run of a step that a round lets recompute."""

from __future__ import annotations

from typing import Any

import pytest

from ftkit.errors import RecoveryError, RecoveryInconsistent, ReinferenceExhausted
from ftkit.faults import LinkError
from ftkit.recovery import Action, Cause, Decision, StepWrapper


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

    def before_attempt(self, scheduler_output: Any, call: Any) -> None:
        self.repairs.append(scheduler_output)
        self.repair_pending = False


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
