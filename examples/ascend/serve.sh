#!/usr/bin/env bash
# Serve a model with vLLM-Ascend and ftkit's recovery engine on: a transient fault in a model
# step (a broken HCCL link, a force-stopped device, an HBM memory error, a hung operator, an
# out-of-memory error) is recovered by re-running the step on every rank, token for token.
#
#   examples/ascend/serve.sh MODEL [TENSOR_PARALLEL_SIZE] [more vllm serve arguments...]
#
# e.g. examples/ascend/serve.sh /models/Qwen2.5-7B-Instruct 2 --port 8000
#
# Needs: CANN, torch_npu, vLLM and vllm-ascend as the NPU machine has them, and ftkit installed
# into the same Python environment (pip install -e . -e cli from a checkout). See docs/ascend.md.
# Settings: FTKIT_MAX_REINFERENCE (default 3), FTKIT_ROUND_TIMEOUT_S (30), FTKIT_EVENT_LOG_DIR
# (none), ASCEND_SET_ENV (CANN's environment script, sourced when it exists).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 MODEL [TENSOR_PARALLEL_SIZE] [vllm serve arguments...]" >&2
    exit 2
fi
model=$1
tensor_parallel=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))

ascend_env=${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [[ -f $ascend_env ]]; then
    # shellcheck disable=SC1090
    source "$ascend_env"
fi

# ftkit restores the step state of vLLM's V1 model runner (not the V2 one).
export VLLM_USE_V2_MODEL_RUNNER=0
# Let ftkit handle HCCL errors: HCCL's asynchronous error handling could end the process
# before the recovery round has run.
export HCCL_ASYNC_ERROR_HANDLING=0

settings=$(printf '{"fault_tolerance": {"enabled": true, "max_reinference": %d, "round_timeout_s": %s%s}}' \
    "${FTKIT_MAX_REINFERENCE:-3}" "${FTKIT_ROUND_TIMEOUT_S:-30}" \
    "${FTKIT_EVENT_LOG_DIR:+, \"event_log_dir\": \"$FTKIT_EVENT_LOG_DIR\"}")

# Stop here, with the reason, unless vLLM sees the NPUs and ftkit's Ascend backend is usable.
ftkit doctor --expect-platform npu

# Asynchronous scheduling overlaps steps, so a failed step could not be re-run alone; a
# compiled graph (vLLM's default without --enforce-eager) blocks in collectives ftkit cannot
# stop.
exec vllm serve "$model" \
    --tensor-parallel-size "$tensor_parallel" \
    --no-async-scheduling \
    --enforce-eager \
    --additional-config "$settings" \
    "$@"
