"""The Session: owns policies, wiring, and the background event loop every run executes in.

A Session runs its own event loop in a background thread (an anyio blocking portal), so a script,
papermill and JupyterLab all behave the same way: `train()` returns at once, rollouts and training
go on while the notebook runs other cells, and heavy torch work stays off the kernel's loop
(engines decode in their own threads, train steps run in worker threads).

    import astranb as ab

    session = ab.Session("runs/arith")
    policy = session.policy("solver", model=ab.models.tiny(), algorithm=ab.M2PO())
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=200, batch_size=64, group_size=8, max_staleness=4)
    run.wait()                      # or: await run
    run.metrics.tail()
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import torch

from .. import environments
from ..algorithms import GRPO, Algorithm
from ..dataflow.buffer import Group
from ..dataflow.config import INSPECT_EVERY, RunConfig
from ..dataflow.sampling import DEFAULT_MAX_GEN_BATCHES
from ..dataflow.stall import STALL_SECONDS
from ..environments.base import Environment
from ..evaluation import RoleEvaluation, check_evaluation
from ..models import ModelSpec, dtype_for, resolve
from ..remote.client import TrainerClient
from ..remote.external import External
from ..remote.pool import RolloutPool, ServicesPublisher
from ..remote.process import default_trainer
from ..remote.scaling import Autoscaler
from ..remote.serialize import spec_to_wire
from ..remote.trainer import RemoteTrainer
from ..training.local import AdamWConfig, LocalTrainer
from ..training.lora import LoRA, lora_to_dict
from ..training.reference import Reference, reference_to_dict
from ..weights.store import WeightStore
from . import heldout, launch, restore
from .context import RunContext
from .manual import ManualPlays
from .placement import Placement, external_choice, place
from .policy import Policy
from .recorder import Recorder
from .restore import also_on_the_class
from .run import Run
from .trackers import Tracker
from .trackers import resolve as resolve_trackers
from .wiring import Wiring

__all__ = ["Session"]

ENGINES = ("hf", "vllm")


class Session:
    """An experiment: policies, the environments they are wired to, and their runs.

    Args:
        directory: where runs write metrics, episodes and checkpoints (created if missing).
        device: torch device for engines and trainers ("cpu", "cuda", ...).
        torch_threads: intra-op threads per torch worker; default: half the cores (the engine
            and the trainer run side by side), at least 1.
        rollout: URLs of rollout services (`astranb serve rollout`); episodes are played there
            instead of in this process. Services can be added and removed while a run goes on.
        trainer: where policies train. "process": each policy's trainer in its own child
            process (`remote.process`), so training and rollouts never wait on each other for
            Python's interpreter lock; on a CPU with small models this is what lets them
            overlap. "thread": in this process, in a worker thread (the trainer's model is then
            `policy.trainer.model`). A URL: a trainer service (`astranb serve trainer`), with
            rollout services. Default: $ASTRANB_TRAINER if set, else "process" on a CPU with at
            least 2 cores and "thread" otherwise (on a GPU the engine and the trainer already
            run their heavy work outside Python).
        token: bearer token of the services (default: $ASTRANB_TOKEN).
        failure_timeout: seconds a rollout service may stay silent before its in-flight
            episodes are resubmitted to the others.
        transport: httpx transport per URL, `url -> transport` (in-process tests).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] = "runs/session",
        *,
        device: str = "cpu",
        torch_threads: int | None = None,
        rollout: Sequence[str] | str | None = None,
        trainer: str | None = None,
        token: str | None = None,
        failure_timeout: float = 5.0,
        transport: Callable[[str], Any] | None = None,
    ):
        # creates the folder and locks it: one live Session per folder
        self._context = RunContext(Path(directory))
        self._manual = ManualPlays()  # session.play's sample streams and group ids
        self.device = device
        threads = torch_threads or max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(threads)
        token = token if token is not None else os.environ.get("ASTRANB_TOKEN") or None
        urls = [rollout] if isinstance(rollout, str) else list(rollout or [])
        if urls:
            self._context.pool = RolloutPool(urls, token, self._context.policies,
                                             failure_timeout=failure_timeout,
                                             transport=transport)
        if trainer is None and not urls:
            trainer = default_trainer(device)
        if trainer not in (None, "thread", "process") and not str(trainer).startswith(
                ("http://", "https://")):
            raise ValueError(f"trainer={trainer!r}: use 'thread', 'process', or the URL of a "
                             "trainer service (http://host:port)")
        self._train_in = "process" if trainer == "process" and not urls else "thread"
        self._threads = threads
        if trainer is not None and trainer not in ("thread", "process"):
            if self._context.pool is None:
                raise ValueError("a trainer service needs rollout services too: pass "
                                 "rollout=[url, ...] (`astranb serve rollout` on the GPU hosts)")
            client = TrainerClient(trainer, token,
                                   transport=transport(trainer) if transport else None)
            self._context.trainer = client
            self._context.pool.trainer_url = client.url

    @property
    def context(self) -> RunContext:
        """The run context behind this Session (advanced, internal): its event loop, folder
        lock, policies, wiring, runs and services, as the run layer receives them
        (`astranb.session.context`). Everyday use needs only the Session's own methods."""
        return self._context

    @property
    def directory(self) -> Path:
        """The Session's folder: each run writes run-NNN inside it."""
        return self._context.directory

    @property
    def policies(self) -> dict[str, Policy]:
        """Name -> policy, in creation order."""
        return self._context.policies

    # -- building --------------------------------------------------------------------------------
    def policy(
        self,
        name: str,
        model: ModelSpec | str | os.PathLike[str],
        *,
        engine: str = "hf",
        algorithm: Algorithm | None = None,
        optimizer: AdamWConfig | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        weight_transfer: str = "delta",
        full_every: int = 10,
        reference: Reference | None = None,
        lora: LoRA | None = None,
        trainer: External | str | None = None,
    ) -> Policy:
        """Create a policy: a rollout engine and a trainer over two copies of `model`.

        Args:
            name: unique name (metrics and wiring use it).
            model: `models.tiny(...)`, `models.local(path)` or a local model directory.
            engine: rollout engine; "hf" (torch continuous batching) in this process, or
                "vllm": a vLLM server this process starts on loopback (`make vllm` installs
                it; 30-100 s to start on CPU; see README, "Choosing an engine").
            algorithm: GRPO() (default) or M2PO(...).
            optimizer: AdamWConfig(...) settings.
            max_batch_size: most sequences the engine decodes at once.
            seed: sampling seed of the engine.
            weight_transfer: "delta" publishes bf16 weights through a versioned store as sparse
                bit-exact deltas (full snapshots every `full_every` versions and whenever a delta
                cannot apply); "state" copies the trainer's full-precision tensors directly
                (engines in this process only: rollout services always get payloads).
            full_every: versions between forced full snapshots ("delta" only; 0: never forced).
            reference: a frozen policy the trainer scores every batch with (no optimizer, no
                engine): `ab.Reference(kl_coef=0.04)` adds KL to the policy's starting weights
                to the loss; `ab.Reference(model=teacher, distill=1.0)` is on-policy
                distillation from a teacher (training/reference.py). Every trainer but FSDP
                (`--nproc` > 1); a teacher's directory must exist where the trainer runs.
            lora: train low-rank adapters (PEFT) instead of the full weights:
                `ab.LoRA(rank=8, alpha=16)`. Engines get the merged weights; checkpoints and
                `policy.save_pretrained` hold the adapters (training/lora.py). Every trainer
                but FSDP (`--nproc` > 1).
            trainer: "external" (or `ab.External(host, port, token)`): a training loop of your
                own trains this policy, in another process or on another host, through
                `ab.TrainerLink` (remote/trainer_link.py); the session lends it each batch and
                takes each version's weights back, checked. Default: the Session's trainer.
        """
        self._context.check_open()
        if name in self.policies:
            raise ValueError(f"a policy named {name!r} exists already; pick another name")
        if weight_transfer not in ("delta", "state"):
            raise ValueError(f"weight_transfer must be 'delta' or 'state', got {weight_transfer!r}")
        spec, algorithm, optimizer = resolve(model), algorithm or GRPO(), optimizer or AdamWConfig()
        if reference is not None and not isinstance(reference, Reference):
            raise TypeError(f"reference must be an ab.Reference(...), got {reference!r}")
        if lora is not None and not isinstance(lora, LoRA):
            raise TypeError(f"lora must be an ab.LoRA(...), got {lora!r}; e.g. "
                            "lora=ab.LoRA(rank=8, alpha=16)")
        external = external_choice(trainer, reference=reference, lora=lora,
                                   weight_transfer=weight_transfer)
        if self._context.pool is not None:
            if external is not None:
                raise ValueError("an external trainer trains a policy sampled in this process; "
                                 "with rollout services use a trainer service (Session(trainer="
                                 "'http://...')) or leave trainer= out")
            if weight_transfer != "delta":
                raise ValueError(
                    f"weight_transfer={weight_transfer!r} only applies to an engine in this "
                    "process; rollout services always receive versioned bf16 payloads (deltas "
                    "when they can). Leave weight_transfer out for a remote policy")
            policy = self._remote_policy(name, spec, engine, algorithm, optimizer,
                                         max_batch_size, seed, full_every, reference, lora)
            self._record(name, engine, max_batch_size, seed, weight_transfer, full_every,
                         reference, lora)
            return policy
        if engine not in ENGINES:
            raise ValueError(
                f"engine={engine!r} is not available here; use one of {ENGINES} "
                "(SGLang engines are served by `astranb serve rollout` on a GPU host)"
            )
        where = Placement(self._train_in, self.device, dtype_for(self.device, spec),
                          self._threads, self.directory, external)
        parts = place(name, spec, algorithm, optimizer, where, self._context.stack,
                      self._context.loop() if external is not None else None,
                      max_batch_size=max_batch_size, seed=seed,
                      weight_transfer=weight_transfer, full_every=full_every,
                      reference=reference, lora=lora, engine=engine)
        eng = parts.engine
        policy = Policy(name, spec, algorithm, optimizer, eng, parts.trainer, parts.publisher,
                        eng.tokenizer, max_batch_size=max_batch_size, seed=seed, lora=lora)
        policy.run_on_loop = self._context.call
        self.policies[name] = policy
        self._record(name, engine, max_batch_size, seed, weight_transfer, full_every, reference,
                     lora, external)
        return policy

    def _record(self, name: str, engine: str, max_batch_size: int, seed: int,
                weight_transfer: str, full_every: int, reference: Reference | None,
                lora: LoRA | None, external: External | None = None) -> None:
        """Keep the policy's options for the run's plan (what resume rebuilds it from)."""
        self._context.recipes[name] = {
            "engine": engine, "max_batch_size": max_batch_size, "seed": seed,
            "weight_transfer": weight_transfer, "full_every": full_every,
            **({} if reference is None else {"reference": reference_to_dict(reference)}),
            **({} if lora is None else {"lora": lora_to_dict(lora)}),
            **({} if external is None else {"trainer": "external"})}

    def _remote_policy(self, name: str, spec: ModelSpec, engine: str, algorithm: Algorithm,
                       optimizer: AdamWConfig, max_batch_size: int, seed: int,
                       full_every: int, reference: Reference | None,
                       lora: LoRA | None) -> Policy:
        """A policy whose episodes run on rollout services (and trains on the trainer service)."""
        pool = self._context.pool
        assert pool is not None  # add_policy comes here only with rollout services
        trainer: RemoteTrainer | LocalTrainer
        if self._context.trainer is not None:
            body = {"name": name, "model": spec_to_wire(spec),
                    "optimizer": dataclasses.asdict(optimizer), "full_every": full_every,
                    **({} if reference is None else {"reference": reference_to_dict(reference)}),
                    **({} if lora is None else {"lora": lora_to_dict(lora)})}
            trainer = RemoteTrainer(self._context.trainer, body, algorithm)
            self._context.call(trainer.create)
            publisher = ServicesPublisher(pool, name, trainer)
        else:
            trainer = LocalTrainer(spec, algorithm, optimizer, device=self.device,
                                   dtype=dtype_for(self.device, spec), reference=reference,
                                   lora=lora)
            publisher = ServicesPublisher(pool, name, trainer,
                                          WeightStore(name, full_every=full_every))
        publisher.publish_initial()
        policy = Policy(name, spec, algorithm, optimizer, None, trainer, publisher,
                        spec.tokenizer(), max_batch_size=max_batch_size, seed=seed, lora=lora)
        policy.run_on_loop = self._context.call
        self.policies[name] = policy
        try:
            self._context.call(pool.prepare)  # every service builds its engine now
            wrong = {m.url: m.engine for m in pool.members.values()
                     if not m.removed and m.engine != engine}
            if wrong:
                raise ValueError(f"policy {name!r} asks for engine={engine!r} but these rollout "
                                 f"services run another: {wrong}; pass engine= to match, or "
                                 "start them with `astranb serve rollout --engine ...`")
        except Exception:
            del self.policies[name]
            raise
        return policy

    def add_rollout(self, url: str) -> None:
        """Use one more rollout service, also during a run (it catches up, then gets work)."""
        pool = self._context.pool
        self._context.check_open()
        if pool is None:
            raise ValueError("this session plays episodes in this process; create it with "
                             "Session(..., rollout=[url, ...]) to use rollout services")
        self._context.call(pool.add, url)

    def remove_rollout(self, url: str) -> None:
        """Stop using a rollout service; its in-flight episodes are resubmitted to the others."""
        pool = self._context.pool
        self._context.check_open()
        if pool is None:
            raise ValueError("this session has no rollout services")
        self._context.call(pool.remove, url)

    @property
    def rollout_services(self) -> dict[str, str]:
        """URL -> state ("new", "ready", "suspect", "dead") of each rollout service."""
        pool = self._context.pool
        if pool is None:
            return {}
        return {m.url: m.state for m in pool.members.values() if not m.removed}

    @property
    def relays(self) -> dict[str, str]:
        """Region -> URL of the rollout service that pulls each version into it for the rest
        (services started with `--region`; empty without regions or a trainer service)."""
        pool = self._context.pool
        return dict(pool.relays) if pool is not None else {}

    def wire(self, env: Environment | str, *, weight: float = 1.0, **roles: Policy) -> Environment:
        """Connect each of the environment's roles to a policy: `wire(env, solver=policy)`.

        One policy may fill several roles (shared parameters: `wire(env, solver=p, verifier=p)`)
        or each role its own policy (trained independently, each on its own turns only). Wire
        several environments to train on all of them; a run picks each group's environment with
        probability proportional to `weight`. Wiring an environment again replaces its wiring.
        """
        self._context.check_open()
        if isinstance(env, str):
            env = environments.load(env)
        if not isinstance(env, Environment):
            raise TypeError(f"wire() takes an Environment or a registered name, got {env!r}")
        unknown = set(roles) - set(env.roles)
        if unknown:
            raise ValueError(
                f"{env.name} has no role(s) {sorted(unknown)}; its roles are {env.roles}"
            )
        for role, policy in roles.items():
            if not isinstance(policy, Policy) or self.policies.get(policy.name) is not policy:
                raise TypeError(f"role {role!r} must be wired to a policy of this session")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"weight must be a number > 0 (relative sampling weight), "
                             f"got {weight!r}")
        self._context.wire(env, dict(roles), float(weight))
        return env

    @property
    def wiring(self) -> Wiring:
        """What is wired to what, with its problems: print it, or end a notebook cell with it."""
        return Wiring(self._context, self.wire)

    # -- running ---------------------------------------------------------------------------------
    def train(
        self,
        steps: int,
        batch_size: int = 64,
        group_size: int = 8,
        max_staleness: int = 1,
        *,
        order: str = "edf",
        seed: int = 0,
        mode: str = "independent",
        eval_every: int | None = None,
        eval_n: int = 64,
        eval_k: int = 1,
        eval_split: str = "test",
        eval_env: Environment | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        record: str = "sample",
        record_per_step: int = 8,
        loggers: Sequence[Tracker | str] = (),
        autoscale: Autoscaler | None = None,
        stall_seconds: float = STALL_SECONDS,
        max_gen_batches: int | None = DEFAULT_MAX_GEN_BATCHES,
        stop_when_learned: bool = False,
        sampler: str = "stream",
        inspect_every: int = INSPECT_EVERY,
    ) -> Run:
        """Start training in the background and return its Run handle at once.

        Args:
            steps: train steps per policy.
            batch_size: episodes per step; a multiple of group_size.
            group_size: episodes per sample (advantages are normalised within a group).
            max_staleness: how many versions rollouts may run ahead of training (0: synchronous).
            order: buffer order, "edf" or "fifo".
            seed: seed of the sample streams (and of the choice between environments).
            mode: with several policies, "independent" (each steps when its own batch is
                ready) or "barrier" (versions advance together, as in AstraFlow).
            eval_every: evaluate on held-out samples every this many versions of the evaluated
                environment's policies (version 0 included, and the final version always),
                alongside training and without pausing it; None: no evaluation. Results:
                `run.evaluations`, the `kind="eval"` rows of `run.metrics`, the dashboard.
                Evaluation episodes are never trained on and not counted as episodes.
            eval_n: problems per evaluation: the first eval_n samples of
                `env.split_samples(eval_split, seed=10_000)` (the ones `evaluate` plays by
                default), the same in every window.
            eval_k: plays per problem (avg@k, pass@k).
            eval_split: the held-out split; the environment must list it in `splits`.
            eval_env: the environment to evaluate (default: the wired one). It may be another
                environment than the trained ones if its roles are wired (by name) to one
                policy each.
            checkpoint_every: write a checkpoint of every policy (weights, optimizer, version,
                sample-stream positions, RNG states) into the run's folder each time its
                version is a multiple of this, and at the end; after a kernel restart
                `ab.Session.resume(directory)` goes on from the newest one. None: none.
            keep_checkpoints: checkpoints kept per policy (the newest; at least 2).
            record: which episodes `run.episodes` keeps (in the run folder's
                episodes.jsonl.zst, with the last 256 also in memory): "sample" (every failed
                or truncated episode and `record_per_step` others a step, picked uniformly;
                the quickstart's 600 steps keep ~5k of ~156k episodes), "all" (every episode)
                or "none" (failed and truncated ones only). Observers still see every episode.
            record_per_step: with record="sample", episodes kept per metrics row besides the
                failed and truncated ones.
            loggers: experiment trackers that get every metrics row and evaluation window
                (`astranb.session.trackers`): "tensorboard", "wandb", "mlflow" (with their defaults)
                or objects such as `ab.trackers.TensorBoard(logdir)`,
                `ab.trackers.WandB(project=..., mode="offline")`, `ab.trackers.MLflow(...)`.
                They log from threads of their own and are closed, their files complete, when
                the run ends; one that fails is reported once and switched off, never stopping
                training.
            autoscale: an `astranb.remote.scaling.Autoscaler` that adds and drains rollout services
                during the run from the trainers' idle time (`services.autoscaler()` of
                `launch_ray` / `launch_local`); needs rollout services.
            stall_seconds: when no step is published and no group reaches a buffer for this
                long, the run records a "stalled" event saying what it waits for, shown by
                `run.status` ("stalled"), `run.stalled`, the dashboard and the waiting cell.
            max_gen_batches: dynamic sampling's bound: a step waits for at most about this
                many batches' worth of groups. Groups whose rewards all tie are dropped by
                `filter_groups`; once `(max_gen_batches - 1) * batch_size / group_size` of them
                were dropped since the policy's last step, the step takes the groups it has
                (at least one) and trains those with a signal; the row says
                `filter_budget_hit`. None: no bound (a run whose task is learned then plays
                ever more episodes per step).
            stop_when_learned: end a policy's training at its "learned" event: the last
                max(64, 4 * batch_size / group_size) groups all tied, some at its best reward.
                The event is recorded either way (`run.learned`, the dashboard, the waiting
                cell).
            sampler: "stream" plays every sample in stream order; "open" skips samples its
                policies have lately solved (every episode at the best reward), most of the
                time (a floor of 10% keeps each in play), so where samples repeat the
                rollouts go to those with something left to learn. A skipped sample is
                accounted as filtered and counts towards the budget; rows' `reward` counts it
                at its recent reward (`reward_played`: the played episodes' mean).
            inspect_every: record step 0 and every this many steps after it for the step
                inspector, token by token: `run.steps[i].show()` (session/steps.py; the newest
                100 per policy kept in the run folder's trained-steps/); 0: none.

        Raises:
            ValueError: on invalid settings or wiring, before any work starts.
        """
        self._context.check_open()
        config = RunConfig(steps, batch_size, group_size, max_staleness, order, seed, mode,
                           stall_seconds, max_gen_batches, stop_when_learned, sampler,
                           inspect_every)
        if autoscale is not None and self._context.pool is None:
            raise ValueError("autoscale= adds and drains rollout services; this session plays "
                             "episodes in this process. Give Session(rollout=[...]) URLs")
        restore.check_checkpointing(self._context, checkpoint_every)
        wired = launch.check_ready(self._context)
        held_out = (None if eval_every is None else heldout.heldout(
            wired, eval_env, eval_split, eval_n, eval_k, eval_every))
        policies = {p.name: p for _, wiring, _ in wired for p in wiring.values()}
        trackers = resolve_trackers(loggers)  # a bad logger fails here, before any work
        directory = restore.next_run_folder(self.directory)
        recorder = Recorder(directory, {name: launch.decoder(p) for name, p in policies.items()},
                            record=record, per_step=record_per_step, seed=seed)
        targets = {name: p.version + steps for name, p in policies.items()}
        if checkpoint_every:
            restore.write_run_plan(directory, config, wired, self._context.recipes, targets,
                                   checkpoint_every=checkpoint_every, keep=keep_checkpoints,
                                   held_out=held_out, eval_n=eval_n, record=record,
                                   per_step=record_per_step)
        run = launch.start(self._context, config, wired, recorder, held_out, targets=targets,
                           checkpoints=(checkpoint_every or 0, keep_checkpoints),
                           loggers=trackers, autoscale=autoscale)
        run.session = self
        return run

    @also_on_the_class
    def resume(self, run: str | int | os.PathLike[str] | None = None, *,
               envs: Mapping[str, Environment] | Sequence[Environment] | None = None,
               loggers: Sequence[Any] | None = None) -> Run:
        """Go on with a run that was trained with `checkpoint_every` and interrupted (a kernel
        restart, a killed process), from its newest good checkpoint, to its target steps.

            session = ab.Session("runs/x")   # after the restart: a fresh Session on the folder
            run = session.resume()           # or: run = ab.Session.resume("runs/x")

        Policies the Session does not have yet are created from the run's plan (the same
        model, algorithm and optimizer), and environments made again by name; pass `envs` for
        ones that cannot be (made with arguments, or not registered). The trainers load their
        checkpoints (checked bit for bit), the engines get those weights, and the run goes on in
        its own folder: metrics continue the same series (rows of steps after the checkpoint
        are set aside in metrics.discarded.jsonl), a "resumed" event marks the restart, and
        nothing generated before it is trained on.

        Args:
            run: which run of this folder (index, "run-002", or a path); default: the newest
                with checkpoints.
            envs: environments to wire again, by name (a mapping) or as a list.
            loggers: experiment trackers, as for `train` (they log the resumed steps).

        Raises:
            NoCheckpoint: the run has no plan or no good checkpoint.
            ValueError: the run finished already, or its environments cannot be made again.
        """
        self._context.check_open()
        resumed = restore.resume(self._context, run, envs, loggers, make_policy=self.policy,
                                 wire=self.wire)
        resumed.session = self
        return resumed

    @overload
    def evaluate(self, env: Environment | None = None, *, split: None = None, n: int = 128,
                 k: int = 1, seed: int = 10_000) -> dict[str, float]: ...

    @overload
    def evaluate(self, env: Environment | None = None, *, split: str, n: int = 128,
                 k: int = 1, seed: int = 10_000) -> dict[str, RoleEvaluation]: ...

    def evaluate(
        self, env: Environment | None = None, *, split: str | None = None, n: int = 128,
        k: int = 1, seed: int = 10_000,
    ) -> dict[str, float] | dict[str, RoleEvaluation]:
        """Play episodes with the current weights (nothing is trained) and score them.

        Without `split`: the mean reward per role of `n` episodes of `env.samples(seed)`, plus
        "failed_episodes" when some failed. With `split` ("test", or any split the environment
        lists in `splits`): the first `n` samples of `env.split_samples(split, seed)`, each
        played `k` times, and per role a `RoleEvaluation`: avg@k (mean over problems of the
        mean reward of the k plays), pass@k (share of problems solved, `env.solved(reward)`,
        by at least one of k plays), the weight versions of the role's tokens, and how many
        plays failed or were truncated. Episodes play on this process's engines or on the
        rollout services, whichever the session uses.

        Args:
            env: which environment (default: the wired one; needed when several are wired). An
                environment that is not wired works when each of its roles is wired, by name, to
                one policy.
            split: the samples' split; None keeps the plain mean-reward evaluation.
            n: problems (samples) to play.
            k: plays per problem (with `split` only).
            seed: seed of the sample stream.

        Returns:
            role -> mean reward (no split), or role -> RoleEvaluation (with a split).

        Raises:
            ValueError: bad arguments, or the environment has no such split.
            RuntimeError: every episode failed (the first error is in the message).

        Warns:
            RuntimeWarning: the weights changed while the evaluation played (a run was
                training), so its tokens come from more than one version.
        """
        self._context.check_open()
        heldout.positive("n", n, "the number of problems to play")
        heldout.positive("k", k, "plays per problem")
        if env is None:
            env = heldout.only_env(launch.check_ready(self._context), "env")
        wiring = heldout.eval_wiring(env, list(self._context.wiring))
        if split is None:
            return heldout.mean_reward(self._context, env, wiring, n, k, seed)
        plays, results = heldout.on_split(self._context, env, wiring, split, n, k, seed)
        check_evaluation(plays, results)  # called here: its warning names evaluate's caller
        return results

    def play(self, env: Environment | None = None, *, groups: int = 1, group_size: int = 8,
             samples: Sequence[Mapping[str, Any]] | None = None, seed: int = 0) -> list[Group]:
        """Play groups of episodes with the current weights: a manual loop's first block.

            groups = session.play(groups=2, group_size=8)
            batch = policy.build_batch(groups)
            policy.forward_backward(batch); policy.optim_step(); policy.publish_weights()

        (session/manual.py). The episodes are played as a run plays them, by the engines of this
        process, but nothing is recorded or counted: the groups are yours to look at and train.

        Args:
            env: which environment (default: the wired one; needed when several are wired).
            groups: how many samples to play (ignored when `samples` is given).
            group_size: episodes per sample.
            samples: the samples to play (default: the next `groups` of `env.samples(seed)`;
                successive calls go on through the stream).
            seed: seed of the sample stream.

        Returns:
            One `Group` per sample, with its successful episodes (`group.trajectories`).

        Raises:
            RuntimeError: a run is training (stop it first), or every episode failed.
            ValueError: bad arguments, or the session plays on rollout services.
        """
        self._context.check_open()
        return self._manual.play(self._context, env, groups, group_size, samples, seed)

    @property
    def runs(self) -> list[Run]:
        return list(self._context.runs)

    def close(self) -> None:
        """Stop running runs, close engines, service clients and the background loop.

        Idempotent. A script that ends without it gets it called at interpreter exit."""
        self._context.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        envs = [view.label for view in self.wiring.environments]
        return (f"Session({str(self.directory)!r}, policies={list(self.policies)}, "
                f"environments={envs})")

    def _repr_html_(self) -> str:
        from ..notebook.html import card, table

        context = self._context
        where = ("embedded" if context.pool is None
                 else f"{len(context.pool.members)} rollout service(s)")
        if context.trainer is not None:
            where += ", trainer service"
        policies = table(
            ("policy", "model", "algorithm", "version", "rollouts"),
            [(name, p.spec.name, p.algorithm.name, p.version, p.describe()["rollouts"])
             for name, p in self.policies.items()],
        ) if self.policies else "<div>no policies yet: session.policy(name, model=...)</div>"
        runs = f"{len(context.runs)} run(s): " + ", ".join(r.status for r in context.runs[-5:])
        runs = runs if context.runs else "no runs"
        return card("Session", f"{self.directory} · {where} · {runs}",
                    policies + self.wiring._repr_html_(), "astranb-session")

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (then every use raises SessionClosed)."""
        return self._context.closed
