"""Corrections a loss can apply: truncated importance sampling and KL to a reference policy.

Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"). The engine samples with its own kernels and bf16-rounded
weights, the trainer scores with fp32 ones: even at staleness 0 the two disagree a little on
every token's logprob. The tokens were drawn from the engine's distribution, so the trainer's
gradient is reweighted by how much likelier its own policy makes them, and the weight is capped
so a few tokens cannot dominate:

    token level      w_t = min(exp(logp_trainer_old_t - logp_engine_t), C)
    sequence level   w_i = min(exp(sum over row i's tokens of (logp_trainer_old - logp_engine)), C)

No gradient flows through w. Here logp_trainer_old is the trainer's logprob before the step: in
astranb one batch is one optimizer step, so it is the trainer's current logprob, detached
(`logp_B_T.detach()`); the loss's own ratio is then measured against it (1 at the start of the
step), and the whole gap to the engine, mismatch and staleness together, is carried by w. The
paper's cap is C = 2.

KL to a reference policy (Schulman 2020, "Approximating KL divergence"). With tokens sampled from
the policy and log r = ref_logp - logp, three per-token estimates of KL(policy || reference):

    k1 = -log r               unbiased, can be negative
    k2 = (log r)^2 / 2        biased, always >= 0, low variance
    k3 = (r - 1) - log r      unbiased, always >= 0 (GRPO's KL term)

In the loss (GRPO): loss += kl_coef * token mean of k. In the reward (PPO for RLHF,
REINFORCE++): each token's reward -= kl_coef * k, detached. Both need the reference policy's
logprob of every sampled token, which the batch does not carry yet: these functions wait for a
reference policy's logprobs (ref_logp_B_T) and are pure until then.
"""

from __future__ import annotations

import torch

from .losses import token_mean

__all__ = [
    "TIS_LEVELS",
    "KL_ESTIMATORS",
    "truncated_is_weights",
    "truncation",
    "truncation_masks",
    "kl_estimate",
    "kl_loss_term",
    "kl_reward_penalty",
]

TIS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


@torch.no_grad()
def truncated_is_weights(
    trainer_logp_B_T: torch.Tensor,
    engine_logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """The truncated importance weight of every token (detached; 0 off the trained tokens).

    Args:
        trainer_logp_B_T: the trainer's logprob of each sampled token, before the step.
        engine_logp_B_T: the engine's logprob of it (the batch's old_logp_B_T).
        mask_B_T: 1 on trained tokens; a row is one sequence.
        cap: C, the largest weight (the paper's 2).
        level: "token" (one weight per token) or "sequence" (one per row, the product of its
            tokens' ratios, given to each of its tokens).

    Returns:
        w_B_T = min(ratio, cap) on trained tokens, 0 elsewhere.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"truncated IS level must be one of {TIS_LEVELS}, got {level!r}")
    trained_B_T = mask_B_T.bool()
    log_w_B_T = torch.where(trained_B_T, trainer_logp_B_T - engine_logp_B_T, 0.0)
    if level == "sequence":
        log_w_B_T = log_w_B_T.sum(dim=1, keepdim=True).expand_as(log_w_B_T)
    return torch.where(trained_B_T, torch.exp(log_w_B_T).clamp(max=cap), 0.0)


def truncation(
    logp_B_T: torch.Tensor,
    engine_logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    cap: float | None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """What a loss with truncated IS trains against: (the logprobs its ratio is measured
    against, the weights, their metrics).

    With `cap` None: the engine's logprobs, no weights, no metrics (no correction). Otherwise
    the trainer's own logprobs before the step (`logp_B_T.detach()`), `truncated_is_weights`
    of those against the engine's, and {"tis_weight_mean", "tis_capped_frac"} over the trained
    tokens.
    """
    if cap is None:
        return engine_logp_B_T, None, {}
    trainer_B_T = logp_B_T.detach()
    weight_B_T = truncated_is_weights(trainer_B_T, engine_logp_B_T, mask_B_T, cap=cap,
                                      level=level)
    capped_B_T = _capped(weight_B_T, mask_B_T, cap).to(weight_B_T.dtype)
    metrics = {"tis_weight_mean": float(token_mean(weight_B_T, mask_B_T)),
               "tis_capped_frac": float(token_mean(capped_B_T, mask_B_T))}
    return trainer_B_T, weight_B_T, metrics


def _capped(weight_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float) -> torch.Tensor:
    return (weight_B_T >= cap) & mask_B_T.bool()


@torch.no_grad()
def truncation_masks(
    logp_B_T: torch.Tensor, engine_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor,
    cap: float | None, level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What `truncation` gives a loss's ratio to measure against, and its "capped" mask (the
    tokens `tis_capped_frac` counts; none without a cap), for `Algorithm.token_masks`."""
    old_B_T, weight_B_T, _ = truncation(logp_B_T, engine_logp_B_T, mask_B_T, cap, level)
    if weight_B_T is None or cap is None:
        return old_B_T, {}
    return old_B_T, {"capped": _capped(weight_B_T, mask_B_T, cap)}


def kl_estimate(
    logp_B_T: torch.Tensor, ref_logp_B_T: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """A per-token estimate of KL(policy || reference) from tokens the policy sampled.

    Args:
        logp_B_T: the policy's logprob of each sampled token (differentiable).
        ref_logp_B_T: the reference policy's logprob of it.
        estimator: "k1", "k2" or "k3" (see the module doc).

    Returns:
        k_B_T, differentiable in logp.
    """
    log_r_B_T = ref_logp_B_T - logp_B_T
    if estimator == "k1":
        return -log_r_B_T
    if estimator == "k2":
        return 0.5 * log_r_B_T**2
    if estimator == "k3":
        return torch.expm1(log_r_B_T) - log_r_B_T
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_loss_term(
    logp_B_T: torch.Tensor,
    ref_logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k3",
    num_tokens: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """kl_coef * the token mean of the KL estimate: what a loss adds for KL in the loss.

    Args:
        logp_B_T: the policy's logprobs (differentiable).
        ref_logp_B_T: the reference policy's logprobs.
        mask_B_T: 1 on trained tokens.
        kl_coef: the weight (DeepSeekMath's GRPO: 0.04, with k3).
        estimator: "k1", "k2" or "k3".
        num_tokens: denominator of the token mean (see `token_mean`).

    Returns:
        A scalar tensor.
    """
    masked_ref_B_T = torch.where(mask_B_T.bool(), ref_logp_B_T, logp_B_T.detach())
    k_B_T = kl_estimate(logp_B_T, masked_ref_B_T, estimator)
    return kl_coef * token_mean(k_B_T, mask_B_T, num_tokens)


@torch.no_grad()
def kl_reward_penalty(
    logp_B_T: torch.Tensor,
    ref_logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Each trained token's reward term for KL in the reward: -kl_coef * k (no gradient).

    Summed over a row (`.sum(dim=1)`) it is the sequence's penalty; summed from token t to the
    end it is REINFORCE++'s KL return at t.

    Args:
        logp_B_T: the sampling policy's logprobs.
        ref_logp_B_T: the reference policy's logprobs.
        mask_B_T: 1 on trained tokens; the others get 0.
        kl_coef: the weight.
        estimator: "k1" (PPO for RLHF, REINFORCE++), "k2" or "k3".

    Returns:
        penalty_B_T.
    """
    k_B_T = kl_estimate(logp_B_T, ref_logp_B_T, estimator)
    return torch.where(mask_B_T.bool(), -kl_coef * k_B_T, 0.0)
