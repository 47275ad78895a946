"""Playing one episode: the single place an environment's `episode()` is called.

The orchestrator, the rollout service, evaluation, the debugger and replay all play episodes
through `play_episode`, so an episode means the same thing everywhere: whatever the environment
raises fails that episode only (its traceback is kept on the trajectory), an episode that reaches
the context or its token budget ends as truncated (kept, trained on, with the environment's
`truncated_reward`), cancellation goes through, and the trajectory holds every turn, tool call
and count the context recorded.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import anyio

from ..errors import EpisodeTruncated
from ..types import Trajectory
from .base import Environment, EpisodeContext

__all__ = ["play_episode"]


async def play_episode(
    env: Environment,
    wiring: Mapping[str, Any],
    sample: Mapping[str, Any],
    *,
    context: EpisodeContext | None = None,
    reraise: tuple[type[BaseException], ...] = (),
    group: int = -1,
    started_version: int = 0,
    id: str = "",
) -> Trajectory:
    """Play one episode of `env` on `sample` with `wiring` (role -> policy).

    Args:
        context: the context to play through (default: a fresh `EpisodeContext`); the
            debugger's replay passes one that answers from a recording.
        reraise: exception types that propagate instead of failing the episode.
        group, started_version, id: stamped on the trajectory (a run's bookkeeping).

    Returns:
        The trajectory; `error` holds the traceback if the episode raised.
    """
    ctx = context if context is not None else EpisodeContext(env, wiring)
    truncated = None
    try:
        result = await env.episode(ctx, sample)
        if ctx.truncation is not None:  # the agent's endpoint call hit a limit
            raise ctx.truncation
        rewards, error = env.rewards_for(result), None
    except anyio.get_cancelled_exc_class():
        raise
    except reraise:
        raise
    except EpisodeTruncated as cut:
        truncated, error = cut.reason, None
        rewards = env.rewards_for(env.truncated_reward)
    except Exception:
        rewards, error = {}, traceback.format_exc()
        if ctx.truncation is not None:  # the agent raised the error its endpoint call got
            truncated, error = ctx.truncation.reason, None
            rewards = env.rewards_for(env.truncated_reward)
    finally:
        await ctx.aclose()
    return Trajectory(sample, tuple(ctx.turns), rewards, group, error, started_version, id,
                      tuple(ctx.tool_calls), env.name, truncated, dict(ctx.counts))
