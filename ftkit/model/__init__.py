"""The embedded default model (a tiny Llama and tokenizer) and the wide benchmark model,
both built locally."""

from ftkit.model.tiny import TINY, build_tiny_model, resolve_model
from ftkit.model.wide import build_wide_model

__all__ = ["TINY", "build_tiny_model", "build_wide_model", "resolve_model"]
