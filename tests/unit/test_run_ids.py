"""Run ids stay unique across the engine sessions of one process.

Regression: a host replaces its engine session after a failed run, and the new session
numbered its runs from 1 again. A process kill's restart re-plans the faults from the
``FaultFired`` events of its run id in the shared event log, so it took a fault an earlier
run with the same id had fired for one of its own, and never planned it: the scenario was
reported as not applied.
"""

from __future__ import annotations

from ftkit.scenario import EngineSpec
from ftkit.vllm.engine import EngineSession


def test_sessions_of_one_process_never_reuse_a_run_id():
    first, second = (EngineSession(EngineSpec(model="unused")) for _ in range(2))
    ids = [first.new_run_id(), first.new_run_id(), second.new_run_id(), first.new_run_id()]
    assert len(set(ids)) == len(ids), ids
