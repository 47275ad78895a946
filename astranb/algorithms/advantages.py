"""Group-relative advantages, as in GRPO.

Every prompt is answered N times; the N answers form a group. An answer's advantage is how much
better its reward is than the group's average, optionally divided by how spread out the group's
rewards are:

    adv[g, i] = (r[g, i] - mean_g) / (std_g + eps)        (normalize_std=True)
    adv[g, i] =  r[g, i] - mean_g                         (normalize_std=False)

`std_g` is the population standard deviation of the group's rewards (divide by N, not N - 1), so
a group of binary rewards [1, 0, 0, 1] has std 0.5 and advantages [1, -1, -1, 1]. `eps` only keeps
the division finite: a group whose rewards are all equal has std 0 and every advantage is
exactly 0 / eps = 0.

Such a group teaches nothing: every answer is pushed by zero. Dynamic sampling (DAPO) drops these
groups before training; `groups_with_signal` and `has_signal` are that filter. They compare rewards
exactly, so rewards that differ by any amount count as signal.

Other baselines the zoo uses (algorithms/zoo.py):

    leave-one-out (RLOO)   adv[g, i] = r[g, i] - mean of the group's OTHER rewards
                                     = N / (N - 1) * (r[g, i] - mean_g)
    whitened (REINFORCE++) adv = (a - mean) / (std + eps) over a whole batch's trained tokens
                           (`whiten`; the trainer calls it once per step, see
                           `Algorithm.batch_advantages`)

DAPO's overlong reward shaping is a function of the completion's length only (`overlong_penalty`):
0 up to `max_tokens - cache`, then falling linearly to -1 at `max_tokens`, and -1 beyond.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "group_advantages",
    "groups_with_signal",
    "has_signal",
    "leave_one_out_advantages",
    "whiten",
    "overlong_penalty",
]


def _as_float_rewards(rewards_G_N: torch.Tensor) -> torch.Tensor:
    """Check the rewards are a [groups, samples] table and give them a floating dtype.

    Args:
        rewards_G_N: rewards, one row per group (a tensor or anything `torch.as_tensor` accepts).

    Returns:
        The rewards as a floating tensor of shape [G, N].
    """
    rewards_G_N = torch.as_tensor(rewards_G_N)
    if rewards_G_N.dim() != 2:
        raise ValueError(
            f"rewards must have shape [groups, samples_per_group], got {tuple(rewards_G_N.shape)}; "
            "for a single group pass rewards[None, :]"
        )
    if not rewards_G_N.is_floating_point():
        rewards_G_N = rewards_G_N.to(torch.get_default_dtype())
    return rewards_G_N


def group_advantages(
    rewards_G_N: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of every sample relative to its group.

    Args:
        rewards_G_N: reward of sample n of group g, shape [G, N].
        normalize_std: divide by the group's population std (+ eps); False only subtracts the mean.
        eps: added to the std so that a group with identical rewards gets advantage 0, not NaN.

    Returns:
        adv_G_N: advantages, same shape as the rewards, floating dtype.
    """
    rewards_G_N = _as_float_rewards(rewards_G_N)
    mean_G_1 = rewards_G_N.mean(dim=1, keepdim=True)
    centred_G_N = rewards_G_N - mean_G_1
    if not normalize_std:
        return centred_G_N
    std_G_1 = rewards_G_N.std(dim=1, keepdim=True, correction=0)
    return centred_G_N / (std_G_1 + eps)


def groups_with_signal(rewards_G_N: torch.Tensor) -> torch.Tensor:
    """Which groups have rewards that are not all equal (the dynamic-sampling filter).

    Args:
        rewards_G_N: reward of sample n of group g, shape [G, N].

    Returns:
        keep_G: bool, True where at least two of the group's rewards differ (exact comparison).
    """
    rewards_G_N = torch.as_tensor(rewards_G_N)
    if rewards_G_N.dim() != 2:
        raise ValueError(
            f"rewards must have shape [groups, samples_per_group], got {tuple(rewards_G_N.shape)}"
        )
    same_G_N = rewards_G_N == rewards_G_N[:, :1]
    return ~same_G_N.all(dim=1)


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether one group's rewards are not all equal.

    Args:
        rewards: the group's rewards.

    Returns:
        True when at least two rewards differ (exact comparison); False for an empty or
        one-element group.
    """
    rewards = list(rewards)
    return any(r != rewards[0] for r in rewards[1:])


def leave_one_out_advantages(rewards_G_N: torch.Tensor) -> torch.Tensor:
    """RLOO's advantage: each reward minus the mean of the other rewards of its group.

    Args:
        rewards_G_N: reward of sample n of group g, shape [G, N] with N >= 2.

    Returns:
        adv_G_N = r - (sum_g - r) / (N - 1); a group of equal rewards gets 0 everywhere.

    Raises:
        ValueError: N < 2 (a lone sample has no other samples to be its baseline).
    """
    rewards_G_N = _as_float_rewards(rewards_G_N)
    samples = rewards_G_N.shape[1]
    if samples < 2:
        raise ValueError(
            f"leave-one-out advantages need at least 2 samples per group, got {samples}; "
            "sample each prompt twice or more (group_size >= 2)"
        )
    others_G_N = (rewards_G_N.sum(dim=1, keepdim=True) - rewards_G_N) / (samples - 1)
    return rewards_G_N - others_G_N


def whiten(adv_B_T: torch.Tensor, mask_B_T: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages shifted and scaled to mean 0 and std 1 over the trained tokens (REINFORCE++).

    Every trained token counts once, so a long row weighs more than a short one (the batch's
    token-level statistics, as REINFORCE++ normalises). The std is the population std.

    Args:
        adv_B_T: advantage of each token.
        mask_B_T: 1 on trained tokens; the others come back as 0.
        eps: added to the std (a batch of equal advantages becomes all 0, not NaN).

    Returns:
        The whitened advantages, 0 off the trained tokens.
    """
    trained_B_T = mask_B_T.bool()
    values_K = adv_B_T[trained_B_T]
    if values_K.numel() == 0:
        return torch.zeros_like(adv_B_T)
    mean = values_K.mean()
    std = values_K.std(correction=0)
    return torch.where(trained_B_T, (adv_B_T - mean) / (std + eps), 0.0)


def overlong_penalty(
    length: torch.Tensor | float, *, max_tokens: int = 20480, cache: int = 4096
) -> torch.Tensor:
    """DAPO's soft overlong punishment: a reward term that depends on the completion's length.

        0                                    length <= max_tokens - cache
        ((max_tokens - cache) - length) / cache     in between (0 down to -1)
        -1                                   length > max_tokens

    Args:
        length: completion length(s) in tokens.
        max_tokens: the generation budget (DAPO: 20480).
        cache: the punishment buffer at its end (DAPO: 4096, so lengths up to 16384 are free).

    Returns:
        The penalty, same shape as `length`, to add to the task's reward.
    """
    if not 0 < cache <= max_tokens:
        raise ValueError(f"overlong cache must be in (0, max_tokens={max_tokens}], got {cache}")
    length = torch.as_tensor(length, dtype=torch.get_default_dtype())
    ramp = ((max_tokens - cache) - length) / cache
    return torch.where(length > max_tokens, -1.0, ramp.clamp(max=0.0))
