"""The FSDP2 trainer backend: each policy's model sharded over the ranks of a torch.distributed job.

Run it with torchrun: every rank builds the same model from the policy's spec (same seed, so the
same weights), shards each decoder layer and then the root with `fully_shard`, and keeps only its
shard of the parameters and of the AdamW state. Rank 0 holds the `FSDPBackend` that the outside
world calls; each call becomes a command (training/collective.py) that every rank runs.

A step, on every rank:

1. take this rank's contiguous share of the batch's rows (ceil(B / world) rows; the last ranks may
   get fewer or none) and split it into micro-batches;
2. forward, loss and backward on each, with exactly LocalTrainer's code (`backward_micro_batches`)
   and the *whole batch's* token count as the denominator. The ranks' losses therefore add up to
   the batch's token-mean loss, and so do their gradients. FSDP's reduce-scatter would average
   them over ranks, which divides the gradient by the world size; we set its divide factor to 1
   with sum-only reductions instead (scaling each rank's loss by the world size would do too, at
   the price of a loss value that no longer reads as the loss). tests/test_fsdp.py checks the
   result against LocalTrainer.
   FSDP gathers parameters in every forward and reduces gradients in every backward, so a rank
   with fewer micro-batches runs the missing ones on a row whose loss mask is all zero: zero
   loss, zero gradient, zero weight in the metrics.
3. sum the metrics over ranks (they are token-weighted sums, so the sum is LocalTrainer's value),
   clip the global gradient norm, and take the AdamW step on the local shards.

One difference from LocalTrainer: M2PO's token mask is chosen per micro-batch. The micro-batches
here are cut inside each rank's share, so they match a LocalTrainer with the same
micro_batch_size only when the share, ceil(B / world), is a multiple of it (or at most it, with
B a multiple of the share). GRPO's loss is per token and matches for any split.

Checkpoints. torch.distributed.checkpoint's FileSystemWriter would write each rank's shard in
parallel, but it stores the checkpoint's `.metadata` file with pickle, and astranb puts no pickle
on any wire or file another process reads. So `save` gathers the full model and optimizer state to
rank 0 (torch.distributed.checkpoint.state_dict, full_state_dict + cpu_offload) and writes
LocalTrainer's format, safetensors + JSON: model.safetensors, optimizer.safetensors, trainer.json.
It writes a temporary directory and renames it into place, so a kill mid-save leaves the previous
checkpoint (or none), never half of one. `load` reads on rank 0 and broadcasts each tensor, every
rank keeping its shard (`broadcast_from_rank0`). The price is that the whole state must fit in
rank 0's CPU memory. The files are LocalTrainer's: either trainer can load what the other saved.

    # serve.py; run with: torchrun --nproc-per-node 2 serve.py
    import astranb as ab
    from astranb.training.fsdp import main_worker

    def serve(trainer):  # rank 0 only; the other ranks follow
        trainer.create("solver", ab.models.tiny(), ab.GRPO(), ab.AdamWConfig(lr=1e-3))
        metrics = trainer.step("solver", batch)  # a Batch from astranb.dataflow.batcher
        trainer.save("solver", "ckpt/solver")

    main_worker(serve)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..algorithms import Algorithm
from ..algorithms.config import algorithm_from_dict, algorithm_to_dict
from ..models import ModelSpec
from ..types import Batch
from .collective import Collective, Command, RankZeroLost
from .local import (
    MAX_METRICS,
    AdamWConfig,
    backward_micro_batches,
    clip_and_step,
    micro_batches,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
    step_advantages,
    token_logprobs,
)

__all__ = ["FSDPBackend", "follow", "main_worker"]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass
class _Policy:
    """One policy's shard on one rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    algorithm: Algorithm
    config: AdamWConfig
    micro_batch_size: int
    param_names: list[str]
    """Parameter names in optimizer order (the index order of the checkpoint format)."""
    shapes: dict[str, tuple[int, ...]]
    """Full (unsharded) shape of each state_dict entry, to check a checkpoint before loading."""
    version: int = 0


class _Replica:
    """This rank's shards of every policy, and the command handlers every rank runs."""

    def __init__(self, compute_dtype: torch.dtype | None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if dist.get_backend() == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (self.world,))
        self.precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.policies: dict[str, _Policy] = {}

    def handlers(self) -> dict[str, Callable[[Command], object]]:
        return {"create": self.create, "step": self.step, "logprobs": self.logprobs,
                "gather": self.gather, "load": self.load}

    def create(self, command: Command) -> int:
        args = command.args
        optimizer = args["optimizer"]
        config = AdamWConfig(**{**optimizer, "betas": tuple(optimizer["betas"])})
        model = ModelSpec(**args["spec"]).build(device=self.device).train()
        self._shard(model)
        adamw = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        algorithm = algorithm_from_dict(args["algorithm"])
        names = [name for name, _ in model.named_parameters()]
        shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
        self.policies[args["name"]] = _Policy(
            model, adamw, algorithm, config, args["micro_batch_size"], names, shapes
        )
        return 0

    def _shard(self, model: torch.nn.Module) -> None:
        # Hugging Face models name their repeated block classes in _no_split_modules
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        for module in list(model.modules()):
            if type(module).__name__ in block_names:
                fully_shard(module, mesh=self.mesh, mp_policy=self.precision)
        fully_shard(model, mesh=self.mesh, mp_policy=self.precision)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # the ranks' losses already add up to the batch loss: sum gradients, don't average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def step(self, command: Command) -> dict[str, float]:
        policy = self.policies[command.args["name"]]
        batch = Batch(**{k: v.to(self.device) for k, v in command.tensors.items()})
        batch = step_advantages(policy.algorithm, batch)
        num_tokens = max(batch.num_tokens, 1)
        own, missing = _share(batch.size, self.rank, self.world, policy.micro_batch_size)
        policy.optimizer.zero_grad(set_to_none=True)
        totals = backward_micro_batches(policy.model, policy.algorithm, batch, own, num_tokens)
        if missing:
            blank = replace(batch, loss_mask_B_T=torch.zeros_like(batch.loss_mask_B_T))
            rows = [slice(0, 1)] * missing
            idle = backward_micro_batches(policy.model, policy.algorithm, blank, rows, num_tokens)
            totals = {k: totals.get(k, 0.0) + idle[k] for k in idle}
        totals = self._sum_over_ranks(totals)
        totals["grad_norm"] = clip_and_step(policy.model, policy.optimizer, policy.config)
        totals["tokens"] = float(batch.num_tokens)
        policy.version += 1
        return totals

    @torch.no_grad()
    def logprobs(self, command: Command) -> torch.Tensor:
        """Every row's token logprobs: each rank fills its own rows (and runs the blank passes
        that keep its collectives in step), one sum over ranks assembles them."""
        policy = self.policies[command.args["name"]]
        batch = Batch(**{k: v.to(self.device) for k, v in command.tensors.items()})
        own, missing = _share(batch.size, self.rank, self.world, policy.micro_batch_size)
        logp_B_T = torch.zeros(batch.input_ids_B_T.shape, dtype=torch.float32, device=self.device)
        for rows in own:
            logp_B_T[rows] = token_logprobs(policy.model, batch, rows)[0].float()
        for _ in range(missing):
            token_logprobs(policy.model, batch, slice(0, 1))
        dist.all_reduce(logp_B_T)  # each row is non-zero on one rank only
        return logp_B_T.cpu()

    def _sum_over_ranks(self, totals: dict[str, float]) -> dict[str, float]:
        """Token-weighted sums add up over ranks; MAX_METRICS take the largest rank's."""
        out: dict[str, float] = {}
        for op, keys in ((dist.ReduceOp.SUM, sorted(set(totals) - MAX_METRICS)),
                         (dist.ReduceOp.MAX, sorted(set(totals) & MAX_METRICS))):
            # every rank ran the same loss code, so the key sets agree
            if not keys:
                continue
            values = torch.tensor([totals[k] for k in keys], dtype=torch.float64,
                                  device=self.device)
            dist.all_reduce(values, op=op)
            out.update(zip(keys, values.tolist(), strict=True))
        return {k: out[k] for k in totals}

    def gather(self, command: Command):
        policy = self.policies[command.args["name"]]
        # a model's state dict holds tensors only (the declared type allows any state value)
        model = cast(dict[str, torch.Tensor], get_model_state_dict(policy.model, options=_GATHER))
        if self.world == 1:  # nothing was gathered: these may be views of the live parameters
            model = {k: v.clone() for k, v in model.items()}
        if not command.args.get("optimizer"):
            return model
        optimizer = get_optimizer_state_dict(policy.model, policy.optimizer, options=_GATHER)
        return model, optimizer, policy.version

    def load(self, command: Command) -> int:
        policy = self.policies[command.args["name"]]
        model, optimizer = command.local if self.rank == 0 else ({}, {})
        set_model_state_dict(policy.model, model, options=_SCATTER)
        set_optimizer_state_dict(policy.model, policy.optimizer, optimizer, options=_SCATTER)
        policy.version = int(command.args["version"])
        return policy.version


def _share(rows: int, rank: int, world: int, micro: int) -> tuple[list[slice], int]:
    """This rank's micro-batches, and how many blank ones it must add to keep step with the rest.

    Returns:
        (own, missing): own slices of the contiguous share [rank * c, (rank + 1) * c) with
        c = ceil(rows / world); missing = micro-batches of a full share - len(own).
    """
    chunk = -(-rows // world)
    own = micro_batches(min(rank * chunk, rows), min((rank + 1) * chunk, rows), micro)
    return own, len(micro_batches(0, chunk, micro)) - len(own)


class FSDPBackend:
    """Rank 0's handle on policies trained with FSDP2 over every rank of the job.

    Build it on rank 0 while every other rank runs `follow()` with the same arguments;
    `main_worker` does both. Methods may be called from any thread; they run one at a time.

    Args:
        timeout_s: how long followers wait for rank 0 before exiting (rank 0 pings them while
            idle, so only a dead or hung rank 0 trips it); also the timeout of each collective.
        compute_dtype: forward/backward dtype (e.g. torch.bfloat16 on GPU); parameters, AdamWConfig
            state and gradient reduction stay fp32. None computes in fp32.

    Example:
        trainer.create("solver", ab.models.tiny(), ab.GRPO(), ab.AdamWConfig())  # version 0
        trainer.step("solver", batch)          # {"loss": ..., "grad_norm": ..., ...}
        trainer.weights("solver")              # full CPU state, as LocalTrainer.weights()
    """

    def __init__(self, *, timeout_s: float = 300.0, compute_dtype: torch.dtype | None = None):
        self._replica = _Replica(compute_dtype)
        self._channel = Collective(self._replica.handlers(), timeout_s=timeout_s)
        self.world_size = self._replica.world

    def create(
        self,
        name: str,
        spec: ModelSpec,
        algorithm: Algorithm,
        optimizer: AdamWConfig | None = None,
        micro_batch_size: int = 64,
        *,
        reference: object = None,
        lora: object = None,
    ) -> int:
        """Build policy `name`'s model on every rank and shard it; returns its version (0).

        A policy of the same name is replaced (as LocalBackend does), optimizer state and all.
        `optimizer` None means `AdamWConfig()`. `reference` and `lora` are refused: FSDP does
        not train them yet.

        Raises:
            ValueError: micro_batch_size < 1; a reference or LoRA asked for.
            TypeError: the algorithm is not one of astranb's configs (only those travel as JSON;
                the trainer service runs any other one's loss in its caller).
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        for field, value in (("reference", reference), ("lora", lora)):
            if value is not None:
                raise ValueError(f"{field}= is not trained by FSDP yet (--nproc > 1); serve the "
                                 f"trainer with --nproc 1 for a policy with {field}=, or leave "
                                 "it out")
        args = {
            "name": name,
            "spec": asdict(spec),
            "algorithm": algorithm_to_dict(algorithm),
            "optimizer": asdict(optimizer if optimizer is not None else AdamWConfig()),
            "micro_batch_size": micro_batch_size,
        }
        return self._channel.call("create", args)

    def step(self, name: str, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; version += 1. Metrics as LocalTrainer.step's."""
        self._policy(name)
        tensors = {field: getattr(batch, field) for field in Batch.__dataclass_fields__}
        return self._channel.call("step", {"name": name}, tensors)

    def logprobs(self, name: str, batch: Batch) -> torch.Tensor:
        """The current weights' logprob of each of the batch's tokens (no grad), as
        LocalTrainer.logprobs."""
        self._policy(name)
        tensors = {field: getattr(batch, field) for field in Batch.__dataclass_fields__}
        return self._channel.call("logprobs", {"name": name}, tensors)

    def version(self, name: str) -> int:
        """Steps taken by policy `name` (restored by `load`)."""
        return self._policy(name).version

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """Full CPU weights, named as in the model's state_dict (as LocalTrainer.weights())."""
        self._policy(name)
        return self._channel.call("gather", {"name": name})

    def save(self, name: str, directory: str | os.PathLike) -> None:
        """Write model, optimizer state and version in LocalTrainer's format, atomically."""
        policy = self._policy(name)
        model, optimizer, version = self._channel.call("gather", {"name": name, "optimizer": True})
        # the files are written here, off the channel's thread, so it keeps pinging followers
        indices = {fqn: i for i, fqn in enumerate(policy.param_names)}
        tensors, meta = optimizer_state_to_tensors(_rename_params(optimizer, indices))
        info = {"version": version, "optimizer": asdict(policy.config), **meta}
        _write_atomically(Path(directory), model, tensors, info)

    def load(self, name: str, directory: str | os.PathLike) -> int:
        """Restore what `save` (or LocalTrainer.save) wrote; returns the restored version."""
        policy = self._policy(name)
        directory = Path(directory)
        info = json.loads((directory / "trainer.json").read_text())
        model = load_file(directory / "model.safetensors")
        tensors = load_file(directory / "optimizer.safetensors")
        _check_checkpoint(directory, policy, model, tensors)  # before the ranks commit to it
        names = dict(enumerate(policy.param_names))
        optimizer = _rename_params(optimizer_state_from_tensors(tensors, info), names)
        args = {"name": name, "version": int(info["version"])}
        return self._channel.call("load", args, local=(model, optimizer))

    def close(self) -> None:
        """Shut the followers down (they return from `follow`). Idempotent."""
        self._channel.close()

    def _policy(self, name: str) -> _Policy:
        try:
            return self._replica.policies[name]
        except KeyError:
            known = sorted(self._replica.policies)
            raise KeyError(
                f"no policy {name!r} on this trainer (have {known}); create() it first"
            ) from None


def _check_checkpoint(directory: Path, policy: _Policy, model: dict, optimizer: dict) -> None:
    """Raise ValueError unless the checkpoint's tensors fit the policy's model."""
    shapes = {name: tuple(value.shape) for name, value in model.items()}
    wrong = sorted(
        k for k in shapes.keys() | policy.shapes.keys() if shapes.get(k) != policy.shapes.get(k)
    )
    unknown = {int(k.split(".", 1)[0]) for k in optimizer} - set(range(len(policy.param_names)))
    if wrong or unknown:
        raise ValueError(
            f"the checkpoint in {directory} does not fit this policy's model (tensors missing, "
            f"extra or shaped differently: {wrong[:5]}; optimizer slots of unknown parameters: "
            f"{sorted(unknown)[:5]}); load it into a policy created with the same ModelSpec"
        )


def _rename_params(state: dict, mapping: dict) -> dict:
    """An optimizer state_dict with its parameter keys mapped (names <-> indices)."""
    groups = [{**g, "params": [mapping[p] for p in g["params"]]} for g in state["param_groups"]]
    return {"state": {mapping[p]: s for p, s in state["state"].items()}, "param_groups": groups}


def _write_atomically(directory: Path, model: dict, optimizer: dict, info: dict) -> None:
    """Write the three checkpoint files into a temporary sibling, then rename it into place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        save_file(model, tmp / "model.safetensors")
        save_file(optimizer, tmp / "optimizer.safetensors")
        (tmp / "trainer.json").write_text(json.dumps(info, indent=1))
        if directory.exists():
            # a kill between these renames leaves two whole checkpoints and no `directory`
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            directory.replace(old / "checkpoint")
            tmp.replace(directory)
            shutil.rmtree(old)
        else:
            tmp.replace(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def follow(*, timeout_s: float = 300.0, compute_dtype: torch.dtype | None = None) -> None:
    """Ranks > 0: hold this rank's shards and run rank 0's commands until it closes.

    Takes the same arguments as the FSDPBackend built on rank 0.

    Raises:
        RankZeroLost: rank 0 sent nothing for timeout_s (it pings while idle) or vanished.
    """
    replica = _Replica(compute_dtype)
    Collective(replica.handlers(), timeout_s=timeout_s).follow()


def main_worker(
    serve: Callable[[FSDPBackend], object],
    *,
    timeout_s: float = 300.0,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Entry point of each torchrun process: rank 0 calls serve(backend), the others follow.

    Initialises the process group from torchrun's environment (NCCL on cuda:LOCAL_RANK when CUDA
    is present, gloo on CPU otherwise). When `serve` returns or raises, the followers are shut
    down and the process group destroyed. A follower whose rank 0 died or hung (or whose
    command failed) prints why and exits with status 1, and so does any rank whose launcher
    (torchrun) has gone: otherwise rank 0, still serving and pinging, would keep the job alive.

    Args:
        serve: runs on rank 0 with the FSDPBackend (e.g. an HTTP server around it); what it
            returns is ignored.
        timeout_s: see FSDPBackend.
        compute_dtype: see FSDPBackend.
    """
    _exit_with_launcher()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if dist.get_rank() == 0:
        trainer = FSDPBackend(timeout_s=timeout_s, compute_dtype=compute_dtype)
        try:
            serve(trainer)
        finally:
            trainer.close()
    else:
        try:
            follow(timeout_s=timeout_s, compute_dtype=compute_dtype)
        except RankZeroLost as error:
            _exit(f"astranb FSDP follower: {error}")
        except Exception:
            _exit(traceback.format_exc())
    dist.destroy_process_group()


def _exit_with_launcher() -> None:
    """End this process (status 1) once the process that started it has gone."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:  # an orphan is re-parented to init or a subreaper
            time.sleep(1.0)
        _exit(f"astranb FSDP rank {os.environ.get('RANK', '?')}: its launcher has gone; exiting")

    threading.Thread(target=watch, name="astranb-launcher-watch", daemon=True).start()


def _exit(message: str) -> None:
    """Print why and end the process with status 1, skipping interpreter teardown.

    Not sys.exit: destroying a process group with a failed gloo operation in flight can abort
    the interpreter (std::terminate), which would replace status 1 with SIGABRT.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
