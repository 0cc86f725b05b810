"""The embedded models (the default tiny Llama with its tokenizer, and ``tiny-moe``, a tiny
Mixtral with the same tokenizer) and the wide benchmark model, all built locally."""

from ftkit.model.moe import TINY_MOE, build_tiny_moe_model
from ftkit.model.tiny import TINY, build_tiny_model, resolve_model
from ftkit.model.wide import build_wide_model

__all__ = ["TINY", "TINY_MOE", "build_tiny_model", "build_tiny_moe_model", "build_wide_model",
           "resolve_model"]
