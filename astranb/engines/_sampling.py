"""Batched next-token sampling with per-row temperature and nucleus (top-p) settings.

The logprob recorded for a token is taken under the distribution that actually drew it:
log_softmax(filtered logits / T) for sampled rows, log_softmax(logits) for greedy rows (T = 0).
The trainer recomputes exactly this quantity, so the two must agree to float precision.
"""

from __future__ import annotations

import torch

__all__ = ["top_p_filter", "sample"]


def top_p_filter(logits_B_V: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's nucleus.

    The nucleus is the smallest set of most likely tokens whose probability mass reaches top_p: a
    token is kept when the mass of the tokens ranked strictly above it is below top_p (so the most
    likely token is always kept). Rows with top_p >= 1 are returned unchanged, bit for bit.

    Args:
        logits_B_V: logits (already divided by the temperature).
        top_p_B: nucleus mass per row, in (0, 1].

    Returns:
        Filtered logits, same shape.
    """
    sorted_B_V, order_B_V = logits_B_V.sort(dim=-1, descending=True)
    probs_B_V = sorted_B_V.softmax(dim=-1)
    mass_above_B_V = probs_B_V.cumsum(dim=-1) - probs_B_V
    top_p_B_1 = top_p_B.unsqueeze(1)
    # The top_p < 1 guard keeps rounding (cumsum slightly above 1) from dropping tail tokens.
    drop_sorted_B_V = (mass_above_B_V >= top_p_B_1) & (top_p_B_1 < 1)
    drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter(1, order_B_V, drop_sorted_B_V)
    return logits_B_V.masked_fill(drop_B_V, float("-inf"))


def sample(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    generator: torch.Generator | None,
    *,
    any_sampled: bool,
    any_top_p: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its logprob under the sampling distribution.

    Args:
        logits_B_V: last-position logits (any float dtype; computed in float32).
        temperature_B: per-row temperature; 0 means greedy.
        top_p_B: per-row nucleus mass.
        generator: the engine's seeded generator (on the logits' device).
        any_sampled: some row has temperature > 0 (False skips the random draw entirely).
        any_top_p: some sampled row has top_p < 1 (False skips the sort).

    Returns:
        (tokens_B, logprobs_B).
    """
    logits_B_V = logits_B_V.float()
    if not any_sampled:
        logp_B_V = torch.log_softmax(logits_B_V, dim=-1)
        tokens_B = logp_B_V.argmax(dim=-1)
        return tokens_B, logp_B_V.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
    greedy_B = temperature_B == 0
    scaled_B_V = logits_B_V / torch.where(greedy_B, 1.0, temperature_B).unsqueeze(1)
    if any_top_p:
        scaled_B_V = top_p_filter(scaled_B_V, torch.where(greedy_B, 1.0, top_p_B))
    logp_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    drawn_B = torch.multinomial(logp_B_V.exp(), 1, generator=generator).squeeze(1)
    tokens_B = torch.where(greedy_B, logp_B_V.argmax(dim=-1), drawn_B)
    return tokens_B, logp_B_V.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
