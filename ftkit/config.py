"""Recovery settings: what a deployment writes in vLLM's ``additional_config``.

Users set the recovery through vLLM's ``additional_config`` key ``fault_tolerance``, with
the same keys on every platform::

    additional_config={"fault_tolerance": {"enabled": true, "max_reinference": 3}}

Unknown keys are rejected, so a typo does not silently leave recovery off. The record crosses
process boundaries inside vLLM's own configuration (to every worker) and inside an engine job.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields
from typing import Any

from ftkit.bounds import DEFAULT_ROUND_TIMEOUT_S, StepBound, step_bound
from ftkit.errors import FtkitError

#: The ``additional_config`` key that holds ftkit's settings.
CONFIG_KEY = "fault_tolerance"
#: The environment variable that holds a server's injection secret (``ftkit.serve.control``):
#: the route checks it, and so does every worker that has it in its environment, so that
#: nothing plans a fault without it (vLLM's ``/collective_rpc`` under
#: ``VLLM_SERVER_DEV_MODE=1`` reaches the workers' methods directly).
INJECT_SECRET_ENV = "FTKIT_INJECT_SECRET"
#: Old names of settings, still accepted (with a warning) under their new name.
_RENAMED = {"journal_dir": "event_log_dir"}


@dataclass(frozen=True)
class RecoveryConfig:
    """What ``additional_config["fault_tolerance"]`` may say.

    ``enabled``: wrap the worker's step with the recovery engine.
    ``max_reinference``: re-runs of one step before the fault is surfaced (0: never re-run).
    ``round_timeout_s``: bound on each wait of a recovery round; a peer that does not answer
    within it turns the round into a clean failure.
    ``event_log_dir``: where each rank appends its event log (fault and recovery events, JSON
    lines, ``ftkit.contracts.eventlog``); ``None`` keeps them in memory only. (Formerly
    ``journal_dir``, still accepted.)
    ``op_timeout_s``: operators (and collectives) that run longer raise the hang error
    instead of blocking: ``set_op_timeout_ms`` on Ascend, the collectives' bound on CPU and
    CUDA; ``None``: ``ftkit.bounds.DEFAULT_OP_TIMEOUT_S`` (120 s).
    ``injection``: a server (``vllm serve``) accepts faults from ``ftkit inject``, each with
    the shared secret of its ``FTKIT_INJECT_SECRET`` (``ftkit.serve.control``); off by default.
    ``max_restarts``: a server replaces an engine that died (a killed worker or engine core)
    up to this many times, and resumes every request it was running (``ftkit.vllm.restart``);
    0 (the default): a dead engine ends the server, as in vLLM.
    ``standby``: with ``max_restarts``, keep a second engine started and idle, which takes
    over at once when the engine dies (it costs a second engine's memory).

    Every re-run of a step happens inside the step's RPC, which vLLM bounds by
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``; ``step_bound()`` says how long these settings
    may need.
    """

    enabled: bool = False
    max_reinference: int = 3
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    event_log_dir: str | None = None
    op_timeout_s: float | None = None
    injection: bool = False
    max_restarts: int = 0
    standby: bool = False

    @classmethod
    def from_mapping(cls, raw: dict[str, Any] | None) -> RecoveryConfig:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise FtkitError(f"additional_config[{CONFIG_KEY!r}] must be a mapping, got {raw!r}")
        raw = dict(raw)
        for old, new in _RENAMED.items():
            if old in raw:
                warnings.warn(f"{CONFIG_KEY}.{old} is now called {new}", FutureWarning,
                              stacklevel=2)
                if new in raw:
                    raise FtkitError(f"{CONFIG_KEY}: give {new} only (it replaces {old})")
                raw[new] = raw.pop(old)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise FtkitError(
                f"additional_config[{CONFIG_KEY!r}]: unknown key(s) {', '.join(unknown)}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        cfg = cls(**raw)
        if not isinstance(cfg.enabled, bool):
            raise FtkitError(f"{CONFIG_KEY}.enabled must be true or false")
        if not isinstance(cfg.injection, bool):
            raise FtkitError(f"{CONFIG_KEY}.injection must be true or false")
        if isinstance(cfg.max_restarts, bool) or not isinstance(cfg.max_restarts, int) \
                or cfg.max_restarts < 0:
            raise FtkitError(f"{CONFIG_KEY}.max_restarts must be an integer >= 0")
        if not isinstance(cfg.standby, bool):
            raise FtkitError(f"{CONFIG_KEY}.standby must be true or false")
        if not cfg.enabled:
            needs = [name for name in ("injection", "max_restarts", "standby")
                     if getattr(cfg, name)]
            if needs:
                keys = " and ".join(f"{CONFIG_KEY}.{name}" for name in needs)
                raise FtkitError(f"{keys} need{'s' if len(needs) == 1 else ''} "
                                 f"{CONFIG_KEY}.enabled: true (recovery is off, and they are "
                                 f"parts of it): turn recovery on, or remove "
                                 f"{'it' if len(needs) == 1 else 'them'}")
        if cfg.standby and not cfg.max_restarts:
            raise FtkitError(f"{CONFIG_KEY}.standby needs max_restarts >= 1 (the standby "
                             f"engine takes over from one that died)")
        if isinstance(cfg.max_reinference, bool) or not isinstance(cfg.max_reinference, int) \
                or cfg.max_reinference < 0:
            raise FtkitError(f"{CONFIG_KEY}.max_reinference must be an integer >= 0")
        if not isinstance(cfg.round_timeout_s, (int, float)) or cfg.round_timeout_s <= 0:
            raise FtkitError(f"{CONFIG_KEY}.round_timeout_s must be a number > 0")
        if cfg.op_timeout_s is not None and (isinstance(cfg.op_timeout_s, bool) or not
                                             isinstance(cfg.op_timeout_s, (int, float))
                                             or cfg.op_timeout_s <= 0):
            raise FtkitError(f"{CONFIG_KEY}.op_timeout_s must be a number > 0")
        return cfg

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> RecoveryConfig:
        return cls.from_mapping((additional_config or {}).get(CONFIG_KEY))

    def step_bound(self) -> StepBound:
        """How long one step RPC may take while it is recovered under these settings, at
        worst: ``max_reinference`` failing attempts, each ended by the operator timeout and
        followed by a round, then the attempt that succeeds."""
        return step_bound(failing_attempts=self.max_reinference, attempt_s=self.op_timeout_s,
                          round_timeout_s=self.round_timeout_s)

    def to_mapping(self) -> dict[str, Any]:
        """The ``additional_config["fault_tolerance"]`` that gives this config."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RecoveryConfig:
        return dataclasses.replace(self, **changes)
