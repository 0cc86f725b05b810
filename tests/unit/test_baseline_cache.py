"""The fault-free baseline's cache keeps everything the oracle compares, and drops entries
that lack it."""

from __future__ import annotations

import json
import math

import pytest

from ftkit.results import RequestOutput, RunOutput
from ftkit.runner import baseline as cache


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_CACHE_DIR", str(tmp_path))


def completion(sample: int) -> RequestOutput:
    return RequestOutput(index=1, sample=sample, token_ids=[5, 6], token_times=[0.1, 0.2],
                         finish_reason="stop", stop_reason="river",
                         logprobs=[-0.1234567890123, -math.inf],
                         top_logprobs=[[[5, -0.1234567890123], [9, -3.5]],
                                       [[6, -math.inf], [9, -0.0]]],
                         prompt_logprobs=[None, [[2, -1.0000000000000002]]],
                         text="the river")


def test_an_entry_keeps_every_compared_field_bit_for_bit():
    stored = RunOutput(requests=[completion(0), completion(1)], generate_s=1.5)
    cache.store("k", stored)
    loaded = cache.load("k")
    assert loaded is not None and loaded.from_cache
    assert loaded.requests == stored.requests
    assert [r.key for r in loaded.requests] == [(1, 0), (1, 1)]
    assert math.copysign(1.0, loaded.requests[0].top_logprobs[1][1][1]) == -1.0


def test_an_entry_of_an_older_format_is_dropped():
    path = cache.cache_path("old")
    path.parent.mkdir(parents=True)
    # An entry of the previous format: its requests carry token ids only.
    path.write_text(json.dumps({"v": 1, "requests": [{"index": 0, "token_ids": [1, 2]}]}))
    assert cache.load("old") is None
    assert not path.exists()


def test_the_key_names_the_cache_version(monkeypatch):
    from ftkit.scenario.model import Scenario

    scenario = Scenario.model_validate({"name": "s", "workload": {"prompts": ["a"]},
                                        "faults": []})
    current = cache.baseline_key(scenario, "unused-for-tiny")
    monkeypatch.setattr(cache, "BASELINE_CACHE_VERSION", 2)
    assert cache.baseline_key(scenario, "unused-for-tiny") != current
