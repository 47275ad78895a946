"""Plain data that flows through astranb: samples, generations, trajectories, batches, weights.

Everything here is a frozen dataclass so a record can be shared between the event loop, worker
threads and widgets without copies or locks. Tensor fields carry their shape in the name
(`logp_B_T` is batch x tokens).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = [
    "SamplingParams",
    "GenerationRequest",
    "Generation",
    "Turn",
    "ToolCall",
    "Trajectory",
    "Batch",
    "WeightUpdate",
]


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout engine samples one completion."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept before sampling (1.0 keeps the whole distribution)."""
    max_new_tokens: int = 16
    """Upper bound on generated tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (the stop token is kept in the completion)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @staticmethod
    def check_names(names: Iterable[str]) -> None:
        """TypeError naming the options that are not SamplingParams fields, if any."""
        known = {f.name for f in fields(SamplingParams)}
        unknown = set(names) - known
        if unknown:
            raise TypeError(f"unknown sampling option(s) {sorted(unknown)}; use {sorted(known)}")

    @classmethod
    def of(cls, value: SamplingParams | Mapping[str, Any] | None, **defaults: Any
           ) -> SamplingParams:
        """An environment's `sampling=` argument as SamplingParams: given as they are, a dict
        of their fields, or nothing (None or {}) for SamplingParams(**defaults)."""
        if isinstance(value, SamplingParams):
            return value
        if not value:
            return cls(**defaults)
        cls.check_names(value)
        return cls(**value)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt for a rollout engine."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids (already templated and tokenized)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings for this request."""


@dataclass(frozen=True)
class Generation:
    """What an engine returns for one request: tokens with their logprobs and weight versions."""

    prompt_ids: tuple[int, ...]
    """The prompt, as given."""
    completion_ids: tuple[int, ...]
    """Sampled tokens, stop token included."""
    logprobs: tuple[float, ...]
    """Log-probability of each sampled token under the sampling distribution that drew it."""
    versions: tuple[int, ...]
    """Weight version that produced each sampled token (same length as completion_ids)."""
    finish_reason: str
    """"stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""
    text: str = ""
    """Decoded completion without special tokens."""

    @property
    def min_version(self) -> int:
        """Oldest weight version among the completion's tokens."""
        return min(self.versions) if self.versions else -1


@dataclass(frozen=True)
class Turn:
    """One generate() call inside an episode, made by one role."""

    role: str
    """Environment role that made the call."""
    policy: str
    """Name of the policy wired to that role."""
    generation: Generation
    """The engine's answer."""
    sampling: SamplingParams
    """Sampling settings used (the trainer needs the temperature)."""
    agent: str = ""
    """Which agent of the episode's tree made the call: "" the episode's own, "0", "0.1", ...
    the sub-agents `ctx.spawn` started (`agent_depth` gives its depth)."""


def agent_depth(agent: str) -> int:
    """Depth of a `Turn.agent` path in the episode's tree: 0 for "", 1 for "0", 2 for "0.1"."""
    return agent.count(".") + 1 if agent else 0


@dataclass(frozen=True)
class ToolCall:
    """One `ctx.tool(...)` call inside an episode: what a tool was asked and what it answered."""

    name: str
    """Name the episode gave the tool."""
    args: Mapping[str, Any]
    """The call's arguments by parameter name, as JSON values (repr() for anything else)."""
    result: Any = None
    """What the tool returned, as a JSON value (repr() for anything else); None if it raised."""
    error: str | None = None
    """"ExceptionType: message" when the tool raised (the episode then sees the exception)."""
    position: int = 0
    """Number of generate() turns made before the call (where it sits between the turns)."""


@dataclass(frozen=True)
class Trajectory:
    """A finished episode: every turn it made and the rewards it earned."""

    sample: Mapping[str, Any]
    """The dataset sample the episode ran on."""
    turns: tuple[Turn, ...]
    """Every generate() call, in order."""
    rewards: Mapping[str, float]
    """Reward per role."""
    group: int
    """Group id: episodes of one group share a sample and are normalised together."""
    error: str | None = None
    """Traceback text when the episode raised; such an episode is never trained on."""
    started_version: int = 0
    """Trainer version when the episode was admitted."""
    id: str = ""
    """Episode id, unique within a run ("<group>.<index>"); services deduplicate results by it."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Every ctx.tool() call, in call order."""
    env: str = ""
    """Name of the environment that played the episode."""
    truncated: str | None = None
    """Why the episode was cut short (context or token budget), or None if it ended itself."""
    counts: Mapping[str, int] = field(default_factory=dict)
    """Facts the episode counted with `ctx.count` (malformed tool calls, verifier timeouts);
    summed into the run's metrics as `count/<name>`."""
    sample_id: str = ""
    """Which sample of the run's streams it played, "<stream>:<position>" (a training run's
    episodes; "" otherwise): the same name before and after a resume."""

    def __repr__(self) -> str:
        def turn(t: Turn) -> str:
            versions = sorted(set(t.generation.versions))
            span = (f"v{versions[0]}" + (f"-{versions[-1]}" if len(versions) > 1 else "")
                    if versions else "v?")
            tokens = len(t.generation.completion_ids)
            return f"{t.role}: {t.generation.text!r} ({tokens} tokens, {span})"

        calls = f", {len(self.tool_calls)} tool call(s)" if self.tool_calls else ""
        outcome = f"rewards={dict(self.rewards)}" if self.ok else "FAILED"
        if self.truncated:
            outcome += ", truncated"
        return (f"Trajectory({self.env or 'episode'} {self.id or ''} group {self.group}: "
                f"[{'; '.join(turn(t) for t in self.turns)}]{calls}, {outcome})")

    def _repr_html_(self) -> str | None:
        """The step-through viewer in a notebook (prompts need a tokenizer, so they show as token
        ids); None (plain repr) when no view is registered."""
        return _html_view(self) if _html_view is not None else None

    @property
    def ok(self) -> bool:
        return self.error is None

    def min_version(self, policy: str | None = None) -> int:
        """Oldest token version in the episode (optionally only the given policy's tokens)."""
        versions = [
            t.generation.min_version for t in self.turns if policy is None or t.policy == policy
        ]
        versions = [v for v in versions if v >= 0]
        return min(versions) if versions else -1


_html_view: Callable[[Trajectory], str] | None = None


def register_html_view(view: Callable[[Trajectory], str]) -> None:
    """How a Trajectory shows in a notebook. Plain data imports nothing above it, so the layer
    that knows how to show an episode (the recorder) registers itself here."""
    global _html_view
    _html_view = view


def jsonable(value: Any) -> Any:
    """`value` as JSON values: mappings and sequences converted inside, repr() for the rest."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, numbers.Integral):  # numpy integers too
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None  # NaN and inf are not JSON
    return repr(value)


@dataclass(frozen=True)
class Batch:
    """A padded training batch for one policy. Prompt tokens have loss_mask 0."""

    input_ids_B_T: torch.Tensor
    """Prompt + completion token ids, right padded."""
    attention_mask_B_T: torch.Tensor
    """1 for real tokens, 0 for padding."""
    loss_mask_B_T: torch.Tensor
    """1 on completion tokens that are trained (targets), aligned with input_ids."""
    old_logp_B_T: torch.Tensor
    """Behaviour logprob of each target token (0 where loss_mask is 0)."""
    advantages_B_T: torch.Tensor
    """Advantage of each target token (the sequence advantage broadcast over its tokens)."""
    versions_B_T: torch.Tensor
    """Weight version that generated each target token (-1 on prompt and padding)."""
    temperature_B: torch.Tensor
    """Sampling temperature of each row (the trainer scales logits by it)."""
    rewards_B: torch.Tensor
    """Scalar reward of each row."""
    top_p_B: torch.Tensor | None = None
    """Nucleus mass each row was sampled with (None: 1 everywhere); the trainer truncates its
    distribution the same way, so its logprobs are those of the distribution that sampled."""

    def __post_init__(self) -> None:
        if self.top_p_B is None:
            object.__setattr__(self, "top_p_B", torch.ones(self.input_ids_B_T.shape[0]))

    @property
    def size(self) -> int:
        return int(self.input_ids_B_T.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask_B_T.sum())


@dataclass(frozen=True)
class WeightUpdate:
    """A published set of weights for one policy."""

    policy: str
    """Policy name."""
    version: int
    """Version these weights are (the trainer's step count after producing them)."""
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> tensor, as the engine's model names them (empty when `payload` is set)."""
    payload: bytes | bytearray | None = None
    """Instead of `state`: a weight payload (full snapshot or delta, see astranb.weights)."""
    prepared: Any = None
    """Work done on `payload` while it arrived (a weights.Prepared: its hash, inflated sections);
    engines hand it to `Mirror.apply`, which uses it only for that very buffer."""
