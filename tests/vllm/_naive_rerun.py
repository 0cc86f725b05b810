"""Run in a child process by the integration tests: the recovery engine with one of its
repairs switched off (or a plain engine without ftkit), on an in-process engine of its own.
Prints the tokens (and the sampled tokens' logprobs) as JSON.

Usage: ``_naive_rerun.py MODEL EVENT_LOG_DIR MAX_TOKENS PROMPTS_JSON FAULT_JSON CRIPPLE
[SAMPLING_JSON [TENSOR_PARALLEL]]`` where CRIPPLE is ``rollback`` (no rollback of the runner state), ``kv`` (lost
KV is not recomputed), ``reload`` (hit weights are not reloaded), ``resample`` (a failed
sampling RPC is re-run from the logits its step left, not from the forward pass: the earlier
design) or ``plain`` (no ftkit, no fault: the fault-free baseline). SAMPLING_JSON holds the
``SamplingSpec`` fields (greedy ``max_tokens`` by default); FAULT_JSON may be ``null``;
TENSOR_PARALLEL is the engine's tensor-parallel size (1 by default).
"""

import json
import sys

import ftkit.recovery.coordinator as coordinator
from ftkit import procs
from ftkit.config import RecoveryConfig
from ftkit.contracts.job import SamplingSpec
from ftkit.contracts.plan import FaultPlan
from ftkit.scenario import EngineSpec, FaultSpec
from ftkit.vllm.engine import EngineSession
from ftkit.vllm.kv_recompute import KvRecompute
from ftkit.vllm.memory import RunnerMemory
from ftkit.vllm.runner_state import V1RunnerState


def resample_from_kept_logits() -> None:
    """The earlier design: no step is re-run from its forward pass; a failed sampling RPC is
    re-run alone, from the forward state its step left (kept when sampling begins)."""
    coordinator.replay_point = lambda statuses: None
    begin, rollback = V1RunnerState.begin_sample, V1RunnerState.rollback_sample

    def begin_sample(self, scheduler_output):
        self.kept_forward_state = self.runner.execute_model_state
        return begin(self, scheduler_output)

    def rollback_sample(self, record):
        rollback(self, record)
        self.runner.execute_model_state = self.kept_forward_state

    V1RunnerState.begin_sample = begin_sample
    V1RunnerState.rollback_sample = rollback_sample


CRIPPLES = {
    "rollback": lambda: setattr(V1RunnerState, "rollback_execute", lambda self, record: None),
    "kv": lambda: setattr(KvRecompute, "run", lambda self, scheduler_output, call: None),
    "reload": lambda: setattr(RunnerMemory, "reload_params", lambda self, names: []),
    "resample": resample_from_kept_logits,
    "plain": lambda: None,
}


def main() -> None:
    model, event_log_dir, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts, cripple = json.loads(sys.argv[4]), sys.argv[6]
    fault = json.loads(sys.argv[5])
    sampling = SamplingSpec(**json.loads(sys.argv[7])) if len(sys.argv) > 7 \
        else SamplingSpec(max_tokens=max_tokens)
    tensor_parallel = int(sys.argv[8]) if len(sys.argv) > 8 else 1
    CRIPPLES[cripple]()
    recovery = None if cripple == "plain" else RecoveryConfig(
        enabled=True, max_reinference=3, event_log_dir=event_log_dir)
    spec = EngineSpec(model=model, tensor_parallel_size=tensor_parallel)
    with EngineSession(spec, recovery=recovery) as engine:
        run_id = engine.new_run_id()
        if fault is not None:
            engine.set_fault_plan(FaultPlan.from_specs(run_id, [FaultSpec.model_validate(fault)]))
        out = engine.generate(prompts, sampling, run_id=run_id)
    print("RESULT " + json.dumps({"error": out.error,
                                  "tokens": [r.token_ids for r in out.requests],
                                  "logprobs": [r.logprobs for r in out.requests],
                                  "top_logprobs": [r.top_logprobs for r in out.requests]}))


if __name__ == "__main__":
    main()
    procs.exit_quickly(0)  # as ftkit's engine hosts end: vLLM's heap is not torn down (2 s)
