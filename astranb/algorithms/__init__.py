"""RL algorithms as pure torch functions: advantages, token losses, and the configs that pick them.

    >>> import torch
    >>> from astranb.algorithms import GRPO, M2PO
    >>> GRPO().advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    tensor([[ 1.0000, -1.0000, -1.0000,  1.0000]])
    >>> M2PO().name
    'm2po'

Nothing here keeps state or does I/O; the trainer calls these on tensors it already holds.
"""

from .advantages import group_advantages, groups_with_signal, has_signal
from .config import GRPO, M2PO, Algorithm
from .losses import ppo_clip_loss, token_mean
from .m2po import m2po_loss, m2po_mask

__all__ = [
    "GRPO",
    "M2PO",
    "Algorithm",
    "group_advantages",
    "groups_with_signal",
    "has_signal",
    "token_mean",
    "ppo_clip_loss",
    "m2po_mask",
    "m2po_loss",
]
