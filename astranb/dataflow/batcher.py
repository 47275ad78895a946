"""Turn finished groups into one padded training batch for a policy.

Each turn a policy made becomes one row: prompt + completion, trained on the completion tokens.
The row's advantage is its episode's reward for the turn's role, normalised within the group
(the algorithm decides how), broadcast over the row's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..algorithms import Algorithm
from ..types import Batch, Trajectory, Turn
from .buffer import Group

__all__ = ["build_batch", "group_rewards", "has_signal_for", "policy_reward"]


def policy_reward(traj: Trajectory, policy: str) -> float | None:
    """An episode's reward for the role(s) `policy` played (their mean); None if it played none."""
    roles = {t.role for t in traj.turns if t.policy == policy}
    return sum(traj.rewards[r] for r in roles) / len(roles) if roles else None


def group_rewards(group: Group | Sequence[Trajectory], policy: str) -> list[float]:
    """Reward of each episode of the group in which `policy` took part."""
    trajectories = group.trajectories if isinstance(group, Group) else group
    rewards = [policy_reward(traj, policy) for traj in trajectories]
    return [r for r in rewards if r is not None]


def has_signal_for(group: Group | Sequence[Trajectory], policy: str) -> bool:
    """False when every episode earned the same reward (zero advantage: nothing to learn)."""
    rewards = group_rewards(group, policy)
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards)


def build_batch(groups: Sequence[Group], policy: str, algorithm: Algorithm, pad_id: int) -> Batch:
    """Collate `policy`'s turns of `groups` into a right-padded Batch."""
    rows: list[tuple[Turn, float, float]] = []
    for group in groups:
        trajectories = [t for t in group.trajectories if policy_reward(t, policy) is not None]
        rewards = [r for t in trajectories if (r := policy_reward(t, policy)) is not None]
        adv_1_N = algorithm.advantages(torch.tensor([rewards], dtype=torch.float32))
        # one reward and one advantage per trajectory: equal lengths by construction
        for traj, reward, adv in zip(trajectories, rewards, adv_1_N[0].tolist(), strict=True):
            rows.extend((turn, adv, reward) for turn in traj.turns if turn.policy == policy)
    if not rows:
        raise ValueError(f"no turns of policy {policy!r} in the batch's groups")
    return _collate(rows, pad_id)


def _collate(rows: list[tuple[Turn, float, float]], pad_id: int) -> Batch:
    B = len(rows)
    T = max(len(t.generation.prompt_ids) + len(t.generation.completion_ids) for t, _, _ in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    old_logp = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    temperature = torch.ones(B, dtype=torch.float32)
    rewards = torch.zeros(B, dtype=torch.float32)
    for i, (turn, advantage, reward) in enumerate(rows):
        gen = turn.generation
        p, c = len(gen.prompt_ids), len(gen.completion_ids)
        input_ids[i, : p + c] = torch.tensor(gen.prompt_ids + gen.completion_ids)
        attention[i, : p + c] = 1
        loss_mask[i, p : p + c] = 1.0
        old_logp[i, p : p + c] = torch.tensor(gen.logprobs, dtype=torch.float32)
        adv[i, p : p + c] = advantage
        versions[i, p : p + c] = torch.tensor(gen.versions)
        temperature[i] = turn.sampling.temperature if turn.sampling.temperature > 0 else 1.0
        rewards[i] = reward
    return Batch(input_ids, attention, loss_mask, old_logp, adv, versions, temperature, rewards)
