"""A researcher's own loss for a trainer in another process: the loss runs here, its gradient goes.

A trainer in a child process or behind a trainer service cannot run an `Algorithm` written in a
notebook cell: code does not travel (no pickle), and a class defined in a cell cannot be imported
by name elsewhere. So such a step is taken in two calls, and the loss runs where its code lives:

    caller (holds the Algorithm)                     trainer (child process or service)
    ────────────────────────────                     ──────────────────────────────────
    logprobs(batch) ───────────────────────────────► a forward without grad: logp_B_T
    leaf = logp_B_T, requires grad
    loss, metrics = algorithm.loss(leaf, old, adv, mask, num_tokens)
    g_B_T = dloss/dleaf                   (autograd, here)
    step(batch, advantages = g_B_T) ───────────────► LogpGradient: loss = sum(g * logp) plus the
                                                     algorithm's entropy bonus; backward, clip,
    metrics: the caller's loss and its own ◄──────── optimizer step; version + 1
    metrics, the trainer's entropy and norms

The trainer's second forward (with grad) computes the same logprobs as the first, so the
parameters' gradient, sum_t g_t * dlogp_t/dtheta, is the one the thread trainer gets by calling
`algorithm.loss` itself: the same parameters after the same steps. The price is one forward
without grad per step. The loss sees the whole batch at once (a thread trainer that splits a batch
into micro-batches calls it on each), and the entropy bonus, a plain token mean, is left to the
trainer (`LogpGradient.entropy_coef`).

Only tensors travel: the batch and the gradient as safetensors, as any step's batch does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..algorithms import Algorithm
from ..algorithms.config import LogpGradient, travels_as_config
from ..types import Batch
from .local import step_advantages

__all__ = ["runs_in_caller", "trainer_algorithm", "gradient_batch", "merged_metrics"]


def runs_in_caller(algorithm: Algorithm) -> bool:
    """Whether a trainer in another process needs this algorithm's loss run by the caller (any
    Algorithm but astranb's own configs, which travel as JSON)."""
    return not travels_as_config(algorithm)


def trainer_algorithm(algorithm: Algorithm) -> Algorithm:
    """What the trainer in the other process is built with: the algorithm itself when it travels,
    else its trainer half, `LogpGradient` with the algorithm's entropy bonus."""
    if not runs_in_caller(algorithm):
        return algorithm
    return LogpGradient(entropy_coef=float(algorithm.entropy_coef))


def gradient_batch(algorithm: Algorithm, batch: Batch,
                   logp_B_T: torch.Tensor) -> tuple[Batch, dict[str, float]]:
    """The batch whose LogpGradient step trains `algorithm`'s loss, and the loss's metrics.

    Args:
        algorithm: the caller's algorithm.
        batch: the step's batch.
        logp_B_T: the trainer's logprobs of the batch's tokens (`logprobs(batch)`).

    Returns:
        (batch with advantages_B_T = dloss/dlogp, 0 off the trained tokens;
         {"loss": the loss's value, **its metrics}).
    """
    batch = step_advantages(algorithm, batch)
    mask_B_T = batch.loss_mask_B_T
    leaf_B_T = logp_B_T.detach().to(batch.old_logp_B_T.dtype).clone().requires_grad_(True)
    loss, metrics = algorithm.loss(leaf_B_T, batch.old_logp_B_T, batch.advantages_B_T, mask_B_T,
                                   num_tokens=max(batch.num_tokens, 1))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"{type(algorithm).__name__}.loss must return (a scalar tensor, metrics); "
                        f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    if loss.requires_grad:
        (grad_B_T,) = torch.autograd.grad(loss, leaf_B_T, allow_unused=True)
    else:
        grad_B_T = None
    if grad_B_T is None:  # a loss that does not depend on the logprobs
        grad_B_T = torch.zeros_like(leaf_B_T)
    grad_B_T = torch.where(mask_B_T.bool(), grad_B_T, 0.0).detach()
    found = {"loss": float(loss.detach())}
    found.update({key: float(value.detach() if isinstance(value, torch.Tensor) else value)
                  for key, value in metrics.items()})
    return replace(batch, advantages_B_T=grad_B_T), found


def merged_metrics(caller: dict[str, float], trainer: dict[str, float],
                   algorithm: Algorithm) -> dict[str, float]:
    """One step's metrics as the thread trainer reports them: the trainer's (entropy, gradient
    norm, logprob gap, tokens, timings), the caller's loss metrics, and as `loss` the caller's
    loss minus the entropy bonus (the trainer's `loss` is its surrogate's value)."""
    merged = {**trainer, **caller}
    merged["loss"] = caller["loss"] - float(algorithm.entropy_coef) * trainer.get("entropy", 0.0)
    return merged
