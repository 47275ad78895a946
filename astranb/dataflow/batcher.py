"""Turn finished groups into one padded training batch for a policy.

Each conversation a policy had in an episode becomes one row: the last turn's prompt +
completion, trained on the tokens the policy sampled (every turn's completion) and not on prompt
or observation tokens. Turns whose prompt does not extend the previous turn's tokens (a template
that rewrote history, separate conversations) are rows of their own. The row's advantage is its
episode's reward for the turn's role, normalised within the group among that role's episodes
(the algorithm decides how), broadcast over the row's tokens. A policy that plays two roles of
one game (self-play) is normalised per role: its two seats' rewards of a zero-sum game average
to 0 in every episode, and one mean per episode would leave it nothing to learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..algorithms import Algorithm
from ..types import Batch, Trajectory, Turn
from .buffer import Group

__all__ = ["build_batch", "chains", "group_rewards", "has_signal_for", "pad_id", "policy_reward",
           "role_rewards"]


def policy_reward(traj: Trajectory, policy: str) -> float | None:
    """An episode's reward for the role(s) `policy` played (their mean); None if it played none."""
    roles = {t.role for t in traj.turns if t.policy == policy}
    return sum(traj.rewards[r] for r in roles) / len(roles) if roles else None


def group_rewards(group: Group | Sequence[Trajectory], policy: str) -> list[float]:
    """Reward of each (episode, role) of the group in which `policy` played the role: one per
    episode for a policy with one role, each seat's for self-play (see `role_rewards`)."""
    return [reward for pairs in role_rewards(group, policy).values() for _, reward in pairs]


def role_rewards(group: Group | Sequence[Trajectory], policy: str
                 ) -> dict[str, list[tuple[Trajectory, float]]]:
    """For each role `policy` played in the group: (episode, that role's reward), in order."""
    trajectories = group.trajectories if isinstance(group, Group) else group
    found: dict[str, list[tuple[Trajectory, float]]] = {}
    for traj in trajectories:
        for role in dict.fromkeys(t.role for t in traj.turns if t.policy == policy):
            found.setdefault(role, []).append((traj, traj.rewards[role]))
    return found


def has_signal_for(group: Group | Sequence[Trajectory], policy: str) -> bool:
    """False when, in every role the policy played, every episode earned the same reward (zero
    advantage: nothing to learn)."""
    for pairs in role_rewards(group, policy).values():
        if len(pairs) > 1 and any(r != pairs[0][1] for _, r in pairs):
            return True
    return False


def pad_id(tokenizer: Any) -> int:
    """The id a batch is right-padded with: the tokenizer's pad token, else its eos (else 0)."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else (tokenizer.eos_token_id or 0)


def build_batch(groups: Sequence[Group], policy: str, algorithm: Algorithm, pad_id: int, *,
                merge: bool = True) -> Batch:
    """Collate `policy`'s turns of `groups` into a right-padded Batch.

    Args:
        merge: train each of an episode's conversations as one sequence where every turn's prompt
            extends the previous turn's prompt + completion token for token (see `chains`);
            False gives one row per turn. Both give the same loss.
    """
    rows: list[_Row] = []
    for group in groups:
        for role, pairs in role_rewards(group, policy).items():
            rewards = [reward for _, reward in pairs]
            adv_1_N = algorithm.advantages(torch.tensor([rewards], dtype=torch.float32))
            # one reward and one advantage per (episode, role): equal lengths by construction
            for (traj, reward), adv in zip(pairs, adv_1_N[0].tolist(), strict=True):
                turns = [turn for turn in traj.turns if turn.policy == policy and turn.role == role]
                for chain in (chains(turns) if merge else [[turn] for turn in turns]):
                    rows.append(_Row(chain, adv, reward))
    if not rows:
        raise ValueError(f"no turns of policy {policy!r} in the batch's groups")
    return _collate(rows, pad_id)


def chains(turns: Sequence[Turn]) -> list[list[Turn]]:
    """Split one episode's turns into conversations that can train as single sequences.

    A turn joins a chain when its prompt starts with the chain's last prompt + completion,
    token for token, and it was sampled with the same temperature and top-p (one row has one
    sampling distribution). Anything else starts a new chain, so a template that rewrote the
    history, or two interleaved conversations, fall back to more rows, never to wrong ones.
    """
    found: list[list[Turn]] = []
    for turn in turns:
        for chain in reversed(found):
            last = chain[-1]
            before = last.generation.prompt_ids + last.generation.completion_ids
            prompt = turn.generation.prompt_ids
            if (len(prompt) > len(before) and prompt[: len(before)] == before
                    and _distribution(turn) == _distribution(last)):
                chain.append(turn)
                break
        else:
            found.append([turn])
    return found


def _distribution(turn: Turn) -> tuple[float, float]:
    return turn.sampling.temperature, turn.sampling.top_p


class _Row:
    """One training row: a chain of turns, the last one's prompt + completion as its tokens."""

    def __init__(self, turns: list[Turn], advantage: float, reward: float):
        self.turns, self.advantage, self.reward = turns, advantage, reward
        last = turns[-1].generation
        self.ids = last.prompt_ids + last.completion_ids


def _collate(rows: list[_Row], pad_id: int) -> Batch:
    # Python lists first, one tensor per field at the end: a tensor per row and turn made this
    # the slowest part of a small model's train step.
    B = len(rows)
    T = max(len(row.ids) for row in rows)
    ids: list[int] = []
    ids_at: list[int] = []  # flat index (row * T + column) of every real token
    done_at: list[int] = []  # flat index of every sampled (trained) token
    logps: list[float] = []
    advs: list[float] = []
    token_versions: list[int] = []
    temperature: list[float] = []
    top_p: list[float] = []
    for i, row in enumerate(rows):
        base = i * T
        ids += row.ids
        ids_at += range(base, base + len(row.ids))
        for turn in row.turns:  # each turn's completion: sampled tokens, trained
            gen = turn.generation
            p, c = len(gen.prompt_ids), len(gen.completion_ids)
            done_at += range(base + p, base + p + c)
            logps += gen.logprobs
            advs += [row.advantage] * c
            token_versions += gen.versions
        sampling = row.turns[0].sampling
        temperature.append(sampling.temperature if sampling.temperature > 0 else 1.0)
        top_p.append(sampling.top_p if sampling.temperature > 0 else 1.0)
    at = torch.tensor(ids_at, dtype=torch.long)
    trained = torch.tensor(done_at, dtype=torch.long)
    input_ids = torch.full((B * T,), pad_id, dtype=torch.long)
    input_ids[at] = torch.tensor(ids, dtype=torch.long)
    attention = torch.zeros(B * T, dtype=torch.long)
    attention[at] = 1
    loss_mask = torch.zeros(B * T, dtype=torch.float32)
    loss_mask[trained] = 1.0
    old_logp = torch.zeros(B * T, dtype=torch.float32)
    old_logp[trained] = torch.tensor(logps, dtype=torch.float32)
    adv = torch.zeros(B * T, dtype=torch.float32)
    adv[trained] = torch.tensor(advs, dtype=torch.float32)
    versions = torch.full((B * T,), -1, dtype=torch.long)
    versions[trained] = torch.tensor(token_versions, dtype=torch.long)
    input_ids, attention, loss_mask, old_logp, adv, versions = (
        t.view(B, T) for t in (input_ids, attention, loss_mask, old_logp, adv, versions))
    rewards = torch.tensor([row.reward for row in rows], dtype=torch.float32)
    return Batch(input_ids, attention, loss_mask, old_logp, adv, versions,
                 torch.tensor(temperature, dtype=torch.float32), rewards,
                 torch.tensor(top_p, dtype=torch.float32))
