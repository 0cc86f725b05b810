"""Every wait bound ftkit uses, in one place.

Each constant bounds one wait (or paces one poll); the modules that wait import it from here,
so that how the bounds compose (with each other and with vLLM's own timeouts) can be read on
one page. The one composition that matters to vLLM is ``step_bound``, at the end: every
re-run of a step happens inside the step's RPC, and vLLM's multi-process executor waits for
one step RPC at most ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s by default), then ends the
engine. ftkit raises that timeout for the engines it starts (``ftkit.vllm.environment``) and,
through its plugin, in the engine core of an engine it did not start (``vllm serve``) whose
timeout is too short, saying so; and it refuses at validation a scenario whose faults need
more than its engine will be given (``ftkit.scenario.rules``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ftkit.errors import FtkitError

# --- inside a worker: collectives, the monitor, recovery rounds -----------------------------

#: Bound on one operator or collective when the recovery settings name none
#: (``fault_tolerance.op_timeout_s``): it then raises the hang error instead of blocking. On
#: Ascend it is torch_npu's operator timeout (``set_op_timeout_ms``; CANN's own default is far
#: longer, and HCCL's ``HCCL_EXEC_TIMEOUT`` is about half an hour); on CPU and CUDA it bounds
#: the collectives (a compute kernel cannot be timed out there). Long enough that no healthy
#: operator of a large model reaches it; short enough that a hung step is recovered.
DEFAULT_OP_TIMEOUT_S = 120.0
#: How long a blocked collective waits between looks at the stop flag. It bounds how long a
#: healthy rank stays blocked after its monitor was told to stop (detection is event driven;
#: this only paces the unblocking of a collective that a peer never joined).
COLLECTIVE_STOP_SLICE_S = 0.005
#: Bound on one collective that a peer never joins and no stop ends (a peer hung without
#: announcing a fault): it then raises instead of blocking forever. The operator timeout
#: replaces it where set.
COLLECTIVE_TIMEOUT_S = DEFAULT_OP_TIMEOUT_S
#: The monitor's wait for a fault announcement wakes up this often only to notice a shutdown.
MONITOR_WAKE_S = 60.0
#: While an idle rank re-runs a step in its monitor thread, the watch for a further round looks
#: this often whether one was announced (and whether the re-run is over).
ROUND_WATCH_SLICE_S = 0.05
#: Default bound on every wait inside one recovery round (peers reporting, rebuild, done).
DEFAULT_ROUND_TIMEOUT_S = 30.0
#: A step waits at the gate at most this many round timeouts for a round the monitor runs:
#: a round has three waits (reports, the communicators' rebuild, peers done), each bounded
#: by the round timeout.
GATE_TIMEOUT_ROUNDS = 3
#: The monitor's pause after an unexpected error in its loop, before it watches again (so
#: that a persistent error does not spin).
MONITOR_ERROR_PAUSE_S = 0.1
#: How long a worker that sent SIGKILL to the engine core (a ``process_kill`` fault) waits for
#: its own end, which follows from it, before it gives up with an error.
KILL_WAIT_S = 30.0
#: How often that worker looks again while it waits.
KILL_WAIT_POLL_S = 0.05

# --- processes: the scenario runner, the engine host, the engine session --------------------

#: Bound on how long an engine host may take to exit once told to (its engine shuts down).
HOST_EXIT_GRACE_S = 30.0
#: Bound on waiting for the thread that reads an engine host's progress lines to end.
HOST_READER_JOIN_S = 5.0
#: How long an engine host whose input ended waits to see whether its parent died (the kernel
#: closes a dying process's pipes a moment before it marks the process dead).
ORPHAN_CHECK_S = 2.0
#: How often the runner looks at the event log for new fault and recovery events (and at the
#: engine host: alive, deadline passed, new processes below it).
EVENT_POLL_S = 0.25
#: Bound on a serve scenario's server start, until its ``/health`` answers 200 (a TP 2 server
#: of the tiny model starts in 20-40 s on two cores; more beside other work).
SERVE_START_TIMEOUT_S = 240.0
#: Bound on one fault-free run of a serve workload when the oracle is measured.
SERVE_RUN_TIMEOUT_S = 120.0
#: How often a starting server's ``/health`` is asked.
SERVE_HEALTH_POLL_S = 0.5
#: How often the engine host reports token progress, at most.
PROGRESS_EVERY_S = 0.2
#: How long a process asked to terminate (SIGTERM) may take before it is killed; also the
#: bound on waiting for a killed process to be gone.
REAP_GRACE_S = 10.0
#: How often a running workload looks at the engine's processes (to see one die).
DEATH_WATCH_POLL_S = 0.05
#: How often a wait for processes to be gone looks at them again.
PROCESS_POLL_S = 0.02
#: How often an engine's watchdog process (and an engine host) looks whether its owner (its
#: parent) still lives; bounds how long an engine outlives an owner killed with SIGKILL.
OWNER_WATCH_POLL_S = 0.25
#: How often a starting engine is looked at for the processes it started and the shared
#: memory they map, so that its watchdog knows them if the owner dies during the start.
ENGINE_START_TRACK_S = 0.5
#: How long an engine ftkit starts on its own Ray cluster waits for its ranks' places (vLLM's
#: Ray executor waits 1800 s, well past its front end's own wait for the engine core): every
#: node is up before the engine starts, so a place still missing after this is a lost node.
RAY_PLACEMENT_TIMEOUT_S = 60.0
#: Where the engine core reads it (``ftkit.vllm.plugin``; unset: vLLM's own wait).
RAY_PLACEMENT_TIMEOUT_ENV = "FTKIT_RAY_PLACEMENT_TIMEOUT_S"


# --- how they compose with vLLM's own bound on a step -----------------------------------------

#: vLLM's setting: how long its multi-process executor (tensor parallel 2 and more) waits for
#: one ``execute_model`` or ``sample_tokens`` RPC before it ends the engine
#: (``vllm/v1/executor/multiproc_executor.py``; whole seconds, ``vllm/envs.py``).
VLLM_EXECUTE_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
#: Its value when the environment does not set it.
VLLM_EXECUTE_TIMEOUT_DEFAULT_S = 300
#: Room in a step's RPC for the attempt that finally succeeds (a long prefill on a large
#: model takes seconds; this leaves it tens).
LAST_ATTEMPT_S = 30.0


def round_bound_s(round_timeout_s: float) -> float:
    """How long one recovery round may last: its three waits (reports, the rebuild, peers
    done), each bounded by the round timeout; the gate waits as long."""
    return GATE_TIMEOUT_ROUNDS * round_timeout_s


@dataclass(frozen=True)
class StepBound:
    """How long one step RPC may take while it is recovered: ``failing_attempts`` attempts,
    each ended at the latest by the operator timeout (``attempt_s``) and followed by a
    recovery round (``round_bound_s(round_timeout_s)``), then the attempt that succeeds
    (``LAST_ATTEMPT_S``)."""

    failing_attempts: int
    attempt_s: float
    round_timeout_s: float

    @property
    def round_s(self) -> float:
        return round_bound_s(self.round_timeout_s)

    @property
    def total_s(self) -> float:
        return self.failing_attempts * (self.attempt_s + self.round_s) + LAST_ATTEMPT_S

    @property
    def needed_s(self) -> int:
        """The smallest ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` that lets the step finish."""
        return math.ceil(self.total_s)

    def fits(self, execute_timeout_s: float) -> bool:
        return self.total_s <= execute_timeout_s

    def describe(self) -> str:
        """The arithmetic, in words: "3 failing attempts x (110 s operator timeout + 90 s
        recovery round) + 30 s for the last attempt = 630 s"."""
        return (f"{self.failing_attempts} failing attempt"
                f"{'' if self.failing_attempts == 1 else 's'} x ({self.attempt_s:g} s "
                f"operator timeout + {self.round_s:g} s recovery round, {GATE_TIMEOUT_ROUNDS} x "
                f"round_timeout_s {self.round_timeout_s:g} s) + {LAST_ATTEMPT_S:g} s for the "
                f"last attempt = {self.total_s:g} s")


def step_bound(*, failing_attempts: int, attempt_s: float | None,
               round_timeout_s: float) -> StepBound:
    """The composition of one step's bounds. ``attempt_s``: how long a failing attempt may
    last (``None``: until the default operator timeout ends it)."""
    return StepBound(failing_attempts,
                     DEFAULT_OP_TIMEOUT_S if attempt_s is None else float(attempt_s),
                     round_timeout_s)


def vllm_execute_timeout_s(environ: Mapping[str, str]) -> int:
    """vLLM's execute timeout under ``environ``, read as vLLM reads it (an integer)."""
    raw = environ.get(VLLM_EXECUTE_TIMEOUT_ENV)
    if raw is None:
        return VLLM_EXECUTE_TIMEOUT_DEFAULT_S
    try:
        return int(raw)
    except ValueError:
        raise FtkitError(f"{VLLM_EXECUTE_TIMEOUT_ENV}={raw!r} is not a whole number of "
                         "seconds (vLLM reads it with int())") from None


def scenario_round_timeout_s(run_timeout_s: float) -> float:
    """The round timeout of a scenario's engine: the default, or the whole run's bound
    (``expect.timeout_s``) where that is shorter."""
    return min(DEFAULT_ROUND_TIMEOUT_S, run_timeout_s)
