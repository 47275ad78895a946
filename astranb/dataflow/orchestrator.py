"""The rollout side of a run: play groups of episodes under the staleness gate, feed the buffers.

Each worker loops: pick an environment (by the sampling weights of the wired environments), wait
for admission of its policies, take its next sample, play `group_size` episodes of it
concurrently, then hand the group to the buffer of every policy that played in it. A group whose
rewards are all equal for every policy that filters (dynamic sampling) is dropped here, up to a
budget per step (see `sampling`: past it, the policy's buffer is cut and its step takes the
groups it has), and so are failed episodes; a failed episode is still recorded. Tied groups
are also where a learned task shows: a "learned" event is recorded here.

A run that cannot get anywhere stops with an error that says why, instead of spinning forever:
every episode keeps failing (`EpisodesKeepFailing`); episodes keep ending before their policy
sampled a single token, e.g. a prompt longer than the model's context (`NoTrainableTokens`);
every sample stream has ended before the steps were taken, or yielded nothing at all
(`SamplesRanOut`, raised by the buffer pop that can no longer be served). Both counts of
episodes in a row are `max_consecutive_failures` (the run passes max(64, 2 x batch_size)).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from ..contracts import PolicyHandle, RemoteEpisodes, RunRecorder
from ..environments.base import Environment
from ..environments.play import play_episode
from ..errors import EpisodesKeepFailing, NoTrainableTokens
from ..types import Trajectory
from ._tasks import run_all
from .batcher import group_rewards, has_signal_for, policy_reward
from .buffer import Buffer, Group
from .ledger import SampleLedger, sample_id
from .sampling import OpenSamples, Ties, learned_message
from .staleness import StalenessGate

__all__ = ["Orchestrator", "Source", "RolloutCounters", "EpisodesKeepFailing", "play_heldout"]


@dataclass
class RolloutCounters:
    """Running totals the trainer loop reads into each metrics row."""

    episodes: int = 0
    failed: int = 0
    filtered_groups: int = 0
    rollout_tokens: int = 0
    rewards_since_step: dict[str, list[float]] = field(default_factory=dict)
    """Per policy: its own role's reward in each episode it played, since its last step."""
    truncated_since_step: dict[str, int] = field(default_factory=dict)
    """Per policy: episodes of its environments cut short (context or token budget) since its
    last step."""
    counts_since_step: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per policy: the sum of each `ctx.count` name over its environments' episodes since its
    last step."""
    count_names: set[str] = field(default_factory=set)
    """Every count name seen in the run (rows report each, 0 when nothing was counted)."""
    epoch: int | None = None
    """Largest `sample["_epoch"]` among played samples (None: samples carry no epoch)."""
    samples: SampleLedger = field(default_factory=SampleLedger)
    """Every drawn sample not yet accounted for by a row, and what the next rows report."""
    groups_since_step: dict[str, int] = field(default_factory=dict)
    """Per policy: its groups played since its last step (kept or dropped)."""
    tied_since_step: dict[str, int] = field(default_factory=dict)
    """Per policy: of those, the ones whose rewards all tied."""
    filtered_since_step: dict[str, int] = field(default_factory=dict)
    """Per policy: groups dropped by filter_groups since its last step (the budget's count)."""
    budget_hit: set[str] = field(default_factory=set)
    """Policies whose filter budget was reached since their last step."""
    skipped_since_step: dict[str, int] = field(default_factory=dict)
    """Per policy: samples the open-samples sampler skipped since its last step."""
    rewards_skipped: dict[str, list[float]] = field(default_factory=dict)
    """Per policy: the recent mean reward of each sample skipped since its last step (the
    rows' reward counts them, so it estimates the stream's reward)."""

    def take_sampling(self, policy: str) -> dict[str, Any]:
        """How `policy`'s groups tied since its last call (forgotten): `groups_played`,
        `groups_tied`, `tied_fraction` (NaN when none was played), `groups_skipped` (by the
        open-samples sampler) and `filter_budget_hit`."""
        played = self.groups_since_step.pop(policy, 0)
        tied = self.tied_since_step.pop(policy, 0)
        self.filtered_since_step.pop(policy, None)
        hit = policy in self.budget_hit
        self.budget_hit.discard(policy)
        return {"groups_played": played, "groups_tied": tied,
                "tied_fraction": tied / played if played else float("nan"),
                "groups_skipped": self.skipped_since_step.pop(policy, 0),
                "filter_budget_hit": hit}

    def take_rewards(self, policy: str) -> list[float]:
        """`policy`'s own-role rewards of the episodes finished since its last call (forgotten)."""
        return self.rewards_since_step.pop(policy, [])

    def take_episode_facts(self, policy: str) -> dict[str, int]:
        """`truncated` and `count/<name>` of `policy`'s episodes since its last call (forgotten)."""
        counts = self.counts_since_step.pop(policy, {})
        facts = {"truncated": self.truncated_since_step.pop(policy, 0)}
        facts.update({f"count/{name}": counts.get(name, 0) for name in sorted(self.count_names)})
        return facts

    def add(self, traj: Trajectory, policies: Iterable[str]) -> None:
        """Count a finished episode (failed or not) towards the policies that played it."""
        self.episodes += 1
        self.rollout_tokens += sum(len(t.generation.completion_ids) for t in traj.turns)
        epoch = traj.sample.get("_epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            self.epoch = epoch if self.epoch is None else max(self.epoch, epoch)
        self.count_names.update(traj.counts)
        for name in policies:
            if traj.truncated is not None:
                self.truncated_since_step[name] = self.truncated_since_step.get(name, 0) + 1
            mine = self.counts_since_step.setdefault(name, {})
            for key, n in traj.counts.items():
                mine[key] = mine.get(key, 0) + n


class Source:
    """One wired environment: its roles' policies, its sampling weight and its sample stream.

    A resumed run builds it with `skip` (samples the interrupted run drew) and `replay` (the
    positions, below `skip`, of those it drew but never accounted for: see `ledger.py`, with
    the sample itself or None to take it from the stream again); those are yielded first."""

    def __init__(self, env: Environment, wiring: Mapping[str, PolicyHandle], weight: float = 1.0,
                 seed: int = 0, skip: int = 0,
                 replay: Sequence[tuple[int, Mapping[str, Any] | None]] = ()):
        if not weight > 0:
            raise ValueError(f"{env.name}: sampling weight must be > 0, got {weight!r}")
        if skip < 0:
            raise ValueError(f"{env.name}: skip must be >= 0, got {skip!r}")
        self.env, self.wiring, self.weight = env, dict(wiring), float(weight)
        self.policies = {p.name: p for p in self.wiring.values()}
        self.tokenizers = {p.name: p.tokenizer for p in self.policies.values()
                           if p.tokenizer is not None}
        """Policy name -> tokenizer, handed to every recorded episode (the debugger's tokens)."""
        self.samples: Iterator[Mapping[str, Any]] | None = iter(env.samples(seed))
        """The sample stream; None once it has ended."""
        self.drawn = 0
        """Samples taken from the stream so far (skipped ones included): where a resumed run
        picks the stream up (`skip`)."""
        self._replay: deque[tuple[int, Mapping[str, Any]]] = deque()
        self.skipped = skip
        """Samples skipped at the start (drawn by the run this one resumes)."""
        self.empty_in_a_row = 0
        """Episodes in a row that ended before any policy sampled a token."""
        if skip:
            self._skip(skip, dict(replay))

    def _skip(self, skip: int, replay: Mapping[int, Mapping[str, Any] | None]) -> None:
        """Go on where the checkpointed run was, not from the first sample; the samples to replay
        that the checkpoint could not keep are taken from the stream on the way."""
        assert self.samples is not None
        found: dict[int, Mapping[str, Any]] = {}
        for position, sample in enumerate(itertools.islice(self.samples, skip)):
            self.drawn += 1
            if position in replay:
                kept = replay[position]
                found[position] = kept if kept is not None else sample
        self._replay.extend(sorted(found.items(), key=lambda item: item[0]))

    def draw(self) -> tuple[int, Mapping[str, Any]] | None:
        """(position, sample): a sample to replay first, else the stream's next one; None (and
        the stream marked ended) once both have ended."""
        if self._replay:
            return self._replay.popleft()
        sample = next(self.samples, None) if self.samples is not None else None
        if sample is None:
            self.samples = None
            return None
        self.drawn += 1
        return self.drawn - 1, sample


class Orchestrator:
    """Plays episodes of the wired environments.

    Args:
        sources: the wired environments (a single Source, or several with sampling weights).
        buffers: policy name -> buffer.
        gate: the run's staleness gate.
        recorder: where episodes go.
        group_size: episodes per sample.
        seed: seed of the environment choice.
        max_consecutive_failures: stop the run after this many failed episodes in a row, or
            this many in a row of one environment that sampled no token.
        remote: rollout services that play the episodes instead of this process.
        filter_budget: groups a policy may drop by filter_groups between two of its steps
            before its buffer is cut (`sampling.filter_budget`; None: no bound).
        learned_after: tied groups in a row at the best reward that make a "learned" event.
        on_learned: called with a policy's name when its "learned" event is recorded.
        open_samples: skip samples lately solved, most of the time (`sampling.OpenSamples`);
            None: play every sample.
    """

    def __init__(
        self,
        sources: Source | list[Source],
        buffers: Mapping[str, Buffer],
        gate: StalenessGate,
        recorder: RunRecorder,
        *,
        group_size: int,
        seed: int = 0,
        max_consecutive_failures: int = 64,
        remote: RemoteEpisodes | None = None,
        filter_budget: int | None = None,
        learned_after: int = 64,
        on_learned: Callable[[str], None] | None = None,
        open_samples: OpenSamples | None = None,
    ):
        self.sources = [sources] if isinstance(sources, Source) else list(sources)
        self.buffers = buffers
        self.gate = gate
        self.recorder = recorder
        self.group_size = group_size
        self.counters = RolloutCounters()
        self._group_ids = itertools.count()
        self._policies = {n: p for src in self.sources for n, p in src.policies.items()}
        self._stream = {id(src): i for i, src in enumerate(self.sources)}
        self._rng = random.Random(seed)
        self._consecutive_failures = 0
        self._max_failures = max_consecutive_failures
        self.remote = remote
        self.in_flight: dict[int, float] = {}
        """Group id -> when it began playing (the event loop's clock), for groups playing now."""
        self.delivered = 0
        """Groups put in a buffer so far (the watchdog's sign of progress)."""
        self.filtered: dict[str, tuple[int, frozenset[float]]] = {}
        """Per policy: (groups dropped by filter_groups in a row, the distinct rewards they
        earned); forgotten when one of its groups is kept."""
        self.ties: dict[str, Ties] = {name: Ties() for name in self._policies}
        """Per policy: its tied groups in a row, best reward, whether a signal has come."""
        self.filter_budget = filter_budget
        self.learned_after = learned_after
        self.on_learned = on_learned
        self.open_samples = open_samples
        self.started = 0.0
        """When the run started, on the event loop's clock (set by `Dataflow.run`)."""

    def position(self) -> dict[str, Any]:
        """Where the sample streams and the environment choice stand (JSON), for a checkpoint:
        `restore_position` on a new orchestrator with the same sources goes on from here.
        "pending" holds the samples drawn but not yet accounted for by a metrics row (see
        `ledger.py`): a resumed run plays them first."""
        return {"drawn": [src.drawn for src in self.sources],
                "choice_rng": _rng_to_json(self._rng.getstate()),
                "pending": self.counters.samples.pending()}

    def restore_position(self, position: Mapping[str, Any]) -> None:
        """Continue the environment choice where `position()` left it (the sample streams are
        skipped ahead when their Sources are built: `Source(..., skip=drawn)`)."""
        state = position.get("choice_rng")
        if state is not None:
            self._rng.setstate(_rng_from_json(state))

    async def run(self, workers: int) -> None:
        """Run `workers` group workers until cancelled (or every sample stream ends: then the
        buffers are closed, so a step that can no longer be fed fails with why)."""
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(self._worker)
        reason = self._ran_out()
        for buffer in self.buffers.values():
            buffer.close(reason)

    def _ran_out(self) -> str:
        """Why no more groups will come (every sample stream has ended), with the fix."""
        if not any(src.drawn for src in self.sources):
            names = " and ".join(f"{src.env.name}.samples(seed)" for src in self.sources)
            return (f"{names} yielded no sample, so no episode can be played; give the "
                    "environment samples (check its dataset, split and filters)")
        counts = ", ".join(f"{src.drawn} from {src.env.name}"
                           + (f", {src.skipped} of them before the resume" if src.skipped else "")
                           for src in self.sources)
        return (f"every sample stream has ended ({counts}) before the run's steps were taken; "
                "train fewer steps, or make samples() endless (e.g. loop over the data in "
                "epochs)")

    def _choose(self) -> Source | None:
        live = [src for src in self.sources if src.samples is not None]
        if not live:
            return None
        return self._rng.choices(live, weights=[src.weight for src in live])[0]

    async def _worker(self) -> None:
        while (source := self._choose()) is not None:
            names = tuple(source.policies)
            await self.gate.admit(names)
            # _choose() saw this stream live, but another worker may have ended it while
            # admit() waited
            drawn = source.draw()
            if drawn is None:
                self.gate.release({n: 1 for n in names})
                continue
            position, sample = drawn
            key = sample_id(self._stream[id(source)], position)
            self.counters.samples.drawn(key, sample, names)
            seen = self.open_samples
            known = None if seen is None else seen.key(sample)
            if seen is not None and not seen.play(known):
                self._skip(key, names, known)
                await anyio.lowlevel.checkpoint()  # an endless run of solved samples must yield
                continue
            group = await self.play_group(sample, source, key)
            self._deliver(group, source)
            if seen is not None:
                seen.record(known, self._solved(group), {
                    name: sum(rewards) / len(rewards) for name in group.policies
                    if (rewards := group_rewards(group, name))})

    def _skip(self, key: str, names: Sequence[str], known: str | None) -> None:
        """The open-samples sampler skips sample `key` (lately solved): accounted as filtered,
        counted towards each policy's budget, its recent reward kept for the rows' estimate."""
        assert self.open_samples is not None
        c = self.counters
        for name in names:
            if name in self.gate.retired:
                c.samples.forget(name, key)
                continue
            c.samples.dropped(name, key, "filtered")
            c.skipped_since_step[name] = c.skipped_since_step.get(name, 0) + 1
            self._add_filtered(name)
            reward = self.open_samples.reward(known, name)
            if reward is not None:
                # the sample stands for a group of episodes not played
                c.rewards_skipped.setdefault(name, []).extend([reward] * self.group_size)
        self.gate.release({n: 1 for n in names})

    def _solved(self, group: Group) -> bool:
        """Whether every policy that played the group earned its best reward in every episode,
        having earned less before (False for a group that failed: it says nothing)."""
        def solved(name: str) -> bool:
            rewards, ties = group_rewards(group, name), self.ties[name]
            return (len(rewards) > 1 and ties.worst < ties.best
                    and all(r == ties.best for r in rewards))

        return bool(group.policies) and all(solved(name) for name in group.policies)

    async def play_group(self, sample: Mapping[str, Any], source: Source | None = None,
                         key: str = "") -> Group:
        """Play group_size episodes of `sample` (named `key`, see `ledger.sample_id`)
        concurrently; failed ones are left out."""
        source = source or self.sources[0]
        group_id = next(self._group_ids)
        admitted = min(p.version for p in source.policies.values())
        self.in_flight[group_id] = anyio.current_time()
        try:
            if self.remote is not None:
                return await self._play_remote(self.remote, sample, group_id, admitted, source,
                                               key)
            return await self._play_here(sample, group_id, admitted, source, key)
        finally:
            del self.in_flight[group_id]

    async def _play_here(self, sample: Mapping[str, Any], group_id: int, admitted: int,
                         source: Source, key: str) -> Group:
        results: list[Trajectory | None] = [None] * self.group_size

        async def play(i: int) -> None:
            results[i] = await self.play_episode(sample, group_id, admitted, source, key)

        await run_all([functools.partial(play, i) for i in range(self.group_size)])
        ok = tuple(t for t in results if t is not None and t.ok)
        used = frozenset(turn.policy for t in ok for turn in t.turns)
        return Group(group_id, ok, admitted, used, key)

    async def _play_remote(self, remote: RemoteEpisodes, sample: Mapping[str, Any], group_id: int,
                           admitted: int, source: Source, key: str) -> Group:
        epoch = remote.epoch
        ids = remote.episode_ids(group_id, self.group_size)
        results = await remote.play(source.env,
                                    [(i, dict(sample), group_id, admitted) for i in ids])
        results = [dataclasses.replace(t, sample_id=key) for t in results]
        for traj in results:
            self._count(traj, source)
        if remote.epoch != epoch:  # the trainer rolled back meanwhile: these weights are gone
            return Group(group_id, (), admitted, frozenset(), key)
        ok = tuple(t for t in results if t.ok)
        return Group(group_id, ok, admitted, frozenset(turn.policy for t in ok for turn in t.turns),
                     key)

    async def play_episode(self, sample: Mapping[str, Any], group_id: int, admitted: int,
                           source: Source | None = None, key: str = "") -> Trajectory:
        """One episode; an exception becomes a failed, recorded trajectory."""
        source = source or self.sources[0]
        traj = await play_episode(source.env, source.wiring, sample, group=group_id,
                                  started_version=admitted)
        if key:
            traj = dataclasses.replace(traj, sample_id=key)
        self._count(traj, source)
        return traj

    def _count(self, traj: Trajectory, source: Source) -> None:
        c = self.counters
        c.add(traj, source.policies)
        first = next(iter(source.policies.values()))
        # the environment travels with the recorded episode, so the debugger can re-score it
        self.recorder.add_episode(traj, first.version, environment=source.env,
                                  tokenizers=source.tokenizers)
        if traj.ok:
            self._consecutive_failures = 0
            self._check_tokens(traj, source)
            for name in {turn.policy for turn in traj.turns}:
                reward = policy_reward(traj, name)
                if reward is not None:  # always: `name` made a turn, so it played a role
                    c.rewards_since_step.setdefault(name, []).append(reward)
            return
        c.failed += 1
        self._consecutive_failures += 1
        # raise once: episodes finishing in the same tick must not each add a copy of the error
        if self._consecutive_failures == self._max_failures:
            raise EpisodesKeepFailing(
                f"the last {self._consecutive_failures} episodes of {source.env.name} all failed; "
                f"fix the environment (run.episodes[-1].show() has the full trace). "
                f"Last error:\n{traj.error}"
            )

    def _check_tokens(self, traj: Trajectory, source: Source) -> None:
        """Count episodes in a row that ended before a token was sampled; stop the run at
        `max_consecutive_failures` of them (they train nothing, and cost nothing to play, so
        the run would spin through them forever)."""
        if any(turn.generation.completion_ids for turn in traj.turns):
            source.empty_in_a_row = 0
            return
        source.empty_in_a_row += 1
        if source.empty_in_a_row != self._max_failures:  # raise once (see _count)
            return
        raise NoTrainableTokens(
            f"the last {self._max_failures} episodes of {source.env.name} produced no token to "
            f"train on: {_no_tokens_why(traj)}; run.episodes[-1].show() shows the last one.")

    def _deliver(self, group: Group, source: Source) -> None:
        """Put the group in the buffer of each policy that can learn from it; release the rest."""
        names = tuple(source.policies)
        release = {}
        for name in names:
            self._count_ties(group, name)
            reason = self._drop_reason(group, name)
            if reason is None:
                self.buffers[name].put(group)
                self.delivered += 1
                self.filtered.pop(name, None)
                continue
            release[name] = 1
            if reason == "retired":  # its rows are all written: nothing will report it
                self.counters.samples.forget(name, group.key)
                continue
            self.counters.samples.dropped(name, group.key, reason)
            if reason == "filtered":  # one more in a row (the watchdog reads it)
                n, seen = self.filtered.get(name, (0, frozenset()))
                self.filtered[name] = (n + 1, seen | set(group_rewards(group, name)))
                self._add_filtered(name)
        if len(release) == len(names):
            self.counters.filtered_groups += 1
        if release:
            self.gate.release(release)

    def _drop_reason(self, group: Group, name: str) -> str | None:
        """Why policy `name` cannot learn from `group` (see `ledger.REASONS`; "retired": it has
        taken its last step), or None when it can."""
        if name in self.gate.retired:
            return "retired"
        if name not in group.policies:
            return "unused" if group.trajectories else "failed"
        if (self._policies[name].algorithm.filter_groups and not has_signal_for(group, name)
                and not (self._over_budget(name) and len(self.buffers[name]) == 0)):
            return "filtered"
        return None if _enough(group, name) else "failed"

    def _add_filtered(self, name: str) -> None:
        """One more group of `name` filtered (played and tied, or skipped as solved) since its
        last step; at its budget, its waiting step is told to take what it has."""
        since = self.counters.filtered_since_step
        since[name] = since.get(name, 0) + 1
        if self._over_budget(name):
            self.buffers[name].cut()

    def _over_budget(self, name: str) -> bool:
        """Whether `name` has dropped its budget of tied groups for this step (from its first
        group with a signal on: see `sampling`): its step then trains what its buffer holds, and
        a tied group goes in only when the buffer is empty (a step needs one group at least)."""
        budget, c = self.filter_budget, self.counters
        if budget is None or not self.ties[name].signal:
            return False
        if c.filtered_since_step.get(name, 0) < budget:
            return False
        c.budget_hit.add(name)
        return True

    def _count_ties(self, group: Group, name: str) -> None:
        """Count `group` towards `name`'s tied groups; record "learned" when they show it."""
        if name not in group.policies or name in self.gate.retired:
            return
        c = self.counters
        c.groups_since_step[name] = c.groups_since_step.get(name, 0) + 1
        ties = self.ties[name]
        if ties.add(group_rewards(group, name)):
            c.tied_since_step[name] = c.tied_since_step.get(name, 0) + 1
        tied_at = ties.learned(self.learned_after)
        if tied_at is None:
            return
        policy = self._policies[name]
        self.recorder.add_event("learned", {
            "time": anyio.current_time() - self.started, "policy": name, "step": policy.version,
            "groups": ties.streak, "reward": max(tied_at),
            "tied_at": {f"{value:g}": n for value, n in tied_at.items()},
            "message": learned_message(name, ties.streak, tied_at)})
        if self.on_learned is not None:
            self.on_learned(name)


def _no_tokens_why(traj: Trajectory) -> str:
    """Why an episode sampled no token, and the fix."""
    cut = traj.truncated or ""
    if not traj.turns and cut.startswith("context"):
        return (f"each was cut short before its first turn ({cut}). Use shorter prompts (they "
                "must leave room in the context for the answer, max_new_tokens) or a model with "
                "a longer context")
    if cut:
        return (f"each was cut short before sampling a token ({cut}). Raise the environment's "
                "limit (max_episode_tokens, max_agent_turns) or lower what one turn asks for")
    return (f"the last one made {len(traj.turns)} turn(s) and sampled nothing. Check the "
            "environment's sampling (max_new_tokens > 0) and that it calls ctx.generate")


def _enough(group: Group, policy: str) -> bool:
    """A group needs two scored episodes for a group-relative advantage to mean anything."""
    return sum(policy_reward(t, policy) is not None for t in group.trajectories) >= 2


async def play_heldout(env: Environment, wiring: Mapping[str, PolicyHandle],
                       samples: Sequence[Mapping[str, Any]], k: int, *,
                       remote: RemoteEpisodes | None = None, group: int = -1,
                       version: int = 0) -> list[list[Trajectory]]:
    """Play every sample k times, all at once, for evaluation: in this process or on `remote`.

    Nothing here is counted, recorded or delivered to a buffer, so these episodes are never
    trained on. `group` (negative, apart from every training group) goes into the episode ids.

    Returns:
        Per sample, its k trajectories (failed ones included), in order.
    """
    flat: list[Trajectory | None] = [None] * (len(samples) * k)
    if remote is not None:
        ids = remote.episode_ids(group, len(flat))
        items = [(ids[i * k + j], dict(sample), group, version)
                 for i, sample in enumerate(samples) for j in range(k)]
        flat = list(await remote.play(env, items))
    else:
        async def play(index: int) -> None:
            flat[index] = await play_episode(env, wiring, samples[index // k], group=group,
                                             started_version=version,
                                             id=f"eval.{group}.{index}")

        await run_all([functools.partial(play, index) for index in range(len(flat))])
    done = [t for t in flat if t is not None]
    assert len(done) == len(flat)  # every task above filled its slot
    return [done[i * k:(i + 1) * k] for i in range(len(samples))]


def _rng_to_json(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(state: Sequence[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
