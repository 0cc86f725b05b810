"""Cross-rank agreement: every rank reports where it stands, all reach the same decision.

A *recovery round* starts when a rank's step fails (its own fault) and announces it on the
side channel. Every rank then takes part exactly once, from wherever it is:

* a rank whose step failed reports ``failed`` with the fault kind;
* a rank whose collective was stopped because of the announcement reports ``stopped``;
* a rank that finished its step while the round was pending reports ``completed``;
* a rank that was between steps reports ``idle`` (its monitor thread answers for it).

Each report carries the rank's position in the stream of step RPCs that the executor sends
to every rank in the same order (``execute_model`` and ``sample_tokens`` each count one).
``decide`` is a pure function of the reports, so all ranks, reading the same reports, reach the
same decision without another exchange: re-run (``recompute``) or surface the fault (``raise``).

Re-running is exact only when the ranks will issue the same collectives afterwards. Collectives
live in ``execute_model`` only (sampling is rank-local in vLLM), so ranks may stand one RPC apart
as long as the one behind is at a sampling RPC or idle. Anything else is refused (a ``Cause``,
and a reason for people) rather than risking desynchronised collectives.

A sampling RPC that failed (or was stopped) is never re-run from the logits its step's forward
pass left: vLLM's sampler applies penalties, logit bias and temperature to them in place, and
the fault itself may have hit them. The step is re-run from its forward pass instead, and since
the forward has collectives, every rank re-runs it: the decision carries a ``Replay`` (the
``execute_model`` RPC of that step). A rank that has already sampled that step, or that has
gone on into the next ``execute_model``, undoes what it did since and runs it again; see
``StepWrapper``.

The side channel (``ftkit.recovery.channel``) is a key-value store (the job's TCP store), not a
process group: it has no collective sequence to desynchronise, every wait on it has a timeout,
and a lost peer turns into a timeout, that is, into a clean ``raise``.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ftkit.contracts.step import RpcKind
from ftkit.errors import RecoveryError, RecoveryInconsistent, ReinferenceExhausted
from ftkit.recovery.channel import SideChannel


class RankState(str, enum.Enum):
    FAILED = "failed"
    STOPPED = "stopped"
    COMPLETED = "completed"
    IDLE = "idle"


@dataclass(frozen=True)
class RankStatus:
    """What one rank reports in a round.

    ``rpc`` is the counter of the RPC in flight (``failed``/``stopped``) or of the last RPC
    this rank completed (``completed``/``idle``). ``failures`` counts the consecutive failed
    attempts of the RPC in flight, this one included.
    """

    rank: int
    state: RankState
    rpc: int
    rpc_kind: RpcKind = RpcKind.NONE
    step: int = 0
    failures: int = 0
    kind: str | None = None
    error: str = ""
    #: Device state this rank's fault destroyed, which every rank helps rebuild: KV block
    #: ids (``kv_lost``), or the whole KV cache (``kv_lost_all``, after a device reset).
    kv_lost: tuple[int, ...] = ()
    kv_lost_all: bool = False
    #: Parameters this rank reloads from the checkpoint itself (its own shard).
    reload_params: tuple[str, ...] = ()
    #: Set when this rank cannot repair what its fault hit: the round must raise.
    unrecoverable: str = ""

    @property
    def reruns(self) -> bool:
        return self.state in (RankState.FAILED, RankState.STOPPED)

    @property
    def next_rpc(self) -> int:
        """The RPC this rank will execute next if the round decides to recompute."""
        return self.rpc if self.reruns else self.rpc + 1

    def to_json(self) -> str:
        d = asdict(self)
        d["state"] = self.state.value
        d["rpc_kind"] = self.rpc_kind.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankStatus:
        d = json.loads(text)
        d["state"] = RankState(d["state"])
        d["rpc_kind"] = RpcKind(d["rpc_kind"])
        d["kv_lost"] = tuple(d.get("kv_lost", ()))
        d["reload_params"] = tuple(d.get("reload_params", ()))
        return cls(**d)


class Action(str, enum.Enum):
    RECOMPUTE = "recompute"
    RAISE = "raise"


class Cause(str, enum.Enum):
    """Why a round decided what it did; callers choose on this, never on ``reason``'s text."""

    #: Every rank can re-run (the cause of every ``recompute``).
    RERUN = "rerun"
    #: A rank's error is not a fault ftkit handles.
    NOT_A_FAULT = "not_a_fault"
    #: A rank cannot repair what its fault destroyed.
    UNREPAIRABLE = "unrepairable"
    #: A step failed more often than ``max_reinference`` allows.
    REINFERENCE_EXHAUSTED = "reinference_exhausted"
    #: The ranks stand at positions from which no common re-run is exact.
    OUT_OF_STEP = "out_of_step"
    #: A rank did not report within the round's bound (it died or hangs).
    PEER_SILENT = "peer_silent"
    #: A rank did not finish the rebuild within the round's bound.
    PEER_UNFINISHED = "peer_unfinished"
    #: This rank's part of the round raised (its rebuild failed, say).
    ROUND_FAILED = "round_failed"


#: The error a ``raise`` of each cause surfaces as (``RecoveryError`` for the others).
_ERRORS: dict[Cause, type[RecoveryError]] = {
    Cause.REINFERENCE_EXHAUSTED: ReinferenceExhausted,
    Cause.OUT_OF_STEP: RecoveryInconsistent,
}


@dataclass(frozen=True)
class Replay:
    """Every rank re-runs from the forward pass of step ``step``, its ``execute_model`` RPC
    ``rpc`` (the RPCs a rank completed since are undone and run again)."""

    rpc: int
    step: int


@dataclass(frozen=True)
class Decision:
    """What a round decided, the same on every rank; ``reason`` is for people to read."""

    action: Action
    cause: Cause
    reason: str
    #: Fault kinds reported as own faults in this round (for device recovery and records).
    kinds: tuple[str, ...] = ()
    statuses: tuple[RankStatus, ...] = field(default=(), compare=False)
    #: Set when a sampling RPC failed, or a forward pass that a peer completed: the step
    #: every rank re-runs from its forward pass (``replay_point``).
    replay: Replay | None = None

    @property
    def recompute(self) -> bool:
        return self.action is Action.RECOMPUTE

    @property
    def error(self) -> type[RecoveryError]:
        """The class of ``ftkit.errors`` that a ``raise`` of this decision surfaces as."""
        return _ERRORS.get(self.cause, RecoveryError)

    @property
    def kv_lost_all(self) -> bool:
        """Some rank lost its whole KV cache: every rank recomputes every request's KV."""
        return any(s.kv_lost_all for s in self.statuses)

    @property
    def kv_lost(self) -> tuple[int, ...]:
        """The KV blocks some rank lost, which every rank recomputes (the union)."""
        return tuple(sorted({b for s in self.statuses for b in s.kv_lost}))

    def status_of(self, rank: int) -> RankStatus | None:
        return next((s for s in self.statuses if s.rank == rank), None)


def decide(statuses: Sequence[RankStatus], max_reinference: int) -> Decision:
    """The round's decision. Pure: the same reports give the same decision on every rank."""
    statuses = tuple(sorted(statuses, key=lambda s: s.rank))
    kinds = tuple(sorted({s.kind for s in statuses if s.state is RankState.FAILED and s.kind}))

    def rerun(reason: str, replay: Replay | None = None) -> Decision:
        return Decision(Action.RECOMPUTE, Cause.RERUN, reason, kinds, statuses, replay)

    def refuse(cause: Cause, reason: str) -> Decision:
        return Decision(Action.RAISE, cause, reason, kinds, statuses)

    failed = [s for s in statuses if s.state is RankState.FAILED]
    if not failed and not any(s.state is RankState.STOPPED for s in statuses):
        # Nobody reports a failure: an announcement without a fault (cannot happen unless a
        # rank died between announcing and reporting). Re-running nothing is harmless.
        return rerun("no rank reports a failure")
    for s in failed:
        if s.kind is None:
            return refuse(Cause.NOT_A_FAULT,
                          f"rank {s.rank}: error is not a transient fault: {s.error}")
        if s.unrecoverable:
            return refuse(Cause.UNREPAIRABLE, f"rank {s.rank}: {s.kind} cannot be repaired: "
                                              f"{s.unrecoverable}")
    for s in statuses:
        if s.reruns and s.failures > max_reinference:
            return refuse(
                Cause.REINFERENCE_EXHAUSTED,
                f"rank {s.rank}: step {s.step} ({s.rpc_kind.value}) failed {s.failures} times; "
                f"max_reinference is {max_reinference}",
            )
    replay = replay_point(statuses)
    if replay is not None:
        for s in statuses:
            if not _reaches(s, replay):
                return refuse(
                    Cause.OUT_OF_STEP,
                    f"ranks are out of step: step {replay.step} is re-run from its forward "
                    f"pass (RPC {replay.rpc}), but rank {s.rank} is {s.state.value} at RPC "
                    f"{s.rpc} ({s.rpc_kind.value or 'idle'}), beyond what it can undo",
                )
        return rerun(", ".join(f"rank {s.rank} {s.state.value}" for s in statuses)
                     + f"; every rank re-runs step {replay.step} from its forward pass",
                     replay)
    newest = max(s.next_rpc for s in statuses)
    for s in statuses:
        if s.next_rpc == newest:
            continue
        behind_at_collectives = s.reruns and s.rpc_kind is RpcKind.EXECUTE
        if s.next_rpc < newest - 1 or behind_at_collectives:
            return refuse(
                Cause.OUT_OF_STEP,
                f"ranks are out of step: rank {s.rank} would re-run RPC {s.next_rpc} "
                f"({s.rpc_kind.value or 'idle'}) while another rank is at RPC {newest}; "
                "its collectives have no partner",
            )
    return rerun(", ".join(f"rank {s.rank} {s.state.value}" for s in statuses))


def replay_point(statuses: Sequence[RankStatus]) -> Replay | None:
    """The step re-run from its forward pass on every rank, or ``None``: that of the earliest
    sampling RPC some rank re-runs (its ``execute_model`` is the RPC just before it on every
    rank); else the earliest ``execute_model`` some rank re-runs that a peer completed. A
    pipeline stage completes its forward pass once it sent its activations, while the next
    stage may fail in its own; a tensor-parallel rank may complete it (and sample) when its
    peer failed after the step's last collective. Either way the peer's forward pass is run
    again with the failed one, and their transfers pair up."""
    sampling = [s for s in statuses if s.reruns and s.rpc_kind is RpcKind.SAMPLE]
    if sampling:
        first = min(sampling, key=lambda s: s.rpc)
        return Replay(rpc=first.rpc - 1, step=first.step)
    forwards = [s for s in statuses if s.reruns and s.rpc_kind is RpcKind.EXECUTE]
    if not forwards:
        return None
    first = min(forwards, key=lambda s: s.rpc)
    if any(s.rpc > first.rpc or (not s.reruns and s.rpc == first.rpc) for s in statuses):
        return Replay(rpc=first.rpc, step=first.step)
    return None


def _reaches(s: RankStatus, replay: Replay) -> bool:
    """Whether rank ``s`` can get back to just before ``replay.rpc`` and run on from there:
    a rank undoes at most that step's two RPCs and the next ``execute_model``."""
    if s.reruns and s.rpc_kind is RpcKind.SAMPLE:
        return s.rpc == replay.rpc + 1  # that very sampling RPC
    if s.reruns:
        # That step's forward itself, or the next one (having sampled that step).
        return s.rpc in (replay.rpc, replay.rpc + 2)
    # Completed or idle: not yet at the step (it runs it afresh), after its forward, after
    # its sampling, or after the next ``execute_model`` when that one had no forward pass (a
    # step that only forgets finished requests: with a forward it could not have completed
    # while a peer was still sampling the step before).
    return replay.rpc - 1 <= s.rpc <= replay.rpc + 2


def trigger_key(epoch: int) -> str:
    """The key whose setting announces round ``epoch`` to every rank's monitor."""
    return f"round/{epoch}/trigger"


@dataclass
class RoundTimes:
    """Where one rank's part of one round went, in seconds (for the event log)."""

    #: From this rank's report until every rank's report had arrived.
    statuses_s: float = 0.0
    #: The rebuild (device, communicators, repairs), when the round decided to re-run.
    rebuild_s: float = 0.0
    #: After its own rebuild, waiting for every rank to finish theirs.
    peers_done_s: float = 0.0
    #: The parts of the rebuild, filled in by the rebuild itself (``None``: not run).
    device_s: float | None = None
    comms_s: float | None = None
    repair_s: float | None = None


#: Rebuilds this rank after a ``recompute`` decision, filling in the parts of ``RoundTimes``
#: it measures; it runs on every rank, in whichever thread takes part in the round.
Rebuild = Callable[[Decision, RoundTimes], None]


class Coordinator:
    """Runs one rank's part of a recovery round over a side channel."""

    def __init__(self, rank: int, world_size: int, *, max_reinference: int,
                 round_timeout_s: float, rebuild: Rebuild) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_reinference = max_reinference
        self.round_timeout_s = round_timeout_s
        self._rebuild = rebuild
        #: Timings of this rank's last round (rounds of one rank never overlap).
        self.last_times = RoundTimes()

    def participate(self, channel: SideChannel, epoch: int, status: RankStatus) -> Decision:
        """Report, wait for every rank's report, decide, rebuild, and wait for all to finish.

        Every wait is bounded by ``round_timeout_s``; a rank that does not report in time
        makes the decision ``raise`` on the ranks that waited for it.
        """
        times = self.last_times = RoundTimes()
        started = time.monotonic()
        base = f"round/{epoch}"
        channel.set(f"{base}/status/{self.rank}", status.to_json())
        channel.set(trigger_key(epoch), str(self.rank))
        keys = [f"{base}/status/{r}" for r in range(self.world_size)]
        if not channel.wait(keys, self.round_timeout_s):
            missing = [r for r, k in enumerate(keys) if not channel.has(k)]
            return Decision(Action.RAISE, Cause.PEER_SILENT,
                            f"rank(s) {missing} did not report within "
                            f"{self.round_timeout_s:g} s", (), (status,))
        times.statuses_s = time.monotonic() - started
        statuses = [RankStatus.from_json(channel.get(k)) for k in keys]
        decision = decide(statuses, self.max_reinference)
        if decision.recompute:
            rebuild_started = time.monotonic()
            self._rebuild(decision, times)
            times.rebuild_s = time.monotonic() - rebuild_started
        channel.set(f"{base}/done/{self.rank}", decision.action.value)
        done = [f"{base}/done/{r}" for r in range(self.world_size)]
        done_started = time.monotonic()
        arrived = channel.wait(done, self.round_timeout_s)
        times.peers_done_s = time.monotonic() - done_started
        if not arrived:
            return Decision(Action.RAISE, Cause.PEER_UNFINISHED,
                            f"peers did not finish round {epoch} within "
                            f"{self.round_timeout_s:g} s", decision.kinds, decision.statuses)
        return decision
