"""Run in a child process by the integration tests: the recovery engine with one of its
repairs switched off, on an in-process engine of its own. Prints the tokens as JSON.

Usage: ``_naive_rerun.py MODEL EVENT_LOG_DIR MAX_TOKENS PROMPTS_JSON FAULT_JSON CRIPPLE`` where
CRIPPLE is ``rollback`` (no rollback of the runner state), ``kv`` (lost KV is not
recomputed) or ``reload`` (hit weights are not reloaded).
"""

import json
import sys

from ftkit.config import RecoveryConfig
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession
from ftkit.vllm.kv_recompute import KvRecompute
from ftkit.vllm.memory import RunnerMemory
from ftkit.vllm.runner_state import V1RunnerState

CRIPPLES = {
    "rollback": lambda: setattr(V1RunnerState, "rollback_execute", lambda self, record: None),
    "kv": lambda: setattr(KvRecompute, "run", lambda self, scheduler_output, call: None),
    "reload": lambda: setattr(RunnerMemory, "reload_params", lambda self, names: []),
}


def main() -> None:
    model, event_log_dir, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts, cripple = json.loads(sys.argv[4]), sys.argv[6]
    fault = FaultSpec.model_validate_json(sys.argv[5])
    CRIPPLES[cripple]()
    recovery = RecoveryConfig(enabled=True, max_reinference=3, event_log_dir=event_log_dir)
    with EngineSession(EngineSpec(model=model), recovery=recovery) as engine:
        run_id = engine.new_run_id()
        engine.set_fault_plan(FaultPlan.from_specs(run_id, [fault]))
        out = engine.generate(prompts, SamplingSpec(max_tokens=max_tokens), run_id=run_id)
    print("RESULT " + json.dumps({"error": out.error,
                                  "tokens": [r.token_ids for r in out.requests]}))


if __name__ == "__main__":
    main()
