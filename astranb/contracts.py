"""The contracts between astranb's parts: small Protocols that local and remote parts both satisfy.

The dataflow (gate, buffers, orchestrator, train loop) is written against these, never against a
concrete engine, trainer or HTTP client, so the Session can hand it parts that run in this
process or parts that talk to services, and the simulator parts that cost virtual time:

    Engine          samples completions; takes new weights as it runs  engines/ (hf, sglang), sim
    Trainer         one optimizer step per batch; the current weights  training/, remote/trainer
    Publisher       brings samplers to the trainer's latest version    weights/publish, remote/pool
    PolicyHandle    what the dataflow sees of a policy                 policy.Policy
    RemoteEpisodes  episodes played elsewhere (rollout services)       remote/pool
    RunRecorder     where rows, events and episodes go                 recorder.Recorder

Nothing here imports anything of astranb but `types`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import torch

from .types import Batch, Generation, GenerationRequest, Trajectory, WeightUpdate

__all__ = [
    "Checkpointable",
    "Engine",
    "Trainer",
    "Publisher",
    "PolicyHandle",
    "RemoteEpisodes",
    "RunRecorder",
    "Tokenizer",
]


class Tokenizer(Protocol):
    """The part of a (Hugging Face) tokenizer astranb uses."""

    pad_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """A rollout engine: samples completions from the latest weights it was given.

    Every sampled token carries the weight version that produced it; updates are applied
    between decode steps (in-flight), so tokens after an update carry the new version.
    """

    name: str
    """Policy name the engine serves."""

    @property
    def version(self) -> int:
        """Weight version the next sampled token will carry."""
        ...

    @property
    def weights_checksum(self) -> int | None:
        """Checksum of the weights as last published to the engine (None: none or unknown)."""
        ...

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generate one completion; cancelling the awaiting task drops the request."""
        ...

    def update_weights(self, update: WeightUpdate) -> Future[Any]:
        """Queue new weights, applied between decode steps.

        Resolves to {"kind", ...} once applied.
        """
        ...

    def close(self) -> None:
        """Stop the engine and free what it holds."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """Trains one policy: a step per batch, and the weights as they are now.

    `LocalTrainer` (this process), the FSDP trainer behind a trainer service (through
    `remote.RemoteTrainer`) and the simulator's trainer satisfy it. `step` may be a plain method
    (run in a worker thread) or a coroutine (awaited).
    """

    @property
    def version(self) -> int:
        """Steps taken so far (the version of the current weights)."""
        ...

    def step(self, batch: Batch) -> Any:
        """One optimizer step on `batch`; returns (or resolves to) its metrics."""
        ...

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights by parameter name."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """A trainer whose state can be written to a folder and read back (`LocalTrainer`,
    `ProcessTrainer`): what `train(checkpoint_every=...)` and `Session.resume` need."""

    def save(self, directory: str | os.PathLike[str]) -> Any:
        """Write weights, optimizer state and version (safetensors + JSON)."""
        ...

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what `save` wrote."""
        ...


@runtime_checkable
class Publisher(Protocol):
    """Brings whatever samples for a policy to the trainer's current version."""

    @property
    def where(self) -> str:
        """Where the policy's rollouts run, in words ("this process", "2 rollout service(s)")."""
        ...

    @property
    def checksum(self) -> int | None:
        """Checksum of the latest published weights (None before the first publish)."""
        ...

    async def publish(self, name: str, trainer: Trainer) -> dict[str, Any]:
        """Send `trainer`'s weights out as version `trainer.version`; transfer metrics."""
        ...


class PolicyHandle(Protocol):
    """What the dataflow sees of a policy."""

    name: str
    algorithm: Any
    tokenizer: Any
    engine: Engine | None

    @property
    def version(self) -> int: ...

    async def train_step(self, batch: Batch) -> dict[str, float]: ...

    async def publish(self) -> dict[str, Any]: ...


class RemoteEpisodes(Protocol):
    """Episodes played somewhere else (rollout services) instead of in this process."""

    epoch: int
    """Moves on when a trainer rolls back: episodes begun before are discarded on arrival."""

    def episode_ids(self, group: int, n: int) -> list[str]: ...

    async def play(self, env: Any, samples: Sequence[tuple[str, dict[str, Any], int, int]]
                   ) -> list[Trajectory]:
        """Play episodes (id, sample, group, admitted version); their trajectories, in order."""
        ...

    def start_run(self, sources: Sequence[Any]) -> None:
        """New episode ids and accounting for a run; register its environments with the services."""
        ...

    async def run(self) -> None:
        """Serve the services (pulls, heartbeats, failover) until cancelled."""
        ...


class RunRecorder(Protocol):
    """Where a run's metrics rows, events and episodes go."""

    def add_row(self, row: dict[str, Any]) -> None: ...

    def add_event(self, kind: str, data: dict[str, Any]) -> None: ...

    def add_episode(self, trajectory: Trajectory, trainer_version: int, *,
                    environment: Any = None, tokenizers: Mapping[str, Any] | None = None
                    ) -> Any: ...
