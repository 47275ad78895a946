"""The contracts between astranb's parts: small Protocols that local and remote parts both satisfy.

The dataflow (gate, buffers, orchestrator, train loop) is written against these, never against a
concrete engine, trainer or HTTP client, so the Session can hand it parts that run in this
process or parts that talk to services, and the simulator parts that cost virtual time:

    Engine             samples completions; takes new weights as it runs   engines/, sim/
    Trainer            one optimizer step per batch; the current weights   training/, remote/, sim/
    Checkpointable     a trainer whose state is saved and loaded           LocalTrainer,
                                                                           ProcessTrainer
    SupervisedTrainer  a trainer that also takes supervised steps          the same two
    RecordingTrainer   a trainer that records what a step trained          the same two
    Publisher          brings a policy's samplers to its trainer's version weights/, remote/, sim/
    PolicyHandle       what the dataflow sees of a policy                  session.policy.Policy
    RemoteEpisodes     episodes played elsewhere (rollout services)        remote.pool, sim/
    RunRecorder        where rows, events and episodes go                  session.recorder

An implementation declares the contracts it satisfies by subclassing them (`class
LocalTrainer(Trainer, Checkpointable, SupervisedTrainer)`): that is what a reader, mypy and
tests/test_contracts.py go by, and it gives the implementation the documented defaults of the
contract's optional members (`Trainer.prepare`, `Publisher.overlaps_next_step`,
`Publisher.publish_initial`). Callers never probe for a member with getattr/hasattr: what is
optional is either declared here with a default, or a separate capability contract checked with
isinstance (`Checkpointable`, `SupervisedTrainer`).

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
    "RecordingTrainer",
    "RunRecorder",
    "SupervisedTrainer",
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

    `LocalTrainer` (this process), `ProcessTrainer` (a child process), the FSDP trainer behind a
    trainer service (through `remote.RemoteTrainer`) and the simulator's trainer satisfy it.
    `step` may be a plain method (run in a worker thread) or a coroutine (awaited).
    """

    version: int
    """Steps taken so far (the version of the current weights)."""

    def step(self, batch: Batch) -> Any:
        """One optimizer step on `batch`; returns (or resolves to) its metrics."""
        ...

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights by parameter name."""
        ...

    async def prepare(self, batch: Batch) -> None:
        """Get `batch` ready for the `step` that will receive it (the train loop calls this when
        it collects a batch, possibly while the previous step still trains).

        Default: nothing to do. `ProcessTrainer` encodes the batch for its pipe here, in a
        worker thread, so its next step only has to send the bytes.
        """
        return None


@runtime_checkable
class Checkpointable(Protocol):
    """A trainer whose state can be written to a folder and read back (`LocalTrainer`,
    `ProcessTrainer`): what `train(checkpoint_every=...)` and `Session.resume` need. A trainer
    service checkpoints itself and is not one."""

    def save(self, directory: str | os.PathLike[str]) -> Any:
        """Write weights, optimizer state and version (safetensors + JSON)."""
        ...

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what `save` wrote."""
        ...


@runtime_checkable
class SupervisedTrainer(Protocol):
    """A trainer that also takes supervised steps (`Policy.sft`'s warm start): `LocalTrainer`,
    `ProcessTrainer`. Each supervised step is a weight version, as in RL."""

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """One step of negative log-likelihood on the batch's loss-masked tokens; its metrics.
        `lr` overrides the optimizer's learning rate for this step."""
        ...


@runtime_checkable
class RecordingTrainer(Protocol):
    """A trainer that can record what one step trained, token by token, for the step inspector
    (`train(inspect_every=N)`): `LocalTrainer`, `ProcessTrainer`. The recorded step is an
    ordinary `step` call, so whatever wraps or watches `step` sees it too."""

    def record_next_step(self) -> None:
        """Have the next `step` also record what it trains."""
        ...

    def take_recording(self) -> Any:
        """The last recorded step's record (a `training.trace.StepTrace`), once; None when
        there is none."""
        ...


@runtime_checkable
class Publisher(Protocol):
    """Brings whatever samples for one policy to that policy's trainer's current version.

    A publisher is built for one policy: it holds the policy's name, its trainer and the engine
    (or rollout services) it feeds, so its methods take no arguments.
    """

    overlaps_next_step: bool = False
    """Whether a version's weights are already in this process when `publish` starts (a trainer
    in a child process sends them with the step's reply): the train loop may then start the
    next step while they are applied, and collect its batch during the step. Default: False."""

    @property
    def where(self) -> str:
        """Where the policy's rollouts run, in words ("this process", "2 rollout service(s)")."""
        ...

    @property
    def checksum(self) -> int | None:
        """Checksum of the latest published weights (None before the first publish)."""
        ...

    def publish_initial(self) -> None:
        """Publish version 0 before the first episode (blocking: called while the policy is
        built), so the samplers start from exactly the published weights.

        Default: nothing, for samplers that already hold the trainer's starting weights (an
        engine built from the same recipe, a simulated one)."""
        return None

    async def publish(self) -> dict[str, Any]:
        """Send the trainer's weights out as version `trainer.version`; transfer metrics."""
        ...


class PolicyHandle(Protocol):
    """What the dataflow sees of a policy."""

    name: str
    algorithm: Any
    tokenizer: Any
    engine: Engine | None

    @property
    def version(self) -> int: ...

    @property
    def overlaps_next_step(self) -> bool:
        """Its publisher's `Publisher.overlaps_next_step`."""
        ...

    async def prepare(self, batch: Batch) -> None:
        """Its trainer's `Trainer.prepare`."""
        ...

    async def train_step(self, batch: Batch) -> dict[str, float]: ...

    async def train_step_recorded(self, batch: Batch) -> tuple[dict[str, float], Any]:
        """`train_step`, and what it trained (a `training.trace.StepTrace`; None when its
        trainer is no `RecordingTrainer`)."""
        ...

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

    def add_row(self, row: dict[str, Any], *, samples: dict[str, Any] | None = None) -> None:
        """A metrics row; `samples`: the names of the samples it accounts for, in
        `ledger.compact` form ({"trained": ..., "dropped": {reason: ...}})."""
        ...

    def add_event(self, kind: str, data: dict[str, Any]) -> None: ...

    def add_trace(self, row: dict[str, Any], trace: Any) -> None:
        """What the step of metrics row `row` trained (a `training.trace.StepTrace`), for the
        step inspector; kept on a bounded basis."""
        ...

    def add_episode(self, trajectory: Trajectory, trainer_version: int, *,
                    environment: Any = None, tokenizers: Mapping[str, Any] | None = None
                    ) -> Any: ...
