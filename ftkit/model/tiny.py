"""Build the embedded ``tiny`` model: a small Llama plus a byte-level BPE tokenizer.

Everything is derived from fixed seeds and a fixed corpus, so two builds write the same
bytes. The model lands in a content-addressed cache directory
(``<cache>/models/tiny-<digest>``) whose name is the digest of the build recipe; a build
that finds the directory complete does nothing.

The shape is the smallest that vLLM's CPU backend accepts at tensor parallel 1 and 2:
hidden 128, 2 layers, 4 heads of dimension 32, 4 KV heads (divisible by 2), a vocabulary
of about 512 tokens. Weights are drawn with std 0.2 so that greedy decoding does not
collapse into one repeated token.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftkit.errors import FtkitError

TINY = "tiny"

#: Bump when anything below changes what is written: it is part of the cache key.
RECIPE_VERSION = 2

#: The chat template of the tokenizer (vLLM's chat API needs one): each message as
#: ``role: content`` on a line of its own, then ``assistant:`` for the answer.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VOCAB_SIZE = 512
WEIGHT_STD = 0.2
WEIGHT_SEED = 1234

# A fixed corpus for the tokenizer: plain English words so prompts tokenize naturally.
_CORPUS_WORDS = (
    "the a an of to in and or is are was were be been it this that these those for on "
    "with as at by from up down out over under again further then once here there when "
    "where why how all any both each few more most other some such no nor not only own "
    "same so than too very can will just should now model token link fault rank device "
    "memory cluster inference recovery step flap break reset hang kill process request "
    "prompt output input tensor parallel engine worker batch cache block sample decode "
    "prefill scheduler network operator error retry stream verify scenario chaos test "
    "quick brown fox jumps lazy dog river mountain city ocean forest light dark night "
    "day sun moon star cloud rain snow wind fire water earth stone tree leaf flower bird "
    "fish horse cat mouse house door window road bridge train ship plane car book story "
    "music song voice word letter number one two three four five six seven eight nine ten"
).split()


def cache_root() -> Path:
    """Where ftkit caches models and fault-free results (``FTKIT_CACHE_DIR`` overrides)."""
    env = os.environ.get("FTKIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ftkit"


def recipe_digest() -> str:
    """Digest of everything that determines the model's bytes."""
    recipe = {
        "version": RECIPE_VERSION,
        "config": CONFIG,
        "vocab": VOCAB_SIZE,
        "std": WEIGHT_STD,
        "seed": WEIGHT_SEED,
        "corpus": _CORPUS_WORDS,
        "chat_template": CHAT_TEMPLATE,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _corpus() -> list[str]:
    lines = []
    words = _CORPUS_WORDS
    for i in range(400):
        # A deterministic walk through the words gives pairs for the BPE merges.
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)))
    return lines


def _build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2)
        + "\n"
    )
    return tok.get_vocab_size()


def _build_weights(out: Path, vocab: int, config: dict[str, Any] = CONFIG,
                   std: float = WEIGHT_STD) -> None:
    inter = config["intermediate_size"]

    def mlp(p: str, h: int, draw: Callable[..., Any]) -> dict[str, Any]:
        return {f"{p}.mlp.gate_proj.weight": draw(inter, h),
                f"{p}.mlp.up_proj.weight": draw(inter, h),
                f"{p}.mlp.down_proj.weight": draw(h, inter)}

    save_weights(out, vocab, config, std, mlp)


def save_weights(out: Path, vocab: int, config: dict[str, Any], std: float,
                 mlp: Callable[[str, int, Callable[..., Any]], dict[str, Any]]) -> None:
    """Write a decoder's random weights (from ``WEIGHT_SEED``): embeddings, each layer's norms
    and attention, then ``mlp(layer_prefix, hidden, draw)``'s tensors for that layer (drawn in
    that order), the final norm and the head."""
    import torch
    from safetensors.torch import save_file

    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    hd = config["head_dim"]
    gen = torch.Generator().manual_seed(WEIGHT_SEED)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    tensors = {"model.embed_tokens.weight": draw(vocab, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = draw(heads * hd, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = draw(kv_heads * hd, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = draw(kv_heads * hd, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = draw(h, heads * hd)
        tensors.update(mlp(p, h, draw))
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = draw(vocab, h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_model(out: Path, config: dict[str, Any] = CONFIG, std: float = WEIGHT_STD) -> None:
    vocab = _build_tokenizer(out)
    written = dict(config, vocab_size=vocab)
    (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n"
    )
    _build_weights(out, vocab, config, std)


_COMPLETE_MARK = ".ftkit-complete"


def build_tiny_model(out: str | Path | None = None) -> Path:
    """Build the tiny model and return its directory.

    Without ``out`` the model goes to the content-addressed cache and is built only once.
    With ``out`` it is written there (the directory is created; existing files replaced).
    The write is atomic: a partially written model is never seen under the final name.
    """
    return build_cached("tiny", recipe_digest(), _write_model, out)


def build_cached(name: str, digest: str, write: Callable[[Path], None],
                 out: str | Path | None = None) -> Path:
    """Build a model with ``write`` into ``out`` or, without it, into the content-addressed
    cache directory ``<cache>/models/<name>-<digest>`` (once); atomic either way."""
    target = Path(out) if out is not None else cache_root() / "models" / f"{name}-{digest}"
    if (target / _COMPLETE_MARK).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=target.parent))
    try:
        write(staging)
        (staging / _COMPLETE_MARK).write_text(digest + "\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first: its bytes are identical.
            if not (target / _COMPLETE_MARK).exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(spec: str) -> Path:
    """Turn a scenario's ``engine.model`` into a local directory vLLM can load: an embedded
    model's name (``tiny``, ``tiny-moe``: built once, then cached) or a model directory."""
    if spec == TINY:
        return build_tiny_model()
    from ftkit.model.moe import TINY_MOE, build_tiny_moe_model

    if spec == TINY_MOE:
        return build_tiny_moe_model()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FtkitError(f"model path {spec!r} is not a directory")
    if not (path / "config.json").is_file():
        raise FtkitError(f"model path {spec!r} has no config.json")
    return path
