"""The local trainer: one model copy in this process, trained one policy-gradient step at a time.

A step reads as five phases: split the batch into micro-batches, forward each to get the logprobs
of its target tokens, take the algorithm's token-mean loss (normalised by the whole batch's token
count, so micro-batches add up to one batch mean), backward, then clip and apply the optimizer.
The version goes up by one per step; `weights()` is what gets published to the rollout engines.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..algorithms import Algorithm, token_mean
from ..models import ModelSpec
from ..types import Batch

__all__ = ["AdamW", "LocalTrainer", "token_logprobs"]


@dataclass(frozen=True)
class AdamW:
    """Optimizer settings for a policy's trainer."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"AdamW lr must be a positive number, got {self.lr!r}; e.g. lr=1e-3")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")


def token_logprobs(model, batch: Batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each input token given the ones before it, and the entropy there.

    Returns (logp_B_T, entropy_B_T) aligned with input_ids (position 0 is 0: nothing predicts
    it). Logits are divided by each row's sampling temperature, as the engine sampled them.
    """
    ids = batch.input_ids_B_T[rows]
    mask = batch.attention_mask_B_T[rows]
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logits = logits / batch.temperature_B[rows].to(logits.device)[:, None, None]
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    target = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.nn.functional.pad
    return pad(target, (1, 0)), pad(entropy, (1, 0))


class LocalTrainer:
    """Trains one policy's model in this process.

    Args:
        spec: the model recipe (the same one the rollout engine was built from).
        algorithm: advantage and loss rule.
        optimizer: AdamW settings.
        micro_batch_size: rows per forward/backward (memory, not maths: the result is the same).
        device: torch device.
        dtype: parameter dtype (fp32 on CPU; bf16 on GPU).
    """

    def __init__(
        self,
        spec: ModelSpec,
        algorithm: Algorithm,
        optimizer: AdamW = AdamW(),
        *,
        micro_batch_size: int = 64,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.spec = spec
        self.algorithm = algorithm
        self.optimizer_config = optimizer
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.model = spec.build(dtype=dtype, device=self.device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optimizer.lr,
            betas=optimizer.betas,
            weight_decay=optimizer.weight_decay,
        )
        self.version = 0

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; returns loss and algorithm metrics. Version += 1."""
        batch = _to(batch, self.device)
        num_tokens = max(batch.num_tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for start in range(0, batch.size, self.micro_batch_size):
            rows = slice(start, start + self.micro_batch_size)
            loss, metrics = self._micro_step(batch, rows, num_tokens)
            weight = float(batch.loss_mask_B_T[rows].sum()) / num_tokens
            totals["loss"] = totals.get("loss", 0.0) + float(loss)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * weight
        totals["grad_norm"] = self._apply()
        totals["tokens"] = float(batch.num_tokens)
        self.version += 1
        return totals

    def _micro_step(self, batch: Batch, rows: slice, num_tokens: int):
        logp, entropy = token_logprobs(self.model, batch, rows)
        mask = batch.loss_mask_B_T[rows]
        loss, metrics = self.algorithm.loss(
            logp, batch.old_logp_B_T[rows], batch.advantages_B_T[rows], mask, num_tokens=num_tokens
        )
        mean_entropy = token_mean(entropy, mask, num_tokens)
        if self.algorithm.entropy_coef:
            loss = loss - self.algorithm.entropy_coef * mean_entropy
        # metrics are per-token means over this micro-batch; step() re-weights them by its tokens
        metrics["entropy"] = float(mean_entropy.detach()) * num_tokens / max(float(mask.sum()), 1.0)
        loss.backward()
        return loss.detach(), metrics

    def _apply(self) -> float:
        clip = self.optimizer_config.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        return float(norm)

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the current weights, named as in the model's state_dict."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, directory: str | Path) -> Path:
        """Write weights, optimizer state and version (safetensors + JSON; no pickle)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.weights(), directory / "model.safetensors")
        tensors, meta = _optimizer_tensors(self.optimizer)
        save_file(tensors, directory / "optimizer.safetensors")
        info = {"version": self.version, "optimizer": asdict(self.optimizer_config), **meta}
        (directory / "trainer.json").write_text(json.dumps(info, indent=1))
        return directory

    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote (same model spec)."""
        directory = Path(directory)
        info = json.loads((directory / "trainer.json").read_text())
        self.model.load_state_dict(load_file(directory / "model.safetensors"))
        _load_optimizer(self.optimizer, load_file(directory / "optimizer.safetensors"), info)
        self.version = int(info["version"])


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch(*(getattr(batch, f).to(device) for f in Batch.__dataclass_fields__))


def _optimizer_tensors(optimizer: torch.optim.Optimizer):
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors, {"param_groups": state["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict, info: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": info["param_groups"]})
