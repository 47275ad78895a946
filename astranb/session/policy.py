"""A policy: one model being trained, with the engine that samples from it and its trainer.

`session.policy(...)` builds one; users rarely construct it directly. The engine and the trainer
each hold their own copy of the model, built from the same spec so they start bit-identical; after
every train step the trainer publishes its weights to the engine as version v+1.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from ..algorithms import Algorithm
from ..contracts import Engine, Publisher, RecordingTrainer, SupervisedTrainer, Trainer
from ..dataflow.batcher import build_batch, pad_id
from ..dataflow.buffer import Group
from ..models import ModelSpec
from ..training.local import AdamWConfig
from ..training.lora import LoRA
from ..training.sft import Demonstration, sft_batches
from ..types import Batch

__all__ = ["Policy"]


@dataclass(eq=False)
class Policy:
    """One trainable policy.

    Attributes:
        name: unique within the session; used in metrics and wiring.
        spec: how the model and tokenizer are built.
        algorithm: advantage and loss rule (GRPO, M2PO).
        optimizer: AdamW settings.
        engine: the rollout engine sampling from the current weights.
        trainer: the trainer updating them.
        publisher: how new weights get from the trainer to the engine or the services.
    """

    name: str
    spec: ModelSpec
    algorithm: Algorithm
    optimizer: AdamWConfig
    engine: Engine | None
    """The engine in this process (None when rollout services sample for the policy)."""
    trainer: Trainer
    """Local, on a trainer service (`remote.RemoteTrainer`) or simulated: one contract."""
    publisher: Publisher
    """Brings the engine (or the rollout services) to the trainer's latest version."""
    tokenizer: Any = field(repr=False)
    max_batch_size: int = 64
    """Most sequences an engine decodes at once."""
    seed: int = 0
    """Sampling seed of the engine(s)."""
    lora: LoRA | None = None
    """The LoRA adapters the trainer trains in place of the full weights (None: full weights)."""
    run_on_loop: Callable[[Callable[[], Awaitable[Any]]], Any] | None = field(
        default=None, repr=False)
    """Runs a coroutine function on the session's event loop (set by the session)."""

    @property
    def version(self) -> int:
        """Weights version: the number of train steps taken."""
        return self.trainer.version

    @property
    def weights_checksum(self) -> int | None:
        """Checksum of the latest published weights (None before the first publish)."""
        return self.publisher.checksum

    @property
    def overlaps_next_step(self) -> bool:
        """Whether the next step may start while this one's weights are applied (the publisher
        has them in hand when it starts: a trainer in a child process)."""
        return self.publisher.overlaps_next_step

    async def prepare(self, batch: Batch) -> None:
        """Get `batch` ready for the train step that will receive it (the trainer's own
        preparation: encoding it for a child process's pipe; most trainers have none)."""
        await self.trainer.prepare(batch)

    async def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step, off the event loop: awaited when the trainer's step is async (a
        trainer service, a simulated trainer), else in a worker thread."""
        if inspect.iscoroutinefunction(self.trainer.step):
            metrics: dict[str, float] = await self.trainer.step(batch)
            return metrics
        return await anyio.to_thread.run_sync(self.trainer.step, batch)

    async def train_step_recorded(self, batch: Batch) -> tuple[dict[str, float], Any]:
        """`train_step`, and what it trained (a `training.trace.StepTrace`) when the trainer
        records steps (`RecordingTrainer`); None, and a plain step, when it does not."""
        trainer = self.trainer
        if not isinstance(trainer, RecordingTrainer):
            return await self.train_step(batch), None
        trainer.record_next_step()
        metrics = await self.train_step(batch)
        return metrics, trainer.take_recording()

    async def publish(self) -> dict[str, Any]:
        """Send the trainer's current weights out; returns once the samplers use them.

        Through a weight store (the default) the weights travel as a payload: a delta against
        the receiver's version when it holds the previous one, else a full snapshot; a delta
        that fails to apply (wrong base, corruption) is healed by a full snapshot. Returns
        transfer metrics for the run's metrics row.
        """
        return await self.publisher.publish()

    # -- a manual loop (session/manual.py): the blocks a train step is made of -----------------

    def build_batch(self, groups: Sequence[Group]) -> Batch:
        """Collate this policy's turns of `groups` (from `session.play`) into the batch a step
        trains: tokens, masks, the algorithm's group-relative advantages, the sampling logprobs
        and the weight version of every token (`dataflow.batcher.build_batch`, the train
        loop's own)."""
        return build_batch(list(groups), self.name, self.algorithm, pad_id(self.tokenizer))

    def forward_backward(self, batch: Batch, algorithm: Algorithm | None = None
                         ) -> dict[str, float]:
        """The loss of `batch` (the policy's algorithm, or `algorithm`) and its gradient,
        added to the trainer's gradients; the weights do not change until `optim_step`.

        Returns:
            The loss and the algorithm's metrics (what a metrics row gets from a step).
        """
        metrics: dict[str, float] = self._blocks("forward_backward").forward_backward(
            batch, algorithm)
        return metrics

    def optim_step(self) -> dict[str, float]:
        """Apply the gradients `forward_backward` left (clipped, AdamW); version += 1. The
        engine still samples from the old weights until `publish_weights()`."""
        metrics: dict[str, float] = self._blocks("optim_step").optim_step()
        return metrics

    def publish_weights(self) -> dict[str, Any]:
        """Bring the engine to the trainer's version now (blocking; `publish` from a cell);
        returns the transfer's metrics."""
        if self.run_on_loop is None:
            raise RuntimeError(f"policy {self.name!r} is not part of a session: nothing can "
                               "publish its weights")
        transfer: dict[str, Any] = self.run_on_loop(self.publish)
        return transfer

    def _blocks(self, what: str) -> Any:
        if not hasattr(self.trainer, what):
            raise ValueError(f"policy {self.name!r}: its trainer ({type(self.trainer).__name__}) "
                             f"has no {what}; a manual loop needs a trainer on this machine "
                             "(Session(trainer='thread' or 'process'))")
        return self.trainer

    def sft(self, examples: Sequence[Demonstration], steps: int = 100, batch_size: int = 16,
            *, lr: float | None = None, seed: int = 0,
            progress: bool = True) -> list[dict[str, float]]:
        """Supervised warm-start on demonstrations, on this policy's own trainer, then publish.

        The loss is the negative log-likelihood of the assistant tokens only (prompts, tool
        results and other roles' messages are context). Each demonstration is tokenized the way
        `ctx.chat` builds prompts, so the model learns exactly the tokens it will later sample.
        Every step is a weight version, as in RL.

        Args:
            examples: conversations (lists of {"role", "content"} messages), dicts
                {"messages": [...], "tools": [fn, ...]}, or (prompt, completion) text pairs.
            steps: optimizer steps.
            batch_size: demonstrations per step.
            lr: learning rate of these steps (default: the optimizer's); RL keeps its own.
            seed: shuffling seed.
            progress: print the loss ten times along the way.

        Returns:
            The metrics of every step (loss, grad_norm, tokens).
        """
        trainer = self.trainer
        if not isinstance(trainer, SupervisedTrainer):
            raise NotImplementedError(
                f"policy {self.name!r}: its trainer ({type(self.trainer).__name__}) has no "
                "supervised step; warm-start the model in-process (a Session without trainer=) "
                "and save it, then load that directory on the trainer service")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        pad = self.tokenizer.pad_token_id
        batches = sft_batches(self.tokenizer, list(examples), batch_size, seed,
                              0 if pad is None else int(pad))
        history: list[dict[str, float]] = []
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, os.cpu_count() or 1))  # nothing else runs meanwhile
        try:
            for i in range(steps):
                history.append(trainer.sft_step(next(batches), lr=lr))
                if progress and (i + 1) % max(1, steps // 10) == 0:
                    print(f"sft {self.name}: step {i + 1}/{steps}, "
                          f"loss {history[-1]['loss']:.4f}")
        finally:
            torch.set_num_threads(threads)
        if self.run_on_loop is None:
            raise RuntimeError(f"policy {self.name!r} is not part of a session: nothing can "
                               "publish its weights")
        self.run_on_loop(self.publish)
        return history

    def save_pretrained(self, directory: str | os.PathLike[str], *, merged: bool = False) -> Path:
        """Write the policy's current weights (the trainer's, full precision) with its config
        and tokenizer as a Hugging Face model folder, which `ab.models.local(directory)` reads
        back: e.g. a trained teacher for `ab.Reference(model=..., distill=1.0)`.

        A LoRA policy writes PEFT's adapter folder (adapter_config.json and
        adapter_model.safetensors, loaded by `peft.PeftModel.from_pretrained(base, directory)`)
        and its tokenizer; `merged=True` writes the base model with the adapters merged instead.
        On a trainer service only the adapter folder can be written (fetched from the service);
        the full or merged weights stay there (RuntimeError).

        Returns:
            The folder.
        """
        directory = Path(directory)
        if self.lora is not None and not merged:
            save_adapter = getattr(self.trainer, "save_adapter", None)
            if save_adapter is None:
                raise ValueError(f"policy {self.name!r}: its trainer "
                                 f"({type(self.trainer).__name__}) cannot write adapters")
            if inspect.iscoroutinefunction(save_adapter):  # a trainer service's: over HTTP
                if self.run_on_loop is None:
                    raise RuntimeError(f"policy {self.name!r} is not part of a session: nothing "
                                       "can reach its trainer service")
                self.run_on_loop(lambda: save_adapter(directory))
            else:
                save_adapter(directory)
            self.spec.tokenizer().save_pretrained(directory)
            return directory
        model = self.spec.build(dtype=torch.float32, device="cpu")
        model.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in self.trainer.weights().items()})
        model.save_pretrained(directory)
        self.spec.tokenizer().save_pretrained(directory)
        return directory

    @property
    def remote(self) -> bool:
        """Whether rollout services sample for the policy (no engine in this process)."""
        return self.engine is None

    def __repr__(self) -> str:
        return (
            f"Policy({self.name!r}, model={self.spec.name}, algorithm={self.algorithm.name}, "
            f"version={self.version}{', remote' if self.remote else ''})"
        )

    def describe(self) -> dict[str, object]:
        """What the policy is and where it runs, as plain values (the notebook display's rows)."""
        checksum = self.weights_checksum
        return {
            "model": self.spec.name + (f" ({self.spec.path})" if self.spec.path else ""),
            "algorithm": repr(self.algorithm),
            "optimizer": repr(self.optimizer),
            "rollouts": self.publisher.where if self.remote else type(self.engine).__name__,
            "trainer": type(self.trainer).__name__,
            "version": self.version,
            "weights checksum": (f"{checksum:016x}" if isinstance(checksum, int)
                                 else "not published"),
        }

    def _repr_html_(self) -> str:
        from ..notebook.html import card, table

        where = "rollout services" if self.remote else "this process"
        rows = list(self.describe().items())
        return card(f"Policy {self.name!r}", f"version {self.version}, rollouts in {where}",
                    table(("", ""), rows), "astranb-policy")
