"""The trainer side of a run: pop a fresh batch, step, publish, record. One loop per policy.

The heavy step runs in a worker thread, so the event loop keeps serving rollouts meanwhile: with
`max_staleness >= 1` the engine keeps generating for later versions while a step runs. Groups in
the batch stay "live" for the staleness gate until the new weights are published, which is what
makes `max_staleness=0` fully synchronous. With the trainer in a child process the next batch
is popped, collated and encoded while a step trains (`_collect_next`), so the child goes from one
step to the next with only the pipe in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ..contracts import PolicyHandle, RemoteEpisodes, RunRecorder
from ..errors import TrainerRolledBack
from ..types import Batch
from .barrier import VersionBarrier
from .batcher import build_batch, has_signal_for, pad_id
from .buffer import Buffer, Group
from .orchestrator import RolloutCounters
from .sampling import in_batch
from .staleness import StalenessGate

__all__ = ["TrainLoop", "silent_flags", "MISMATCH_THRESHOLD"]

MISMATCH_THRESHOLD = 0.2
"""A step's mean |trainer logprob - engine logprob| above which it is flagged "mismatch": the
average token's ratio is then past PPO's usual clip range (exp(0.2) = 1.22)."""


@dataclass
class TrainLoop:
    """Trains one policy for `steps` steps from the groups in its buffer."""

    policy: PolicyHandle
    buffer: Buffer
    gate: StalenessGate
    recorder: RunRecorder
    counters: RolloutCounters
    steps: int
    groups_per_batch: int
    max_staleness: int
    started: float = 0.0
    """When the run started, on the event loop's clock (set by `Dataflow.run`)."""
    dropped_stale: int = 0
    trained_twice: int = 0
    remote: RemoteEpisodes | None = None
    """Rollout services that play the episodes, if any (a rollback moves their epoch on)."""
    barrier: VersionBarrier | None = None
    """A VersionBarrier in mode="barrier": step v starts once every policy is at version v."""
    published: int = -1
    """The version the samplers hold: set at the start and after every publish (what held-out
    evaluation windows wait for)."""
    checkpoint: Callable[[PolicyHandle], Awaitable[None]] | None = None
    """Writes a checkpoint of the policy (the Session's, with `train(checkpoint_every=...)`)."""
    checkpoint_every: int = 0
    """Versions between two checkpoints (0: none). One is written whenever the trainer stands
    at a multiple of it, idle, with the rows of every step before it recorded, and at the end."""
    inspect_every: int = 0
    """Steps between two the step inspector records (`RunConfig.inspect_every`: every version
    that is a multiple of it, and the run's first step); 0: none."""

    def __post_init__(self) -> None:
        self._trained: set[str] = set()
        self.published = self.policy.version
        self._first_version = self.policy.version  # the step inspector records it (and every N)
        # the previous step's publish, when it overlaps this step
        self._publishing: asyncio.Future[dict[str, Any]] | None = None
        # the next step's batch, collected while this one trains (see `_collect_next`)
        self._next: asyncio.Future[tuple[list[Group], Batch]] | None = None
        self.doing = "buffer"
        """What the loop waits on now (the watchdog's reading): "barrier", "buffer",
        "trainer", "publish", "checkpoint" or "done"."""
        self.step_started: float | None = None
        """When the running train step began (event loop clock); None between steps."""

    def end_early(self) -> None:
        """Take the step under way (or the next one, between steps), then end (a learned task
        with `stop_when_learned`)."""
        self.steps = min(self.steps, self.policy.version + 1)

    async def run(self) -> None:
        try:
            started_at = self.policy.version
            while self.policy.version < self.steps:
                if self.policy.version != started_at and self._checkpoint_due():
                    await self._checkpoint()
                await self.step()
            await self._finish_publishing()
            if self.checkpoint is not None and self.checkpoint_every:
                await self._checkpoint()  # the final version: the run can be continued later
        finally:
            self.doing = "done"
            if self._publishing is not None:  # cancelled or failed meanwhile
                self._publishing.cancel()
                self._publishing = None
            if self._next is not None:
                self._next.cancel()
                self._next = None
        # done: stop holding back the other policies' rollouts (their groups may include ours)
        self.gate.retire(self.policy.name)
        self._release(self.buffer.drain())

    async def step(self) -> dict[str, Any]:
        policy, version = self.policy, self.policy.version
        t_wait = anyio.current_time()  # the event loop's clock (virtual in the simulator)
        if self.barrier is not None and self.barrier.slowest() < version:
            self.gate.set_waiting(policy.name, True)
            self.doing = "barrier"
            try:
                await self.barrier.wait(version)
            finally:
                self.gate.set_waiting(policy.name, False)
        self.doing = "buffer"
        collected, self._next = self._next, None
        if collected is not None:  # popped while the previous step trained
            groups, batch = await collected
        else:
            groups, batch = await self._collect(version)
        tokens_before = self.counters.rollout_tokens
        t_step = anyio.current_time()
        self._collect_next(version + 1)
        self.doing, self.step_started = "trainer", t_step
        try:
            if self.inspect_every and (version % self.inspect_every == 0
                                       or version == self._first_version):
                metrics, trace = await policy.train_step_recorded(batch)
            else:
                metrics, trace = await policy.train_step(batch), None
        except TrainerRolledBack as rollback:
            return await self._roll_back(groups, rollback)
        finally:
            self.doing, self.step_started = "publish", None
        tokens_during = self.counters.rollout_tokens - tokens_before
        self._count_trained(groups)
        await self._finish_publishing()  # versions reach the engine in order

        async def publish() -> dict[str, Any]:
            transfer = await policy.publish()
            self.published = policy.version
            self._release(groups)
            if self.barrier is not None:
                self.barrier.advanced()
            row, samples = self._row(version, groups, {**metrics, **transfer}, t_wait, t_step,
                                     tokens_during, batch)
            self.recorder.add_row(row, samples=samples)
            if trace is not None:
                self.recorder.add_trace(row, trace)
            return row

        if policy.overlaps_next_step and self.barrier is None:
            # The weights are already here (the trainer sent them with the step): the engine
            # applies them while the next batch is collated and trained; its groups stay live
            # for the staleness gate until then, exactly as if we had waited.
            self._publishing = _start(publish)
            return {"policy": policy.name, "step": version, "version": version + 1}
        return await publish()

    async def _collect(self, version: int) -> tuple[list[Group], Batch]:
        """The batch to train at `version`: fresh groups popped from the buffer, collated (and
        encoded for the trainer, when it takes batches prepared ahead)."""
        policy = self.policy
        groups = await self.buffer.pop(
            self.groups_per_batch, version, self.max_staleness, on_drop=self._drop
        )
        try:
            batch = build_batch(self._in_batch(groups), policy.name, policy.algorithm,
                                pad_id(policy.tokenizer))
            await policy.prepare(batch)
        except BaseException:  # cancelled (or failed) before training: the groups go back
            for group in groups:
                self.buffer.put(group)
            raise
        return groups, batch

    def _in_batch(self, groups: list[Group]) -> list[Group]:
        """The popped groups the step trains: tied groups that filled the batch past the
        filter's budget are left out when others have a signal (see `sampling.in_batch`)."""
        return [g for g, kept in zip(groups, self._kept(groups), strict=True) if kept]

    def _kept(self, groups: list[Group]) -> list[bool]:
        name = self.policy.name
        return in_batch([has_signal_for(g, name) for g in groups],
                        self.policy.algorithm.filter_groups)

    def _collect_next(self, version: int) -> None:
        """Start collecting the batch of `version` while the current step trains.

        With the trainer in a child process (a publisher that `overlaps_next_step`), the time
        between two steps is the trainer's idle time: popping, collating and encoding the next
        batch beforehand leaves only the pipe in between. The staleness bound is checked for
        the version the batch will train at, exactly as a pop at that step would; the groups
        stay live for the gate until their own step is published. Not done with a barrier
        (the next step waits for the other policies first) or past the last step."""
        if (version >= self.steps or self.barrier is not None
                or not self.policy.overlaps_next_step):
            return
        self._next = asyncio.ensure_future(self._collect(version))

    async def _forget_next(self) -> None:
        """Cancel a batch being collected ahead; its groups go back to the buffer."""
        collecting, self._next = self._next, None
        if collecting is not None:
            collecting.cancel()
            await asyncio.wait([collecting])  # its groups are back once it has ended

    def _checkpoint_due(self) -> bool:
        return (self.checkpoint is not None and self.checkpoint_every > 0
                and self.policy.version % self.checkpoint_every == 0)

    async def _checkpoint(self) -> None:
        # the trainer is idle between two steps; the previous step's row must be on record
        # first, so the checkpoint at version v goes with exactly the rows of steps < v
        await self._finish_publishing()
        assert self.checkpoint is not None
        self.doing = "checkpoint"
        await self.checkpoint(self.policy)

    async def _finish_publishing(self) -> None:
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    async def _roll_back(self, groups: list[Group], rollback: TrainerRolledBack) -> dict[str, Any]:
        """The trainer service lost steps: forget everything generated by the lost weights.

        Buffered groups and the ones in this batch are dropped (released), in-flight groups are
        discarded on arrival (the pool's epoch moves on), and every rollout service is brought
        back to the recovered version before rollouts go on, so the staleness bound keeps
        meaning versions that exist.
        """
        await self._forget_next()  # collected for weights that are gone: dropped below
        transfer = await self.policy.publish()  # services back on the recovered weights first
        self.published = self.policy.version
        if self.remote is not None:
            self.remote.epoch += 1  # groups begun before this point are discarded on arrival
        dropped = groups + self.buffer.drain()
        self._release(dropped)
        self.dropped_stale += len(dropped)
        for group in dropped:
            self.counters.samples.dropped(self.policy.name, group.key, "stale")
        row = {"policy": self.policy.name, "step": rollback.expected, "version": rollback.recovered,
               "time": anyio.current_time() - self.started, "dropped_stale": self.dropped_stale,
               **transfer}
        self.recorder.add_event("rollback", row)
        return row

    def _count_trained(self, groups: list[Group]) -> None:
        for group in groups:
            for traj in group.trajectories:
                if traj.id and traj.id in self._trained:
                    self.trained_twice += 1
                self._trained.add(traj.id)

    def _drop(self, group: Group) -> None:
        self.dropped_stale += 1
        self.counters.samples.dropped(self.policy.name, group.key, "stale")
        self._release([group])

    def _release(self, groups: list[Group]) -> None:
        if groups:
            self.gate.release({self.policy.name: len(groups)})

    def _row(self, version: int, groups: list[Group], metrics: Mapping[str, Any], t_wait: float,
             t_step: float, tokens_during: int, batch: Batch
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The step's metrics row, and the names of the samples it accounts for (the run
        folder's samples.jsonl; the row has their counts)."""
        now = anyio.current_time()
        staleness = [version - g.min_version(self.policy.name) for g in groups]
        versions = batch.versions_B_T[batch.loss_mask_B_T > 0]
        rewards = self.counters.take_rewards(self.policy.name)
        # samples the open-samples sampler skipped count at their recent reward, so `reward`
        # stays an estimate of the stream's, not only of the harder samples played
        estimated = rewards + self.counters.rewards_skipped.pop(self.policy.name, [])
        c = self.counters
        epoch = {} if c.epoch is None else {"epoch": c.epoch}
        kept = self._kept(groups)
        for group, trained in zip(groups, kept, strict=True):
            if not trained:  # popped to end the step's wait, left out of its batch
                c.samples.dropped(self.policy.name, group.key, "filtered")
        accounted, samples = c.samples.take(
            self.policy.name, [g.key for g, trained in zip(groups, kept, strict=True) if trained])
        trained_groups = [g for g, trained in zip(groups, kept, strict=True) if trained]
        finished = [turn.generation.finish_reason for g in trained_groups
                    for traj in g.trajectories for turn in traj.turns
                    if turn.policy == self.policy.name]
        row = {
            "policy": self.policy.name,
            "step": version,
            "version": version + 1,
            "time": now - self.started,
            "reward": sum(estimated) / len(estimated) if estimated else float("nan"),
            "reward_played": sum(rewards) / len(rewards) if rewards else float("nan"),
            "batch_reward": float(batch.rewards_B.mean()),
            "episodes_since_step": len(rewards),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            # groups trained at staleness 0, 1, 2, ... (the dashboard's distribution panel)
            "staleness_counts": [staleness.count(s) for s in range(max(staleness) + 1)],
            "token_version_min": int(versions.min()),
            "token_version_max": int(versions.max()),
            "buffer_size": len(self.buffer),
            "live_groups": self.gate.live[self.policy.name],
            "dropped_stale": self.dropped_stale,
            "trained_twice": self.trained_twice,
            "filtered_groups": c.filtered_groups,
            "episodes": c.episodes,
            "failed_episodes": c.failed,
            "rollout_tokens": c.rollout_tokens,
            "rollout_tokens_during_step": tokens_during,
            # since this policy's last step: truncated episodes and count/<name> sums
            **c.take_episode_facts(self.policy.name),
            # how many samples this row accounts for: trained in this step, dropped since the
            # last (their names go to samples.jsonl)
            **accounted,
            # how the policy's groups tied since its last step, and the filter's budget
            **c.take_sampling(self.policy.name),
            "tied_trained": sum(trained and not has_signal_for(g, self.policy.name)
                                for g, trained in zip(groups, kept, strict=True)),
            "trained_groups": len(trained_groups),
            # completions of this step cut at the token limit
            "cut_completions": finished.count("length"),
            "completions": len(finished),
            **epoch,
            "wait_seconds": t_step - t_wait,
            "step_seconds": now - t_step,
            **metrics,
        }
        row["flags"] = silent_flags(row)
        return row, samples


def silent_flags(row: Mapping[str, Any]) -> list[str]:
    """Why a step's metrics row says it silently taught (next to) nothing, as names:

        "tied"       every group it trained had equal rewards (all advantages 0)
        "truncated"  at least half its completions were cut at the token limit
        "zero_loss"  its loss moved no weight (a gradient norm of 0)
        "mismatch"   its mean trainer/engine logprob gap is above `MISMATCH_THRESHOLD`
    """
    flags = []
    if row.get("trained_groups") and row.get("tied_trained") == row["trained_groups"]:
        flags.append("tied")
    if row.get("completions") and 2 * row.get("cut_completions", 0) >= row["completions"]:
        flags.append("truncated")
    if row.get("grad_norm") == 0:
        flags.append("zero_loss")
    if float(row.get("logp_gap_mean") or 0.0) > MISMATCH_THRESHOLD:
        flags.append("mismatch")
    return flags


def _start(job: Callable[[], Awaitable[dict[str, Any]]]) -> asyncio.Future[dict[str, Any]]:
    """Run `job` in the background: an asyncio task (awaited later by `_finish_publishing`)."""
    return asyncio.ensure_future(job())
