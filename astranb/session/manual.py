"""A manual loop: the blocks `session.train` is made of, run one notebook cell at a time.

    groups = session.play(groups=2, group_size=8)   # episodes with the current weights
    batch  = policy.build_batch(groups)             # tokens, masks, advantages, old logprobs
    out    = policy.forward_backward(batch)         # loss and gradients; weights unchanged
    policy.optim_step()                             # AdamW on those gradients; version += 1
    policy.publish_weights()                        # the engine samples from the new version

The blocks are the train loop's own: episodes are played by `environments.play.play_episode`
(the orchestrator's, the debugger's and evaluation's function), batches are collated by
`dataflow.batcher.build_batch` with the policy's algorithm, and a trainer's `step` is
`forward_backward` followed by `optim_step` (training/local.py; the child-process trainer runs
the same two in its child). Between two cells everything can be looked at: the groups'
trajectories and rewards, the batch's tensors, the loss's metrics, the gradients of a trainer in
this process (`policy.trainer.model`).

Nothing here is recorded in a run's folder or counted by a run: a manual step is the researcher's
own. It must not overlap a run training the same policy (`session.play` refuses while a run is
going).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..dataflow.buffer import Group
from ..environments.base import Environment
from ..environments.play import play_episode
from ..types import Trajectory
from . import heldout, launch

if TYPE_CHECKING:
    from .context import RunContext

__all__ = ["ManualPlays", "SampleStreams", "play_groups"]


class SampleStreams:
    """One stream of samples per (environment, seed), so that successive `session.play` calls
    go on through the environment's samples instead of replaying the first ones."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], tuple[Environment, Iterator[Mapping[str, Any]]]] = {}

    def take(self, env: Environment, seed: int, n: int) -> list[Mapping[str, Any]]:
        """The next `n` samples of `env.samples(seed)`.

        Raises:
            ValueError: the stream ran out before `n` samples.
        """
        key = (id(env), seed)
        if key not in self._streams or self._streams[key][0] is not env:
            self._streams[key] = (env, iter(env.samples(seed)))
        samples = list(itertools.islice(self._streams[key][1], n))
        if len(samples) < n:
            raise ValueError(f"{env.name}'s samples (seed {seed}) ran out after "
                             f"{len(samples)} of {n}; pass samples= or another seed")
        return samples


async def play_groups(env: Environment, wiring: Mapping[str, Any],
                      samples: Sequence[Mapping[str, Any]], group_size: int,
                      first_id: int) -> list[Group]:
    """Play each sample `group_size` times, all at once, with the current weights.

    Returns:
        One Group per sample (ids from `first_id`), holding its successful episodes (failed
        ones are left out, as the train loop leaves them out).

    Raises:
        RuntimeError: every episode failed (the first error is in the message).

    Warns:
        RuntimeWarning: some episodes failed (how many, and the first error).
    """
    version = min(p.version for p in wiring.values())
    flat: list[Trajectory | None] = [None] * (len(samples) * group_size)

    async def play(index: int) -> None:
        group = first_id + index // group_size
        flat[index] = await play_episode(env, wiring, samples[index // group_size], group=group,
                                         started_version=version,
                                         id=f"manual.{group}.{index % group_size}")

    async with anyio.create_task_group() as tg:
        for i in range(len(flat)):
            tg.start_soon(play, i)
    played = [t for t in flat if t is not None]
    failed = [t for t in played if not t.ok]
    if failed and len(failed) == len(played):
        raise RuntimeError(f"all {len(played)} episodes failed; the first error:\n"
                           f"{failed[0].error}")
    if failed:
        warnings.warn(f"{len(failed)} of {len(played)} episodes failed and are left out of "
                      f"the groups; the first error: {failed[0].error}", RuntimeWarning,
                      stacklevel=4)
    groups = []
    for i in range(len(samples)):
        ok = tuple(t for t in played[i * group_size:(i + 1) * group_size] if t.ok)
        names = frozenset(turn.policy for t in ok for turn in t.turns)
        groups.append(Group(first_id + i, ok, version, names))
    return groups


class ManualPlays:
    """What `Session.play` keeps between calls: the sample streams and the next group id."""

    def __init__(self) -> None:
        self.streams = SampleStreams()
        self.next_group = 0

    def play(self, context: RunContext, env: Environment | None, groups: int, group_size: int,
             samples: Sequence[Mapping[str, Any]] | None, seed: int) -> list[Group]:
        """`Session.play`: check, choose the samples, play them on the session's loop."""
        going = [r for r in context.runs if not r.done]
        if going:
            raise RuntimeError("a run is training these policies: a manual step now would race "
                               "it. Stop it first (run.stop()) or wait for it (run.wait())")
        if context.pool is not None:
            raise ValueError("session.play plays on this process's engines; this session's "
                             "episodes run on rollout services. Use a Session without rollout= "
                             "for a manual loop")
        heldout.positive("group_size", group_size, "episodes per sample (e.g. group_size=8)")
        if env is None:
            env = heldout.only_env(launch.check_ready(context), "env")
        wiring = heldout.eval_wiring(env, list(context.wiring))
        if samples is None:
            heldout.positive("groups", groups, "the number of samples to play (e.g. groups=2)")
            chosen = self.streams.take(env, seed, groups)
        else:
            chosen = [dict(sample) for sample in samples]
            if not chosen:
                raise ValueError("samples= is empty: give at least one sample to play")
        first, self.next_group = self.next_group, self.next_group + len(chosen)
        return context.call(play_groups, env, wiring, chosen, group_size, first)
