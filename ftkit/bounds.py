"""Every wait bound ftkit uses, in one place.

Each constant bounds one wait (or paces one poll); the modules that wait import it from here,
so that how the bounds compose (with each other and with vLLM's own timeouts, such as
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s by default) can be read on one page.
"""

from __future__ import annotations

# --- inside a worker: collectives, the monitor, recovery rounds -----------------------------

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
#: How often the engine host reports token progress, at most.
PROGRESS_EVERY_S = 0.2
#: How long a process asked to terminate (SIGTERM) may take before it is killed; also the
#: bound on waiting for a killed process to be gone.
REAP_GRACE_S = 10.0
#: How often a running workload looks at the engine's processes (to see one die).
DEATH_WATCH_POLL_S = 0.05
#: How often a wait for processes to be gone looks at them again.
PROCESS_POLL_S = 0.02
