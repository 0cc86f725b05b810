"""Recovery settings and every wait bound the recovery engine uses, in one place.

Users set the recovery through vLLM's ``additional_config`` key ``fault_tolerance``, with
the same keys on every platform::

    additional_config={"fault_tolerance": {"enabled": true, "max_reinference": 3}}

Unknown keys are rejected, so a typo does not silently leave recovery off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ftkit.errors import FtkitError

#: The ``additional_config`` key that holds ftkit's settings.
CONFIG_KEY = "fault_tolerance"

#: How long a blocked collective waits between looks at the stop flag. It bounds how long a
#: healthy rank stays blocked after its monitor was told to stop (detection is event driven;
#: this only paces the unblocking of a collective that a peer never joined).
COLLECTIVE_STOP_SLICE_S = 0.005
#: Bound on one collective that a peer never joins and no stop ends (a peer hung without
#: announcing a fault): it then raises instead of blocking forever.
COLLECTIVE_TIMEOUT_S = 120.0
#: The monitor's wait for a fault announcement wakes up this often only to notice a shutdown.
MONITOR_WAKE_S = 60.0
#: Default bound on every wait inside one recovery round (peers reporting, rebuild, done).
DEFAULT_ROUND_TIMEOUT_S = 30.0
#: Connecting to the side channel at start.
SIDE_CHANNEL_CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RecoveryConfig:
    """What ``additional_config["fault_tolerance"]`` may say.

    ``enabled``: wrap the worker's step with the recovery engine.
    ``max_reinference``: re-runs of one step before the fault is surfaced (0: never re-run).
    ``round_timeout_s``: bound on each wait of a recovery round; a peer that does not answer
    within it turns the round into a clean failure.
    ``journal_dir``: where each rank appends its recovery and fault events (JSON lines);
    ``None`` keeps them in memory only.
    ``op_timeout_s``: operators (and collectives) that run longer raise the hang error
    instead of blocking: ``set_op_timeout_ms`` on Ascend; ``None`` keeps the backend's bound.
    """

    enabled: bool = False
    max_reinference: int = 3
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    journal_dir: str | None = None
    op_timeout_s: float | None = None

    @classmethod
    def from_mapping(cls, raw: dict[str, Any] | None) -> RecoveryConfig:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise FtkitError(f"additional_config[{CONFIG_KEY!r}] must be a mapping, got {raw!r}")
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
