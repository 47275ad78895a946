"""The trainer side of a run: pop a fresh batch, step, publish, record. One loop per policy.

The heavy step runs in a worker thread, so the event loop keeps serving rollouts meanwhile: with
`max_staleness >= 1` the engine keeps generating for later versions while a step runs. Groups in
the batch stay "live" for the staleness gate until the new weights are published, which is what
makes `max_staleness=0` fully synchronous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from ..dataflow.batcher import build_batch
from ..dataflow.buffer import Buffer, Group
from ..dataflow.orchestrator import RolloutCounters
from ..dataflow.staleness import StalenessGate
from ..policy import Policy
from ..recorder import Recorder

__all__ = ["TrainLoop"]


@dataclass
class TrainLoop:
    """Trains one policy for `steps` steps from the groups in its buffer."""

    policy: Policy
    buffer: Buffer
    gate: StalenessGate
    recorder: Recorder
    counters: RolloutCounters
    steps: int
    groups_per_batch: int
    max_staleness: int
    started: float
    dropped_stale: int = 0

    async def run(self) -> None:
        while self.policy.version < self.steps:
            await self.step()

    async def step(self) -> dict:
        policy, version = self.policy, self.policy.version
        t_wait = time.perf_counter()
        groups = await self.buffer.pop(
            self.groups_per_batch, version, self.max_staleness, on_drop=self._drop
        )
        batch = build_batch(groups, policy.name, policy.algorithm, _pad_id(policy))
        tokens_before = self.counters.rollout_tokens
        t_step = time.perf_counter()
        metrics = await anyio.to_thread.run_sync(policy.trainer.step, batch)
        tokens_during = self.counters.rollout_tokens - tokens_before
        transfer = await policy.publish()
        self._release(groups)
        row = self._row(version, groups, {**metrics, **transfer}, t_wait, t_step, tokens_during, batch)
        self.recorder.add_row(row)
        return row

    def _drop(self, group: Group) -> None:
        self.dropped_stale += 1
        self._release([group])

    def _release(self, groups: list[Group]) -> None:
        if groups:
            self.gate.release({self.policy.name: len(groups)})

    def _row(self, version, groups, metrics, t_wait, t_step, tokens_during, batch) -> dict:
        now = time.perf_counter()
        staleness = [version - g.min_version(self.policy.name) for g in groups]
        versions = batch.versions_B_T[batch.loss_mask_B_T > 0]
        rewards = self.counters.take_rewards()
        c = self.counters
        return {
            "policy": self.policy.name,
            "step": version,
            "version": version + 1,
            "time": now - self.started,
            "reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "batch_reward": float(batch.rewards_B.mean()),
            "episodes_since_step": len(rewards),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "token_version_min": int(versions.min()),
            "token_version_max": int(versions.max()),
            "buffer_size": len(self.buffer),
            "live_groups": self.gate.live[self.policy.name],
            "dropped_stale": self.dropped_stale,
            "filtered_groups": c.filtered_groups,
            "episodes": c.episodes,
            "failed_episodes": c.failed,
            "rollout_tokens": c.rollout_tokens,
            "rollout_tokens_during_step": tokens_during,
            "wait_seconds": t_step - t_wait,
            "step_seconds": now - t_step,
            **metrics,
        }


def _pad_id(policy: Policy) -> int:
    pad = policy.tokenizer.pad_token_id
    return pad if pad is not None else (policy.tokenizer.eos_token_id or 0)
