"""Token-level policy-gradient losses: the token mean and the PPO clipped surrogate (GRPO's loss).

Every completion token is one term of the loss. `mask_B_T` is 1 on tokens that are trained (the
completion) and 0 on prompt and padding, which contribute nothing, not even NaN.

Token mean. The loss is the sum over trained tokens divided by how many there are, so a long answer
weighs more than a short one token for token (DAPO's token-level mean). When a minibatch is split
into micro-batches for memory, pass the whole minibatch's token count as `num_tokens` to every
micro-batch: the micro-batch losses then add up to exactly the minibatch token mean, and so do
their gradients.

PPO clip. The samples were drawn by an older policy, so each token is reweighted by the ratio
r = exp(logp - old_logp) = pi(token) / pi_old(token). The clipped surrogate of one token is

    -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

In words: a token may raise its objective only until its ratio leaves the trust region in the
direction the advantage pushes it (r > 1 + clip_high when A > 0, r < 1 - clip_low when A < 0).
Past that edge the clipped term is the smaller one, it does not depend on logp, and the token gets
zero gradient; `clip_frac` counts those tokens. In the other direction nothing is clipped, so a
token whose update went the wrong way is always corrected.

Metrics are python floats over the trained tokens:
    clip_frac   share of tokens whose clipped term is active (they get no gradient)
    ratio_mean  mean of r
    approx_kl   mean of k3 = (r - 1) - log r, an unbiased, always non-negative estimate of
                KL(pi_old || pi) from tokens sampled by pi_old (Schulman's "k3" estimator)
"""

from __future__ import annotations

import torch

__all__ = ["token_mean", "clip_active", "ppo_clip_loss", "logp_gradient_loss"]


def token_mean(
    x_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    num_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of x over the masked tokens, divided by a token count.

    Args:
        x_B_T: per-token values.
        mask_B_T: 1 (or True) on tokens that count, 0 elsewhere; values at 0 are ignored even if
            they are NaN or inf.
        num_tokens: the denominator; defaults to mask.sum(). Pass the whole minibatch's token count
            so that micro-batch losses add up to the minibatch token mean. Clamped to at least 1.

    Returns:
        A scalar tensor (differentiable in x).
    """
    weights_B_T = mask_B_T.to(x_B_T.dtype)
    total = torch.where(weights_B_T != 0, x_B_T * weights_B_T, 0.0).sum()
    if num_tokens is None:
        num_tokens = weights_B_T.sum()
    denominator = torch.as_tensor(num_tokens, dtype=x_B_T.dtype, device=x_B_T.device)
    return total / denominator.clamp(min=1)


def masked_log_ratio(
    logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor
) -> torch.Tensor:
    """log r = logp - old_logp on trained tokens, exactly 0 elsewhere.

    Zeroing the untrained tokens first keeps exp() finite there, so padding can never turn the
    loss or its gradient into NaN.

    Args:
        logp_B_T: logprobs under the policy being trained.
        old_logp_B_T: logprobs under the policy that sampled the tokens.
        mask_B_T: 1 on trained tokens.

    Returns:
        log_ratio_B_T, differentiable in logp.
    """
    return torch.where(mask_B_T.bool(), logp_B_T - old_logp_B_T, 0.0)


@torch.no_grad()
def ratio_metrics(log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> dict[str, float]:
    """Mean ratio and k3 KL estimate over the trained tokens.

    Args:
        log_ratio_B_T: log r per token.
        mask_B_T: 1 on trained tokens.

    Returns:
        {"ratio_mean": mean r, "approx_kl": mean (r - 1) - log r}, as python floats.
    """
    log_ratio_B_T = log_ratio_B_T.detach()
    ratio_B_T = torch.exp(log_ratio_B_T)
    k3_B_T = (ratio_B_T - 1) - log_ratio_B_T
    return {
        "ratio_mean": float(token_mean(ratio_B_T, mask_B_T)),
        "approx_kl": float(token_mean(k3_B_T, mask_B_T)),
    }


@torch.no_grad()
def clip_active(ratio_B_T: torch.Tensor, adv_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                clip_low: float, clip_high: float) -> torch.Tensor:
    """Trained tokens whose clipped term -clip(r) * A is the one the loss takes (no gradient):
    what `clip_frac` counts.

    Args:
        ratio_B_T: each token's ratio (its own, or its sequence's).
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].

    Returns:
        bool_B_T, False off the trained tokens.
    """
    ratio_B_T = ratio_B_T.detach()
    clipped_B_T = ratio_B_T.clamp(1 - clip_low, 1 + clip_high) * adv_B_T
    return (clipped_B_T < ratio_B_T * adv_B_T) & mask_B_T.bool()


def ppo_clip_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss, averaged over tokens.

    Args:
        logp_B_T: logprobs of the sampled tokens under the policy being trained (requires grad).
        old_logp_B_T: logprobs of the same tokens under the policy that sampled them.
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens, 0 on prompt and padding.
        clip_low: the ratio is clipped below at 1 - clip_low.
        clip_high: the ratio is clipped above at 1 + clip_high.
        num_tokens: denominator of the token mean (see `token_mean`); defaults to mask.sum().

    Returns:
        (loss, metrics): the scalar loss and {"clip_frac", "ratio_mean", "approx_kl"} as floats.
    """
    log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
    ratio_B_T = torch.exp(log_ratio_B_T)
    clipped_ratio_B_T = ratio_B_T.clamp(1 - clip_low, 1 + clip_high)
    surrogate_B_T = ratio_B_T * adv_B_T
    clipped_surrogate_B_T = clipped_ratio_B_T * adv_B_T
    loss_B_T = -torch.minimum(surrogate_B_T, clipped_surrogate_B_T)
    loss = token_mean(loss_B_T, mask_B_T, num_tokens)

    with torch.no_grad():
        clip_active_B_T = clip_active(ratio_B_T, adv_B_T, mask_B_T, clip_low, clip_high)
        metrics = {"clip_frac": float(token_mean(clip_active_B_T.to(loss.dtype), mask_B_T))}
        metrics.update(ratio_metrics(log_ratio_B_T, mask_B_T))
    return loss, metrics


def logp_gradient_loss(
    logp_B_T: torch.Tensor, grad_B_T: torch.Tensor, mask_B_T: torch.Tensor
) -> torch.Tensor:
    """sum over trained tokens of grad * logp: a loss whose gradient in logp is `grad`.

    The trainer's half of a loss computed elsewhere (algorithms.LogpGradient): `grad_B_T` is
    dL/dlogp of that loss, so backpropagating this gives the parameters dL/dtheta.

    Args:
        logp_B_T: logprobs of the sampled tokens under the policy being trained (requires grad).
        grad_B_T: dL/dlogp per token (it holds any token mean already: no division here).
        mask_B_T: 1 on trained tokens; elsewhere nothing counts, not even NaN.

    Returns:
        The scalar loss.
    """
    return torch.where(mask_B_T.bool(), logp_B_T * grad_B_T, 0.0).sum()
