"""The zoo's token losses: the clipped surrogate at token or sequence level, CISPO, and how a
loss's tokens are summed into one number.

Clipped surrogate, three ways to take the ratio (`level`):

    "token"         r_t = exp(logp_t - old_logp_t)                            (PPO, GRPO, DAPO)
    "sequence"      s_i = exp(mean over row i's tokens of (logp - old_logp))  (GSPO: length-
                    normalised, so a long answer's ratio is not a product of thousands of terms)
    "sequence_sum"  s_i = exp(sum over row i's tokens of (logp - old_logp))   (RLOO: the whole
                    answer is one action, its probability the product of its tokens')

and each token's loss is -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), where a
sequence's ratio is given to each of its tokens.

CISPO (MiniMax-M1, 2025) keeps every token's gradient and clips only the importance weight, which
no gradient flows through:

    loss_t = -sg(clip(r_t, min_weight, max_weight)) * A_t * logp_t

so a token past the trust region still learns, at a capped rate (PPO's clip would give it none).

Aggregation (`aggregation`), the denominator that makes the tokens one loss:

    "token"     sum of the tokens' losses / the step's token count        (DAPO, BNPO; GRPO here)
    "row"       mean over rows of each row's token mean                   (GSPO, RLOO, DeepSeekMath)
    "constant"  sum of the tokens' losses / (max_tokens * rows)           (Dr. GRPO)

A row here is one sequence (a row of `mask_B_T`). "row" and "constant" are means over rows, and
the trainer may split a step's rows into micro-batches whose losses it adds up; each such call is
weighted by its share of the step's tokens (`num_tokens`), so a step trained in one call (a small
model, or a loss run in the caller) gets exactly the formula, and a split step a token-weighted
mean of its micro-batches' values (TRL averages its gradient-accumulation steps the same way,
with equal weights).

Any loss can be multiplied token by token by a weight that carries no gradient (`weight_B_T`,
e.g. truncated importance weights, algorithms/corrections.py) before it is aggregated.
"""

from __future__ import annotations

import torch

from .losses import clip_active, masked_log_ratio, ratio_metrics, token_mean

__all__ = ["LEVELS", "AGGREGATIONS", "aggregate", "clipped_surrogate_loss", "cispo_loss",
           "surrogate_clipped", "cispo_clipped"]

LEVELS = ("token", "sequence", "sequence_sum")
AGGREGATIONS = ("token", "row", "constant")


def _call_share(mask_B_T: torch.Tensor, num_tokens: int | float | torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """This call's share of the step's tokens (1 when the call is the whole step)."""
    tokens = mask_B_T.bool().sum().to(dtype)
    if num_tokens is None:
        return torch.ones((), dtype=dtype, device=mask_B_T.device)
    total = torch.as_tensor(num_tokens, dtype=dtype, device=mask_B_T.device).clamp(min=1)
    return tokens / total


def aggregate(
    loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    aggregation: str = "token",
    *,
    num_tokens: int | float | torch.Tensor | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """The tokens' losses summed into one scalar (see the module doc for the three ways).

    Args:
        loss_B_T: per-token loss; values off the trained tokens are ignored, even NaN.
        mask_B_T: 1 on trained tokens; each row is one sequence.
        aggregation: "token", "row" or "constant".
        num_tokens: the step's token count when this call is part of a step (see module doc).
        max_tokens: the constant length of "constant" (Dr. GRPO's generation budget).

    Returns:
        A scalar tensor (0 when no token is trained).
    """
    if aggregation == "token":
        return token_mean(loss_B_T, mask_B_T, num_tokens)
    trained_B_T = mask_B_T.bool()
    sums_B = torch.where(trained_B_T, loss_B_T, 0.0).sum(dim=1)
    lengths_B = trained_B_T.sum(dim=1).to(loss_B_T.dtype)
    rows = (lengths_B > 0).sum().to(loss_B_T.dtype).clamp(min=1)
    share = _call_share(mask_B_T, num_tokens, loss_B_T.dtype)
    if aggregation == "row":
        return (sums_B / lengths_B.clamp(min=1)).sum() / rows * share
    if aggregation == "constant":
        if not max_tokens or max_tokens < 1:
            raise ValueError(f"aggregation 'constant' needs max_tokens >= 1, got {max_tokens!r}")
        return sums_B.sum() / (rows * max_tokens) * share
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _level_log_ratio(log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                     level: str) -> torch.Tensor:
    """The log ratio each token's surrogate uses: its own, or its row's (mean or sum)."""
    if level == "token":
        return log_ratio_B_T
    trained_B_T = mask_B_T.bool()
    sums_B_1 = log_ratio_B_T.sum(dim=1, keepdim=True)  # already 0 off the trained tokens
    if level == "sequence":
        sums_B_1 = sums_B_1 / trained_B_T.sum(dim=1, keepdim=True).clamp(min=1)
    elif level != "sequence_sum":
        raise ValueError(f"ratio level must be one of {LEVELS}, got {level!r}")
    return torch.where(trained_B_T, sums_B_1.expand_as(log_ratio_B_T), 0.0)


def _weighted(loss_B_T: torch.Tensor, weight_B_T: torch.Tensor | None) -> torch.Tensor:
    return loss_B_T if weight_B_T is None else loss_B_T * weight_B_T.detach()


def clipped_surrogate_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
    aggregation: str = "token",
    max_tokens: int | None = None,
    weight_B_T: torch.Tensor | None = None,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-min(r * A, clip(r) * A) with the ratio at `level`, aggregated by `aggregation`.

    Args:
        logp_B_T: logprobs of the sampled tokens under the policy being trained (requires grad).
        old_logp_B_T: logprobs under the policy the ratio is measured against.
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens, 0 on prompt and padding; a row is a sequence.
        clip_low: the ratio is clipped below at 1 - clip_low.
        clip_high: the ratio is clipped above at 1 + clip_high.
        level: "token", "sequence" (GSPO) or "sequence_sum" (RLOO).
        aggregation: "token", "row" or "constant" (see `aggregate`).
        max_tokens: the constant of aggregation "constant".
        weight_B_T: a per-token factor without gradient (truncated IS weights), or None.
        num_tokens: the step's token count (see `aggregate`).

    Returns:
        (loss, metrics): clip_frac (share of trained tokens whose clipped term is active: no
        gradient), ratio_mean and approx_kl (of the token ratios, as GRPO reports them).
    """
    token_log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
    ratio_B_T = torch.exp(_level_log_ratio(token_log_ratio_B_T, mask_B_T, level))
    surrogate_B_T = ratio_B_T * adv_B_T
    clipped_B_T = ratio_B_T.clamp(1 - clip_low, 1 + clip_high) * adv_B_T
    loss_B_T = _weighted(-torch.minimum(surrogate_B_T, clipped_B_T), weight_B_T)
    loss = aggregate(loss_B_T, mask_B_T, aggregation, num_tokens=num_tokens,
                     max_tokens=max_tokens)
    with torch.no_grad():
        active_B_T = clip_active(ratio_B_T, adv_B_T, mask_B_T, clip_low, clip_high).to(loss.dtype)
        metrics = {"clip_frac": float(token_mean(active_B_T, mask_B_T))}
        metrics.update(ratio_metrics(token_log_ratio_B_T, mask_B_T))
    return loss, metrics


def cispo_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    max_weight: float = 5.0,
    min_weight: float = 0.0,
    weight_B_T: torch.Tensor | None = None,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: -sg(clip(r, min_weight, max_weight)) * A * logp, token mean.

    Args:
        logp_B_T: logprobs of the sampled tokens under the policy being trained (requires grad).
        old_logp_B_T: logprobs under the policy that sampled them.
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens.
        max_weight: the importance weight's cap (ScaleRL's epsilon_max, 5).
        min_weight: its floor (MiniMax-M1 sets none: 0).
        weight_B_T: a further per-token factor without gradient (truncated IS), or None.
        num_tokens: the step's token count (see `token_mean`).

    Returns:
        (loss, metrics): cispo_clip_frac (share of trained tokens whose weight was capped or
        floored; unlike PPO's clip they still get a gradient), ratio_mean, approx_kl.
    """
    log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
    ratio_B_T = torch.exp(log_ratio_B_T.detach())
    is_weight_B_T = ratio_B_T.clamp(min_weight, max_weight)
    trained_B_T = mask_B_T.bool()
    safe_logp_B_T = torch.where(trained_B_T, logp_B_T, 0.0)
    loss_B_T = _weighted(-is_weight_B_T * adv_B_T * safe_logp_B_T, weight_B_T)
    loss = token_mean(loss_B_T, mask_B_T, num_tokens)
    with torch.no_grad():
        clipped_B_T = _weight_clipped(ratio_B_T, is_weight_B_T, mask_B_T).to(loss.dtype)
        metrics = {"cispo_clip_frac": float(token_mean(clipped_B_T, mask_B_T))}
        metrics.update(ratio_metrics(log_ratio_B_T, mask_B_T))
    return loss, metrics


def _weight_clipped(ratio_B_T: torch.Tensor, weight_B_T: torch.Tensor,
                    mask_B_T: torch.Tensor) -> torch.Tensor:
    """Trained tokens whose CISPO weight was capped or floored (what cispo_clip_frac counts)."""
    return (weight_B_T != ratio_B_T) & mask_B_T.bool()


@torch.no_grad()
def surrogate_clipped(
    logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, adv_B_T: torch.Tensor,
    mask_B_T: torch.Tensor, *, clip_low: float, clip_high: float, level: str = "token",
) -> torch.Tensor:
    """The tokens `clipped_surrogate_loss` counts in clip_frac (bool_B_T): the step inspector's
    "clipped" mask, computed as the loss computes it."""
    token_log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
    ratio_B_T = torch.exp(_level_log_ratio(token_log_ratio_B_T, mask_B_T, level))
    return clip_active(ratio_B_T, adv_B_T, mask_B_T, clip_low, clip_high)


@torch.no_grad()
def cispo_clipped(
    logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor, *,
    max_weight: float, min_weight: float,
) -> torch.Tensor:
    """The tokens `cispo_loss` counts in cispo_clip_frac (bool_B_T)."""
    ratio_B_T = torch.exp(masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T))
    return _weight_clipped(ratio_B_T, ratio_B_T.clamp(min_weight, max_weight), mask_B_T)
