"""The fault taxonomy: which faults ftkit knows, and how a raised exception is classified.

Two kinds of exceptions meet here:

* the errors real devices and networks raise (torch_npu's ``RuntimeError`` texts such as
  ``"FORCE STOP"`` or ``"SUSPECT REMOTE ERROR"``), and
* the errors ftkit's CPU backend raises to model them (``LinkError``, ``ForceStopError`` ...),
  which carry the same texts so that both are classified by one function.

``classify`` looks at the exception type first and at the message second, and returns the
``FaultKind`` the recovery engine should handle, or ``None`` for an error that is not a
transient fault (a bug, a bad request): those are never retried.

What ftkit knows about each kind (its params, rules, injector, damage assessment, doctor
row) is registered in ``ftkit.kinds``; ``FaultKind`` here is only the vocabulary.
"""

from __future__ import annotations

import enum


class FaultKind(str, enum.Enum):
    """The faults a scenario can inject and the recovery engine can handle (each one's
    module in ``ftkit.kinds`` says what it is: ``ftkit.kinds.kind_spec``)."""

    LINK_BREAK = "link_break"
    LINK_FLAP = "link_flap"
    DEVICE_RESET = "device_reset"
    UCE = "uce"
    HANG = "hang"
    OOM = "oom"
    PROCESS_KILL = "process_kill"
    RAY_WORKER_KILL = "ray_worker_kill"
    NODE_LOSS = "node_loss"

    def __str__(self) -> str:  # "link_flap", not "FaultKind.LINK_FLAP", in messages
        return self.value


# --- the errors the CPU backend raises, modelled on torch_npu's -----------------------------

class SimulatedFault(RuntimeError):
    """Base of the errors ftkit's CPU backend raises to model a device or network fault.

    The message starts with the text torch_npu raises for the same fault (``text``), so that
    the error is classified alike by its type and by its text."""

    kind: FaultKind
    text: str = ""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.text}{detail}")


class LinkError(SimulatedFault):
    """A collective's link is down: what HCCL reports as a remote error."""

    kind = FaultKind.LINK_BREAK
    text = "SUSPECT REMOTE ERROR: "


class ForceStopError(SimulatedFault):
    """The device was force-stopped (``stop_device``, a reset): what torch_npu raises."""

    kind = FaultKind.DEVICE_RESET
    text = "FORCE STOP. "


class UceError(SimulatedFault):
    """An uncorrectable memory error: the device reports its address separately."""

    kind = FaultKind.UCE
    text = "UCE ERROR. "


class OperatorTimeout(SimulatedFault):
    """A hung operator ended by the operator timeout (``set_op_timeout_ms`` on Ascend)."""

    kind = FaultKind.HANG


class CommunicationStopped(RuntimeError):
    """Raised on a healthy rank whose collective was stopped because a peer failed.

    It is not a fault of this rank: the recovery engine joins the peer's recovery.
    """


# --- classification -------------------------------------------------------------------------

# torch_npu error texts (DESIGN.md), most specific first.
_TEXT_RULES: tuple[tuple[str, FaultKind], ...] = (
    ("SUSPECT REMOTE ERROR", FaultKind.LINK_BREAK),
    ("HCCL OP RETRY FAILED", FaultKind.LINK_BREAK),
    ("HCCS_LINK_EXIT", FaultKind.LINK_BREAK),
    ("SUSPECT_REMOTE_EXIT", FaultKind.LINK_BREAK),
    ("HCCL_OP_RETRY_EXIT", FaultKind.LINK_BREAK),
    ("FORCE STOP", FaultKind.DEVICE_RESET),
    ("UCE ERROR", FaultKind.UCE),
    ("UCE_EXIT", FaultKind.UCE),
    ("SUSPECT MEM ERROR", FaultKind.UCE),
    ("ECC ERROR", FaultKind.UCE),
)


def classify(exc: BaseException) -> FaultKind | None:
    """The fault kind an exception stands for, or ``None`` if it is not a transient fault.

    The exception type decides first (ftkit's own simulated faults, out-of-memory errors);
    then the message is matched, case-sensitively, against torch_npu's error texts.
    """
    if isinstance(exc, SimulatedFault):
        return exc.kind
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return FaultKind.OOM
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    for needle, kind in _TEXT_RULES:
        if needle in text:
            return kind
    return None


class CollectiveDesync(RuntimeError):
    """The ranks reached the same collective of a group with different collectives (another
    operation, dtype or size): their collective sequences diverged. Not a transient fault:
    a recovery round that sees it decides to raise, and nothing is combined."""


def is_peer_stop(exc: BaseException) -> bool:
    """True when the exception only says that a peer's fault stopped this rank."""
    return isinstance(exc, CommunicationStopped)
