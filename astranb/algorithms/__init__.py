"""RL algorithms as pure torch functions: advantages, token losses, and the configs that pick them
(GRPO and M2PO in config.py; the algorithms papers compare against in zoo.py).

    >>> import torch
    >>> from astranb.algorithms import GRPO, M2PO
    >>> GRPO().advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    tensor([[ 1.0000, -1.0000, -1.0000,  1.0000]])
    >>> M2PO().name
    'm2po'

Nothing here keeps state or does I/O; the trainer calls these on tensors it already holds.
"""

from .advantages import (
    group_advantages,
    groups_with_signal,
    has_signal,
    leave_one_out_advantages,
    overlong_penalty,
    whiten,
)
from .config import GRPO, M2PO, Algorithm
from .corrections import kl_estimate, kl_loss_term, kl_reward_penalty, truncated_is_weights
from .losses import ppo_clip_loss, token_mean
from .m2po import m2po_loss, m2po_mask
from .surrogates import aggregate, cispo_loss, clipped_surrogate_loss
from .zoo import CISPO, DAPO, GSPO, RLOO, DrGRPO, ReinforcePP

__all__ = [
    "GRPO",
    "M2PO",
    "DrGRPO",
    "DAPO",
    "GSPO",
    "CISPO",
    "RLOO",
    "ReinforcePP",
    "Algorithm",
    "group_advantages",
    "groups_with_signal",
    "has_signal",
    "leave_one_out_advantages",
    "whiten",
    "overlong_penalty",
    "token_mean",
    "aggregate",
    "ppo_clip_loss",
    "clipped_surrogate_loss",
    "cispo_loss",
    "m2po_mask",
    "m2po_loss",
    "truncated_is_weights",
    "kl_estimate",
    "kl_loss_term",
    "kl_reward_penalty",
]
