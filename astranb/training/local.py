"""The local trainer: one model copy in this process, trained one policy-gradient step at a time.

A step reads as five phases: split the batch into micro-batches, forward each to get the logprobs
of its target tokens, take the algorithm's token-mean loss (normalised by the whole batch's token
count, so micro-batches add up to one batch mean), backward, then clip and apply the optimizer.
The version goes up by one per step; `weights()` is what gets published to the rollout engines.

The phases are module functions (`micro_batches`, `backward_micro_batches`, `clip_and_step`), as
is the optimizer's checkpoint format, so that the FSDP backend (training/fsdp.py) runs the very
same maths on each rank's share of the rows and writes checkpoints this trainer can load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..algorithms import Algorithm, token_mean
from ..algorithms.corrections import kl_loss_term
from ..contracts import Checkpointable, RecordingTrainer, SupervisedTrainer, Trainer
from ..engines import FastLM, top_p_filter
from ..models import ModelSpec
from ..types import Batch
from . import lora as adapters
from .lora import LoRA
from .reference import Reference
from .trace import StepRecorder, StepRecording

__all__ = [
    "AdamWConfig",
    "LocalTrainer",
    "token_logprobs",
    "logp_gap",
    "MAX_METRICS",
    "micro_batches",
    "backward_micro_batches",
    "clip_and_step",
    "optimizer_state_to_tensors",
    "optimizer_state_from_tensors",
]


@dataclass(frozen=True)
class AdamWConfig:
    """Optimizer settings for a policy's trainer (AdamW). Named so it never shadows
    `torch.optim.AdamW`, the optimizer it configures."""

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
            raise ValueError(f"AdamWConfig lr must be a positive number, got {self.lr!r}; "
                             "e.g. lr=1e-3")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")



def token_logprobs(model, batch: Batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each input token given the ones before it, and the entropy there.

    Returns (logp_B_T, entropy_B_T) aligned with input_ids (position 0 is 0: nothing predicts
    it). The distribution is the one the engine sampled from: logits divided by each row's
    temperature, then, for rows sampled with top_p < 1, cut to the same nucleus
    (`engines.top_p_filter`). A token outside the current nucleus (possible once the
    weights moved on) gets the floor logprob LOGP_FLOOR and no gradient, instead of -inf.

    Right-padded rows of a model `engines.FastLM` supports go through its lean forward
    (the same arithmetic; on a small model most of the model's own forward is Python).
    """
    ids = batch.input_ids_B_T[rows]
    mask = batch.attention_mask_B_T[rows]
    fast = FastLM.of(model)
    if fast is not None and bool((mask[:, 1:] <= mask[:, :-1]).all()):  # right padded
        logits = fast.logits(ids).float()[:, :-1]
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1]
    logits = logits / batch.temperature_B[rows].to(logits.device)[:, None, None]
    assert batch.top_p_B is not None  # Batch fills it in
    top_p_B = batch.top_p_B[rows].to(logits.device)
    if bool((top_p_B < 1).any()):
        logits = _nucleus(logits, top_p_B)
    logp_all = torch.log_softmax(logits, dim=-1)
    target = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).clamp(min=LOGP_FLOOR)
    entropy = -(logp_all.exp() * logp_all.clamp(min=LOGP_FLOOR)).sum(-1)
    pad = torch.nn.functional.pad
    return pad(target, (1, 0)), pad(entropy, (1, 0))


LOGP_FLOOR = -50.0
"""Logprob given to a trained token its row's nucleus no longer holds (probability ~2e-22)."""


def _nucleus(logits_B_T_V: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Logits with every token outside each position's top-p nucleus set to -inf (the mask is
    chosen without gradient; the kept logits stay differentiable)."""
    B, T, V = logits_B_T_V.shape
    with torch.no_grad():
        flat_N_V = logits_B_T_V.detach().reshape(B * T, V)
        kept_N_V = top_p_filter(flat_N_V, top_p_B.repeat_interleave(T)) > float("-inf")
    return logits_B_T_V.masked_fill(~kept_N_V.reshape(B, T, V), float("-inf"))


LOGITS_BUDGET = 1 << 24
"""Logit elements one forward/backward may hold when LocalTrainer chooses its micro-batches
(16M: 64 MB in fp32, a few times that with log-softmax and gradients)."""


def rows_per_pass(tokens: int, vocab_size: int, budget: int = LOGITS_BUDGET) -> int:
    """Rows of `tokens` tokens whose logits over `vocab_size` fit `budget` elements (at least 1)."""
    return max(1, budget // max(tokens * vocab_size, 1))


def micro_batches(start: int, stop: int, size: int) -> list[slice]:
    """Row slices of at most `size` rows covering [start, stop)."""
    return [slice(i, min(i + size, stop)) for i in range(start, stop, size)]


def step_advantages(algorithm: Algorithm, batch: Batch) -> Batch:
    """The batch with the advantages its whole step trains on (`Algorithm.batch_advantages`,
    e.g. REINFORCE++'s batch normalisation), taken before the batch is split into micro-batches."""
    adv_B_T = algorithm.batch_advantages(batch.advantages_B_T, batch.loss_mask_B_T)
    return batch if adv_B_T is batch.advantages_B_T else replace(batch, advantages_B_T=adv_B_T)


def backward_micro_batches(
    model, algorithm: Algorithm, batch: Batch, rows: list[slice], num_tokens: int,
    kl: KLTerm | None = None, recording: StepRecording | None = None,
) -> dict[str, float]:
    """Forward, loss and backward on each row slice; gradients add up in the model.

    Args:
        model: the policy's model, in train mode.
        algorithm: gives the token loss.
        batch: the step's batch.
        rows: the row slices to run, one forward/backward each.
        num_tokens: denominator of every token mean: the whole step's token count, so that
            micro-batches (and data-parallel ranks) add up to one token mean over the step.
        kl: KL to a reference policy added to the loss (None: none).
        recording: what a step the inspector samples keeps of each slice (None: nothing).

    Returns:
        {"loss": summed loss, "entropy" and each algorithm metric: the sum of the slices' token
        means weighted by their share of `num_tokens`}. Summed over all the slices of a step,
        these are the step's metrics.
    """
    totals: dict[str, float] = {}
    for part in rows:
        loss, metrics = _micro_step(model, algorithm, batch, part, num_tokens, kl, recording)
        weight = float(batch.loss_mask_B_T[part].sum()) / num_tokens
        totals["loss"] = totals.get("loss", 0.0) + float(loss)
        for key, value in metrics.items():
            if key in MAX_METRICS:
                totals[key] = max(totals.get(key, 0.0), value)
            else:
                totals[key] = totals.get(key, 0.0) + value * weight
    return totals


MAX_METRICS = frozenset({"logp_gap_max"})
"""Step metrics that are a maximum over the step's tokens, not a token mean: micro-batches
(and data-parallel ranks) combine them with max instead of a weighted sum."""


def logp_gap(logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor,
             mask_B_T: torch.Tensor) -> tuple[float, float]:
    """Mean and max of |trainer logprob - engine logprob| over the trained tokens.

    The engine samples from bf16 copies of the trainer's weights (and its own kernels), so
    even at staleness 0 the two logprobs differ a little (~1e-3 on a tiny fp32 model); with
    staleness the policy's own drift adds to it. (0, 0) when no token is trained.
    """
    trained = mask_B_T > 0
    if not bool(trained.any()):
        return 0.0, 0.0
    gap = (logp_B_T.detach() - old_logp_B_T).abs()[trained]
    return float(gap.mean()), float(gap.max())


@dataclass(frozen=True)
class KLTerm:
    """KL(policy || reference) in a step's loss: the reference's logprob of every batch token,
    its weight and its estimator (see training/reference.py)."""

    ref_logp_B_T: torch.Tensor
    kl_coef: float
    estimator: str


def _micro_step(model, algorithm: Algorithm, batch: Batch, rows: slice, num_tokens: int,
                kl: KLTerm | None = None, recording: StepRecording | None = None):
    logp, entropy = token_logprobs(model, batch, rows)
    if recording is not None:
        recording.watch(logp)
    mask = batch.loss_mask_B_T[rows]
    loss, metrics = algorithm.loss(
        logp, batch.old_logp_B_T[rows], batch.advantages_B_T[rows], mask, num_tokens=num_tokens
    )
    mean_entropy = token_mean(entropy, mask, num_tokens)
    if algorithm.entropy_coef:
        loss = loss - algorithm.entropy_coef * mean_entropy
    if kl is not None:
        ref_B_T = kl.ref_logp_B_T[rows]
        term = kl_loss_term(logp, ref_B_T, mask, kl_coef=kl.kl_coef, estimator=kl.estimator,
                            num_tokens=num_tokens)
        loss = loss + term
        # the token mean of the estimate over this micro-batch (the caller re-weights it)
        metrics["kl"] = float(term.detach()) / kl.kl_coef * num_tokens / max(
            float(mask.sum()), 1.0)
    # metrics are per-token means over this micro-batch; the caller re-weights them by its tokens
    metrics["entropy"] = float(mean_entropy.detach()) * num_tokens / max(float(mask.sum()), 1.0)
    metrics["logp_gap_mean"], metrics["logp_gap_max"] = logp_gap(
        logp, batch.old_logp_B_T[rows], mask)
    loss.backward()
    if recording is not None:
        recording.micro_batch(algorithm, batch, rows, logp)
    return loss.detach(), metrics


def clip_and_step(model, optimizer: torch.optim.Optimizer, config: AdamWConfig) -> float:
    """Clip the global gradient norm to config.grad_clip (0: no clipping), step, return the norm."""
    clip = config.grad_clip
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    # with sharded (DTensor) parameters the norm is a replicated DTensor: take it whole
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    return float(norm)


class LocalTrainer(StepRecorder, Trainer, Checkpointable, SupervisedTrainer, RecordingTrainer):
    """Trains one policy's model in this process.

    Args:
        spec: the model recipe (the same one the rollout engine was built from).
        algorithm: advantage and loss rule.
        optimizer: AdamW settings.
        micro_batch_size: rows per forward/backward (memory, not maths: the result is the same);
            None: as many rows as keep one pass's logits under `LOGITS_BUDGET` elements, so a
            small model trains a whole batch in one forward and one backward.
        device: torch device.
        dtype: parameter dtype (fp32 on CPU; bf16 on GPU).
        reference: a frozen policy that scores every batch: KL to it in the loss, or on-policy
            distillation from it (training/reference.py); None: none.
    """

    def __init__(
        self,
        spec: ModelSpec,
        algorithm: Algorithm,
        optimizer: AdamWConfig = AdamWConfig(),
        *,
        micro_batch_size: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        reference: Reference | None = None,
        lora: LoRA | None = None,
    ):
        self.spec = spec
        self.algorithm = algorithm
        self.optimizer_config = optimizer
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.model = spec.build(dtype=dtype, device=self.device).train()
        self.reference = reference
        self.reference_model = None if reference is None else self._frozen(reference, dtype)
        self.lora = lora
        if lora is not None:  # after the reference copied the base weights
            self.model = adapters.wrap(self.model, lora).train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optimizer.lr,
            betas=optimizer.betas,
            weight_decay=optimizer.weight_decay,
        )
        self.version = 0
        self.vocab_size = int(getattr(self.model.config, "vocab_size", 0) or 1)

    def _frozen(self, reference: Reference, dtype: torch.dtype):
        """The reference's model: its own spec built, or a copy of this model as built."""
        if reference.model is None:
            model = self.spec.build(dtype=dtype, device=self.device)
            model.load_state_dict(self.model.state_dict())
        else:
            model = reference.model.build(dtype=dtype, device=self.device)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        return model.eval()


    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; returns loss and algorithm metrics. Version += 1.
        After `record_next_step`, it also records what it trained (`take_recording`)."""
        if not self._record_next:
            return self._step(batch, None)[0]
        self._record_next = False
        metrics, batch = self._step(batch, recording := StepRecording())
        self._recording = recording.trace(self.algorithm, batch)
        return metrics

    def _step(self, batch: Batch, recording: StepRecording | None
              ) -> tuple[dict[str, float], Batch]:
        """A step is the two blocks a manual loop calls: forward_backward, then optim_step."""
        self.optimizer.zero_grad(set_to_none=True)
        totals, batch = self._forward_backward(batch, self.algorithm, recording)
        totals["grad_norm"] = self._optim_step(recording)
        totals["tokens"] = float(batch.num_tokens)
        return totals, batch

    def forward_backward(self, batch: Batch, algorithm: Algorithm | None = None
                         ) -> dict[str, float]:
        """The first half of a step: the loss of `batch` and its gradient, added to the
        gradients already there (several calls before one `optim_step` accumulate, each a
        token mean over its own batch). The weights do not change.

        Args:
            algorithm: the loss to take (default: the trainer's own).

        Returns:
            The loss and the algorithm's metrics, as `step` returns them (without grad_norm).
        """
        totals, batch = self._forward_backward(batch, algorithm or self.algorithm, None)
        totals["tokens"] = float(batch.num_tokens)
        return totals

    def optim_step(self) -> dict[str, float]:
        """The second half of a step: clip the gradients `forward_backward` left, apply AdamW,
        clear them. Version += 1.

        Raises:
            RuntimeError: there is no gradient (no `forward_backward` since the last step).
        """
        if not any(p.grad is not None for p in self.model.parameters()):
            raise RuntimeError("optim_step has no gradient to apply: call "
                               "forward_backward(batch) first")
        return {"grad_norm": self._optim_step(None)}

    def _forward_backward(self, batch: Batch, algorithm: Algorithm,
                          recording: StepRecording | None) -> tuple[dict[str, float], Batch]:
        batch = step_advantages(algorithm, _to(batch, self.device))
        num_tokens = max(batch.num_tokens, 1)
        batch, kl, scored = self._scored(batch)
        rows = micro_batches(0, batch.size, self._rows_per_pass(batch))
        totals = backward_micro_batches(self.model, algorithm, batch, rows, num_tokens, kl,
                                        recording)
        totals.update(scored)
        return totals, batch

    def _optim_step(self, recording: StepRecording | None) -> float:
        if recording is not None:
            recording.gradients(self.model)
        grad_norm = clip_and_step(self.model, self.optimizer, self.optimizer_config)
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return grad_norm

    def _scored(self, batch: Batch) -> tuple[Batch, KLTerm | None, dict[str, float]]:
        """The reference's part of a step: its logprobs of the batch's tokens, the distillation
        signal added to the advantages, the KL term for the loss, and their metrics."""
        reference, model = self.reference, self.reference_model
        if reference is None or model is None:
            return batch, None, {}
        with torch.no_grad():
            ref_B_T = torch.cat([token_logprobs(model, batch, rows)[0] for rows in
                                 micro_batches(0, batch.size, self._rows_per_pass(batch))])
        mask_B_T = batch.loss_mask_B_T
        gap_B_T = (ref_B_T - batch.old_logp_B_T) * mask_B_T  # minus the reverse KL per token
        metrics = {"reverse_kl": float(-gap_B_T.sum()) / max(float(mask_B_T.sum()), 1.0)}
        if reference.distill:
            batch = replace(batch, advantages_B_T=batch.advantages_B_T
                            + reference.distill * gap_B_T.to(batch.advantages_B_T.dtype))
        kl = (KLTerm(ref_B_T, reference.kl_coef, reference.estimator)
              if reference.kl_coef else None)
        return batch, kl, metrics

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """The current weights' logprob of each of the batch's tokens (`token_logprobs`, no grad,
        on CPU): what a loss run by the caller is computed on (training/caller_loss.py)."""
        batch = _to(batch, self.device)
        parts = [token_logprobs(self.model, batch, rows)[0]
                 for rows in micro_batches(0, batch.size, self._rows_per_pass(batch))]
        return torch.cat(parts).float().cpu()

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """One supervised step: token-mean negative log-likelihood of the tokens whose loss_mask
        is 1 (see training/sft.py). Version += 1, like an RL step: the weights changed.

        Args:
            lr: learning rate of this step only (default: the optimizer's).
        """
        batch = _to(batch, self.device)
        num_tokens = max(batch.num_tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for part in micro_batches(0, batch.size, self._rows_per_pass(batch)):
            logp, _ = token_logprobs(self.model, batch, part)
            loss = -token_mean(logp, batch.loss_mask_B_T[part], num_tokens)
            loss.backward()
            total += float(loss.detach())
        groups = self.optimizer.param_groups if lr is not None else []
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = lr
        try:
            grad_norm = clip_and_step(self.model, self.optimizer, self.optimizer_config)
        finally:
            for group, value in zip(groups, saved, strict=True):
                group["lr"] = value
        self.version += 1
        return {"loss": total, "grad_norm": grad_norm, "tokens": float(batch.num_tokens)}

    def _rows_per_pass(self, batch: Batch) -> int:
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return rows_per_pass(batch.input_ids_B_T.shape[1], self.vocab_size)

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the current weights, named as in the model's state_dict (with
        LoRA: the base model's, adapters merged)."""
        if self.lora is not None:
            return adapters.merged_weights(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters' tensors, as PEFT names them.

        Raises:
            ValueError: the trainer trains the full weights (no `lora=`).
        """
        if self.lora is None:
            raise ValueError("this trainer trains the full weights: there is no adapter (give "
                             "lora=ab.LoRA(...) to session.policy to train one)")
        return adapters.adapter_weights(self.model)

    def save_adapter(self, directory: str | os.PathLike[str]) -> Path:
        """Write the adapters as PEFT's folder (`peft.PeftModel.from_pretrained` loads it)."""
        self.adapter_weights()  # the error when there is none
        return adapters.save_adapter(self.model, directory)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write weights, optimizer state and version (safetensors + JSON; no pickle); with LoRA
        also the adapters (adapter.safetensors, what `load` restores)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # with LoRA the adapters are the state (the base is the spec's, as built); the merged
        # weights are kept too: what the policy is, and what a checkpoint's checksum covers
        save_file(self.weights(), directory / "model.safetensors")
        if self.lora is not None:
            save_file(self.adapter_weights(), directory / "adapter.safetensors")
        tensors, meta = optimizer_state_to_tensors(self.optimizer.state_dict())
        save_file(tensors, directory / "optimizer.safetensors")
        info = {"version": self.version, "optimizer": asdict(self.optimizer_config), **meta}
        if self.lora is not None:  # full fine-tuning's format stays FSDP's as well
            info["lora"] = adapters.lora_to_dict(self.lora)
        (directory / "trainer.json").write_text(json.dumps(info, indent=1))
        return directory

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what `save` wrote (same model spec)."""
        directory = Path(directory)
        info = json.loads((directory / "trainer.json").read_text())
        saved = info.get("lora")
        if (saved is None) != (self.lora is None) or (
                saved is not None and adapters.lora_from_dict(saved) != self.lora):
            raise ValueError(f"checkpoint {directory} was written with lora={saved}, this "
                             f"trainer has lora={self.lora}: resume with the same LoRA settings")
        if self.lora is None:
            self.model.load_state_dict(load_file(directory / "model.safetensors"))
        else:
            adapters.load_adapter_weights(self.model, load_file(directory / "adapter.safetensors"))
        tensors = load_file(directory / "optimizer.safetensors")
        self.optimizer.load_state_dict(optimizer_state_from_tensors(tensors, info))
        self.version = int(info["version"])


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch(*(getattr(batch, f).to(device) for f in Batch.__dataclass_fields__))


def optimizer_state_to_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into flat tensors and JSON-able metadata (no pickle).

    This is the checkpoint format: tensors named "{param index}.{slot}" go to
    optimizer.safetensors, {"param_groups": ...} into trainer.json.
    """
    tensors: dict[str, torch.Tensor] = {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors, {"param_groups": state["param_groups"]}


def optimizer_state_from_tensors(tensors: dict[str, torch.Tensor], info: dict) -> dict:
    """The optimizer state_dict that `optimizer_state_to_tensors` split up."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": info["param_groups"]}
