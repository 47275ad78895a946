"""One rank of a small FSDP trainer job, for tests/test_fsdp.py (which also imports its batches).

    torchrun --nproc-per-node 2 -m tests.fsdp_worker first OUT      # create, 2 steps, save
    torchrun --nproc-per-node 2 -m tests.fsdp_worker resume OUT     # load OUT/ckpt-*, 1 step
    RANK=.. WORLD_SIZE=.. python -m tests.fsdp_worker idle OUT TIMEOUT_S  # create, wait forever

Rank 0 writes what the test compares into OUT: weights as safetensors, metrics as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import astranb as ab
from astranb.algorithms import token_mean
from astranb.dataflow.batcher import build_batch
from astranb.dataflow.buffer import Group
from astranb.training.caller_loss import gradient_batch, merged_metrics, trainer_algorithm
from astranb.training.fsdp import FSDPBackend, main_worker
from astranb.types import Batch, Generation, SamplingParams, Trajectory, Turn

SPEC = ab.models.tiny(hidden_size=32, num_layers=2, num_heads=2)
MICRO_BATCH_SIZE = 2
# GRPO with its clip active on some tokens and no gradient clipping (so the raw gradient reaches
# Adam's moments, which the test compares); M2PO with a threshold low enough to drop tokens, an
# entropy bonus, weight decay and gradient clipping: every term of the step is exercised
POLICIES = {
    "grpo": (ab.GRPO(), ab.AdamWConfig(lr=1e-3, grad_clip=0.0)),
    "m2po": (ab.M2PO(threshold=0.01, entropy_coef=0.01),
             ab.AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5)),
}


def make_batch(rows: int, seed: int) -> Batch:
    """The first `rows` rows of a deterministic batch built from groups of 4 episodes.

    Random prompts and completions of varied lengths, behaviour logprobs near the tiny model's
    (so ratios sit around 1), mixed temperatures, non-zero advantages from random rewards.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for gid, start in enumerate(range(0, rows, 4)):
        trajectories = []
        for i in range(start, start + 4):
            prompt = _ints(gen, 3, 60, _int(gen, 2, 5))
            completion = _ints(gen, 3, 60, _int(gen, 1, 6))
            logprobs = (-4.1 + 0.15 * torch.randn(len(completion), generator=gen)).tolist()
            temperature = (0.7, 1.0, 1.3)[i % 3]
            generation = Generation(prompt, completion, tuple(logprobs), (0,) * len(completion),
                                    "length")
            turn = Turn("solver", "p", generation, SamplingParams(temperature=temperature))
            reward = float(torch.rand((), generator=gen))
            trajectories.append(Trajectory({"i": gid}, (turn,), {"solver": reward}, gid))
        groups.append(Group(gid, tuple(trajectories), 0, frozenset({"p"})))
    batch = build_batch(groups, "p", ab.GRPO(), pad_id=0)
    return Batch(*(getattr(batch, f)[:rows] for f in Batch.__dataclass_fields__))


def _int(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (), generator=gen))


def _ints(gen: torch.Generator, low: int, high: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(low, high, (n,), generator=gen).tolist())


BATCHES = {"a": (7, 1), "b": (1, 5)}  # 7 rows: unequal shares; 1 row: rank 1 has none


@dataclass(frozen=True)
class CallerLoss(ab.Algorithm):
    """A user's own loss (not one of astranb's configs): its loss runs in the caller, the ranks
    get its gradient (astranb/training/caller_loss.py)."""

    normalize_std: bool = True
    filter_groups: bool = False
    entropy_coef: float = 0.01

    @property
    def name(self) -> str:
        return "caller"

    def loss(self, logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=None):
        log_ratio = torch.where(mask_B_T.bool(), logp_B_T - old_logp_B_T, 0.0)
        per_token = -torch.exp(log_ratio) * adv_B_T + 0.5 * log_ratio ** 2
        return token_mean(per_token, mask_B_T, num_tokens), {}


CALLER_OPTIMIZER = ab.AdamWConfig(lr=1e-3, grad_clip=0.5)


def _create(trainer: FSDPBackend) -> None:
    for name, (algorithm, optimizer) in POLICIES.items():
        assert trainer.create(name, SPEC, algorithm, optimizer, MICRO_BATCH_SIZE) == 0


def first(trainer: FSDPBackend, out: Path) -> None:
    """Two steps (batch a, then the one-row batch b), weights after each, then a checkpoint."""
    _create(trainer)
    metrics = {}
    for name in POLICIES:
        for key in ("a", "b"):
            metrics[f"{name}.{key}"] = trainer.step(name, make_batch(*BATCHES[key]))
            save_file(trainer.weights(name), out / f"{name}.{key}.safetensors")
        trainer.save(name, out / f"ckpt-{name}")
    algorithm = CallerLoss()
    trainer.create("caller", SPEC, trainer_algorithm(algorithm), CALLER_OPTIMIZER,
                   MICRO_BATCH_SIZE)
    for key in ("a", "b"):
        batch = make_batch(*BATCHES[key])
        sent, found = gradient_batch(algorithm, batch, trainer.logprobs("caller", batch))
        metrics[f"caller.{key}"] = merged_metrics(found, trainer.step("caller", sent), algorithm)
        save_file(trainer.weights("caller"), out / f"caller.{key}.safetensors")
    metrics["world_size"] = trainer.world_size
    (out / "metrics.json").write_text(json.dumps(metrics))


def resume(trainer: FSDPBackend, out: Path) -> None:
    """Load `first`'s checkpoints, save them again at once, then one more step on batch a."""
    _create(trainer)
    metrics = {}
    for name in POLICIES:
        metrics[f"{name}.loaded_version"] = trainer.load(name, out / f"ckpt-{name}")
        metrics[f"{name}.version"] = trainer.version(name)
        save_file(trainer.weights(name), out / f"{name}.loaded.safetensors")
        trainer.save(name, out / f"resaved-{name}")
        metrics[f"{name}.c"] = trainer.step(name, make_batch(*BATCHES["a"]))
        save_file(trainer.weights(name), out / f"{name}.c.safetensors")
    (out / "resume.json").write_text(json.dumps(metrics))


def idle(trainer: FSDPBackend, out: Path) -> None:
    """Create a policy, write this process's id to OUT/ready, then wait (the test ends it)."""
    trainer.create("grpo", SPEC, *POLICIES["grpo"])
    (out / "ready.tmp").write_text(str(os.getpid()))
    (out / "ready.tmp").rename(out / "ready")
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    serve = {"first": first, "resume": resume, "idle": idle}[mode]
    main_worker(lambda trainer: serve(trainer, out), timeout_s=timeout_s)
