"""Run in a child process by the integration tests: the recovery engine with one of its
repairs switched off, on an in-process engine of its own. Prints the tokens as JSON.

Usage: ``_naive_rerun.py MODEL JOURNAL MAX_TOKENS PROMPTS_JSON FAULT_JSON CRIPPLE`` where
CRIPPLE is ``rollback`` (no rollback of the runner state), ``kv`` (lost KV is not
recomputed) or ``reload`` (hit weights are not reloaded).
"""

import json
import sys

from ftkit.vllm.engine import EngineSession, EngineSpec, SamplingSpec
from ftkit.vllm.kv_recompute import KvRecompute
from ftkit.vllm.memory import RunnerMemory
from ftkit.vllm.runner_state import V1RunnerState

CRIPPLES = {
    "rollback": lambda: setattr(V1RunnerState, "rollback_execute", lambda self, record: None),
    "kv": lambda: setattr(KvRecompute, "run", lambda self, scheduler_output, call: None),
    "reload": lambda: setattr(RunnerMemory, "reload_params", lambda self, names: []),
}


def main() -> None:
    model, journal, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts, fault, cripple = json.loads(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6]
    CRIPPLES[cripple]()
    recovery = {"enabled": True, "max_reinference": 3, "event_log_dir": journal}
    with EngineSession(EngineSpec(model=model), recovery=recovery) as engine:
        run_id = engine.new_run_id()
        engine.set_fault_plan(run_id, [fault])
        out = engine.generate(prompts, SamplingSpec(max_tokens=max_tokens), run_id=run_id)
    print("RESULT " + json.dumps({"error": out.error,
                                  "tokens": [r.token_ids for r in out.requests]}))


if __name__ == "__main__":
    main()
