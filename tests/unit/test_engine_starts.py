"""The engine-start count (``ftkit.vllm.plugin.ENGINE_STARTS_FILE_ENV``): one line per engine,
from its rank 0 worker, only where the variable names a file."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ftkit.config import CONFIG_KEY
from ftkit.vllm import plugin


def config(tp: int, pp: int = 1, recovery: bool = False) -> SimpleNamespace:
    extra = {CONFIG_KEY: {"enabled": True}} if recovery else {}
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        additional_config=extra)


def test_rank_0_of_each_engine_notes_its_start(tmp_path, monkeypatch):
    path = tmp_path / "starts.jsonl"
    monkeypatch.setenv(plugin.ENGINE_STARTS_FILE_ENV, str(path))
    for rank in (0, 1):  # one engine of two ranks
        plugin._note_engine_start(SimpleNamespace(rank=rank), config(2, recovery=True))
    plugin._note_engine_start(SimpleNamespace(rank=0), config(1))  # a plain engine
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(s["tensor_parallel_size"], s["pipeline_parallel_size"], s["recovery"])
            for s in lines] == [(2, 1, True), (1, 1, False)]


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(plugin.ENGINE_STARTS_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    plugin._note_engine_start(SimpleNamespace(rank=0), config(1))
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_cannot_be_written_does_not_stop_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.ENGINE_STARTS_FILE_ENV, str(tmp_path / "missing" / "starts"))
    plugin._note_engine_start(SimpleNamespace(rank=0), config(1))  # no exception
