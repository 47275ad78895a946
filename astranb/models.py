"""Model specs: a tiny Qwen3-architecture model built locally, or a local Hugging Face directory.

A spec is a recipe, not a model: the rollout engine and the trainer each build their own copy from
it, and both copies start from bit-identical weights. Nothing here reaches a model hub.

    >>> spec = tiny()
    >>> tok = spec.tokenizer()
    >>> tok.decode(tok.encode("3+4="))
    '3+4='
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelSpec", "tiny", "tiny_parameters", "local", "resolve"]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TINY_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=()<>.,:;?!'\"#_\n"


@dataclass(frozen=True)
class ModelSpec:
    """How to build a policy's model and tokenizer.

    Use `tiny()` for a locally initialised toy model or `local(path)` for a Hugging Face directory.
    """

    name: str
    """Display name."""
    path: str | None = None
    """Local Hugging Face model directory, or None for a freshly initialised tiny model."""
    config: dict[str, Any] = field(default_factory=dict)
    """Qwen3 config overrides for a tiny model."""
    seed: int = 0
    """Initialisation seed for a tiny model (both copies use it, so they start identical)."""

    def tokenizer(self):
        """Build (tiny) or load (local, offline) the tokenizer."""
        if self.path is None:
            return _tiny_tokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def build(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """Build a fresh model copy in eval mode."""
        model: Any  # a transformers PreTrainedModel (its stubs reject `.to(device)`)
        if self.path is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                self.path, local_files_only=True, dtype=dtype
            )
        else:
            model = _tiny_model(self.config, self.seed, dtype)
        return model.to(device).eval()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write model and tokenizer as a Hugging Face directory (loadable with `local`)."""
        directory = Path(directory)
        self.build().save_pretrained(directory)
        self.tokenizer().save_pretrained(directory)
        return directory


def dtype_for(device: str | torch.device) -> torch.dtype:
    """The dtype engines and trainers run in on `device`: float32 on CPU (bf16 matmuls are slow
    there and the tiny models are small), bf16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def tiny(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    **config: Any,
) -> ModelSpec:
    """A small Qwen3-architecture causal LM over a character-level tokenizer (~100K parameters).

    Args:
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads (key/value heads default to the same number).
        seed: initialisation seed.
        **config: any other `Qwen3Config` field.
    """
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}"
        )
    overrides = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": config.pop("num_key_value_heads", num_heads),
        "head_dim": hidden_size // num_heads,
        "intermediate_size": config.pop("intermediate_size", 4 * hidden_size),
        **config,
    }
    return ModelSpec(name=f"tiny-qwen3-{hidden_size}x{num_layers}", config=overrides, seed=seed)


def tiny_parameters(config: dict[str, Any]) -> int:
    """Roughly how many parameters a tiny spec with these overrides builds (no allocation)."""
    c = {**tiny().config, **config}
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    head_dim = int(c["head_dim"])
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * int(c["intermediate_size"])
    return layers * (attention + mlp) + (len(TINY_ALPHABET) + 3) * hidden


def local(path: str | os.PathLike) -> ModelSpec:
    """A local Hugging Face model directory, read offline.

    The directory holds config.json, the weights and the tokenizer files.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face model directory (no config.json). "
            "Pass a folder written by save_pretrained(), or use astranb.models.tiny()."
        )
    return ModelSpec(name=path.name, path=str(path))


def resolve(model: ModelSpec | str | os.PathLike) -> ModelSpec:
    """Accept a spec or a local directory path."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        return local(model)
    raise TypeError(
        f"model must be astranb.models.tiny(), astranb.models.local(path) or a path, got {model!r}"
    )


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *TINY_ALPHABET])}
    # BPE without merges is a character-level model; Fuse joins characters back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS
    )


def _tiny_model(overrides: dict[str, Any], seed: int, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # start from tiny()'s sizes, not Qwen3's multi-billion-parameter defaults, whatever is missing
    overrides = {**tiny().config, **overrides}

    vocab_size = len(TINY_ALPHABET) + 3
    config = Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen3ForCausalLM(config)  # transformers' stubs reject `.to(dtype)`
    return model.to(dtype)
