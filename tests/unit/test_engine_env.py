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
