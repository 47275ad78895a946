"""`ab.debug(env, sample, solver=policy)`: one fresh episode, played now, opened in the debugger.

    dbg = ab.debug("arithmetic", solver=policy)      # the environment's first sample
    dbg = ab.debug(env, {"a": 2, "b": 3}, solver=policy, verifier=other)

The episode is played in this process on the policies' own engines (on an event loop of its own,
so a script and a notebook cell behave the same) and recorded as a run's episodes are; the
debugger it opens is `astranb.notebook.debugger.EpisodeDebugger`. This module, not the debugger's,
builds the Episode: the recorder opens the debugger (`Episode.show()`), so the debugger imports
nothing of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import environments
from ..environments.base import Environment
from ..environments.play import play_episode
from ..session.policy import Policy
from ..session.recorder import Episode
from .debugger import EpisodeDebugger, _call

__all__ = ["debug"]


def debug(env: Environment | str, sample: Mapping[str, Any] | None = None, /,
          **policies: Policy) -> EpisodeDebugger:
    """Play one fresh episode with the given policies and open it in the debugger.

    Args:
        env: an Environment, or the name of an installed one.
        sample: the sample to play (default: the first of `env.samples()`).
        **policies: role -> policy, one for each of the environment's roles.

    Returns:
        An EpisodeDebugger at the first step; its `rescore` samples turns after an edit afresh.
        A failed episode is still returned (its last step holds the traceback).

    Raises:
        ValueError: a role is missing or unknown, or a policy has no engine in this process.
    """
    if isinstance(env, str):
        env = environments.load(env)
    if not isinstance(env, Environment):
        raise TypeError(f"debug() takes an Environment or a registered name, got {env!r}")
    _check_roles(env, policies)
    if sample is None:
        sample = next(iter(env.samples()))
    if not isinstance(sample, Mapping):
        raise TypeError(f"sample must be a dict like those env.samples() yields, got {sample!r}")
    return EpisodeDebugger(_call(_play, env, dict(sample), policies), policies)


def _check_roles(env: Environment, policies: Mapping[str, Any]) -> None:
    unknown = sorted(set(policies) - set(env.roles))
    missing = [r for r in env.roles if r not in policies]
    if unknown or missing:
        problems = ([f"unknown role(s) {unknown}"] if unknown else []) + (
            [f"no policy for role(s) {missing}"] if missing else [])
        example = ", ".join(f"{r}=policy" for r in env.roles)
        raise ValueError(f"{env.name} has roles {env.roles}: {'; '.join(problems)}. "
                         f"Call ab.debug(env, sample, {example})")
    for role, policy in policies.items():
        if not isinstance(policy, Policy):
            raise TypeError(f"role {role!r} must be given a Policy (session.policy(...)), "
                            f"got {policy!r}")
        if policy.engine is None:
            raise ValueError(f"policy {policy.name!r} samples on rollout services; ab.debug plays "
                             "the episode in this process and needs a policy with a local engine")


async def _play(env: Environment, sample: dict[str, Any],
                policies: Mapping[str, Policy]) -> Episode:
    # index and group -1: a fresh episode, not one of a run's
    traj = await play_episode(env, policies, sample)
    version = min((p.version for p in policies.values()), default=0)
    return Episode.from_trajectory(traj, -1, version, environment=env,
                                   tokenizers={p.name: p.tokenizer for p in policies.values()})
