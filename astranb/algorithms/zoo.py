"""The algorithms papers compare against, as configs: each its paper's formula and defaults.

    DrGRPO()       Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"):
                   A = r - mean_g (no std); loss = sum_t -min(r A, clip(r) A) / (max_tokens * rows)
    DAPO()         DAPO (Yu et al. 2025): clip higher [1 - 0.2, 1 + 0.28], token-level mean,
                   dynamic sampling, and overlong reward shaping (`overlong_penalty`)
    GSPO()         GSPO (Zheng et al. 2025): sequence ratio s_i = exp(mean_t log r_t), clipped to
                   [1 - 3e-4, 1 + 4e-4]; loss = mean over sequences of -min(s A, clip(s) A)
    CISPO()        CISPO (MiniMax-M1, 2025): loss_t = -sg(min(r_t, 5)) * A * logp_t, token mean
    RLOO()         RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the others' rewards; the whole
                   answer is one action: s_i = exp(sum_t log r_t), clipped 0.2, mean over rows
    ReinforcePP()  REINFORCE++ (Hu et al. 2025): A = r - mean_g ("with baseline"), normalised over
                   the whole batch's tokens; PPO's clip 0.2, token mean

Every config also takes `tis_cap` (truncated importance sampling for the engine/trainer
mismatch, algorithms/corrections.py; GRPO takes it too): None (the default) trains on the ratio
to the engine's logprobs; a number C measures the ratio against the trainer's own logprobs
before the step and multiplies each token's loss by min(exp(logp_trainer - logp_engine), C), per
token or per sequence (`tis_level`). The paper's C is 2.

All of them travel to trainer processes and services as JSON, like GRPO and M2PO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .advantages import (
    _as_float_rewards,
    group_advantages,
    leave_one_out_advantages,
    overlong_penalty,
    whiten,
)
from .base import Algorithm, _check_bool, _check_entropy, _check_number, _check_tis
from .corrections import truncation, truncation_masks
from .surrogates import cispo_clipped, cispo_loss, clipped_surrogate_loss, surrogate_clipped

__all__ = ["DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP", "ZOO"]

Metrics = dict[str, float]
Tensor = torch.Tensor
Count = int | float | torch.Tensor | None


def _check_width(algorithm: str, field: str, value: object) -> None:
    """A clip width must be a number in (0, 1)."""
    number = _check_number(algorithm, field, value)
    if not 0 < number < 1:
        raise ValueError(
            f"{algorithm} {field} must be in (0, 1), got {value!r}: the ratio is clipped "
            "to [1 - clip_low, 1 + clip_high]"
        )


def _check_tokens(algorithm: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{algorithm} {field} must be a whole number of tokens >= 1, "
                         f"got {value!r}")


@dataclass(frozen=True, kw_only=True)
class _Zoo(Algorithm):
    """What the zoo's configs share: the entropy bonus and truncated importance sampling."""

    entropy_coef: float = 0.0
    """Weight of an entropy bonus (token mean of the policy's entropy, subtracted from the loss)."""
    tis_cap: float | None = None
    """Truncated importance sampling's cap C (Yao et al. 2025 use 2); None: off."""
    tis_level: str = "token"
    """"token": one weight per token; "sequence": one per sequence (the product of its ratios)."""
    _level: ClassVar[str] = "token"
    """The level of the clipped surrogate's ratio ("token", "sequence", "sequence_sum")."""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        _check_entropy(kind, self.entropy_coef)
        _check_bool(kind, "normalize_std", self.normalize_std)
        _check_bool(kind, "filter_groups", self.filter_groups)
        _check_tis(kind, self.tis_cap, self.tis_level)

    def _corrected(self, logp_B_T: Tensor, old_logp_B_T: Tensor,
                   mask_B_T: Tensor) -> tuple[Tensor, Tensor | None, Metrics]:
        """(logprobs the ratio is measured against, truncated IS weights or None, their metrics)."""
        return truncation(logp_B_T, old_logp_B_T, mask_B_T, self.tis_cap, self.tis_level)

    def _surrogate(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor,
                   mask_B_T: Tensor, num_tokens: Count, *, clip: tuple[float, float],
                   level: str = "token", aggregation: str = "token",
                   max_tokens: int | None = None) -> tuple[Tensor, Metrics]:
        """The clipped surrogate (`clipped_surrogate_loss`) under this config's correction."""
        old_B_T, weight_B_T, extra = self._corrected(logp_B_T, old_logp_B_T, mask_B_T)
        loss, metrics = clipped_surrogate_loss(
            logp_B_T, old_B_T, adv_B_T, mask_B_T, clip_low=clip[0], clip_high=clip[1],
            level=level, aggregation=aggregation, max_tokens=max_tokens, weight_B_T=weight_B_T,
            num_tokens=num_tokens)
        return loss, {**metrics, **extra}


@dataclass(frozen=True, kw_only=True)
class _Clipped(_Zoo):
    """The zoo's configs with a clipped surrogate (all but CISPO): their inspector masks."""

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high."""

    def token_masks(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor,
                    mask_B_T: Tensor) -> dict[str, Tensor]:
        """"clipped" (what clip_frac counts) and, with tis_cap, "capped"."""
        old_B_T, masks = truncation_masks(logp_B_T, old_logp_B_T, mask_B_T, self.tis_cap,
                                          self.tis_level)
        masks["clipped"] = surrogate_clipped(logp_B_T, old_B_T, adv_B_T, mask_B_T,
                                             clip_low=self.clip_low, clip_high=self.clip_high,
                                             level=self._level)
        return masks


@dataclass(frozen=True, kw_only=True)
class DrGRPO(_Clipped):
    """Dr. GRPO: GRPO without its two length and difficulty biases (Liu et al. 2025).

        A_i  = r_i - mean_g                          (no division by the group's std)
        loss = sum over rows i, tokens t of -min(r_t A_i, clip(r_t, 0.8, 1.2) A_i)
               / (max_tokens * rows)                 (a constant, not each answer's length)

    Dividing by each answer's length makes a long wrong answer cheaper per token than a short
    one; dividing by the std over-weights prompts that are nearly always right or wrong.
    """

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high."""
    max_tokens: int = 3000
    """The constant length L; set it to the generation budget (the paper's runs: 3000)."""
    normalize_std: bool = False
    """Divide advantages by the group's std (Dr. GRPO: no)."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal before training (the paper keeps them)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_width("DrGRPO", "clip_low", self.clip_low)
        _check_width("DrGRPO", "clip_high", self.clip_high)
        _check_tokens("DrGRPO", "max_tokens", self.max_tokens)

    @property
    def name(self) -> str:
        return "dr_grpo"

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """Clipped surrogate, summed and divided by max_tokens * rows (`aggregate`)."""
        return self._surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens,
                               clip=(self.clip_low, self.clip_high), aggregation="constant",
                               max_tokens=self.max_tokens)


@dataclass(frozen=True, kw_only=True)
class DAPO(_Clipped):
    """DAPO: Decoupled clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025).

        loss = sum over all tokens of -min(r_t A, clip(r_t, 1 - 0.2, 1 + 0.28) A) / tokens

    Clip higher (0.28 above, 0.2 below) leaves room for unlikely tokens to grow, which keeps
    entropy from collapsing; the token-level mean weighs every token alike; dynamic sampling drops
    groups whose rewards are all equal; overlong reward shaping (`overlong_penalty`, a function of
    the completion's length to add to its reward in the environment) punishes answers that run
    into the last `overlong_cache` tokens of the budget.
    """

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low (DAPO: 0.2)."""
    clip_high: float = 0.28
    """The ratio is clipped above at 1 + clip_high (DAPO: 0.28)."""
    max_tokens: int = 20480
    """The generation budget the overlong shaping is measured against (DAPO: 20480)."""
    overlong_cache: int = 4096
    """The buffer at the budget's end where the penalty ramps from 0 to -1 (DAPO: 4096)."""
    normalize_std: bool = True
    """Divide advantages by the group's std (DAPO keeps GRPO's)."""
    filter_groups: bool = True
    """Dynamic sampling: drop groups whose rewards are all equal (DAPO: yes)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_width("DAPO", "clip_low", self.clip_low)
        _check_width("DAPO", "clip_high", self.clip_high)
        _check_tokens("DAPO", "max_tokens", self.max_tokens)
        _check_tokens("DAPO", "overlong_cache", self.overlong_cache)
        if self.overlong_cache > self.max_tokens:
            raise ValueError(f"DAPO overlong_cache ({self.overlong_cache}) must not exceed "
                             f"max_tokens ({self.max_tokens})")

    @property
    def name(self) -> str:
        return "dapo"

    def overlong_penalty(self, length: torch.Tensor | float) -> torch.Tensor:
        """The shaping term for a completion of `length` tokens (0 down to -1; see module doc)."""
        return overlong_penalty(length, max_tokens=self.max_tokens, cache=self.overlong_cache)

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """Clipped surrogate with the asymmetric clip, token mean."""
        return self._surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens,
                               clip=(self.clip_low, self.clip_high), aggregation="token")


@dataclass(frozen=True, kw_only=True)
class GSPO(_Clipped):
    """GSPO: Group Sequence Policy Optimization (Zheng et al. 2025).

        s_i  = exp(1/|y_i| * sum_t (logp_t - old_logp_t))     (the length-normalised ratio)
        loss = mean over sequences i of -min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)

    The reward belongs to the whole answer, so the ratio does too; token ratios' noise averages
    out, which is why the clip range is so much narrower than PPO's.
    """

    _level: ClassVar[str] = "sequence"
    clip_low: float = 3e-4
    """The sequence ratio is clipped below at 1 - clip_low (GSPO: 3e-4)."""
    clip_high: float = 4e-4
    """The sequence ratio is clipped above at 1 + clip_high (GSPO: 4e-4)."""
    normalize_std: bool = True
    """Divide advantages by the group's std (GSPO keeps GRPO's)."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal before training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_width("GSPO", "clip_low", self.clip_low)
        _check_width("GSPO", "clip_high", self.clip_high)

    @property
    def name(self) -> str:
        return "gspo"

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """Sequence-level clipped surrogate, mean over sequences."""
        return self._surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens,
                               clip=(self.clip_low, self.clip_high), level=self._level,
                               aggregation="row")


@dataclass(frozen=True, kw_only=True)
class CISPO(_Zoo):
    """CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

        loss = sum over tokens of -sg(clip(r_t, min_weight, max_weight)) * A * logp_t / tokens

    sg: no gradient through the weight. Every token keeps its gradient A * dlogp (PPO's clip
    zeroes it past the trust region, and those are often the rare tokens a reasoning chain
    hinges on); only how much it counts is capped.
    """

    max_weight: float = 5.0
    """The importance weight's cap (1 + eps_high in MiniMax-M1; ScaleRL's eps_max = 5)."""
    min_weight: float = 0.0
    """Its floor (MiniMax-M1 sets no lower bound: 0)."""
    normalize_std: bool = True
    """Divide advantages by the group's std (group-relative, as GRPO)."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal before training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        top = _check_number("CISPO", "max_weight", self.max_weight)
        bottom = _check_number("CISPO", "min_weight", self.min_weight)
        if not (0 <= bottom < 1 < top and math.isfinite(top)):
            raise ValueError(f"CISPO needs 0 <= min_weight < 1 < max_weight (finite), got "
                             f"min_weight={self.min_weight!r}, max_weight={self.max_weight!r}")

    @property
    def name(self) -> str:
        return "cispo"

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """CISPO's loss; see `cispo_loss`."""
        old_B_T, weight_B_T, extra = self._corrected(logp_B_T, old_logp_B_T, mask_B_T)
        loss, metrics = cispo_loss(logp_B_T, old_B_T, adv_B_T, mask_B_T,
                                   max_weight=self.max_weight, min_weight=self.min_weight,
                                   weight_B_T=weight_B_T, num_tokens=num_tokens)
        return loss, {**metrics, **extra}

    def token_masks(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor,
                    mask_B_T: Tensor) -> dict[str, Tensor]:
        """"clipped": weights capped or floored (what cispo_clip_frac counts); "capped" with
        tis_cap."""
        old_B_T, masks = truncation_masks(logp_B_T, old_logp_B_T, mask_B_T, self.tis_cap,
                                          self.tis_level)
        masks["clipped"] = cispo_clipped(logp_B_T, old_B_T, mask_B_T, max_weight=self.max_weight,
                                         min_weight=self.min_weight)
        return masks


@dataclass(frozen=True, kw_only=True)
class RLOO(_Clipped):
    """RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, after Kool et al. 2019).

        A_i  = r_i - 1/(N-1) * sum over j != i of r_j
        s_i  = exp(sum_t (logp_t - old_logp_t))               (the answer is one action)
        loss = mean over sequences i of -min(s_i A_i, clip(s_i, 0.8, 1.2) A_i)

    At s = 1 the gradient is the paper's REINFORCE, A_i * dlog pi(y_i), with each answer's own
    reward left out of its baseline; the clip guards the stale samples of asynchronous training
    (as TRL's RLOO trainer does).
    """

    _level: ClassVar[str] = "sequence_sum"
    clip_low: float = 0.2
    """The sequence ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """The sequence ratio is clipped above at 1 + clip_high."""
    normalize_std: bool = False
    """Unused: the leave-one-out baseline is not divided by anything."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal before training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_width("RLOO", "clip_low", self.clip_low)
        _check_width("RLOO", "clip_high", self.clip_high)

    @property
    def name(self) -> str:
        return "rloo"

    def advantages(self, rewards_G_N: torch.Tensor) -> torch.Tensor:
        """Leave-one-out advantages; see `leave_one_out_advantages`."""
        return leave_one_out_advantages(rewards_G_N)

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """Whole-sequence clipped surrogate, mean over sequences."""
        return self._surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens,
                               clip=(self.clip_low, self.clip_high), level=self._level,
                               aggregation="row")


@dataclass(frozen=True, kw_only=True)
class ReinforcePP(_Clipped):
    """REINFORCE++ (Hu et al. 2025), the "with baseline" variant for group sampling by default.

        A    = r_i - mean_g            (group_baseline; the plain variant uses r_i)
        A'   = (A - mean) / std        over every trained token of the whole batch
        loss = sum over tokens of -min(r_t A', clip(r_t, 0.8, 1.2) A') / tokens

    Normalising over the batch instead of each group keeps the std of a group with one right
    answer from blowing its advantages up. The trainer normalises once per step, before it
    splits the batch into micro-batches (`batch_advantages`). The paper's KL to the reference
    policy goes in the reward (k1, `corrections.kl_reward_penalty`) once one is wired.
    """

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low (REINFORCE++: PPO's 0.2)."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high."""
    group_baseline: bool = True
    """Subtract the group's mean reward before normalising over the batch."""
    normalize_std: bool = False
    """Unused: the std that divides is the batch's, not the group's."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal before training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_width("ReinforcePP", "clip_low", self.clip_low)
        _check_width("ReinforcePP", "clip_high", self.clip_high)
        _check_bool("ReinforcePP", "group_baseline", self.group_baseline)

    @property
    def name(self) -> str:
        return "reinforce_pp"

    def advantages(self, rewards_G_N: torch.Tensor) -> torch.Tensor:
        """r - group mean (group_baseline) or r itself; the batch normalisation comes after."""
        if self.group_baseline:
            return group_advantages(rewards_G_N, normalize_std=False)
        return _as_float_rewards(rewards_G_N)

    def batch_advantages(self, adv_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        """Normalised over the batch's trained tokens; see `whiten`."""
        return whiten(adv_B_T, mask_B_T)

    def loss(self, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor,
             num_tokens: Count = None) -> tuple[Tensor, Metrics]:
        """PPO clipped surrogate, token mean, on the batch-normalised advantages."""
        return self._surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens,
                               clip=(self.clip_low, self.clip_high), aggregation="token")


ZOO: dict[str, type[Algorithm]] = {
    "dr_grpo": DrGRPO, "dapo": DAPO, "gspo": GSPO, "cispo": CISPO, "rloo": RLOO,
    "reinforce_pp": ReinforcePP,
}
"""The zoo's configs by `name`, for `algorithm_from_dict`."""
