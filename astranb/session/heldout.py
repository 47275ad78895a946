"""Held-out evaluation of a Session's policies: what `Session.evaluate` plays, and what
`Session.train(eval_every=...)` evaluates while it trains.

Both pick the environment (the wired one unless named), the policies that play its roles (its
own wiring, or each role's one wired policy matched by role name) and the samples, then play
them with `dataflow.orchestrator.play_heldout`: in this process, or on the rollout services when
the session has them (`mean_reward` and `on_split` take the Session's `RunContext`). Scoring
(avg@k, pass@k, the checks of a result) is evaluation.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..contracts import RemoteEpisodes
from ..dataflow.flow import HeldOut
from ..dataflow.orchestrator import Source, play_heldout
from ..environments.base import Environment
from ..evaluation import RoleEvaluation, evaluate_trajectories, heldout_samples
from ..types import Trajectory
from .context import RunContext

if TYPE_CHECKING:
    from .policy import Policy

__all__ = ["positive", "only_env", "heldout", "eval_wiring", "mean_reward", "on_split", "play"]

Wired = Sequence[tuple[Environment, Mapping[str, "Policy"], float]]


def positive(name: str, value: Any, meaning: str) -> None:
    """Refuse `value` unless it is a positive int; the message says what `name` means."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer ({meaning}), got {value!r}")


def only_env(wired: Wired, argument: str) -> Environment:
    """The one wired environment; with several, an error asking for `argument`."""
    if len(wired) > 1:
        names = [e.name for e, _, _ in wired]
        raise ValueError(f"several environments are wired ({names}); pass {argument}= (the one "
                         "to evaluate)")
    return wired[0][0]


def heldout(wired: Wired, env: Environment | None, split: str, n: int, k: int,
            every: int) -> HeldOut:
    """What `train(eval_every=...)` evaluates, checked before the run starts."""
    positive("eval_every", every, "policy versions between two evaluation windows (e.g. "
             "eval_every=10), or None to train without evaluating")
    positive("eval_n", n, "the number of held-out problems per window")
    positive("eval_k", k, "plays per problem")
    env = env if env is not None else only_env(wired, "eval_env")
    wiring = eval_wiring(env, wired)
    samples = heldout_samples(env, split, n, 10_000, "eval_split")
    return HeldOut(env, wiring, samples, k, every, split)


def eval_wiring(env: Environment, wired: Wired) -> dict[str, Policy]:
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


def mean_reward(context: RunContext, env: Environment, wiring: Mapping[str, Policy], n: int,
                k: int, seed: int) -> dict[str, float]:
    """`Session.evaluate` without a split: the mean reward per role of n plays."""
    if k != 1:
        raise ValueError(f"k={k} needs a split: pass split='test' (or 'train') to get "
                         "avg@k and pass@k, or leave k out for the mean reward")
    samples = tuple(itertools.islice(env.samples(seed), n))
    plays = context.call(play, context.pool, env, wiring, samples, 1)
    return _mean_rewards([p[0] for p in plays], env.roles)


def on_split(context: RunContext, env: Environment, wiring: Mapping[str, Policy], split: str,
             n: int, k: int, seed: int
             ) -> tuple[list[list[Trajectory]], dict[str, RoleEvaluation]]:
    """`Session.evaluate` with a split: the plays, and per role avg@k, pass@k and the rest
    (left to `evaluation.check_evaluation`, which the caller runs)."""
    samples = heldout_samples(env, split, n, seed)
    plays = context.call(play, context.pool, env, wiring, samples, k)
    return plays, evaluate_trajectories(plays, env.roles, k, split, env.solved)


async def play(pool: RemoteEpisodes | None, env: Environment, wiring: Mapping[str, Policy],
               samples: Sequence[Mapping[str, Any]], k: int) -> list[list[Trajectory]]:
    """Play each sample k times with the current weights, here or on the rollout services."""
    version = min(p.version for p in wiring.values())
    if pool is None:
        return await play_heldout(env, wiring, samples, k, version=version)
    pool.start_run([Source(env, wiring)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        plays = await play_heldout(env, wiring, samples, k, remote=pool, version=version)
        tg.cancel_scope.cancel()
    return plays


def _mean_rewards(results: Sequence[Trajectory | None],
                  roles: Sequence[str]) -> dict[str, float]:
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
