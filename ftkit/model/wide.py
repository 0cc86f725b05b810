"""Build the ``wide`` benchmark model: the layer widths of a 7B-class Llama, two layers.

Hidden 4096, intermediate 11008, 32 heads of dimension 128 (32 KV heads), as Llama-2-7B,
but two layers instead of 32 and the tiny model's tokenizer (about 512 tokens): about 0.4 G
parameters, 1.6 GB in float32. A step of it takes tens of milliseconds or more on a CPU, so
that a fixed per-step cost of microseconds is a share the end-to-end tokens per second can
resolve (the overhead benchmark's ``wide`` part). Not a model of language: weights are drawn
from a fixed seed, scaled so that activations keep the tiny model's range.

Built locally and cached like the tiny model (``<cache>/models/wide-<digest>``); only the
benchmarks build it, never the test suite.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import partial
from pathlib import Path

from ftkit.model.tiny import CONFIG as TINY_CONFIG
from ftkit.model.tiny import WEIGHT_SEED, WEIGHT_STD, _write_model, build_cached
from ftkit.model.tiny import recipe_digest as tiny_digest

#: Bump when anything below changes what is written: it is part of the cache key.
RECIPE_VERSION = 1

CONFIG = dict(TINY_CONFIG, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
              num_attention_heads=32, num_key_value_heads=32, head_dim=128)
#: The tiny model's gain per layer (std * sqrt(hidden)) at this width.
WEIGHT_STD_WIDE = WEIGHT_STD * math.sqrt(TINY_CONFIG["hidden_size"] / CONFIG["hidden_size"])


def recipe_digest() -> str:
    recipe = {"version": RECIPE_VERSION, "config": CONFIG, "std": WEIGHT_STD_WIDE,
              "seed": WEIGHT_SEED, "tokenizer": tiny_digest()}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def build_wide_model(out: str | Path | None = None) -> Path:
    """Build the wide model (once, into the cache, without ``out``) and return its directory."""
    return build_cached("wide", recipe_digest(),
                        partial(_write_model, config=CONFIG, std=WEIGHT_STD_WIDE), out)
