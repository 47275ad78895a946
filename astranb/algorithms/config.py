"""Algorithm configs: what a user passes to `session.policy(..., algorithm=...)`.

An algorithm is two choices: how a group's rewards become advantages, and which token loss turns
advantages into a gradient. Both configs here use group-relative advantages (`group_advantages`)
and differ in the loss:

    GRPO()   PPO's clipped surrogate: each token's ratio is clipped to
             [1 - clip_low, 1 + clip_high].
    M2PO()   no clipping; instead the fewest tokens with the largest (log r)^2 are dropped until
             the batch's mean (log r)^2 is within `threshold`. Made for stale (asynchronous) data.

With `filter_groups=True` the trainer drops groups whose rewards are all equal before training
(dynamic sampling); their advantages are all zero and would only dilute the token mean.

Configs are frozen dataclasses: hashable, printable, and checked when built, so a typo fails at
the call that made it rather than in the middle of a run.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import torch

from .base import Algorithm, _check_bool, _check_entropy, _check_number, _check_tis
from .corrections import truncation, truncation_masks
from .losses import logp_gradient_loss, masked_log_ratio, ppo_clip_loss
from .m2po import m2po_loss, m2po_mask
from .surrogates import clipped_surrogate_loss, surrogate_clipped
from .zoo import ZOO

__all__ = [
    "Algorithm",
    "GRPO",
    "M2PO",
    "LogpGradient",
    "CodeNotAllowed",
    "algorithm_to_dict",
    "algorithm_from_dict",
    "algorithm_reference",
    "travels_as_config",
]


def _check_clip(field: str, value: object) -> None:
    """A GRPO clip width must lie strictly between 0 and 1.

    Args:
        field: "clip_low" or "clip_high".
        value: the value given.
    """
    number = _check_number("GRPO", field, value)
    if not 0 < number < 1:
        raise ValueError(
            f"GRPO {field} must be in (0, 1), got {value!r}: it is a fraction of the ratio "
            f"(the ratio is clipped to [1 - clip_low, 1 + clip_high]); use e.g. {field}=0.2"
        )


@dataclass(frozen=True)
class GRPO(Algorithm):
    """Group-relative advantages with PPO's clipped surrogate loss."""

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low; in (0, 1)."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high; in (0, 1). DAPO's "clip higher" uses 0.28."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std; False only subtracts the group mean."""
    filter_groups: bool = True
    """Drop groups whose rewards are all equal before training (dynamic sampling)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (token mean of the policy's entropy, subtracted from the loss).
    Keeps exploration alive when a small model would otherwise collapse onto one answer."""
    tis_cap: float | None = None
    """Truncated importance sampling's cap C for the engine/trainer mismatch (Yao et al. 2025
    use 2; see algorithms/corrections.py); None: off, the ratio is to the engine's logprobs."""
    tis_level: str = "token"
    """"token": one truncated weight per token; "sequence": one per sequence."""

    def __post_init__(self) -> None:
        _check_clip("clip_low", self.clip_low)
        _check_clip("clip_high", self.clip_high)
        _check_bool("GRPO", "normalize_std", self.normalize_std)
        _check_bool("GRPO", "filter_groups", self.filter_groups)
        _check_entropy("GRPO", self.entropy_coef)
        _check_tis("GRPO", self.tis_cap, self.tis_level)

    @property
    def name(self) -> str:
        return "grpo"

    def loss(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        adv_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        num_tokens: int | float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO clipped surrogate; see `ppo_clip_loss` (times truncated IS weights with tis_cap)."""
        if self.tis_cap is None:
            return ppo_clip_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T,
                                 clip_low=self.clip_low, clip_high=self.clip_high,
                                 num_tokens=num_tokens)
        old_B_T, weight_B_T, extra = truncation(logp_B_T, old_logp_B_T, mask_B_T, self.tis_cap,
                                                self.tis_level)
        loss, metrics = clipped_surrogate_loss(logp_B_T, old_B_T, adv_B_T, mask_B_T,
                                               clip_low=self.clip_low, clip_high=self.clip_high,
                                               weight_B_T=weight_B_T, num_tokens=num_tokens)
        return loss, {**metrics, **extra}

    def token_masks(self, logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor,
                    adv_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> dict[str, torch.Tensor]:
        """"clipped" (what clip_frac counts) and, with tis_cap, "capped"."""
        old_B_T, masks = truncation_masks(logp_B_T, old_logp_B_T, mask_B_T, self.tis_cap,
                                          self.tis_level)
        masks["clipped"] = surrogate_clipped(logp_B_T, old_B_T, adv_B_T, mask_B_T,
                                             clip_low=self.clip_low, clip_high=self.clip_high)
        return masks


@dataclass(frozen=True)
class M2PO(Algorithm):
    """Group-relative advantages with M2PO's second-moment token masking and no clipping."""

    threshold: float = 0.04
    """Bound on the mean (log r)^2 of the batch's tokens; > 0. The paper's default is 0.04."""
    only_violating: bool = False
    """AstraFlow's variant: only sign-violating tokens, (A>0, r>1) or (A<0, r<1), are measured
    and may be dropped; all other tokens are always kept."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std; False only subtracts the group mean."""
    filter_groups: bool = True
    """Drop groups whose rewards are all equal before training (dynamic sampling)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (token mean of the policy's entropy, subtracted from the loss).
    Keeps exploration alive when a small model would otherwise collapse onto one answer."""

    def __post_init__(self) -> None:
        threshold = _check_number("M2PO", "threshold", self.threshold)
        if not (threshold > 0 and math.isfinite(threshold)):
            raise ValueError(
                f"M2PO threshold must be a finite number > 0, got {self.threshold!r}: it bounds "
                "the mean (log ratio)^2 of the batch; use e.g. threshold=0.04 (the paper's default)"
            )
        _check_bool("M2PO", "only_violating", self.only_violating)
        _check_bool("M2PO", "normalize_std", self.normalize_std)
        _check_bool("M2PO", "filter_groups", self.filter_groups)
        _check_entropy("M2PO", self.entropy_coef)

    @property
    def name(self) -> str:
        return "m2po"

    def loss(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        adv_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        num_tokens: int | float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """M2PO loss; see `m2po_loss`."""
        return m2po_loss(
            logp_B_T,
            old_logp_B_T,
            adv_B_T,
            mask_B_T,
            threshold=self.threshold,
            only_violating=self.only_violating,
            num_tokens=num_tokens,
        )

    @torch.no_grad()
    def token_masks(self, logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor,
                    adv_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> dict[str, torch.Tensor]:
        """"dropped": the tokens `m2po_mask` removes (what m2po_masked_frac counts)."""
        log_ratio_B_T = masked_log_ratio(logp_B_T, old_logp_B_T, mask_B_T)
        kept_B_T = m2po_mask(log_ratio_B_T, mask_B_T, self.threshold,
                             only_violating=self.only_violating, adv_B_T=adv_B_T)
        return {"dropped": mask_B_T.bool() & ~kept_B_T.bool()}


@dataclass(frozen=True)
class LogpGradient(Algorithm):
    """The trainer's half of a loss that runs elsewhere: each token's advantage is dL/dlogp.

    A trainer in another process cannot run a loss written in a notebook cell (code does not
    travel), so the caller computes the loss on the logprobs the trainer sent and sends back
    its gradient with respect to them in the batch's advantages (see training/caller_loss.py).
    This config turns that into the parameters' gradient:

        loss = sum over trained tokens of  adv_t * logp_t        (no mean: adv_t already holds it)

    whose gradient is sum_t dL/dlogp_t * dlogp_t/dtheta, the caller's loss's own.
    """

    normalize_std: bool = False
    """Unused here (the caller computed the advantages)."""
    filter_groups: bool = False
    """Unused here (the caller filtered the groups)."""
    entropy_coef: float = 0.0
    """The caller's algorithm's entropy bonus: the trainer adds it, as for its own algorithms."""

    def __post_init__(self) -> None:
        _check_entropy("LogpGradient", self.entropy_coef)

    @property
    def name(self) -> str:
        return "logp_gradient"

    def loss(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        adv_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        num_tokens: int | float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """sum(adv * logp) over the trained tokens; see `logp_gradient_loss`."""
        return logp_gradient_loss(logp_B_T, adv_B_T, mask_B_T), {}


_KINDS: dict[str, type[Algorithm]] = {"grpo": GRPO, "m2po": M2PO, "logp_gradient": LogpGradient}


def _kinds() -> dict[str, type[Algorithm]]:
    """Every config that travels as JSON, by name: the ones above and the zoo's."""
    return {**_KINDS, **ZOO}


class CodeNotAllowed(ValueError):
    """An algorithm given by reference (`module:qualname`) to a process that imports no code."""


def travels_as_config(algorithm: Algorithm) -> bool:
    """Whether `algorithm_to_dict` can describe it: one of astranb's own configs, not a subclass.

    Any other Algorithm (a loss written in a notebook cell) trains in another process only by
    running its loss in the caller (training/caller_loss.py) or, where the trainer imports code,
    by reference (`algorithm_reference`)."""
    return _kinds().get(str(getattr(algorithm, "name", ""))) is type(algorithm)


def algorithm_to_dict(algorithm: Algorithm) -> dict[str, Any]:
    """A JSON-able description of an algorithm config, for sending it to another process.

    Args:
        algorithm: one of astranb's algorithm configs.

    Returns:
        {"kind": algorithm.name, **fields}; `algorithm_from_dict` turns it back.

    Raises:
        TypeError: for any other Algorithm subclass (its code cannot travel as JSON; see
            `travels_as_config`).
    """
    if not travels_as_config(algorithm):
        raise TypeError(
            f"{algorithm!r} is not one of astranb's algorithm configs "
            f"({', '.join(sorted(_kinds()))})"
            ", so it cannot be described as JSON; trainers in other processes run its loss in "
            "the caller instead (training/caller_loss.py)"
        )
    return {"kind": algorithm.name, **asdict(algorithm)}  # type: ignore[call-overload]


def algorithm_reference(algorithm: Algorithm) -> dict[str, Any] | None:
    """The algorithm by reference: its class's `module:qualname` and its fields, for a process
    that imports code (a trainer service started with --allow-code); None when it has none.

    It has none when the class cannot be imported again by that name (defined in a notebook
    cell or in `__main__`, or inside a function), is not a dataclass, or has a field JSON
    cannot hold.
    """
    cls = type(algorithm)
    module, qualname = cls.__module__, cls.__qualname__
    if module == "__main__" or "<locals>" in qualname or not is_dataclass(algorithm):
        return None
    try:
        if _import(f"{module}:{qualname}") is not cls:
            return None
        values = {f.name: getattr(algorithm, f.name) for f in fields(algorithm)}
        json.dumps(values, allow_nan=False)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return {"kind": "import", "ref": f"{module}:{qualname}", "fields": values}


def _import(ref: str) -> Any:
    module, _, qualname = ref.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def algorithm_from_dict(data: dict[str, Any], *, allow_import: bool = False) -> Algorithm:
    """The config `algorithm_to_dict` (or `algorithm_reference`) described, validated again as
    when built by hand.

    Args:
        data: {"kind": ..., **fields}, or {"kind": "import", "ref": "module:qualname",
            "fields": {...}}.
        allow_import: whether a reference may be imported (it runs the module's code).

    Raises:
        ValueError: unknown kind or unknown field, or a reference that is no Algorithm class.
        CodeNotAllowed: a reference, and allow_import is False.
    """
    data = dict(data)
    kind = data.pop("kind", None)
    if kind == "import":
        ref = str(data.get("ref", ""))
        if not allow_import:
            raise CodeNotAllowed(
                f"the algorithm is given by reference ({ref}), and this process does not import "
                "code: start the trainer service with --allow-code to run it there, or leave the "
                "algorithm as it is and its loss runs in the caller")
        try:
            cls = _import(ref)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(f"cannot import the algorithm {ref!r}: {error}") from error
        if not (isinstance(cls, type) and issubclass(cls, Algorithm) and is_dataclass(cls)):
            raise ValueError(f"{ref!r} is not an Algorithm dataclass")
        return cls(**dict(data.get("fields") or {}))
    kinds = _kinds()
    if kind not in kinds:
        raise ValueError(f"unknown algorithm kind {kind!r}; expected one of {sorted(kinds)}")
    cls = kinds[kind]
    unknown = set(data) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**data)
