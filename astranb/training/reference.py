"""A frozen reference (or teacher) policy that only scores: KL to it, or on-policy distillation.

The trainer holds the reference beside the policy it trains: a second copy of a model, frozen
(no optimizer, no engine), that scores the tokens of every batch the policy trains on. With the
batch's tokens sampled by the policy and log r = ref_logp - logp:

    KL in the loss        loss += kl_coef * token mean of k(log r)      (k1, k2 or k3; see
                                                                         algorithms/corrections)
    distillation          advantage_t += distill * (ref_logp_t - old_logp_t)

The second is on-policy distillation (as in Agarwal et al. 2024, "On-Policy Distillation of
Language Models", and Thinking Machines' 2025 write-up): the student samples, the teacher
scores each sampled token, and the per-token reverse KL, old_logp - ref_logp, is a cost the
policy gradient lowers; its negative is the token's advantage, taken before the step (no
gradient flows into it). With `distill` alone (an algorithm that does not filter tied groups,
e.g. `GRPO(filter_groups=False)`, and an environment whose reward is constant) the student
learns only from the teacher; with a task reward as well, both signals add up.

`model=None` is the policy's own model as built (its weights before any training): KL to the
starting policy, as RLHF's PPO and DeepSeekMath's GRPO use. Any other model must share the
policy's tokenizer (the tokens are scored as they are).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..algorithms.corrections import KL_ESTIMATORS
from ..models import ModelSpec

__all__ = ["Reference", "reference_to_dict", "reference_from_dict"]


@dataclass(frozen=True)
class Reference:
    """What the trainer scores a policy's batches with, and what it does with the scores.

    Example:
        session.policy("solver", model=ab.models.tiny(), reference=ab.Reference(kl_coef=0.04))
        session.policy("student", model=ab.models.tiny(), algorithm=ab.GRPO(filter_groups=False),
                       reference=ab.Reference(model=ab.models.local("teacher"), distill=1.0))
    """

    model: ModelSpec | None = None
    """The reference's model (`ab.models.local(dir)`, ...); None: the policy's own, as built."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference) in the loss (DeepSeekMath's GRPO: 0.04; 0: none)."""
    estimator: str = "k3"
    """"k1", "k2" or "k3" (Schulman's estimators; k3 is unbiased and never negative)."""
    distill: float = 0.0
    """Weight of the per-token distillation signal ref_logp - old_logp added to each token's
    advantage (0: none)."""

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, ModelSpec):
            raise TypeError(f"Reference model must be a ModelSpec (ab.models.local(dir), "
                            f"ab.models.tiny(...)) or None, got {self.model!r}")
        for field, value in (("kl_coef", self.kl_coef), ("distill", self.distill)):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"Reference {field} must be a number >= 0, got {value!r}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"Reference estimator must be one of {KL_ESTIMATORS}, got "
                             f"{self.estimator!r}")
        if not self.kl_coef and not self.distill:
            raise ValueError("a Reference with kl_coef=0 and distill=0 does nothing; give "
                             "kl_coef (e.g. 0.04: KL in the loss) or distill (e.g. 1.0: on-policy "
                             "distillation from it)")


def reference_to_dict(reference: Reference) -> dict[str, Any]:
    """Plain values (a run's plan, a trainer child's header)."""
    model = None if reference.model is None else dataclasses.asdict(reference.model)
    return {"model": model, "kl_coef": float(reference.kl_coef),
            "estimator": reference.estimator, "distill": float(reference.distill)}


def reference_from_dict(data: dict[str, Any]) -> Reference:
    """Inverse of `reference_to_dict`."""
    model = data.get("model")
    return Reference(None if model is None else ModelSpec(**model),
                     float(data.get("kl_coef", 0.0)), str(data.get("estimator", "k3")),
                     float(data.get("distill", 0.0)))
