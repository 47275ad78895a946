"""What one train step trained, token by token: the step inspector's recording.

On a sampled step (`train(inspect_every=N)`) the trainer keeps, for every row of the batch, the
tokens, the engine's logprob of each (`old_logp`), the trainer's (`logp`), the advantage, the
loss mask, the weight version that sampled it, dLoss/dlogp (each token's weight in the step's
gradient: 0 where the loss gave it none), and the algorithm's own masks of tokens it treated
specially (`Algorithm.token_masks`: "clipped", "dropped", "capped"), computed on the very
logprobs the loss saw, so they mark exactly the tokens its metrics count. After the backward
pass, before clipping, it adds each parameter's gradient norm. Every other step pays nothing:
the recording is None and no line of it runs.

A `StepTrace` is tensors and a JSON header; it travels (from a trainer's child process) and is
stored (the run folder's steps/, session/steps.py) as one safetensors file with the header in
its metadata. No pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..algorithms import Algorithm
from ..types import Batch

__all__ = ["StepTrace", "StepRecording", "StepRecorder", "BATCH_FIELDS", "caller_trace"]

BATCH_FIELDS = ("input_ids_B_T", "attention_mask_B_T", "loss_mask_B_T", "old_logp_B_T",
                "advantages_B_T", "versions_B_T", "rewards_B")
"""The batch's tensors a trace keeps (the advantages as the step trained them)."""

_HEADER = "astranb.step"
_COMPACT = {"input_ids_B_T": torch.int32, "versions_B_T": torch.int32,
            "attention_mask_B_T": torch.bool, "loss_mask_B_T": torch.bool}


@dataclass(frozen=True)
class StepTrace:
    """One recorded step: tensors by name and a JSON-able header.

    Tensors: the `BATCH_FIELDS`, `logp_B_T` (the trainer's logprobs), `grad_logp_B_T`
    (dLoss/dlogp), one `mask/<name>_B_T` per algorithm mask (bool), and `grad_norm_P` (each
    parameter's gradient norm before clipping, named by the header's `parameters`).
    """

    tensors: dict[str, torch.Tensor]
    """Name -> CPU tensor."""
    header: dict[str, Any] = field(default_factory=dict)
    """JSON-able facts: `parameters` (names for grad_norm_P), `algorithm`, and whatever the
    caller adds (the step's metrics row, its flags)."""

    def masks(self) -> dict[str, torch.Tensor]:
        """The algorithm's masks by name ("clipped", "dropped", "capped")."""
        return {k.removeprefix("mask/").removesuffix("_B_T"): v
                for k, v in self.tensors.items() if k.startswith("mask/")}

    def to_bytes(self) -> bytes:
        """One safetensors file, the header as JSON in its metadata."""
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        return st_save(tensors, metadata={_HEADER: json.dumps(self.header, allow_nan=False)})

    @classmethod
    def from_bytes(cls, data: bytes) -> StepTrace:
        """What `to_bytes` wrote."""
        tensors = dict(st_load(data))
        header = json.loads(_metadata(data).get(_HEADER, "{}"))
        return cls(tensors, header)


def _metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors buffer (its JSON header's "__metadata__")."""
    size = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8:8 + size]).get("__metadata__") or {})


class StepRecording:
    """Collects a `StepTrace` while a step runs (the trainer passes one to its phases)."""

    def __init__(self) -> None:
        self._parts: list[dict[str, torch.Tensor]] = []
        self._norms: dict[str, torch.Tensor] = {}

    @staticmethod
    def watch(logp_B_T: torch.Tensor) -> None:
        """Before backward: keep dLoss/dlogp of this micro-batch's logprobs."""
        if logp_B_T.requires_grad:
            logp_B_T.retain_grad()

    @torch.no_grad()
    def micro_batch(self, algorithm: Algorithm, batch: Batch, rows: slice,
                    logp_B_T: torch.Tensor) -> None:
        """After backward on `rows`: the logprobs, their gradient and the algorithm's masks."""
        mask_B_T = batch.loss_mask_B_T[rows]
        logp = logp_B_T.detach()
        masks = algorithm.token_masks(logp, batch.old_logp_B_T[rows],
                                      batch.advantages_B_T[rows], mask_B_T)
        grad = logp_B_T.grad if logp_B_T.grad is not None else torch.zeros_like(logp)
        part = {"logp_B_T": logp.float().cpu(), "grad_logp_B_T": grad.float().cpu()}
        part.update({f"mask/{name}_B_T": m.bool().cpu() for name, m in masks.items()})
        self._parts.append(part)

    @torch.no_grad()
    def gradients(self, model: torch.nn.Module) -> None:
        """After the backward passes, before clipping: each parameter's gradient norm."""
        self._norms = {name: p.grad.detach().float().norm() for name, p in model.named_parameters()
                       if p.grad is not None}

    def trace(self, algorithm: Algorithm, batch: Batch) -> StepTrace:
        """The step's trace: the batch's tensors and the micro-batches' parts, row-aligned."""
        tensors = {name: getattr(batch, name).detach().cpu() for name in BATCH_FIELDS}
        for name, dtype in _COMPACT.items():  # a quarter to half the bytes, the same values
            tensors[name] = tensors[name].to(dtype)
        for key in self._parts[0] if self._parts else ():
            tensors[key] = torch.cat([part[key] for part in self._parts])
        names = list(self._norms)
        tensors["grad_norm_P"] = (torch.stack([self._norms[n] for n in names]).cpu() if names
                                  else torch.zeros(0))
        return StepTrace(tensors, {"parameters": names, "algorithm": algorithm.name})


@torch.no_grad()
def caller_trace(trace: StepTrace, algorithm: Algorithm, batch: Batch,
                 logp_B_T: torch.Tensor) -> StepTrace:
    """The trace of a step whose loss ran in the caller (training/caller_loss.py).

    The trainer trained `LogpGradient` on the caller's dLoss/dlogp, so its trace holds those
    gradients as advantages and none of the caller's masks; this puts back the advantages the
    caller's loss saw and its algorithm's masks, computed on the very logprobs the loss got.

    Args:
        trace: what the trainer recorded.
        algorithm: the caller's algorithm.
        batch: the step's batch as the caller had it (its own advantages).
        logp_B_T: the trainer's logprobs the caller's loss was computed on.
    """
    mask_B_T = batch.loss_mask_B_T
    adv_B_T = algorithm.batch_advantages(batch.advantages_B_T, mask_B_T)
    logp_B_T = logp_B_T.to(batch.old_logp_B_T.dtype)
    masks = algorithm.token_masks(logp_B_T, batch.old_logp_B_T, adv_B_T, mask_B_T)
    tensors = {k: v for k, v in trace.tensors.items() if not k.startswith("mask/")}
    tensors["advantages_B_T"] = adv_B_T.detach().float().cpu()
    tensors.update({f"mask/{name}_B_T": m.bool().cpu() for name, m in masks.items()})
    return StepTrace(tensors, {**trace.header, "algorithm": algorithm.name})


class StepRecorder:
    """The recording half of a `contracts.RecordingTrainer`, shared by the trainers: a flag the
    next `step` reads (`_record_next`) and the trace it leaves (`_recording`)."""

    _record_next = False  # `record_next_step` was called: the next step records
    _recording: StepTrace | None = None  # the last recorded step's trace, until taken

    def record_next_step(self) -> None:
        """Have the next `step` record what it trains, token by token."""
        self._record_next = True

    def take_recording(self) -> StepTrace | None:
        """The last recorded step's `StepTrace`, once (None: none since the last take)."""
        recording, self._recording = self._recording, None
        return recording

    def step_recorded(self, batch: Any) -> tuple[dict[str, float], StepTrace]:
        """`step`, and what it trained token by token."""
        self.record_next_step()
        metrics = self.step(batch)  # type: ignore[attr-defined]
        recording = self.take_recording()
        assert recording is not None
        return metrics, recording
