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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_advantages", "groups_with_signal", "has_signal"]


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
