"""Each role's reward by the weight version that played it, from a run's recorded episodes.

A run's metrics rows carry `batch_reward` (the policy's own-role reward in its trained batch, after
groups without signal were filtered out) and `reward` (all roles averaged); neither is "how well
does this policy do its job now". These helpers read it from `run.episodes` instead: every turn
records the role that made it and the weight versions of its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd

from astranb import Episode

__all__ = ["role_rewards", "early_late"]


def role_rewards(episodes: Iterable[Episode]) -> pd.DataFrame:
    """One row per (finished episode, role): episode index, role, policy, version, reward.

    `version` is the oldest weight version among the role's tokens in that episode (the policy
    that earned the reward, as trained up to that step). Failed episodes are left out.
    """
    rows = []
    for episode in episodes:
        if episode.error is not None:
            continue
        for role, reward in episode.rewards.items():
            turns = [t for t in episode.turns if t["role"] == role]
            versions = [v for t in turns for v in t["versions"]]
            if versions:
                rows.append({"episode": episode.index, "role": role, "policy": turns[0]["policy"],
                             "version": min(versions), "reward": reward})
    return pd.DataFrame(rows, columns=["episode", "role", "policy", "version", "reward"])


def early_late(table: pd.DataFrame, steps: int, fraction: float = 0.1) -> pd.DataFrame:
    """Mean reward per role over the first and the last `fraction` of `steps` weight versions.

    Returns a frame indexed by role with columns early, late, early_episodes, late_episodes.
    """
    span = max(1, math.ceil(steps * fraction))
    early = table[table["version"] < span]
    late = table[table["version"] >= steps - span]
    return pd.DataFrame({
        "early": early.groupby("role")["reward"].mean(),
        "late": late.groupby("role")["reward"].mean(),
        "early_episodes": early.groupby("role").size(),
        "late_episodes": late.groupby("role").size(),
    })
