"""``check_supported`` refuses what recovery cannot handle, naming the setting to change, and
every setting it names exists in the installed vLLM (0.32): the engine argument, the
``vllm serve`` flag, the environment variable."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import envs
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ftkit.errors import FtkitError
from ftkit.vllm.runner_state import check_supported


def v1_runner(**overrides: Any) -> SimpleNamespace:
    """The attributes check_supported reads of vLLM's V1 GPUModelRunner (and the CPU one)."""
    fields: dict[str, Any] = dict(
        input_batch=object(), requests={}, use_async_scheduling=False,
        speculative_config=None, device=torch.device("cpu"),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE))
    fields.update(overrides)
    return SimpleNamespace(**fields)


class GPUModelRunner:
    """vLLM's V2 runner: another class of the same name, without V1's batch bookkeeping."""

    scheduler_config = SimpleNamespace(async_scheduling=False)
    speculative_config = None
    device = torch.device("cuda")
    compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE)


GPUModelRunner.__module__ = "vllm.v1.worker.gpu.model_runner"


def refusal(runner: Any) -> str:
    with pytest.raises(FtkitError) as info:
        check_supported(runner)
    return str(info.value)


def test_a_v1_runner_without_the_unsupported_features_is_accepted():
    check_supported(v1_runner())
    # CUDA graph settings do not matter off CUDA (the CPU and NPU backends stop the device).
    check_supported(v1_runner(compilation_config=SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)))


def test_the_v2_runner_is_refused_with_the_environment_variable_that_selects_v1():
    message = refusal(GPUModelRunner())
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner is not vLLM's V1 runner" in message
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in message
    assert "VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables


def test_asynchronous_scheduling_is_refused_with_the_argument_and_the_flag():
    message = refusal(v1_runner(use_async_scheduling=True))
    assert "async_scheduling=False" in message and "--no-async-scheduling" in message
    v2 = GPUModelRunner()
    v2.scheduler_config = SimpleNamespace(async_scheduling=True)
    assert "--no-async-scheduling" in refusal(v2)


def test_cuda_graphs_are_refused_on_cuda_with_the_argument_and_the_flag():
    message = refusal(v1_runner(device=torch.device("cuda", 0), compilation_config=(
        SimpleNamespace(cudagraph_mode=CUDAGraphMode.PIECEWISE))))
    assert "CUDA graphs are on" in message
    assert "enforce_eager=True" in message and "--enforce-eager" in message


def test_every_problem_is_named_at_once():
    message = refusal(v1_runner(use_async_scheduling=True, speculative_config=object()))
    assert "asynchronous scheduling" in message and "speculative decoding" in message


def test_the_named_settings_exist_in_this_vllm():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--no-async-scheduling", "--enforce-eager"])
    assert args.async_scheduling is False and args.enforce_eager is True
    engine = EngineArgs(model="unused", async_scheduling=False, enforce_eager=True)
    assert engine.async_scheduling is False and engine.enforce_eager is True


@pytest.mark.parametrize("setting, value, named", [
    ("pipeline_parallel_size", 3, "--pipeline-parallel-size"),  # (more stages than 2)
    ("data_parallel_size", 2, "--data-parallel-size"),
    ("enable_expert_parallel", True, "--enable-expert-parallel"),
])
def test_parallelism_recovery_cannot_handle_is_refused_with_the_argument_and_the_flag(
        setting, value, named):
    from vllm.config import ParallelConfig

    assert setting in ParallelConfig.__dataclass_fields__  # vLLM's own name
    message = refusal(v1_runner(parallel_config=SimpleNamespace(
        **{setting: value}, tensor_parallel_size=2)))
    assert f"{setting}=" in message and named in message
    check_supported(v1_runner(parallel_config=SimpleNamespace(
        pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False)))
