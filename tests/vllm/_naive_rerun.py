"""Run in a child process by test_recovery_tp1: the recovery engine with its rollback
switched off, on an in-process engine of its own. Prints the tokens as JSON."""

import json
import sys

from ftkit.vllm.engine import EngineSession, EngineSpec, SamplingSpec
from ftkit.vllm.runner_state import V1RunnerState


def main() -> None:
    model, token, journal, max_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    prompts = json.loads(sys.argv[5])
    V1RunnerState.rollback_execute = lambda self, record: None
    recovery = {"enabled": True, "max_reinference": 3, "journal_dir": journal}
    with EngineSession(EngineSpec(model=model), recovery=recovery) as engine:
        run_id = engine.new_run_id()
        engine.set_fault_plan(run_id, [{"kind": "oom", "rank": 0, "phase": "forward", "times": 1,
                                        "at": {"request": 0, "token": token}, "params": {}}])
        out = engine.generate(prompts, SamplingSpec(max_tokens=max_tokens), run_id=run_id)
    print("RESULT " + json.dumps({"error": out.error,
                                  "tokens": [r.token_ids for r in out.requests]}))


if __name__ == "__main__":
    main()
