"""M2PO: Second-Moment trust Policy Optimization (Zheng et al., 2025).

Asynchronous RL trains on tokens sampled by older weights. PPO's ratio clipping then discards the
very tokens that carry most of the signal (those whose probability moved most), and training
stalls. M2PO instead bounds one number for the whole batch, the second moment of the log ratio,
and throws away as few tokens as it takes to respect it.

The rule, in plain words:

1. For every trained token, log r = logp - old_logp and M2 = (log r)^2.
2. If the mean M2 over the trained tokens is at most `threshold` (0.04 in the paper), keep all.
3. Otherwise drop tokens, largest M2 first, until the mean M2 of the tokens left is at most
   `threshold`. Dropping the largest value never raises the mean, so the number of drops is the
   smallest one that works, and it is found without a loop: sort M2 in decreasing order, take the
   mean of every suffix with a cumulative sum, and pick the first suffix whose mean is within the
   bound (O(n log n)). Dropping every token is allowed; the loss is then 0.
4. The loss is the plain importance-weighted policy gradient, -r * A, on the kept tokens, with no
   ratio clipping, averaged over the ORIGINAL number of trained tokens (dropped tokens count as 0,
   they do not shrink the denominator).

Ties are broken deterministically: among tokens with equal M2 the first one in row-major
(batch, then time) order is dropped first.

The mask is computed over whatever batch you pass. The paper computes it over the training
minibatch; if you split a minibatch into micro-batches, each micro-batch gets its own mask (the
same trade-off AstraFlow makes).

`only_violating=True` is AstraFlow's variant. There, only sign-violating tokens take part:
tokens whose ratio moved the way the advantage pushes it, (A > 0 and r > 1) or (A < 0 and r < 1),
i.e. the tokens PPO's clip could bind on. Their mean M2 is compared with the threshold and only
they can be dropped; every other trained token is always kept. The threshold therefore bounds the
mean M2 of the violating tokens, not of the whole batch, and drops fewer tokens. (AstraFlow turns
the cutoff into a symmetric PPO clip range exp(+-tau) rather than a mask; for the gradient this is
the same as dropping the violating tokens above the cutoff.)
"""

from __future__ import annotations

import torch

from .losses import masked_log_ratio, ratio_metrics, token_mean

__all__ = ["m2po_mask", "m2po_loss"]


def _accumulate_dtype(device: torch.device) -> torch.dtype:
    """float64 for the M2 sums where the device has it (MPS does not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _violating(log_ratio_B_T: torch.Tensor, adv_B_T: torch.Tensor) -> torch.Tensor:
    """Tokens whose ratio moved the way their advantage pushes: (A>0 and r>1) or (A<0 and r<1).

    Args:
        log_ratio_B_T: log r per token.
        adv_B_T: advantage per token.

    Returns:
        bool_B_T.
    """
    return ((adv_B_T > 0) & (log_ratio_B_T > 0)) | ((adv_B_T < 0) & (log_ratio_B_T < 0))


def _num_to_drop(sorted_m2_K: torch.Tensor, threshold: float) -> int:
    """Fewest leading (largest) values to remove so the mean of the rest is <= threshold.

    Args:
        sorted_m2_K: candidate M2 values in decreasing order.
        threshold: the bound on the mean M2.

    Returns:
        k in [0, K]; k == K (drop everything) always satisfies the bound.
    """
    num_candidates = sorted_m2_K.numel()
    suffix_sums_K = sorted_m2_K.flip(0).cumsum(0).flip(0)
    suffix_counts_K = torch.arange(
        num_candidates, 0, -1, device=sorted_m2_K.device, dtype=sorted_m2_K.dtype
    )
    within_K = suffix_sums_K / suffix_counts_K <= threshold
    # k == K (nothing left) always qualifies; argmax returns the first qualifying k
    within_K1 = torch.cat([within_K, within_K.new_ones(1)])
    return int(torch.argmax(within_K1.to(torch.uint8)))


@torch.no_grad()
def m2po_mask(
    log_ratio_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    threshold: float = 0.04,
    *,
    only_violating: bool = False,
    adv_B_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which tokens M2PO keeps.

    Args:
        log_ratio_B_T: log r = logp - old_logp per token (only read; no gradient flows).
        mask_B_T: 1 on trained tokens, 0 on prompt and padding (those never count and stay 0).
        threshold: bound on the mean (log r)^2 of the tokens that take part.
        only_violating: AstraFlow's variant; only sign-violating tokens take part (see module doc).
        adv_B_T: advantages, required when only_violating is True.

    Returns:
        kept_mask_B_T: the input mask with dropped tokens set to 0 (same dtype as mask_B_T).
    """
    trained_B_T = mask_B_T.bool()
    candidates_B_T = trained_B_T
    if only_violating:
        if adv_B_T is None:
            raise ValueError("m2po_mask(only_violating=True) needs adv_B_T=the advantages")
        candidates_B_T = trained_B_T & _violating(log_ratio_B_T, adv_B_T)

    candidate_idx_K = candidates_B_T.flatten().nonzero().squeeze(1)
    m2_K = log_ratio_B_T.detach().flatten()[candidate_idx_K]
    m2_K = m2_K.to(_accumulate_dtype(m2_K.device)) ** 2
    order_K = torch.sort(m2_K, descending=True, stable=True).indices
    num_drop = _num_to_drop(m2_K[order_K], threshold)

    dropped_B_T = torch.zeros_like(trained_B_T).flatten()
    dropped_B_T[candidate_idx_K[order_K[:num_drop]]] = True
    dropped_B_T = dropped_B_T.view_as(trained_B_T)
    return torch.where(dropped_B_T, torch.zeros_like(mask_B_T), mask_B_T)


def m2po_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    threshold: float = 0.04,
    only_violating: bool = False,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """M2PO loss: -r * A on the tokens `m2po_mask` keeps, no ratio clipping, token mean.

    Args:
        logp_B_T: logprobs of the sampled tokens under the policy being trained (requires grad).
        old_logp_B_T: logprobs of the same tokens under the policy that sampled them.
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens, 0 on prompt and padding.
        threshold: bound on the mean (log r)^2 (0.04 in the paper).
        only_violating: AstraFlow's variant (see module doc).
        num_tokens: denominator of the token mean; defaults to the ORIGINAL mask's token count,
            so dropped tokens count as zero rather than being averaged away.

    Returns:
        (loss, metrics). Metrics, as python floats:
            m2po_masked_frac  dropped tokens / trained tokens
            m2                mean (log r)^2 over all trained tokens, before dropping
            m2_after          mean (log r)^2 over the kept tokens (0 if none are kept)
            ratio_mean        mean r over all trained tokens
            approx_kl         mean k3 = (r - 1) - log r over all trained tokens
    """
    log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
    kept_B_T = m2po_mask(
        log_ratio_B_T, mask_B_T, threshold, only_violating=only_violating, adv_B_T=adv_B_T
    )
    if num_tokens is None:
        num_tokens = mask_B_T.bool().sum()
    loss_B_T = -torch.exp(log_ratio_B_T) * adv_B_T
    loss = token_mean(loss_B_T, kept_B_T, num_tokens)

    with torch.no_grad():
        m2_B_T = log_ratio_B_T.detach() ** 2
        num_trained = mask_B_T.bool().sum()
        num_kept = kept_B_T.bool().sum()
        metrics = {
            "m2po_masked_frac": float((num_trained - num_kept) / num_trained.clamp(min=1)),
            "m2": float(token_mean(m2_B_T, mask_B_T)),
            "m2_after": float(token_mean(m2_B_T, kept_B_T)),
        }
        metrics.update(ratio_metrics(log_ratio_B_T, mask_B_T))
    return loss, metrics
