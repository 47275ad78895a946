"""Bringing an embedded run back after its kernel died: the plan a run leaves and how a Session
rebuilds policies and wiring from it (the folder's lock is `folder.py`).

`session.train(checkpoint_every=N)` writes the run's *plan* (plan.json, see `checkpoint.py`)
before it starts: its settings, each policy's target version, each policy's recipe (the
arguments `Session.policy` took) and the wiring by environment name. `Session.resume` reads it
in a fresh process and calls `restore`: policies that the Session does not have yet are created
from their recipes, environments are made again by name (`ab.environments.load`) unless the
caller passes them, each trainer loads its newest good checkpoint (its weights checked bit for
bit against the checkpoint's checksum) and the engines get those weights before anything plays.

`resume` is `Session.resume`'s body: `restore`, the engines brought to the loaded weights, the
run's held-out windows and Recorder made again from the plan, and the run started on
(`launch.start`). Both take the Session's `RunContext`, and the Session's public `policy` and
`wire` methods to create policies and wire environments with the Session's own checks.
`also_on_the_class` lets `ab.Session.resume(folder)` open the Session itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import environments
from ..algorithms.config import (
    algorithm_from_dict,
    algorithm_reference,
    algorithm_to_dict,
    travels_as_config,
)
from ..contracts import Checkpointable
from ..dataflow.config import RunConfig
from ..models import ModelSpec
from ..training.local import AdamWConfig
from ..training.lora import lora_from_dict
from ..training.reference import reference_from_dict
from ..weights.codec import checksum
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    NoCheckpoint,
    latest_good,
    read_plan,
    restore_rng,
    set_aside_rows,
    write_plan,
)
from .context import RunContext
from .episodes import DamagedRecord, set_aside_episodes
from .folder import (  # FolderLock(ed), next_run_folder re-exported: they lived here first
    PLAN_FILE,
    FolderLock,
    FolderLocked,
    checkpoints_of,
    next_run_folder,
    run_folder_path,
    run_folders,
)
from .heldout import heldout, positive
from .launch import decoder, start
from .recorder import Recorder
from .trackers import resolve as resolve_trackers

if TYPE_CHECKING:
    from ..dataflow.flow import HeldOut
    from ..environments.base import Environment
    from .policy import Policy
    from .run import Run

__all__ = ["Resumption", "FolderLocked", "FolderLock", "make_plan", "restore", "run_folder",
           "resume", "also_on_the_class", "next_run_folder", "write_run_plan",
           "check_checkpointing", "MakePolicy", "Wire"]

MakePolicy = Callable[..., "Policy"]
"""`Session.policy`: a new policy from its name, model and options (a plan's recipe)."""
Wire = Callable[..., "Environment"]
"""`Session.wire`: wires an environment's roles to policies, with its checks."""


# -- the plan --------------------------------------------------------------------------------------

def make_plan(config: RunConfig, wired: Sequence[tuple[Any, Mapping[str, Any], float]],
              recipes: Mapping[str, Mapping[str, Any]], targets: Mapping[str, int], *,
              checkpoint_every: int, keep: int, evaluation: Mapping[str, Any] | None,
              record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """plan.json's content (plain values only)."""
    policies = {p.name: p for _, wiring, _ in wired for p in wiring.values()}
    return {
        "format": 1,
        "config": dataclasses.asdict(config),
        "targets": dict(targets),
        "checkpoint_every": checkpoint_every,
        "keep_checkpoints": keep,
        "policies": {name: _recipe(policy, recipes.get(name, {}))
                     for name, policy in sorted(policies.items())},
        "wiring": [{"env": env.name, "registry": _registry(env),
                    "roles": {role: p.name for role, p in wiring.items()}, "weight": weight}
                   for env, wiring, weight in wired],
        "evaluation": dict(evaluation) if evaluation else None,
        "record": dict(record) if record else None,
    }


def write_run_plan(directory: Path, config: RunConfig,
                   wired: Sequence[tuple[Any, Mapping[str, Any], float]],
                   recipes: Mapping[str, Mapping[str, Any]], targets: Mapping[str, int], *,
                   checkpoint_every: int, keep: int, held_out: HeldOut | None, eval_n: int,
                   record: str, per_step: int) -> None:
    """Write plan.json of a run that `Session.train` starts with checkpoints."""
    evaluation = None if held_out is None else {
        "env": held_out.env.name, "split": held_out.split, "n": eval_n, "k": held_out.k,
        "every": held_out.every}
    write_plan(directory, make_plan(config, wired, recipes, targets,
                                    checkpoint_every=checkpoint_every, keep=keep,
                                    evaluation=evaluation,
                                    record={"mode": record, "per_step": per_step}))


def check_checkpointing(context: RunContext, checkpoint_every: int | None) -> None:
    """Refuse `train(checkpoint_every=...)` where it cannot work, before any work starts."""
    if checkpoint_every is None:
        return
    positive("checkpoint_every", checkpoint_every, "versions between two checkpoints "
             "(e.g. checkpoint_every=50), or None for no checkpoints")
    if context.pool is not None:
        raise ValueError("checkpoint_every is for runs in this process; a trainer "
                         "service checkpoints itself (`astranb serve trainer "
                         "--checkpoint-every N`)")
    cannot = [n for n, p in context.policies.items() if not isinstance(p.trainer, Checkpointable)]
    if cannot:
        raise ValueError(f"checkpoint_every: the trainers of {cannot} cannot write checkpoints "
                         "(a trainer of your own, trainer='external', keeps its own state: "
                         "checkpoint it in your loop); leave checkpoint_every out")


def _registry(env: Environment) -> dict[str, Any] | None:
    """How `ab.environments.load` made `env` (name and JSON-able arguments), or None."""
    name = env.registry_name
    if name is None:
        return None
    kwargs = dict(env.registry_kwargs)
    try:
        json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError):
        return None  # made with objects: the caller passes the environment again
    return {"name": name, "kwargs": kwargs}


def _recipe(policy: Policy, options: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": dataclasses.asdict(policy.spec),
            "algorithm": _algorithm_recipe(policy.algorithm),
            "optimizer": dataclasses.asdict(policy.optimizer), "options": dict(options)}


def _algorithm_recipe(algorithm: Any) -> dict[str, Any]:
    """astranb's own configs as JSON; a user's own algorithm by reference where its class can be
    imported by name, else by its class name only (resume then needs the policy built again)."""
    if travels_as_config(algorithm):
        return algorithm_to_dict(algorithm)
    return algorithm_reference(algorithm) or {"kind": "custom",
                                              "class": type(algorithm).__qualname__}


def _algorithm_of(name: str, recipe: Mapping[str, Any]) -> Any:
    if recipe.get("kind") == "custom":
        raise ValueError(
            f"policy {name!r} trained with its own algorithm {recipe.get('class')!r}, defined "
            "where it cannot be imported by name (a notebook cell): build the policy in this "
            f"session again, session.policy({name!r}, ..., algorithm=...), then resume")
    # a reference names the user's own module: importing it here runs their own code
    return algorithm_from_dict(dict(recipe), allow_import=True)


# -- restoring -------------------------------------------------------------------------------------

@dataclass
class Resumption:
    """What `restore` found and did: everything `Session.resume` needs to start the run."""

    directory: Path
    config: RunConfig
    wired: list[tuple[Environment, dict[str, Policy], float]]
    targets: dict[str, int]
    checkpoints: dict[str, Checkpoint]
    rows: list[dict[str, Any]]
    """The metrics rows kept (steps before each policy's checkpoint)."""
    plan: dict[str, Any]
    played: int = 0
    """Episodes the run had played at the newest checkpoint: the resumed run's indices go on."""
    set_aside: int = 0
    """Recorded episodes moved to episodes.discarded.jsonl.zst (played after the checkpoint,
    or on a sample it plays again)."""

    @property
    def position(self) -> Mapping[str, Any]:
        """The sample streams' position at the newest checkpoint."""
        return _newest(self.checkpoints).state.get("position") or {}

    @property
    def time(self) -> float:
        """The run's clock at the newest checkpoint (rows go on from it)."""
        return max(float(c.state.get("time", 0.0)) for c in self.checkpoints.values())

    def event(self) -> dict[str, Any]:
        return {
            "run": self.directory.name,
            "versions": {n: c.version for n, c in self.checkpoints.items()},
            "checkpoints": {n: c.path.name for n, c in self.checkpoints.items()},
            "weights_checksum": {n: c.weights_checksum for n, c in self.checkpoints.items()},
            "step": min(c.version for c in self.checkpoints.values()),
            "time": self.time,
            "replayed_samples": len(self.position.get("pending") or ()),
            "episodes_set_aside": self.set_aside,
            "resumed_at": time.time(),
        }


def run_folder(directory: Path, run: str | int | os.PathLike[str] | None) -> Path:
    """The run folder to resume: the newest one with a plan, or the one named."""
    if run is None:
        found = [p for p in run_folders(directory) if (p / PLAN_FILE).is_file()]
        if not found:
            raise NoCheckpoint(f"{directory} holds no run trained with checkpoint_every=N: "
                               "there is nothing to resume")
        return found[-1]
    path = (run_folder_path(directory, run) if isinstance(run, int)
            else Path(run) if Path(run).is_absolute() or Path(run).exists()
            else directory / str(run))
    if not path.is_dir():
        raise NoCheckpoint(f"no run folder {path}")
    return path


def resume(context: RunContext, run: str | int | os.PathLike[str] | None,
           envs: Mapping[str, Environment] | Sequence[Environment] | None,
           loggers: Sequence[Any] | None, *, make_policy: MakePolicy, wire: Wire) -> Run:
    """`Session.resume`: rebuild the run on `context` (creating policies with `make_policy`,
    wiring with `wire`), load its checkpoints, start it again."""
    trackers = resolve_trackers(loggers)
    found: Resumption = restore(context, run_folder(context.directory, run), envs,
                                make_policy=make_policy, wire=wire)
    for policy in {p.name: p for _, w, _ in found.wired for p in w.values()}.values():
        context.call(policy.publish)  # the engines sample from the loaded weights
    plan = found.plan
    held_out = None
    if plan.get("evaluation"):
        e = plan["evaluation"]
        env = next((env for env, _, _ in found.wired if env.name == e["env"]), None)
        if env is not None:
            held_out = heldout(found.wired, env, e["split"], e["n"], e["k"], e["every"])
    policies = sorted({p.name for _, w, _ in found.wired for p in w.values()})
    record = plan.get("record") or {}
    recorder = Recorder(found.directory, {n: decoder(context.policies[n]) for n in policies},
                        record=record.get("mode", "sample"),
                        per_step=record.get("per_step", 8), seed=found.config.seed)
    recorder.continue_from(found.rows, found.played)
    recorder.add_event("resumed", found.event())
    return start(context, found.config, found.wired, recorder, held_out, targets=found.targets,
                 checkpoints=(plan["checkpoint_every"], plan["keep_checkpoints"]),
                 position=found.position, time_offset=found.time, loggers=trackers)


class also_on_the_class:  # noqa: N801 - used as a decorator
    """A method that, called on the class with a folder first, opens a Session on that folder
    and calls it there: `ab.Session.resume("runs/x")` is `ab.Session("runs/x").resume()`."""

    def __init__(self, method: Callable[..., Any]):
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: type) -> Callable[..., Any]:
        if obj is not None:
            return functools.partial(self.method, obj)

        @functools.wraps(self.method)
        def on_a_new_session(directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
            session = cls(directory)
            try:
                return self.method(session, *args, **kwargs)
            except BaseException:
                session.close()
                raise

        return on_a_new_session


def restore(context: RunContext, directory: Path,
            envs: Mapping[str, Environment] | Sequence[Environment] | None, *,
            make_policy: MakePolicy, wire: Wire) -> Resumption:
    """Rebuild what the plan in `directory` describes on `context` and load the checkpoints.

    Policies missing from the context are created from their recipes (`make_policy`, the
    Session's `policy`); environments are made again by name unless `envs` holds them (or the
    context already wires them), and wired with `wire` (the Session's `wire`). Each trainer
    loads its newest good checkpoint; its weights must hash to the checkpoint's checksum.
    """
    plan = read_plan(directory)
    policies = _policies(context, plan, make_policy)
    wired = _wiring(context, plan, policies, envs, wire)
    checkpoints: dict[str, Checkpoint] = {}
    for name, policy in policies.items():
        found = latest_good(checkpoints_of(directory, name))
        trainer = policy.trainer
        if not isinstance(trainer, Checkpointable):
            raise CheckpointError(f"the trainer of {name!r} ({type(trainer).__name__}) cannot "
                                  "load checkpoints")
        trainer.load(found.path)
        loaded = checksum(policy.trainer.weights())
        if loaded != found.weights_checksum:
            raise CheckpointError(
                f"{found.path}: the trainer's weights after loading hash to {loaded}, the "
                f"checkpoint says {found.weights_checksum}; the model recipe differs from the "
                "one that wrote it")
        checkpoints[name] = found
    newest = _newest(checkpoints)
    restore_rng(newest.path)
    targets = {name: int(v) for name, v in plan["targets"].items()}
    if all(checkpoints[n].version >= targets[n] for n in checkpoints):
        raise ValueError(
            f"{directory.name} finished: every policy is at its target version ({targets}); "
            "there is nothing to resume. Train on with session.train(steps=...)")
    rows = set_aside_rows(directory, {n: c.version for n, c in checkpoints.items()})
    played, moved = _set_aside_episodes(directory, newest.state)
    config = RunConfig(**plan["config"])
    return Resumption(directory, config, wired, targets, checkpoints, rows, plan, played, moved)


def _newest(checkpoints: Mapping[str, Checkpoint]) -> Checkpoint:
    return max(checkpoints.values(), key=lambda c: c.state.get("time", 0.0))


def _set_aside_episodes(directory: Path, state: Mapping[str, Any]) -> tuple[int, int]:
    """Move the recorded episodes the resumed run replaces out of the record: those played after
    the checkpoint, and those of samples it plays again. Returns (episodes played at the
    checkpoint, episodes moved); (0, 0) for a checkpoint that does not say (older ones)."""
    played = state.get("episodes")
    if not isinstance(played, int):
        return 0, 0
    again = {e["sample_id"] for e in (state.get("position") or {}).get("pending") or ()}
    try:
        moved = set_aside_episodes(directory, lambda e: e.get("index", 0) < played
                                   and e.get("sample_id", "") not in again)
    except DamagedRecord as error:
        warnings.warn(f"{error}; its episodes stay as they are", RuntimeWarning, stacklevel=3)
        moved = 0
    return played, moved


def _policies(context: RunContext, plan: Mapping[str, Any],
              make_policy: MakePolicy) -> dict[str, Policy]:
    found: dict[str, Policy] = {}
    for name, recipe in plan["policies"].items():
        spec = ModelSpec(**recipe["model"])
        policy = context.policies.get(name)
        if policy is None:
            optimizer = dict(recipe["optimizer"])
            optimizer["betas"] = tuple(optimizer.get("betas", (0.9, 0.999)))
            options = dict(recipe["options"])
            if options.get("reference") is not None:  # as plan.json keeps it: plain values
                options["reference"] = reference_from_dict(options["reference"])
            if options.get("lora") is not None:
                options["lora"] = lora_from_dict(options["lora"])
            policy = make_policy(name, spec,
                                 algorithm=_algorithm_of(name, recipe["algorithm"]),
                                 optimizer=AdamWConfig(**optimizer), **options)
        elif policy.spec != spec:
            raise ValueError(f"policy {name!r} of this session has another model than the run "
                             f"to resume ({policy.spec.name} against {spec.name}); resume in a "
                             "fresh Session, or create the policy with the run's model")
        found[name] = policy
    return found


def _wiring(context: RunContext, plan: Mapping[str, Any], policies: Mapping[str, Policy],
            envs: Mapping[str, Environment] | Sequence[Environment] | None,
            wire: Wire) -> list[tuple[Environment, dict[str, Policy], float]]:
    given = dict(envs) if isinstance(envs, Mapping) else {e.name: e for e in envs or ()}
    wired_now = {env.name: env for env, _, _ in context.wiring}
    wired = []
    for entry in plan["wiring"]:
        name = entry["env"]
        env = given.get(name) or wired_now.get(name)
        if env is None:
            registry = entry.get("registry")
            if registry is None:
                raise ValueError(
                    f"the run trained on environment {name!r}, which was not made by "
                    "ab.environments.load(name, ...) with plain arguments, so it cannot be made "
                    "again here; pass it: session.resume(envs=[env])")
            try:
                env = environments.load(registry["name"], **registry["kwargs"])
            except (ValueError, TypeError) as error:
                raise ValueError(
                    f"the run trained on environment {name!r}, which cannot be made again "
                    f"({error}); pass it: session.resume(envs=[env])") from error
        roles = {role: policies[p] for role, p in entry["roles"].items()}
        wire(env, weight=entry["weight"], **roles)
        wired.append((env, roles, float(entry["weight"])))
    return wired
