"""What every algorithm is: the `Algorithm` contract the trainers call, and the argument checks
its configs share (config.py holds GRPO and M2PO, zoo.py the algorithms papers compare against).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from .advantages import group_advantages
from .corrections import TIS_LEVELS

__all__ = ["Algorithm"]


def _check_bool(algorithm: str, field: str, value: object) -> None:
    """Reject non-bool flags (a string such as "no" would otherwise read as True).

    Args:
        algorithm: class name, for the message.
        field: field name, for the message.
        value: the value given.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{algorithm} {field} must be True or False, got {value!r}")


def _check_number(algorithm: str, field: str, value: object) -> float:
    """Reject values that are not real numbers (bools included).

    Args:
        algorithm: class name, for the message.
        field: field name, for the message.
        value: the value given.

    Returns:
        The value as a float.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{algorithm} {field} must be a number, got {value!r}")
    return float(value)


def _check_entropy(algorithm: str, value: object) -> None:
    """The entropy bonus weight must be a finite number >= 0."""
    number = _check_number(algorithm, "entropy_coef", value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(
            f"{algorithm} entropy_coef must be >= 0, got {value!r}; 0 disables the bonus, "
            "0.01-0.05 keeps a tiny model exploring"
        )


def _check_tis(algorithm: str, cap: object, level: object) -> None:
    """Truncated importance sampling's cap is None (off) or a finite number >= 1; its level is
    "token" or "sequence"."""
    if cap is not None:
        number = _check_number(algorithm, "tis_cap", cap)
        if not (math.isfinite(number) and number >= 1):
            raise ValueError(f"{algorithm} tis_cap must be a finite number >= 1 or None, got "
                             f"{cap!r}; the paper's cap is 2")
    if level not in TIS_LEVELS:
        raise ValueError(f"{algorithm} tis_level must be one of {TIS_LEVELS}, got {level!r}")


class Algorithm(ABC):
    """What every algorithm config offers the trainer: advantages, a token loss, and a name.

    Subclasses are frozen dataclasses with at least the fields `normalize_std`, `filter_groups`
    and `entropy_coef`.
    """

    normalize_std: bool
    filter_groups: bool
    entropy_coef: float

    @property
    @abstractmethod
    def name(self) -> str:
        """Short lower-case name, used in logs and metric keys."""

    @abstractmethod
    def loss(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        adv_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        num_tokens: int | float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The token-mean policy loss and its metrics.

        Args:
            logp_B_T: logprobs of the sampled tokens under the policy being trained.
            old_logp_B_T: logprobs under the policy that sampled them.
            adv_B_T: advantage of each token.
            mask_B_T: 1 on trained tokens.
            num_tokens: denominator of the token mean (the minibatch's token count when the
                minibatch is split into micro-batches); defaults to mask_B_T.sum().

        Returns:
            (loss, metrics): a scalar tensor and a dict of python floats.
        """

    def token_masks(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        adv_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Which trained tokens the loss treats specially, for the step inspector: bool tensors
        by name, such as "clipped" (PPO's clip is active: no gradient), "dropped" (M2PO's
        mask) or "capped" (truncated importance weights at their cap).

        The inspector calls this without grad, on the logprobs the loss saw, so a mask marks
        exactly the tokens the loss's metric counts (`clip_frac`, `m2po_masked_frac`,
        `tis_capped_frac`). The default: none.

        Args:
            logp_B_T, old_logp_B_T, adv_B_T, mask_B_T: as `loss` got them.

        Returns:
            name -> bool_B_T (False off the trained tokens).
        """
        return {}

    def batch_advantages(self, adv_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        """The advantages a whole step trains on, from the per-group ones the batch holds.

        Trainers call this once per step, on the whole batch, before splitting it into
        micro-batches; the default keeps the advantages as they are. REINFORCE++ normalises
        them over the batch here.

        Args:
            adv_B_T: each token's advantage, as `advantages` gave it to its row.
            mask_B_T: 1 on trained tokens.

        Returns:
            adv_B_T for `loss`.
        """
        return adv_B_T

    def advantages(self, rewards_G_N: torch.Tensor) -> torch.Tensor:
        """Group-relative advantages of a [groups, samples] reward table.

        Args:
            rewards_G_N: reward of sample n of group g.

        Returns:
            adv_G_N: (r - group mean), divided by (group std + eps) when normalize_std is True.
        """
        return group_advantages(rewards_G_N, normalize_std=self.normalize_std)
