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
