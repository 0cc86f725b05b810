"""The embedded default model: a tiny Llama and tokenizer built locally."""

from ftkit.model.tiny import TINY, build_tiny_model, resolve_model

__all__ = ["TINY", "build_tiny_model", "resolve_model"]
