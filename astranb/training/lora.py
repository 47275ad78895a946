"""LoRA adapters through PEFT: the trainer trains only the adapters, the engines get merged weights.

With `session.policy(..., lora=ab.LoRA(rank=8))` the trainer wraps its model in PEFT's
`get_peft_model`: the base weights are frozen, and each targeted linear layer gains two small
matrices (A: rank x in, B: out x rank; B starts at zero, so version 0 is the base model). The
adapter maths is PEFT's own; this module only maps between PEFT's names and the model's:

    trainer (fp32)                               engines and the weight store
    q_proj.base_layer.weight  W0  (frozen)       q_proj.weight = W0 + layer.get_delta_weight()
    q_proj.lora_A.default     A   (trained)        (PEFT's delta: B @ A * alpha / rank)
    q_proj.lora_B.default     B   (trained)      every other weight as in the base model,
    norm.modules_to_save.default.weight          but norm.weight: the trained copy of a module
                              (trained)            in `modules_to_save`

`merged_weights` is what gets published: the base model's names and shapes, so every engine (hf,
SGLang, a rollout service) takes a LoRA policy's versions unchanged, as full snapshots or bf16
deltas. `adapter_weights` is what a checkpoint holds and what `policy.save_pretrained` writes: a
folder `peft.PeftModel.from_pretrained(base, folder)` loads.

peft is imported when a LoRA is asked for (`pip install "astranb[lora]"`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

__all__ = ["LoRA", "lora_to_dict", "lora_from_dict", "wrap", "merged_weights",
           "adapter_weights", "load_adapter_weights", "save_adapter", "adapter_to_bytes",
           "write_adapter"]


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on a policy's linear layers (Hu et al. 2021), trained in place of the
    full weights.

    Example:
        session.policy("solver", model=ab.models.tiny(), lora=ab.LoRA(rank=8, alpha=16))
    """

    rank: int = 8
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds B @ A * alpha / rank to each targeted weight."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """Module names to adapt (PEFT's `target_modules`: names like ("q_proj", "v_proj"), or
    "all-linear": every linear layer but the output head)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the trainer's logprobs equal to
    what the engine sampled with)."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters (PEFT's `modules_to_save`; a name matches
    every module whose path ends with it): ("norm",) trains every RMSNorm's weight, a few
    hundred numbers that set the scale of the hidden states, which a model trained from random
    weights needs to make any answer likely (bench/lora.py). They travel and are checkpointed
    with the adapters."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}; e.g. rank=8")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or \
                not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be a number > 0, got {self.alpha!r}; e.g. alpha=16 "
                             "(the adapter is scaled by alpha / rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, list):
            object.__setattr__(self, "target_modules", tuple(targets))
            targets = self.target_modules
        if not (isinstance(targets, str) or (isinstance(targets, tuple) and targets
                                             and all(isinstance(t, str) for t in targets))):
            raise ValueError(f"LoRA target_modules must be 'all-linear' or module names like "
                             f"('q_proj', 'v_proj'), got {targets!r}")
        saved = self.modules_to_save
        if isinstance(saved, str) or not all(isinstance(m, str) and m for m in saved):
            raise ValueError(f"LoRA modules_to_save must be a tuple of module names such as "
                             f"('norm',), got {saved!r}")
        object.__setattr__(self, "modules_to_save", tuple(saved))


def lora_to_dict(lora: LoRA) -> dict[str, Any]:
    """Plain values (a run's plan, a trainer child's header, a checkpoint)."""
    data = dataclasses.asdict(lora)
    if isinstance(lora.target_modules, tuple):
        data["target_modules"] = list(lora.target_modules)
    data["modules_to_save"] = list(lora.modules_to_save)
    if not lora.modules_to_save:  # as before: plans and checkpoints of older runs read alike
        del data["modules_to_save"]
    return data


def lora_from_dict(data: dict[str, Any]) -> LoRA:
    """Inverse of `lora_to_dict`."""
    targets = data.get("target_modules", "all-linear")
    return LoRA(int(data["rank"]), float(data["alpha"]),
                targets if isinstance(targets, str) else tuple(targets),
                float(data.get("dropout", 0.0)), tuple(data.get("modules_to_save") or ()))


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is in the test extra
        raise ImportError("ab.LoRA trains adapters through PEFT, which is not installed: "
                          'pip install "astranb[lora]" (or pip install peft)') from exc
    return peft


def wrap(model: torch.nn.Module, lora: LoRA, seed: int = 0) -> Any:
    """`model` wrapped by PEFT with `lora`'s adapters (base weights frozen, adapters trainable).

    The adapters' random start (PEFT draws A, B is zero) comes from `seed`, not from torch's
    global generator: a trainer in a child process starts from the same adapters as one here.

    Raises:
        ValueError: no module of the model matches `lora.target_modules` (the message lists the
            model's linear layers to choose from).
    """
    peft = _peft()
    targets = lora.target_modules
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets if isinstance(targets, str) else list(targets),
                             modules_to_save=list(lora.modules_to_save) or None, bias="none")
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            # PEFT 0.21 asks transformers 5 for a deprecated alias
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                    category=FutureWarning)
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"LoRA target_modules={targets!r} matches no layer of this model "
                         f"({exc}); its linear layers are named {linear}") from exc


def _adapted(model: Any) -> dict[str, Any]:
    """The model's adapted layers by their module path in the base model."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.get_base_model().named_modules()
            if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights the base model would have with the adapters merged, by the base model's
    names: detached CPU copies (the model is not changed; PEFT's `get_delta_weight` gives each
    adapter's contribution)."""
    layers = _adapted(model)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            continue  # a module trained in full: its trained copy below gives the weight
        if ".modules_to_save.default." in name:
            merged[name.replace(".modules_to_save.default.", ".")] = tensor.detach().to(
                "cpu", copy=True)
            continue
        module, _, leaf = name.rpartition(".")
        if module.endswith(".base_layer") and module.removesuffix(".base_layer") in layers:
            path = module.removesuffix(".base_layer")
            if leaf == "weight":
                tensor = tensor + layers[path].get_delta_weight("default").to(tensor.dtype)
            name = f"{path}.{leaf}"
        merged[name] = tensor.detach().to("cpu", copy=True)
    return merged


def adapter_weights(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors as PEFT saves them (detached CPU copies)."""
    state = _peft().get_peft_model_state_dict(model)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def load_adapter_weights(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapters to what `adapter_weights` returned (every adapter tensor must be there).

    Raises:
        ValueError: names missing or extra (a checkpoint of another LoRA configuration).
    """
    expected = set(adapter_weights(model))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"adapter checkpoint does not match this policy's LoRA: missing "
                         f"{missing[:3]}, unexpected {extra[:3]} (was it saved with another "
                         "rank or target_modules?)")
    result = _peft().set_peft_model_state_dict(model, tensors)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter tensors PEFT did not take: {unexpected[:3]}")


def save_adapter(model: Any, directory: str | os.PathLike[str]) -> Path:
    """PEFT's own folder (adapter_config.json + adapter_model.safetensors)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


CONFIG_KEY = "adapter_config"  # the safetensors metadata entry holding adapter_config.json


def adapter_to_bytes(model: Any) -> bytes:
    """PEFT's folder as one safetensors payload: adapter_model.safetensors's tensors, with
    adapter_config.json's text in its metadata (what a trainer service sends; `write_adapter`
    writes the folder back)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_adapter(model, tmp)
        config = (folder / "adapter_config.json").read_text()
        tensors = load_file(folder / "adapter_model.safetensors")
    return save(tensors, metadata={"format": "pt", CONFIG_KEY: config})


def write_adapter(payload: bytes, directory: str | os.PathLike[str]) -> Path:
    """Write what `adapter_to_bytes` made as PEFT's folder (adapter_config.json +
    adapter_model.safetensors).

    Raises:
        ValueError: the payload is not a safetensors file with an adapter config.
    """
    size = int.from_bytes(payload[:8], "little")
    try:
        header = json.loads(payload[8:8 + size])
        config = header["__metadata__"][CONFIG_KEY]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError("the adapter payload is not a safetensors file carrying "
                         f"{CONFIG_KEY!r} in its metadata") from exc
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(payload)
    (directory / "adapter_config.json").write_text(config)
    return directory
