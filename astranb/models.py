"""Model specs: tiny Qwen3-architecture models built locally, or Hugging Face models.

A spec is a recipe, not a model: the rollout engine and the trainer each build their own copy from
it, and both copies start from bit-identical weights. Four kinds:

    tiny()             a toy model over a character-level tokenizer (arithmetic strings)
    tiny_chat()        a small model over a real byte-level BPE with a chat template and tools
    local(path)        a directory written by save_pretrained, read offline
    hf(name)           any causal LM of the Hugging Face hub, read through the local HF cache

Only `hf` with a hub name ever reaches the network, and only when the cache lacks the files and
HF_HUB_OFFLINE is not set.

    >>> spec = tiny()
    >>> tok = spec.tokenizer()
    >>> tok.decode(tok.encode("3+4="))
    '3+4='
"""

from __future__ import annotations

import functools
import json
import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelSpec", "tiny", "tiny_chat", "tiny_parameters", "local", "hf", "resolve",
           "dtype_for"]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TINY_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=()<>.,:;?!'\"#_\n"
TINY_CHAT_ASSETS = Path(__file__).resolve().parent / "assets" / "tiny_chat"
KINDS = ("tiny", "tiny_chat", "local", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """How to build a policy's model and tokenizer.

    Use `tiny()`, `tiny_chat()`, `local(path)` or `hf(name)` rather than building one by hand.
    """

    name: str
    """Display name."""
    path: str | None = None
    """Local Hugging Face model directory (kind "local"), else None."""
    config: dict[str, Any] = field(default_factory=dict)
    """Qwen3 config overrides of a tiny model."""
    seed: int = 0
    """Initialisation seed of a tiny model (both copies use it, so they start identical)."""
    kind: str = ""
    """"tiny", "tiny_chat", "local" or "hf"; left empty, "local" when `path` is set, else "tiny"."""
    repo: str | None = None
    """Hub model name such as "Qwen/Qwen3-0.6B" (kind "hf"), else None."""
    revision: str | None = None
    """Branch, tag or commit of `repo`; None for the default branch."""
    dtype: str | None = None
    """Torch dtype name the model runs in ("bfloat16", ...); None lets `dtype_for` choose."""

    def __post_init__(self) -> None:
        kind = self.kind or ("local" if self.path is not None else "tiny")
        object.__setattr__(self, "kind", kind)
        if kind not in KINDS:
            raise ValueError(f"model kind {kind!r} is unknown; use one of {KINDS}")
        if (kind == "local") != (self.path is not None):
            raise ValueError(f"a {kind!r} model spec {'needs' if kind == 'local' else 'takes no'} "
                             "path; build specs with astranb.models.local(path) or tiny()")
        if (kind == "hf") != (self.repo is not None) or (self.revision and kind != "hf"):
            raise ValueError(f"only an 'hf' model spec names a hub repo and revision (this one is "
                             f"{kind!r}); build it with astranb.models.hf(name)")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The spec's dtype as a torch.dtype (None: the device decides, see `dtype_for`)."""
        return None if self.dtype is None else DTYPES[self.dtype]

    def tokenizer(self) -> Any:
        """Build (tiny) or load (tiny_chat, local: offline; hf: through the cache) the
        tokenizer."""
        from transformers import AutoTokenizer

        if self.kind == "tiny":
            return _tiny_tokenizer()
        if self.kind == "hf":
            return _from_hub(AutoTokenizer.from_pretrained, self.repo, self.revision)
        directory = TINY_CHAT_ASSETS if self.kind == "tiny_chat" else self.path
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)

    def build(self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        """Build a fresh model copy in eval mode, in `dtype` (default: the spec's dtype, else
        float32)."""
        dtype = dtype or self.torch_dtype or torch.float32
        model: Any  # a transformers PreTrainedModel (its stubs reject `.to(device)`)
        if self.kind in ("tiny", "tiny_chat"):
            model = _tiny_model(self.kind, self.config, self.seed, dtype)
        else:
            from transformers import AutoModelForCausalLM

            if self.kind == "hf":
                model = _from_hub(AutoModelForCausalLM.from_pretrained, self.repo, self.revision,
                                  dtype=dtype)
            else:
                assert self.path is not None  # __post_init__ checks it
                model = AutoModelForCausalLM.from_pretrained(
                    self.path, local_files_only=True, dtype=dtype
                )
        return model.to(device).eval()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write model and tokenizer as a Hugging Face directory (loadable with `local`)."""
        directory = Path(directory)
        self.build().save_pretrained(directory)
        self.tokenizer().save_pretrained(directory)
        return directory


def dtype_for(device: str | torch.device, spec: ModelSpec | None = None) -> torch.dtype:
    """The dtype engines and trainers run in on `device`: the spec's own dtype when it sets one,
    else float32 on CPU (bf16 matmuls are slow there and the tiny models are small) and bf16 on
    accelerators."""
    if spec is not None and spec.torch_dtype is not None:
        return spec.torch_dtype
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


# -- the specs ------------------------------------------------------------------------------------

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
    overrides = _overrides(hidden_size, num_layers, num_heads, config)
    return ModelSpec(name=f"tiny-qwen3-{hidden_size}x{num_layers}", config=overrides, seed=seed)


def tiny_chat(
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    **config: Any,
) -> ModelSpec:
    """A small Qwen3-architecture chat model (~0.65M parameters) over a byte-level BPE tokenizer
    of about 1,000 tokens, with a Qwen2.5-style chat template that lists tools and reads
    `<tool_call>` blocks (`astranb.chat.CHAT_TEMPLATE`, append-only).

    The tokenizer ships with astranb (trained by scripts/make_tiny_chat.py); the weights are
    initialised from `seed`, so every copy is bit-identical. Untrained, it writes junk.

    Args:
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads (key/value heads default to the same number).
        seed: initialisation seed.
        **config: any other `Qwen3Config` field.

    >>> spec = tiny_chat()
    >>> tok = spec.tokenizer()
    >>> tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    '<|im_start|>user\\n2+2?<|im_end|>\\n'
    """
    overrides = _overrides(hidden_size, num_layers, num_heads, config)
    return ModelSpec(name=f"tiny-chat-qwen3-{hidden_size}x{num_layers}", config=overrides,
                     seed=seed, kind="tiny_chat")


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


def hf(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
) -> ModelSpec:
    """Any Hugging Face causal LM and its tokenizer.

    An existing local directory is read offline (as `local`). Anything else is a hub name, read
    through the Hugging Face cache: the files are downloaded on first use when the machine is
    online, and only the cache is read when HF_HUB_OFFLINE is set. The config is fetched now, so
    a wrong name fails here rather than in a service.

    Args:
        name_or_path: a hub name such as "Qwen/Qwen3-0.6B", or a directory written by
            save_pretrained.
        revision: branch, tag or commit of a hub model (None: the default branch).
        dtype: torch dtype or its name ("bfloat16"); None or "auto" lets the device choose
            (float32 on CPU, bfloat16 on accelerators).

    Raises:
        FileNotFoundError: the model is not in the cache and the hub cannot be reached, or the
            hub has no such model or revision.
        ValueError: the name is neither a directory nor a hub name, or a revision was given
            for a directory.
    """
    dtype_name = None if dtype is None else _dtype_name(dtype)
    if Path(name_or_path).expanduser().is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub names only, and "
                             f"{str(name_or_path)!r} is a local directory; leave revision out")
        return replace(local(Path(name_or_path).expanduser()), dtype=dtype_name)
    repo = str(name_or_path)
    _check_repo_name(repo)
    _from_hub(_hub_config, repo, revision)
    name = repo if revision is None else f"{repo}@{revision}"
    return ModelSpec(name=name, kind="hf", repo=repo, revision=revision, dtype=dtype_name)


def resolve(model: ModelSpec | str | os.PathLike) -> ModelSpec:
    """Accept a spec or a local directory path."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        return local(model)
    raise TypeError(
        f"model must be astranb.models.tiny(), tiny_chat(), local(path), hf(name) or a path, "
        f"got {model!r}"
    )


def tiny_parameters(config: dict[str, Any], kind: str = "tiny") -> int:
    """Roughly how many parameters a tiny (or tiny_chat) spec with these overrides builds, without
    allocating it."""
    base = tiny_chat() if kind == "tiny_chat" else tiny()
    c = {**base.config, **config}
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    head_dim = int(c["head_dim"])
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * int(c["intermediate_size"])
    vocab = _tiny_chat_vocab()[0] if kind == "tiny_chat" else len(TINY_ALPHABET) + 3
    return layers * (attention + mlp) + vocab * hidden


def _overrides(hidden_size: int, num_layers: int, num_heads: int,
               config: dict[str, Any]) -> dict[str, Any]:
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}"
        )
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": config.pop("num_key_value_heads", num_heads),
        "head_dim": hidden_size // num_heads,
        "intermediate_size": config.pop("intermediate_size", 4 * hidden_size),
        **config,
    }


def _dtype_name(dtype: torch.dtype | str) -> str | None:
    """The canonical name of a dtype given as torch.dtype or string ("auto" is None)."""
    if dtype == "auto":
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one a model runs in; use torch.bfloat16, "
                         "torch.float16, torch.float32 (or their names), or None for the "
                         "device's choice")
    return str(DTYPES[name]).removeprefix("torch.")


# -- tiny models ----------------------------------------------------------------------------------

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


@functools.cache
def _tiny_chat_vocab() -> tuple[int, int, int]:
    """(vocab size, pad id, eos id) of the shipped tiny chat tokenizer, read from its files."""
    data = json.loads((TINY_CHAT_ASSETS / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    settings = json.loads((TINY_CHAT_ASSETS / "tokenizer_config.json").read_text("utf-8"))
    return max(ids.values()) + 1, ids[settings["pad_token"]], ids[settings["eos_token"]]


def _tiny_model(kind: str, overrides: dict[str, Any], seed: int, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # start from the spec function's sizes, not Qwen3's multi-billion-parameter defaults
    if kind == "tiny_chat":
        vocab_size, pad, eos = _tiny_chat_vocab()
        base = {"vocab_size": vocab_size, "max_position_embeddings": 1024,
                "pad_token_id": pad, "bos_token_id": pad, "eos_token_id": eos,
                **tiny_chat().config}
    else:
        base = {"vocab_size": len(TINY_ALPHABET) + 3, "max_position_embeddings": 512,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **tiny().config}
    config = Qwen3Config(tie_word_embeddings=True, **{**base, **overrides})
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen3ForCausalLM(config)  # transformers' stubs reject `.to(dtype)`
    return model.to(dtype)


# -- the hub --------------------------------------------------------------------------------------

def _offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read now rather than when
    huggingface_hub was imported."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _check_repo_name(repo: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise ValueError(
            f"{repo!r} is neither an existing directory nor a hub model name (such as "
            "'Qwen/Qwen3-0.6B'); check the path, or pass a directory written by save_pretrained"
        ) from None


def _hub_config(repo: str, **kwargs: Any) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo, "config.json", **kwargs)


def _from_hub(load: Callable[..., Any], repo: Any, revision: str | None, **kwargs: Any) -> Any:
    """`load(repo, ...)` through the cache (cache only when offline), hub errors made plain."""
    from huggingface_hub import errors

    offline = _offline()
    where = repr(repo) if revision is None else f"{repo!r} at revision {revision!r}"
    try:
        return load(repo, revision=revision, local_files_only=offline, **kwargs)
    except errors.LocalEntryNotFoundError:
        why = " (HF_HUB_OFFLINE is set)" if offline else ""
        message = (f"{where} is not in the Hugging Face cache and the hub cannot be reached"
                   f"{why}: run once online, or pass a local directory written by "
                   "save_pretrained")
    except errors.GatedRepoError:
        raise PermissionError(f"{repo!r} is gated on the Hugging Face hub: accept its terms on "
                              "the model page, then log in (`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        message = (f"the Hugging Face hub has no model {repo!r} (or it is private: log in with "
                   "`hf auth login` or set HF_TOKEN); check the name, or pass a local directory "
                   "written by save_pretrained")
    except errors.RevisionNotFoundError:
        message = f"{repo!r} has no revision {revision!r}; pass a branch, tag or commit it has"
    except errors.EntryNotFoundError:
        message = (f"{where} has no config.json, so it is not a transformers model; pick a "
                   "causal LM repository")
    except OSError as error:  # transformers' own wording for a file missing from the cache
        message = (f"could not load {where} from the Hugging Face cache ({error}); run once "
                   "online, or pass a local directory written by save_pretrained")
    raise FileNotFoundError(message)
