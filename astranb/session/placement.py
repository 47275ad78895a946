"""Which engine, trainer and publisher a policy whose engine runs in this process gets.

    trainer        trainer                       publisher (engine: HFEngine, or VLLMEngine
                                                 for engine="vllm", in every case)
    "thread"       LocalTrainer (this process)   EnginePublisher (bf16 deltas), or
                                                 StatePublisher (weight_transfer="state")
    "process"      ProcessTrainer (a child)      ProcessPublisher (payloads from the child)
    External(...)  ExternalTrainer (a loop of    ExternalPublisher (the payloads it sent,
                   the researcher's own)         checked here)

`Session.policy` checks its arguments and comes here; rollout services have their own case in
session.py (`_remote_policy`). A new engine or trainer kind adds a case here.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..algorithms import Algorithm
from ..engines import HFEngine
from ..models import ModelSpec
from ..remote.external import External, ExternalPublisher, ExternalTrainer, serve
from ..remote.process import ProcessPublisher, ProcessTrainer
from ..training.local import AdamWConfig, LocalTrainer
from ..training.lora import LoRA
from ..training.reference import Reference
from ..weights.publish import EnginePublisher, StatePublisher
from ..weights.store import WeightStore
from .folder import trainer_log

__all__ = ["Placement", "Parts", "place", "external_choice"]


@dataclass(frozen=True)
class Placement:
    """Where a policy's parts go and how they are built (everything `place` needs)."""

    train_in: str
    """"thread" or "process" (the Session's choice), unless `external` is set."""
    device: str
    dtype: torch.dtype
    threads: int
    directory: Path
    """The session folder (child trainers' logs, external trainers' connection files)."""
    external: External | None = None


@dataclass(frozen=True)
class Parts:
    engine: Any
    trainer: Any
    publisher: Any


def external_choice(trainer: External | str | None, *, reference: Reference | None,
                    lora: LoRA | None, weight_transfer: str) -> External | None:
    """The External a policy's `trainer=` asks for (None: the Session's trainer); ValueError
    naming what does not go with it."""
    if trainer is None:
        return None
    if trainer == "external":
        trainer = External()
    if not isinstance(trainer, External):
        raise ValueError(f"trainer={trainer!r}: a policy takes trainer='external' or "
                         "ab.External(host=..., port=..., token=...) (a training loop of your "
                         "own); where astranb's trainers run is Session(trainer=...)")
    given = [n for n, v in (("reference", reference), ("lora", lora)) if v is not None]
    if given:
        raise ValueError(f"an external trainer trains its own way: {' and '.join(given)} are "
                         "for astranb's trainers; leave them out (or build them into your loop)")
    if weight_transfer != "delta":
        raise ValueError("an external trainer sends its weights as payloads (deltas or full "
                         "snapshots): leave weight_transfer out")
    return trainer


def place(name: str, spec: ModelSpec, algorithm: Algorithm, optimizer: AdamWConfig,
          where: Placement, stack: ExitStack, portal: Any, *, max_batch_size: int,
          seed: int, weight_transfer: str, full_every: int, reference: Reference | None,
          lora: LoRA | None, engine: str = "hf") -> Parts:
    """Build the engine, trainer and publisher of a policy sampled in this process; what must
    be closed goes on `stack` (unwound while `portal`, the session's loop, still runs); the
    publisher has published version 0."""
    rollout = _engine(engine, name, spec, where, max_batch_size=max_batch_size, seed=seed)
    stack.callback(rollout.close)
    return _trainer_parts(name, spec, algorithm, optimizer, where, stack, portal, rollout,
                          weight_transfer=weight_transfer, full_every=full_every,
                          reference=reference, lora=lora)


def _engine(kind: str, name: str, spec: ModelSpec, where: Placement, *, max_batch_size: int,
            seed: int) -> Any:
    """The policy's rollout engine: HFEngine here, or a VLLMEngine over a server it starts (the
    server runs the trainer's dtype, so both score tokens alike)."""
    if kind == "vllm":
        from ..engines.vllm import VLLMEngine

        dtype = str(where.dtype).removeprefix("torch.")
        return VLLMEngine(spec, name=name, dtype=dtype, device=torch.device(where.device).type,
                          max_inflight=max_batch_size, seed=seed)
    return HFEngine(spec, device=where.device, dtype=where.dtype,
                    max_batch_size=max_batch_size, seed=seed, name=name)


def _trainer_parts(name: str, spec: ModelSpec, algorithm: Algorithm, optimizer: AdamWConfig,
                   where: Placement, stack: ExitStack, portal: Any, engine: Any, *,
                   weight_transfer: str, full_every: int, reference: Reference | None,
                   lora: LoRA | None) -> Parts:
    """The trainer and publisher that go with `engine` (see the table above)."""
    trainer: Any
    publisher: Any
    if where.external is not None:
        trainer = ExternalTrainer(name, spec, algorithm)
        server = portal.call(serve, trainer, where.external, where.directory / "external")
        stack.callback(portal.call, server.stop)
        stack.callback(trainer.close)  # unwound first: waiting trainers hear 410, then stop
        publisher = ExternalPublisher(engine, trainer)
    elif where.train_in == "process":
        if weight_transfer != "delta":
            raise ValueError("weight_transfer='state' copies tensors inside one process; a "
                             "trainer in a child process (trainer='process') publishes "
                             "payloads: leave weight_transfer out")
        trainer = ProcessTrainer(name, spec, algorithm, optimizer, threads=where.threads,
                                 device=where.device, dtype=where.dtype, full_every=full_every,
                                 log=trainer_log(where.directory, name), reference=reference,
                                 lora=lora)
        stack.callback(trainer.close)
        publisher = ProcessPublisher(engine, trainer)
    else:
        trainer = LocalTrainer(spec, algorithm, optimizer, device=where.device,
                               dtype=where.dtype, reference=reference, lora=lora)
        publisher = (EnginePublisher(name, engine, trainer,
                                     WeightStore(name, full_every=full_every))
                     if weight_transfer == "delta" else StatePublisher(name, engine, trainer))
    publisher.publish_initial()
    return Parts(engine, trainer, publisher)
