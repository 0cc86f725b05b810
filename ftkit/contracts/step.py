"""What the step wrapper shows the hooks that watch each attempt of a step.

The recovery half (``ftkit.recovery``) calls a ``StepHook`` around every attempt of a wrapped
step; the injection half (``ftkit.inject``) is such a hook. Both import this module, neither
imports the other.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol


class RpcKind(str, enum.Enum):
    """Which of the two RPCs of one engine step: ``execute_model`` or ``sample_tokens``."""

    EXECUTE = "execute"
    SAMPLE = "sample"
    NONE = ""


class StepHook(Protocol):
    """Something that wants to see each attempt of a step (the fault injector)."""

    #: Whether ``on_attempt`` should run: read by the step wrapper when told that it may
    #: have changed (``StepWrapper.hooks_changed``), so that a hook with nothing to do
    #: costs the fault-free step nothing. ``on_recovered`` runs whatever it says.
    attempts_wanted: bool

    def on_attempt(self, rpc_kind: RpcKind, step: int, attempt: int, payload: Any) -> None:
        """Attempt ``attempt`` (0: the first) of RPC ``rpc_kind`` of step ``step`` starts;
        ``payload`` is the RPC's argument (the scheduler output for ``EXECUTE``)."""

    def on_recovered(self, rpc_kind: RpcKind, step: int, failures: int, recovery_s: float,
                     *, rollback_s: float, rerun_s: float) -> None:
        """A step recovered: ``recovery_s`` from its first failure until the successful
        attempt returned; of that, ``rollback_s`` restored the last record and ``rerun_s``
        ran the successful attempt."""
