"""Run scenarios end to end: the fault-free baseline (cached), the faulty run, the verdict.

Each engine run happens in an engine host child process (``ftkit.vllm.host``) that the runner
owns: it is started in a new session, bounded by the scenario's ``timeout_s``, and killed with
every process below it (by pid and start time) on timeout, on Ctrl-C and on failure. Fault and
recovery events reach the parent through the ranks' event log (``ftkit.contracts.eventlog``),
which survives the engine's death.

The fault-free baseline runs on a plain vLLM engine (ftkit not installed) with the same engine
settings, and is cached under ``<cache>/baselines`` by model content, engine settings, workload
and vLLM version, so a repeated run does not recompute it.

========================  =====================================================================
``core``                  ``ScenarioRunner``: scenarios to engine jobs, hosts kept between
                          scenarios, the verdict
``host_client``           ``HostClient``: one engine host process, its jobs and its processes
``events``                the ranks' events to fault and recovery records, and progress lines
``baseline``              the fault-free baseline's cache
========================  =====================================================================
"""

from ftkit.runner.baseline import baseline_key
from ftkit.runner.core import ScenarioRunner, run_scenario
from ftkit.runner.events import collect_events

__all__ = ["ScenarioRunner", "run_scenario", "baseline_key", "collect_events"]
