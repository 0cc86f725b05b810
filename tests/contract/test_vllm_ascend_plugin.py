"""The ``vllm.general_plugins`` entry point on a worker shaped like vllm-ascend's NPUWorker.

vllm-ascend's worker (``vllm_ascend.worker.worker.NPUWorker``; ``worker_v1`` in older
releases) derives from vLLM's ``WorkerBase``, does its own set-up before calling
``WorkerBase.__init__``, and has ``execute_model``, ``sample_tokens`` and ``model_runner``
(an ``NPUModelRunner``, a subclass of vLLM's ``GPUModelRunner``). vllm-ascend is not
installed here, so the class below has that shape, module path and name; ``WorkerBase`` and
the plugin are the real ones.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from vllm.config import VllmConfig
from vllm.v1.worker import worker_base

from ftkit.errors import FtkitError
from ftkit.vllm import plugin
from ftkit.vllm.worker import FtkitWorker


class NPUModelRunner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def execute_model(self, scheduler_output: Any) -> None:
        self.calls.append(("execute_model", scheduler_output))

    def sample_tokens(self, grammar_output: Any) -> str:
        self.calls.append(("sample_tokens", grammar_output))
        return "tokens"


class NPUWorker(worker_base.WorkerBase):
    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False,
                 **kwargs: Any) -> None:
        self.adapted = True  # vllm-ascend patches vLLM and registers its ops first
        super().__init__(vllm_config=vllm_config, local_rank=local_rank, rank=rank,
                         distributed_init_method=distributed_init_method,
                         is_driver_worker=is_driver_worker)
        self.use_v2_model_runner = False

    def init_device(self) -> None:
        self.model_runner = NPUModelRunner()

    def execute_model(self, scheduler_output: Any) -> None:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> str:
        return self.model_runner.sample_tokens(grammar_output)


NPUWorker.__module__ = "vllm_ascend.worker.worker"


class PassThroughTolerance:
    """Stands in for the recovery engine (built at the first step from real process groups,
    which this test has none of): records the wrapped calls and runs them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def execute_model(self, inner: Any, scheduler_output: Any) -> Any:
        self.calls.append("execute_model")
        return inner(scheduler_output)

    def sample_tokens(self, inner: Any, grammar_output: Any) -> Any:
        self.calls.append("sample_tokens")
        return inner(grammar_output)


@pytest.fixture
def registered(monkeypatch):
    # The plugin replaces WorkerBase.__init__ for the process; put the original back after.
    monkeypatch.setattr(worker_base.WorkerBase, "__init__", worker_base.WorkerBase.__init__)
    plugin.register()
    plugin.register()  # idempotent: vLLM loads general plugins in several places


def make_worker(additional_config: dict[str, Any] | None) -> NPUWorker:
    config = VllmConfig(additional_config=additional_config or {})
    worker = NPUWorker(vllm_config=config, local_rank=0, rank=0,
                       distributed_init_method="tcp://127.0.0.1:1", is_driver_worker=True)
    worker.init_device()
    return worker


def test_the_plugin_wraps_an_npu_worker_and_its_steps_reach_the_npu_runner(registered,
                                                                          monkeypatch):
    tolerance = PassThroughTolerance()
    monkeypatch.setattr(FtkitWorker, "_build", lambda self: tolerance)
    worker = make_worker({"fault_tolerance": {"enabled": True, "max_reinference": 2}})
    assert type(worker).__module__ == "vllm_ascend.worker.worker" and worker.adapted
    assert isinstance(worker._ftkit, FtkitWorker)
    assert worker._ftkit.config.max_reinference == 2
    assert getattr(worker.execute_model, "__ftkit_wrapped__", False)
    assert getattr(worker.sample_tokens, "__ftkit_wrapped__", False)
    assert worker.ftkit_set_fault_plan == worker._ftkit.set_fault_plan

    assert worker.execute_model("scheduler output") is None
    assert worker.sample_tokens("grammar output") == "tokens"
    assert tolerance.calls == ["execute_model", "sample_tokens"]
    assert worker.model_runner.calls == [("execute_model", "scheduler output"),
                                         ("sample_tokens", "grammar output")]


def test_without_fault_tolerance_in_additional_config_the_worker_is_untouched(registered):
    worker = make_worker(None)
    assert not hasattr(worker, "_ftkit")
    assert worker.execute_model.__func__ is NPUWorker.execute_model
    assert worker.sample_tokens.__func__ is NPUWorker.sample_tokens


def test_a_typo_in_the_settings_stops_the_worker_with_the_known_keys(registered):
    with pytest.raises(FtkitError, match="unknown key.*max_reinferences.*known keys"):
        make_worker({"fault_tolerance": {"enabled": True, "max_reinferences": 2}})


# --- vllm-ascend's strict additional_config ---------------------------------------------------

STANDIN_DIR = Path(__file__).resolve().parent / "standin"


@pytest.fixture
def vllm_ascend(monkeypatch):
    """The vllm-ascend stand-in (its strict ``init_ascend_config``), importable for this test,
    and a module that imported ``init_ascend_config`` by name before the plugin registered,
    as vllm-ascend's own modules do."""
    monkeypatch.syspath_prepend(str(STANDIN_DIR))
    module = importlib.import_module("vllm_ascend.ascend_config")
    early = types.ModuleType("early_importer")
    early.init_ascend_config = module.init_ascend_config
    monkeypatch.setitem(sys.modules, early.__name__, early)
    yield module, early
    for name in [n for n in sys.modules if n == "vllm_ascend" or n.startswith("vllm_ascend.")]:
        del sys.modules[name]


def test_vllm_ascend_validates_everything_but_ftkits_key(vllm_ascend, monkeypatch):
    module, early = vllm_ascend
    settings = {"weight_nz_mode": 0, "fault_tolerance": {"enabled": True}}
    config = VllmConfig(additional_config=dict(settings))
    with pytest.raises(ValueError, match="fault_tolerance: Extra inputs are not permitted"):
        module.init_ascend_config(config)  # what recent vllm-ascend does with ftkit's key

    monkeypatch.setattr(worker_base.WorkerBase, "__init__", worker_base.WorkerBase.__init__)
    plugin.register()
    for init_ascend_config in (module.init_ascend_config, early.init_ascend_config):
        assert init_ascend_config(config).weight_nz_mode == 0
        assert config.additional_config == settings  # ftkit's key is put back
    # vllm-ascend's own validation still rejects what it does not know.
    with pytest.raises(ValueError, match="weight_nz_modes: Extra inputs"):
        module.init_ascend_config(VllmConfig(additional_config={
            "weight_nz_modes": 0, "fault_tolerance": {"enabled": True}}))
    plugin.register()  # once more, as vLLM loads plugins in several places: wrapped once
    assert not getattr(module.init_ascend_config.__wrapped__, "__ftkit_wrapped__", False)
