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
import functools
import itertools
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, overload

import anyio
import torch
from anyio.from_thread import start_blocking_portal

from . import environments
from .algorithms import GRPO, Algorithm
from .algorithms.config import algorithm_to_dict
from .checkpoint import write_checkpoint, write_plan
from .contracts import Checkpointable
from .dataflow.config import RunConfig
from .dataflow.flow import Dataflow, HeldOut
from .dataflow.orchestrator import Source, play_heldout
from .engines import HFEngine
from .environments.base import Environment
from .evaluation import (
    RoleEvaluation,
    check_evaluation,
    evaluate_trajectories,
    heldout_samples,
)
from .models import ModelSpec, dtype_for, resolve
from .policy import Policy
from .recorder import Recorder
from .remote.client import TrainerClient
from .remote.pool import RolloutPool, ServicesPublisher
from .remote.process import ProcessPublisher, ProcessTrainer
from .remote.scaling import Autoscaler
from .remote.serialize import spec_to_wire
from .remote.trainer import RemoteTrainer
from .resuming import FolderLock, Resumption, make_plan, restore, run_folder
from .run import Run
from .runinfo import RunInfo
from .trackers import Tracker, Trackers, run_hyperparameters
from .trackers import resolve as resolve_trackers
from .training.local import AdamWConfig, LocalTrainer
from .types import Trajectory
from .weights.publish import EnginePublisher, StatePublisher
from .weights.store import WeightStore
from .wiring import Wiring

__all__ = ["Session"]

ENGINES = ("hf",)


class _also_on_the_class:  # noqa: N801 - used as a decorator
    """A method that, called on the class with a folder first, opens a Session on that folder
    and calls it there: `ab.Session.resume("runs/x")` is `ab.Session("runs/x").resume()`."""

    def __init__(self, method: Callable[..., Any]):
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: type) -> Callable[..., Any]:
        if obj is not None:
            return functools.partial(self.method, obj)

        @functools.wraps(self.method)
        def on_a_new_session(directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
            session = cls(directory)
            try:
                return self.method(session, *args, **kwargs)
            except BaseException:
                session.close()
                raise

        return on_a_new_session


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
        directory: str | os.PathLike = "runs/session",
        *,
        device: str = "cpu",
        torch_threads: int | None = None,
        rollout: Sequence[str] | str | None = None,
        trainer: str | None = None,
        token: str | None = None,
        failure_timeout: float = 5.0,
        transport: Callable[[str], Any] | None = None,
    ):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = FolderLock(self.directory, self)  # one live Session per folder
        self.device = device
        self.policies: dict[str, Policy] = {}
        self._recipes: dict[str, dict[str, Any]] = {}  # Session.policy's options, for plan.json
        self._wiring: list[tuple[Environment, dict[str, Policy], float]] = []
        self._runs: list[Run] = []
        self._stack = ExitStack()
        self._portal = None
        threads = torch_threads or max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(threads)
        token = token if token is not None else os.environ.get("ASTRANB_TOKEN") or None
        urls = [rollout] if isinstance(rollout, str) else list(rollout or [])
        self._pool = RolloutPool(urls, token, self.policies, failure_timeout=failure_timeout,
                                 transport=transport) if urls else None
        self._trainer = None
        if trainer is None and not urls:
            trainer = _default_trainer(device)
        if trainer not in (None, "thread", "process") and not str(trainer).startswith(
                ("http://", "https://")):
            raise ValueError(f"trainer={trainer!r}: use 'thread', 'process', or the URL of a "
                             "trainer service (http://host:port)")
        self._train_in = "process" if trainer == "process" and not urls else "thread"
        self._threads = threads
        if trainer is not None and trainer not in ("thread", "process"):
            if self._pool is None:
                raise ValueError("a trainer service needs rollout services too: pass "
                                 "rollout=[url, ...] (`astranb serve rollout` on the GPU hosts)")
            self._trainer = TrainerClient(trainer, token,
                                          transport=transport(trainer) if transport else None)
            self._pool.trainer_url = self._trainer.url

    # -- building --------------------------------------------------------------------------------
    def policy(
        self,
        name: str,
        model: ModelSpec | str | os.PathLike,
        *,
        engine: str = "hf",
        algorithm: Algorithm | None = None,
        optimizer: AdamWConfig | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        weight_transfer: str = "delta",
        full_every: int = 10,
    ) -> Policy:
        """Create a policy: a rollout engine and a trainer over two copies of `model`.

        Args:
            name: unique name (metrics and wiring use it).
            model: `models.tiny(...)`, `models.local(path)` or a local model directory.
            engine: rollout engine; "hf" (torch continuous batching) in this process.
            algorithm: GRPO() (default) or M2PO(...).
            optimizer: AdamWConfig(...) settings.
            max_batch_size: most sequences the engine decodes at once.
            seed: sampling seed of the engine.
            weight_transfer: "delta" publishes bf16 weights through a versioned store as sparse
                bit-exact deltas (full snapshots every `full_every` versions and whenever a delta
                cannot apply); "state" copies the trainer's full-precision tensors directly
                (engines in this process only: rollout services always get payloads).
            full_every: versions between forced full snapshots ("delta" only; 0: never forced).
        """
        if name in self.policies:
            raise ValueError(f"a policy named {name!r} exists already; pick another name")
        if weight_transfer not in ("delta", "state"):
            raise ValueError(f"weight_transfer must be 'delta' or 'state', got {weight_transfer!r}")
        spec, algorithm, optimizer = resolve(model), algorithm or GRPO(), optimizer or AdamWConfig()
        if self._pool is not None:
            if weight_transfer != "delta":
                raise ValueError(
                    f"weight_transfer={weight_transfer!r} only applies to an engine in this "
                    "process; rollout services always receive versioned bf16 payloads (deltas "
                    "when they can). Leave weight_transfer out for a remote policy")
            return self._remote_policy(name, spec, engine, algorithm, optimizer, max_batch_size,
                                       seed, full_every)
        if engine not in ENGINES:
            raise ValueError(
                f"engine={engine!r} is not available here; use one of {ENGINES} "
                "(SGLang engines are served by `astranb serve rollout` on a GPU host)"
            )
        dtype = dtype_for(self.device, spec)
        eng = HFEngine(spec, device=self.device, dtype=dtype, max_batch_size=max_batch_size,
                       seed=seed, name=name)
        self._stack.callback(eng.close)
        trainer: LocalTrainer | ProcessTrainer
        publisher: EnginePublisher | StatePublisher | ProcessPublisher
        if self._train_in == "process":
            if weight_transfer != "delta":
                raise ValueError("weight_transfer='state' copies tensors inside one process; a "
                                 "trainer in a child process (trainer='process') publishes "
                                 "payloads: leave weight_transfer out")
            trainer = ProcessTrainer(name, spec, algorithm, optimizer, threads=self._threads,
                                     device=self.device, dtype=dtype, full_every=full_every,
                                     log=self.directory / f"trainer-{name}.log")
            self._stack.callback(trainer.close)
            publisher = ProcessPublisher(eng, trainer)
        else:
            trainer = LocalTrainer(spec, algorithm, optimizer, device=self.device, dtype=dtype)
            publisher = (EnginePublisher(eng, WeightStore(name, full_every=full_every))
                         if weight_transfer == "delta" else StatePublisher(eng))
        publisher.publish_initial(name, trainer)
        policy = Policy(name, spec, algorithm, optimizer, eng, trainer, publisher, eng.tokenizer,
                        max_batch_size=max_batch_size, seed=seed)
        policy.run_on_loop = self._run_on_loop
        self.policies[name] = policy
        self._recipes[name] = {"engine": engine, "max_batch_size": max_batch_size, "seed": seed,
                               "weight_transfer": weight_transfer, "full_every": full_every}
        return policy

    def _remote_policy(self, name, spec, engine, algorithm, optimizer, max_batch_size, seed,
                       full_every) -> Policy:
        """A policy whose episodes run on rollout services (and trains on the trainer service)."""
        pool = self._pool
        assert pool is not None  # add_policy comes here only with rollout services
        trainer: RemoteTrainer | LocalTrainer
        if self._trainer is not None:
            body = {"name": name, "model": spec_to_wire(spec),
                    "algorithm": algorithm_to_dict(algorithm),
                    "optimizer": dataclasses.asdict(optimizer), "full_every": full_every}
            trainer = RemoteTrainer(self._trainer, body)
            self._loop().call(trainer.create)
            publisher = ServicesPublisher(pool, trainer=trainer)
        else:
            trainer = LocalTrainer(spec, algorithm, optimizer, device=self.device,
                                   dtype=dtype_for(self.device, spec))
            publisher = ServicesPublisher(pool, WeightStore(name, full_every=full_every))
        publisher.publish_initial(name, trainer)
        policy = Policy(name, spec, algorithm, optimizer, None, trainer, publisher,
                        spec.tokenizer(), max_batch_size=max_batch_size, seed=seed)
        policy.run_on_loop = self._run_on_loop
        self.policies[name] = policy
        try:
            self._loop().call(pool.prepare)  # every service builds its engine now
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
        if self._pool is None:
            raise ValueError("this session plays episodes in this process; create it with "
                             "Session(..., rollout=[url, ...]) to use rollout services")
        self._loop().call(self._pool.add, url)

    def remove_rollout(self, url: str) -> None:
        """Stop using a rollout service; its in-flight episodes are resubmitted to the others."""
        if self._pool is None:
            raise ValueError("this session has no rollout services")
        self._loop().call(self._pool.remove, url)

    @property
    def rollout_services(self) -> dict[str, str]:
        """URL -> state ("new", "ready", "suspect", "dead") of each rollout service."""
        if self._pool is None:
            return {}
        return {m.url: m.state for m in self._pool.members.values() if not m.removed}

    @property
    def relays(self) -> dict[str, str]:
        """Region -> URL of the rollout service that pulls each version into it for the rest
        (services started with `--region`; empty without regions or a trainer service)."""
        return dict(self._pool.relays) if self._pool is not None else {}

    def wire(self, env: Environment | str, *, weight: float = 1.0, **roles: Policy) -> Environment:
        """Connect each of the environment's roles to a policy: `wire(env, solver=policy)`.

        One policy may fill several roles (shared parameters: `wire(env, solver=p, verifier=p)`)
        or each role its own policy (trained independently, each on its own turns only). Wire
        several environments to train on all of them; a run picks each group's environment with
        probability proportional to `weight`. Wiring an environment again replaces its wiring.
        """
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
        self._wiring = [(e, w, x) for e, w, x in self._wiring if e is not env]
        self._wiring.append((env, dict(roles), float(weight)))
        return env

    @property
    def wiring(self) -> Wiring:
        """What is wired to what, with its problems: print it, or end a notebook cell with it."""
        return Wiring(self)

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
                (`astranb.trackers`): "tensorboard", "wandb", "mlflow" (with their defaults)
                or objects such as `ab.trackers.TensorBoard(logdir)`,
                `ab.trackers.WandB(project=..., mode="offline")`, `ab.trackers.MLflow(...)`.
                They log from threads of their own and are closed, their files complete, when
                the run ends; one that fails is reported once and switched off, never stopping
                training.
            autoscale: an `astranb.remote.scaling.Autoscaler` that adds and drains rollout services
                during the run from the trainers' idle time (`services.autoscaler()` of
                `launch_ray` / `launch_local`); needs rollout services.

        Raises:
            ValueError: on invalid settings or wiring, before any work starts.
        """
        config = RunConfig(steps, batch_size, group_size, max_staleness, order, seed, mode)
        if autoscale is not None and self._pool is None:
            raise ValueError("autoscale= adds and drains rollout services; this session plays "
                             "episodes in this process. Give Session(rollout=[...]) URLs")
        if checkpoint_every is not None:
            _positive("checkpoint_every", checkpoint_every, "versions between two checkpoints "
                      "(e.g. checkpoint_every=50), or None for no checkpoints")
            if self._pool is not None or not all(
                    isinstance(p.trainer, Checkpointable) for p in self.policies.values()):
                raise ValueError("checkpoint_every is for runs in this process; a trainer "
                                 "service checkpoints itself (`astranb serve trainer "
                                 "--checkpoint-every N`)")
        wired = self._check_ready()
        heldout = (None if eval_every is None
                   else self._heldout(wired, eval_env, eval_split, eval_n, eval_k, eval_every))
        policies = {p.name: p for _, wiring, _ in wired for p in wiring.values()}
        trackers = resolve_trackers(loggers)  # a bad logger fails here, before any work
        directory = self._next_run_folder()
        recorder = Recorder(directory, {name: _decoder(p) for name, p in policies.items()},
                            record=record, per_step=record_per_step, seed=seed)
        targets = {name: p.version + steps for name, p in policies.items()}
        if checkpoint_every:
            evaluation = None if heldout is None else {
                "env": heldout.env.name, "split": eval_split, "n": eval_n, "k": eval_k,
                "every": eval_every}
            write_plan(directory, make_plan(config, wired, self._recipes, targets,
                                            checkpoint_every=checkpoint_every,
                                            keep=keep_checkpoints, evaluation=evaluation,
                                            record={"mode": record, "per_step": record_per_step}))
        return self._start(config, wired, recorder, heldout, targets=targets,
                           checkpoints=(checkpoint_every or 0, keep_checkpoints),
                           loggers=trackers, autoscale=autoscale)

    @_also_on_the_class
    def resume(self, run: str | int | os.PathLike | None = None, *,
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
        trackers = resolve_trackers(loggers)
        found: Resumption = restore(self, run_folder(self.directory, run), envs)
        for policy in {p.name: p for _, w, _ in found.wired for p in w.values()}.values():
            self._loop().call(policy.publish)  # the engines sample from the loaded weights
        plan = found.plan
        heldout = None
        if plan.get("evaluation"):
            e = plan["evaluation"]
            env = next((env for env, _, _ in found.wired if env.name == e["env"]), None)
            if env is not None:
                heldout = self._heldout(found.wired, env, e["split"], e["n"], e["k"], e["every"])
        policies = sorted({p.name for _, w, _ in found.wired for p in w.values()})
        record = plan.get("record") or {}
        recorder = Recorder(found.directory, {n: _decoder(self.policies[n]) for n in policies},
                            record=record.get("mode", "sample"),
                            per_step=record.get("per_step", 8), seed=found.config.seed)
        recorder.continue_from(found.rows)
        recorder.add_event("resumed", found.event())
        return self._start(found.config, found.wired, recorder, heldout, targets=found.targets,
                           checkpoints=(plan["checkpoint_every"], plan["keep_checkpoints"]),
                           position=found.position, time_offset=found.time, loggers=trackers)

    def _start(self, config: RunConfig, wired, recorder: Recorder, heldout: HeldOut | None, *,
               targets: Mapping[str, int], checkpoints: tuple[int, int],
               position: Mapping[str, Any] | None = None, time_offset: float = 0.0,
               loggers: Sequence[Tracker] = (), autoscale: Autoscaler | None = None) -> Run:
        policies = sorted({p.name for _, wiring, _ in wired for p in wiring.values()})
        scope_box: list[anyio.CancelScope] = []
        final: dict[str, int] = {}  # the accounting, filled when the run ends; live until then
        resume = {"targets": dict(targets), "checkpoints": checkpoints,
                  "position": position or {}, "time_offset": time_offset,
                  "autoscale": autoscale}
        info = RunInfo.begin(recorder, config, wired,  # run.json: settings, then how it ended
                             stopped=lambda: bool(scope_box) and scope_box[0].cancel_called)
        trackers = None if not loggers else Trackers(
            loggers, recorder, run_hyperparameters(config, wired, heldout),
            {role: p.name for role, p in (heldout.wiring if heldout else {}).items()})
        future = self._loop().start_task_soon(info.watch, self._run_main, config, wired,
                                              recorder, scope_box, final, heldout, resume,
                                              trackers)
        if trackers is not None:  # a task that never started: let its trackers go
            future.add_done_callback(lambda _: trackers.close(wait=False))
        run = Run(config, recorder, future, lambda: self._cancel(scope_box), policies,
                  lambda: dict(final) or self._loop().call(self._accounting), heldout)
        run.session = self
        self._runs.append(run)
        return run

    def _next_run_folder(self) -> Path:
        """run-NNN after every run folder already here (from earlier Sessions too)."""
        taken = [int(p.name[4:]) for p in self.directory.glob("run-*")
                 if p.name[4:].isdigit()]
        return self.directory / f"run-{max(taken, default=-1) + 1:03d}"

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
        _positive("n", n, "the number of problems to play")
        _positive("k", k, "plays per problem")
        if env is None:
            env = _only_env(self._check_ready(), "env")
        wiring = self._eval_wiring(env, list(self._wiring))
        if split is None:
            if k != 1:
                raise ValueError(f"k={k} needs a split: pass split='test' (or 'train') to get "
                                 "avg@k and pass@k, or leave k out for the mean reward")
            samples = tuple(itertools.islice(env.samples(seed), n))
            plays = self._loop().call(self._evaluate, env, wiring, samples, 1)
            return _evaluation([p[0] for p in plays], env.roles)
        samples = heldout_samples(env, split, n, seed)
        plays = self._loop().call(self._evaluate, env, wiring, samples, k)
        results = evaluate_trajectories(plays, env.roles, k, split, env.solved)
        check_evaluation(plays, results)
        return results

    @property
    def runs(self) -> list[Run]:
        return list(self._runs)

    def close(self) -> None:
        """Stop running runs, close engines, service clients and the background loop.

        Idempotent. A script that ends without it gets it called at interpreter exit."""
        import time

        from ._loopthread import untrack

        untrack(self)
        try:
            for run in self._runs:
                run.stop()
            if self._portal is not None:
                # A run whose task had not started yet when stop() came had no cancel scope to
                # cancel (train() then exit at once): stop it again until it has ended, so the
                # portal's exit does not wait for it to train to the end.
                while pending := [run for run in self._runs if run.status == "running"]:
                    time.sleep(0.02)
                    for run in pending:
                        run.stop()
                if self._pool is not None:
                    self._portal.call(self._pool.close)
                if self._trainer is not None:
                    self._portal.call(self._trainer.close)
        finally:
            # the portal stops with the stack: what was entered after it (contexts wrapped by
            # the portal) unwinds first, while the loop still runs
            self._stack.close()
            self._portal = None
            self._lock.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        envs = [view.label for view in self.wiring.environments]
        return (f"Session({str(self.directory)!r}, policies={list(self.policies)}, "
                f"environments={envs})")

    def _repr_html_(self) -> str:
        from .notebook.html import card, table

        where = ("embedded" if self._pool is None
                 else f"{len(self._pool.members)} rollout service(s)")
        if self._trainer is not None:
            where += ", trainer service"
        policies = table(
            ("policy", "model", "algorithm", "version", "rollouts"),
            [(name, p.spec.name, p.algorithm.name, p.version, p.describe()["rollouts"])
             for name, p in self.policies.items()],
        ) if self.policies else "<div>no policies yet: session.policy(name, model=...)</div>"
        runs = f"{len(self._runs)} run(s): " + ", ".join(r.status for r in self._runs[-5:])
        return card("Session", f"{self.directory} · {where} · {runs if self._runs else 'no runs'}",
                    policies + self.wiring._repr_html_(), "astranb-session")

    # -- internals -------------------------------------------------------------------------------
    def wiring_problems(self) -> list[str]:
        """Deprecated: use `session.wiring.problems()` (one place for wiring problems)."""
        import warnings

        warnings.warn("session.wiring_problems() is deprecated; use session.wiring.problems()",
                      DeprecationWarning, stacklevel=2)
        return self._blocking_problems()

    def _blocking_problems(self) -> list[str]:
        """What stops a run from starting, each with its fix (empty: ready to train)."""
        if not self._wiring:
            return ["nothing is wired; call session.wire(env, role=policy) first"]
        problems = []
        for env, wiring, _ in self._wiring:
            missing = [r for r in env.roles if r not in wiring]
            if missing:
                hint = ", ".join(f"{r}=<policy>" for r in missing)
                problems.append(f"role(s) {missing} of {env.name} are not wired; "
                                f"call session.wire(env, {hint})")
            for role, policy in wiring.items():
                if self.policies.get(policy.name) is not policy:
                    problems.append(f"role {role!r} of {env.name} is wired to policy "
                                    f"{policy.name!r}, which is not in this session any more; "
                                    "wire it to one of " + str(sorted(self.policies)))
        return problems

    def _check_ready(self) -> list[tuple[Environment, dict[str, Policy], float]]:
        problems = self._blocking_problems()
        if problems:
            raise ValueError("; ".join(problems))
        running = [r for r in self._runs if not r.done]
        if running:
            raise RuntimeError("a run is still going; await it or call run.stop() first")
        return list(self._wiring)

    def _run_on_loop(self, fn):
        return self._loop().call(fn)

    def _loop(self):
        if self._portal is None:
            from ._loopthread import track

            self._portal = self._stack.enter_context(start_blocking_portal("asyncio"))
            # a script that ends without close() must not hang at exit: the loop is stopped
            # during threading shutdown, before threads are joined (see _loopthread)
            track(self)
        return self._portal

    def _cancel(self, scope_box: list[anyio.CancelScope]) -> None:
        if scope_box and self._portal is not None:
            self._portal.call(scope_box[0].cancel)

    def _heldout(self, wired, env: Environment | None, split: str, n: int, k: int,
                 every: int) -> HeldOut:
        """What `train(eval_every=...)` evaluates, checked before the run starts."""
        _positive("eval_every", every, "policy versions between two evaluation windows (e.g. "
                  "eval_every=10), or None to train without evaluating")
        _positive("eval_n", n, "the number of held-out problems per window")
        _positive("eval_k", k, "plays per problem")
        env = env if env is not None else _only_env(wired, "eval_env")
        wiring = self._eval_wiring(env, wired)
        samples = heldout_samples(env, split, n, 10_000, "eval_split")
        return HeldOut(env, wiring, samples, k, every, split)

    def _eval_wiring(self, env: Environment, wired) -> dict[str, Policy]:
        """Role -> policy to evaluate `env` with: its own wiring, or (not wired) each role's
        one policy among the wired environments, matched by role name."""
        if not isinstance(env, Environment):
            raise TypeError(f"expected an Environment to evaluate, got {env!r}")
        for e, wiring, _ in wired:
            if e is env:
                return dict(wiring)
        found: dict[str, dict[str, Policy]] = {role: {} for role in env.roles}
        for _, wiring, _ in wired:
            for role, policy in wiring.items():
                if role in found:
                    found[role][policy.name] = policy
        unclear = {role: sorted(names) for role, names in found.items() if len(names) != 1}
        if unclear:
            wired_roles = sorted({role for _, wiring, _ in wired for role in wiring})
            raise ValueError(
                f"{env.name} is not wired, and its roles cannot be matched by name to one wired "
                f"policy each ({unclear}: role -> policies found); evaluate a wired environment, "
                f"or one whose roles are named like the wired ones ({wired_roles}) and filled by "
                "one policy each")
        return {role: next(iter(names.values())) for role, names in found.items()}

    async def _run_main(self, config, wired, recorder: Recorder, scope_box, final,
                        heldout: HeldOut | None, resume: Mapping[str, Any],
                        trackers: Trackers | None = None) -> None:
        drawn = list(resume["position"].get("drawn") or [])
        sources = [Source(env, wiring, weight, config.seed, skip=drawn[i] if i < len(drawn) else 0)
                   for i, (env, wiring, weight) in enumerate(wired)]
        every, keep = resume["checkpoints"]
        flow = self._flow = Dataflow(  # read by _accounting
            sources, config, recorder, remote=self._pool, heldout=heldout,
            targets=resume["targets"], time_offset=resume["time_offset"],
            checkpoint=functools.partial(self._checkpoint, recorder.directory, keep),
            checkpoint_every=every)
        flow.orchestrator.restore_position(resume["position"])
        if (heldout is not None and self._pool is not None
                and all(heldout.env is not env for env, _, _ in wired)):
            self._pool.register_env(heldout.env, heldout.wiring)  # the services play it too
        failure: BaseException | None
        try:
            with anyio.CancelScope() as scope:
                scope_box.append(scope)
                scaler = resume.get("autoscale")
                also = [] if scaler is None else [functools.partial(
                    scaler.run, self._pool, lambda: recorder.rows, recorder.add_event)]
                await self._flow.run(*also)
        except BaseExceptionGroup as group:
            failure = _root_cause(group)
        else:
            failure = None
        finally:
            final.update(self._accounting())
            recorder.close()
            if trackers is not None:  # after the recorder: they have every row; files complete
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(trackers.close)
        if failure is not None:
            # Raised here, outside the except block, so its __context__ is not the task group's
            # ExceptionGroup: IPython prints a traceback that links to an exception group as a
            # plain stderr stream instead of an error output, and nbclient/nbmake/papermill
            # would then miss the failure.
            raise failure

    async def _checkpoint(self, directory: Path, keep: int, policy: Policy) -> None:
        """Write a checkpoint of `policy` (called by its train loop between two steps)."""
        flow = self._flow
        state = {"policy": policy.name, "version": policy.version,
                 "position": flow.orchestrator.position(),
                 "time": anyio.current_time() - flow.loops[0].started}
        root = directory / "checkpoints" / policy.name
        trainer = policy.trainer
        assert isinstance(trainer, Checkpointable)  # train() refuses checkpoints otherwise
        await anyio.to_thread.run_sync(functools.partial(
            write_checkpoint, root, policy.version, trainer.save, state, keep=keep))

    def _accounting(self) -> dict[str, int]:
        """The current run's episode accounting (called on the loop)."""
        flow = getattr(self, "_flow", None)
        counts = self._pool.accounting() if self._pool is not None else {}
        return {**counts, "trained_twice": flow.trained_twice if flow is not None else 0}

    async def _evaluate(self, env: Environment, wiring: Mapping[str, Policy],
                        samples: Sequence[Mapping[str, Any]], k: int) -> list[list[Trajectory]]:
        """Play each sample k times with the current weights, here or on the rollout services."""
        version = min(p.version for p in wiring.values())
        if self._pool is None:
            return await play_heldout(env, wiring, samples, k, version=version)
        pool = self._pool
        pool.start_run([Source(env, wiring)])
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            plays = await play_heldout(env, wiring, samples, k, remote=pool, version=version)
            tg.cancel_scope.cancel()
        return plays


def _positive(name: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer ({meaning}), got {value!r}")


def _only_env(wired, argument: str) -> Environment:
    """The one wired environment; with several, an error asking for `argument`."""
    if len(wired) > 1:
        names = [e.name for e, _, _ in wired]
        raise ValueError(f"several environments are wired ({names}); pass {argument}= (the one "
                         "to evaluate)")
    return wired[0][0]


def _evaluation(results: Sequence[Trajectory | None], roles: Sequence[str]) -> dict[str, float]:
    """Mean reward per role over the episodes that finished, and how many failed (if any)."""
    ok = [t for t in results if t is not None and t.ok]
    if not ok:
        first = next((t.error for t in results if t is not None), None)
        raise RuntimeError(f"all {len(results)} evaluation episodes failed; first error:\n"
                           f"{first}")
    result = {r: sum(t.rewards[r] for t in ok) / len(ok) for r in roles}
    if len(ok) < len(results):
        result["failed_episodes"] = float(len(results) - len(ok))
    return result


def _root_cause(group: BaseExceptionGroup) -> BaseException:
    """The error behind nested task-group failures (cancellations it caused left out). When
    different kinds of error happened together: one RuntimeError naming each, with their
    tracebacks in its message (not an exception group, which notebooks show poorly)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = [e for e in _leaves(group) if not isinstance(e, cancelled)] or list(_leaves(group))
    if len({type(e) for e in leaves}) == 1:
        context = leaves[0].__context__
        if context is not None and isinstance(context, BaseExceptionGroup):
            leaves[0].__context__ = None
        return leaves[0]
    details = "\n".join("".join(traceback.format_exception(e)) for e in leaves)
    return RuntimeError(f"{len(leaves)} errors at once in the run's background tasks:\n{details}")


def _leaves(error: BaseException):
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _default_trainer(device: str) -> str:
    chosen = os.environ.get("ASTRANB_TRAINER")
    if chosen:
        if chosen not in ("thread", "process"):
            raise ValueError(f"ASTRANB_TRAINER={chosen!r}: use 'thread' or 'process'")
        return chosen
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "process" if str(device) == "cpu" and (cores or 1) >= 2 else "thread"


def _decoder(policy: Policy):
    """Prompt ids -> text for recorded episodes; the episodes of a group share their prompt, so
    recent prompts are decoded once."""
    tok = policy.tokenizer

    @functools.lru_cache(maxsize=4096)
    def decode(ids: tuple[int, ...]) -> str:
        return tok.decode(list(ids), skip_special_tokens=False)

    return lambda ids: decode(tuple(ids))
