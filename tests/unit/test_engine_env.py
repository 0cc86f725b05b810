"""An in-process engine keeps the environment it started with while it lives.

vLLM's CPU attention reads ``VLLM_CPU_ATTN_SPLIT_KV`` at every step. ``engine_environment``
sets it for an engine's start and restores the environment afterwards, and clears vLLM's cache
of the environment for the engine it starts: an in-process engine that lived on beside a later
engine then divided its decode rows again, and its logprobs drifted in the last bits after a
recovery (seen in ``tests/vllm/test_recovery_tp1.py``). No engine is started here: the
environment of a second engine's start is enough.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from vllm import envs  # noqa: E402

from ftkit.vllm.environment import engine_environment, hold_engine_env  # noqa: E402


@pytest.fixture
def plain_environment(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_ATTN_SPLIT_KV", raising=False)
    yield
    envs.disable_envs_cache()


def test_an_in_process_engine_keeps_its_settings_when_another_engine_starts(plain_environment):
    with engine_environment(1, False):
        assert envs.VLLM_CPU_ATTN_SPLIT_KV is False  # what the in-process engine starts with
    release = hold_engine_env()
    try:
        with engine_environment(2, True):
            pass  # a multi-process engine starts beside it
        assert envs.VLLM_CPU_ATTN_SPLIT_KV is False
    finally:
        release()
    assert "VLLM_CPU_ATTN_SPLIT_KV" not in os.environ  # put back once it is closed


def test_without_holding_them_the_in_process_engine_loses_them(plain_environment):
    """The crippled variant: the environment of the first start is gone after the second."""
    with engine_environment(1, False):
        assert envs.VLLM_CPU_ATTN_SPLIT_KV is False
    with engine_environment(2, True):
        pass
    assert envs.VLLM_CPU_ATTN_SPLIT_KV is True


# --- vLLM's compiled helpers, uncompiled on the CPU build ------------------------------------

@pytest.fixture
def compile_unset(monkeypatch, plain_environment):
    import torch._dynamo

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):  # its own undo (monkeypatch's deletes it)
        yield


def test_a_cpu_engine_runs_vllms_compiled_helpers_uncompiled(compile_unset):
    """Its spawned processes read ``TORCH_COMPILE_DISABLE`` at torch's import; an in-process
    engine runs in this process, whose torch read it long ago: its switch is held too, while
    the engine starts and while it lives, and put back afterwards."""
    import torch._dynamo

    from ftkit.vllm.environment import effective_engine_env, engine_env, engine_env_key

    assert engine_env("cpu")["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in engine_env("cuda")
    assert "TORCH_COMPILE_DISABLE" not in engine_env("npu")
    assert effective_engine_env()["TORCH_COMPILE_DISABLE"] == "1"  # this is the CPU build
    # A fault-free run's cache key says whether its engine compiled them.
    assert engine_env_key()["TORCH_COMPILE_DISABLE"] == "1"
    with engine_environment(1, False):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"
        assert torch._dynamo.config.disable is True
    assert torch._dynamo.config.disable is False and "TORCH_COMPILE_DISABLE" not in os.environ
    release = hold_engine_env()
    try:
        assert torch._dynamo.config.disable is True
    finally:
        release()
    assert torch._dynamo.config.disable is False and "TORCH_COMPILE_DISABLE" not in os.environ


def test_a_compile_setting_in_the_environment_wins(compile_unset, monkeypatch):
    import torch._dynamo

    from ftkit.vllm.environment import engine_env_key

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert engine_env_key()["TORCH_COMPILE_DISABLE"] == "0"
    with engine_environment(1, False):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "0"
        assert torch._dynamo.config.disable is False
