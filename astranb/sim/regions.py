"""Rollout pools in several regions: weights over links (direct or relayed), routing, lag.

AstraFlow rolls out on pools far from the trainer (three pools at 100/60/30 % throughput, two of
them behind 4 Gbit/s, 300 ms links). Whether that pays depends on three things this module
models on the virtual clock, driving the real dataflow through the `RemoteEpisodes` contract
(the slot a `RolloutPool` of rollout services fills in a real run):

Weights. A pool can sample from version v only once v has arrived. After each train step the
trainer announces the version (`RegionPublisher`; it does not wait for far pools), and every
region fetches it over its link (network.py) as `weights.store.WeightStore` serves it: the delta
when the region holds exactly the version before (bytes measured from the real codec,
payload.py), a full snapshot otherwise, and a full snapshot every `full_every` versions. A
region that falls more than one version behind therefore pulls full snapshots until it catches
up. How a region pulls:

- "direct": every service (GPU) of the region pulls each version over the region's link, so the
  link carries n copies, shared fairly while they overlap.
- "relay": one service pulls it once over the link; the others pull it from the relay over the
  region's local link.

A region's pools switch to the version together, once every service holds it, with the engine's
in-flight update (pause `update_seconds`, re-prefill what is decoding: engine.py). Inside a pool
the services pull their work: a request waits in the pool's queue until a GPU has a free batch
slot (`GpuPool(shared_queue=True)`), as AstraFlow's services pull rollout tasks.

Staleness. The gate admits a group at the trainer's version V. Its episodes sample only from
weights >= V: an episode routed to a pool still fetching V waits there for it. So tokens are
never older than their admission, and the bound is kept by the real gate and the buffer's drop
at pop, as in every run. What the scheduler adds is the rule a real one applies to a member that
is updating or behind: a pool more than `max_lag` versions behind the trainer (default 1: it
holds the newest version or is fetching it) gets no new work until it has caught up, and the
episodes waiting there for their weights (not started) go to another pool, as a `RolloutPool`
resubmits the work of a member it lost; so the run never waits on a slow pool beyond the
bound.

Routing (per episode, when the gate admits its group):

- "round_robin": the next eligible pool in turn, whatever its speed or load.
- "throughput": the eligible pool where the episode is expected to finish first: (the episodes
  it holds + 1) x the measured tokens per episode / its measured throughput, plus the time its
  pending weights still need (the estimate of the transfer under way plus the update). The
  throughput is measured from what the pool decoded: `max_batch` over the seconds a sequence
  has taken per token there, times its serving GPUs (`GpuPool.batch_rate`: exact at full
  batches, optimistic for a lightly loaded pool, which therefore gets work until its batches
  fill). A pool a third as fast gets about a third of the work, and one that is fetching a full
  snapshot gets little.

Capacity can change while the run goes on (autoscale.py): a pool may carry an `Autoscale` rule.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..contracts import Publisher, RemoteEpisodes, Trainer
from ..environments.base import Environment
from ..environments.play import play_episode
from ..types import Trajectory
from .autoscale import Autoscale, Scaling, autoscale
from .costs import Lengths, LengthSchedule, RolloutCosts
from .engine import GpuPool, SimEngine
from .network import Link, LinkSpec
from .payload import ModelWeights
from .trainer import SimTokenizer, TrainPool

__all__ = ["Region", "Pool", "RegionRollout", "RegionPublisher", "SyncRecord", "ROUTINGS",
           "SYNCS"]

ROUTINGS = ("throughput", "round_robin")
SYNCS = ("relay", "direct")


# -- what a run is given -----------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """A place rollout GPUs sit in, and how weights reach it."""

    name: str
    link: LinkSpec
    """From the trainer to the region (every pull over it shares its bandwidth)."""
    local: LinkSpec = LinkSpec(100e9, 0.0005)
    """Between the services of the region (a relay's fan-out): 100 Gbit/s, 0.5 ms."""
    sync: str | None = None
    """"relay" or "direct" for this region whatever the run chooses (the trainer's own region
    is best served directly over its fast network); None: the run's choice."""

    def __post_init__(self) -> None:
        if self.sync is not None and self.sync not in SYNCS:
            raise ValueError(f"region {self.name!r}: sync must be one of {SYNCS} or None, got "
                             f"{self.sync!r}")


@dataclass(frozen=True)
class Pool:
    """Rollout GPUs of one kind in one region; one GPU is one rollout service (engine replica).

    A pool's throughput is its GPUs x `speed`: the decode and prefill costs of `RolloutCosts`
    are divided by `speed` (0.5: a GPU half as fast).
    """

    name: str
    region: str
    """Name of its Region."""
    gpus: int
    """GPUs (services) at the start."""
    speed: float = 1.0
    """Throughput of one GPU relative to the RolloutCosts."""
    autoscale: Autoscale | None = None
    """A rule that adds or drains GPUs while the run goes on (None: fixed)."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or not self.speed > 0:
            raise ValueError(f"pool {self.name!r}: need gpus >= 1 and speed > 0, got "
                             f"gpus={self.gpus}, speed={self.speed}")

    def costs(self, base: RolloutCosts) -> RolloutCosts:
        """The per-GPU costs of this pool's GPUs."""
        return RolloutCosts(gpus=self.gpus, max_batch=base.max_batch,
                            step_base=base.step_base / self.speed,
                            step_per_seq=base.step_per_seq / self.speed,
                            prefill_per_token=base.prefill_per_token / self.speed,
                            update_seconds=base.update_seconds)


@dataclass(frozen=True)
class SyncRecord:
    """One version's trip to one region."""

    region: str
    policy: str
    version: int
    kind: str
    """"delta" or "full"."""
    link_bytes: float
    """Bytes over the region's link (n copies with direct pulls, one with a relay)."""
    seconds: float
    """From the start of the pulls until every service held the version."""
    started: float
    """Virtual time the pulls began."""


# -- the run's side ----------------------------------------------------------------------------

@dataclass(eq=False)
class _Replica:
    """What an episode's context needs of a policy on one pool: its name, tokenizer, engine."""

    name: str
    engine: SimEngine
    tokenizer: Any


@dataclass(eq=False)
class _Pool:
    spec: Pool
    index: int
    gpus: GpuPool
    engines: dict[str, SimEngine]
    handles: dict[str, _Replica]
    outstanding: int = 0
    """Episodes routed here and not finished (waiting for weights, queued or decoding)."""
    waiting: int = 0
    """Of those, the ones waiting for the pool's weights."""
    routed: int = 0
    finished: int = 0
    routed_at: dict[int, int] = field(default_factory=dict)
    """Episodes routed here, by the trainer's version when they were routed."""

    def version(self, policy: str) -> int:
        return self.engines[policy].version

    def per_gpu_rate(self) -> float | None:
        """Measured tokens per second of one GPU at full batches (None before any decoding)."""
        return self.gpus.batch_rate()


@dataclass(eq=False)
class _Region:
    spec: Region
    link: Link
    local: Link
    pools: list[_Pool]
    held: dict[str, int]
    """Version of each policy every service of the region holds."""
    eta: dict[str, float] = field(default_factory=dict)
    """Per policy: when the sync under way is expected to be in use (estimate)."""

    @property
    def services(self) -> int:
        return sum(len(p.gpus.gpus) for p in self.pools)


class RegionRollout(RemoteEpisodes):
    """Episodes played on pools in several regions (`contracts.RemoteEpisodes`).

    Args:
        regions: where pools sit and how weights reach them.
        pools: the rollout pools.
        costs: per-GPU rollout costs (each pool scales them by its speed).
        lengths: policy name -> its generation lengths.
        weights: policy name -> its weights' wire sizes.
        token_scale: real tokens per simulated token.
        sync: "relay" or "direct" (module docstring).
        routing: "throughput" or "round_robin".
        max_lag: versions a pool may be behind the trainer and still get new work.
        full_every: every this many versions a full snapshot (0: only when a region is behind).
        train_pools: the trainers' pools (their idle time is an autoscaling signal).
        seed: seed of lengths.
    """

    def __init__(self, regions: Sequence[Region], pools: Sequence[Pool], costs: RolloutCosts,
                 lengths: Mapping[str, Lengths | LengthSchedule],
                 weights: Mapping[str, ModelWeights], *, token_scale: int = 1,
                 sync: str = "relay", routing: str = "throughput", max_lag: int = 1,
                 full_every: int = 10, train_pools: Sequence[TrainPool] = (), seed: int = 0):
        _check(regions, pools, lengths, weights, sync, routing, max_lag, full_every)
        self.costs, self.token_scale = costs, token_scale
        self.sync, self.routing, self.max_lag, self.full_every = sync, routing, max_lag, full_every
        self.weights = dict(weights)
        self.policies = tuple(lengths)
        self.train_pools = list(train_pools)
        self.pools: list[_Pool] = []
        for i, spec in enumerate(pools):
            gpus = GpuPool(spec.costs(costs), token_scale, shared_queue=True)
            engines = {name: SimEngine(name, gpus, lengths[name], seed=seed * 1000 + i)
                       for name in self.policies}
            handles = {name: _Replica(name, engine, SimTokenizer())
                       for name, engine in engines.items()}
            self.pools.append(_Pool(spec, i, gpus, engines, handles))
        self.regions = [
            _Region(r, Link(r.link, r.name), Link(r.local, f"{r.name} local"),
                    [p for p in self.pools if p.spec.region == r.name],
                    dict.fromkeys(self.policies, 0))
            for r in regions]
        self._region_of = {p.index: r for r in self.regions for p in r.pools}
        self._rates_at: tuple[float, dict[int, float]] | None = None
        self.published = dict.fromkeys(self.policies, 0)
        """Newest version the trainer announced, per policy."""
        self.syncs: list[SyncRecord] = []
        self.scaling: list[Scaling] = []
        self.epoch = 0
        self.counts = dict.fromkeys(("submitted", "completed", "abandoned", "rerouted"), 0)
        self._wiring: dict[int, tuple[tuple[str, ...], list[dict[str, _Replica]]]] = {}
        self._turn = itertools.count()
        self._changed = anyio.Event()
        self._announced = {name: anyio.Event() for name in self.policies}
        self._started = 0.0
        self._buffers: list[Any] = []
        self._groups_per_batch = 1
        self._batch_size = 1
        self._tokens_done = 0
        self._episodes_done = 0

    # -- RemoteEpisodes --------------------------------------------------------------------------
    def episode_ids(self, group: int, n: int) -> list[str]:
        return [f"sim.{self.epoch}.{group}.{i}" for i in range(n)]

    def start_run(self, sources: Sequence[Any]) -> None:
        for source in sources:
            roles = {role: p.name for role, p in source.wiring.items()}
            unknown = set(roles.values()) - set(self.policies)
            if unknown:
                raise ValueError(f"{source.env.name}: policies {sorted(unknown)} have no lengths "
                                 f"or weights in the simulated regions ({list(self.policies)})")
            per_pool = [{role: pool.handles[name] for role, name in roles.items()}
                        for pool in self.pools]
            self._wiring[id(source.env)] = (tuple(sorted(set(roles.values()))), per_pool)

    async def run(self) -> None:
        """Decode, fetch weights and autoscale until cancelled."""
        self._started = anyio.current_time()
        for pool in self.pools:
            for gpu in pool.gpus.gpus:
                gpu.since = self._started  # billed from the start of the run
        async with anyio.create_task_group() as tg:
            for pool in self.pools:
                tg.start_soon(pool.gpus.run)
                if pool.spec.autoscale is not None:
                    tg.start_soon(functools.partial(
                        autoscale, pool.spec.autoscale, pool.spec.name, pool.gpus,
                        waiting=functools.partial(getattr, pool, "waiting"),
                        ready=self._ready, steps=self._steps, consumed=self._consumed,
                        finished=self._finished, trainer_busy=self._trainer_busy,
                        trainer_stepped=self._trainer_stepped,
                        started=self._started, log=self.scaling, on_join=self._notify))
            for region in self.regions:
                for name in self.policies:
                    tg.start_soon(self._sync_loop, region, name)

    async def play(self, env: Environment, samples: Sequence[tuple[str, dict[str, Any], int, int]]
                   ) -> list[Trajectory]:
        if id(env) not in self._wiring:
            raise RuntimeError(f"{env.name} is not wired to the simulated regions")
        names, wiring = self._wiring[id(env)]
        results: list[Trajectory | None] = [None] * len(samples)
        chosen = [self._assign(names) for _ in samples]  # in order: deterministic turns

        async def one(i: int, pool: _Pool | None) -> None:
            episode_id, sample, group, admitted = samples[i]
            while pool is None:  # no pool fresh enough: wait for a sync or a new GPU
                await self._event().wait()
                pool = self._assign(names)
            results[i] = await self._play_on(pool, env, wiring, names, sample, group,
                                             admitted, episode_id)

        async with anyio.create_task_group() as tg:
            for i, pool in enumerate(chosen):
                tg.start_soon(one, i, pool)
        done = [t for t in results if t is not None]
        assert len(done) == len(samples)
        return done

    # -- the weights -----------------------------------------------------------------------------
    def announce(self, policy: str, version: int) -> None:
        """The trainer has version `version` of `policy`; regions fetch it."""
        self.published[policy] = max(self.published[policy], version)
        self._announced[policy].set()
        self._announced[policy] = anyio.Event()
        self._notify()

    def lag(self, pool: _Pool, policies: Sequence[str]) -> int:
        """Versions the pool is behind the trainer (the most over `policies`)."""
        return max(self.published[p] - pool.version(p) for p in policies)

    def _payload(self, region: _Region, policy: str, target: int) -> tuple[str, float]:
        weights = self.weights[policy]
        forced = self.full_every > 0 and target % self.full_every == 0
        if region.held[policy] == target - 1 and not forced:
            return "delta", weights.delta_bytes
        return "full", weights.full_bytes

    async def _sync_loop(self, region: _Region, policy: str) -> None:
        while True:
            target = self.published[policy]
            if target <= region.held[policy]:
                await self._announced[policy].wait()
                continue
            kind, nbytes = self._payload(region, policy, target)
            services = region.services
            start = anyio.current_time()
            relayed = (region.spec.sync or self.sync) == "relay" and services > 1
            wan = 1 if relayed else services
            region.eta[policy] = (start + region.spec.link.seconds(nbytes, sharing=wan)
                                  + (region.spec.local.seconds(nbytes, sharing=services - 1)
                                     if relayed else 0.0)
                                  + self.costs.update_seconds)
            before = region.link.bytes
            await _all([functools.partial(region.link.transfer, nbytes)] * wan)
            if relayed:  # the relay holds it; the others fetch it from the relay
                await _all([functools.partial(region.local.transfer, nbytes)] * (services - 1))
            seconds = anyio.current_time() - start
            region.held[policy] = target
            self.syncs.append(SyncRecord(region.spec.name, policy, target, kind,
                                         region.link.bytes - before, seconds,
                                         start - self._started))
            await _all([functools.partial(pool.engines[policy].apply_weights, target)
                         for pool in region.pools])
            region.eta.pop(policy, None)
            self._notify()

    # -- routing ---------------------------------------------------------------------------------
    def _eligible(self, names: Sequence[str]) -> list[_Pool]:
        return [p for p in self.pools
                if p.gpus.serving and self.lag(p, names) <= self.max_lag]

    def _assign(self, names: Sequence[str]) -> _Pool | None:
        """Route the next episode: its pool, which counts it from now on (None: no pool is
        eligible now)."""
        pool = self._pick(names)
        if pool is not None:
            self.counts["submitted"] += 1
            self._route_to(pool)
        return pool

    def _route_to(self, pool: _Pool) -> _Pool:
        pool.outstanding += 1
        pool.routed += 1
        version = min(self.published.values())
        pool.routed_at[version] = pool.routed_at.get(version, 0) + 1
        return pool

    def _pick(self, names: Sequence[str]) -> _Pool | None:
        eligible = self._eligible(names)
        if not eligible:
            return None
        if self.routing == "round_robin":
            order = {p.index: p for p in eligible}
            n = len(self.pools)
            turn = next(self._turn)
            for k in range(n):
                pool = order.get((turn + k) % n)
                if pool is not None:
                    return pool
        rates = self._rates()
        return min(eligible, key=lambda p: (self.expected_finish(p, names, rates), p.index))

    def _rates(self) -> dict[int, float]:
        """Each pool's measured full-batch tokens/s per GPU; pools that have not decoded yet
        get the mean of the others (1.0 when none has: then only GPU counts matter). Measured
        once per virtual instant (a whole batch of episodes is routed at one instant)."""
        now = anyio.current_time()
        if self._rates_at is not None and self._rates_at[0] == now:
            return self._rates_at[1]
        measured = {p.index: r for p in self.pools if (r := p.per_gpu_rate()) is not None}
        prior = sum(measured.values()) / len(measured) if measured else 1.0
        rates = {p.index: measured.get(p.index, prior) for p in self.pools}
        self._rates_at = (now, rates)
        return rates

    def expected_finish(self, pool: _Pool, names: Sequence[str],
                        rates: Mapping[int, float] | None = None) -> float:
        """Seconds until a new episode would finish on `pool`, as the throughput-aware router
        estimates it from measurements (module docstring)."""
        rate = (rates or self._rates())[pool.index]
        tokens = self._tokens_done / self._episodes_done if self._episodes_done else 1.0
        drain = (pool.outstanding + 1) * tokens / (rate * len(pool.gpus.serving))
        now = anyio.current_time()
        weights = 0.0
        if self.lag(pool, names) > 0:
            region = self._region_of[pool.index]
            etas = [region.eta.get(p, now + self.costs.update_seconds) for p in names]
            weights = max(0.0, max(etas) - now)
        return weights + drain

    async def _play_on(self, pool: _Pool, env: Environment,
                       wiring: Sequence[Mapping[str, _Replica]], names: Sequence[str],
                       sample: Mapping[str, Any], group: int, admitted: int,
                       episode_id: str) -> Trajectory:
        finished = False
        try:
            # sample only from weights at least as new as the group's admission
            while any(pool.version(p) < admitted for p in names):
                if self.lag(pool, names) > self.max_lag:  # fell behind: go where it can start
                    other = self._pick(names)
                    if other is not None:
                        pool.outstanding -= 1
                        pool = self._route_to(other)
                        self.counts["rerouted"] += 1
                        continue
                pool.waiting += 1
                try:
                    await self._event().wait()
                finally:
                    pool.waiting -= 1
            traj = await play_episode(env, wiring[pool.index], sample, group=group,
                                      started_version=admitted, id=episode_id)
            finished = True
        finally:
            pool.outstanding -= 1
            if not finished:
                self.counts["abandoned"] += 1  # the run ended first
        self.counts["completed"] += 1
        pool.finished += 1
        self._episodes_done += 1
        self._tokens_done += sum(len(t.generation.completion_ids) for t in traj.turns) \
            * self.token_scale
        return traj

    # -- accounting ------------------------------------------------------------------------------
    def accounting(self) -> dict[str, int]:
        """Episodes routed to pools: every one is completed, still in play, or abandoned because
        the run ended first; `lost` counts the rest and must be 0. `rerouted`: episodes moved
        off a pool that fell behind before they started."""
        c = self.counts
        playing = sum(p.outstanding for p in self.pools)
        return {**c, "playing": playing,
                "lost": c["submitted"] - c["completed"] - c["abandoned"] - playing,
                "drained_sequences": sum(p.gpus.drained_sequences for p in self.pools)}

    def watch_buffers(self, buffers: Sequence[Any], groups_per_batch: int,
                      batch_size: int) -> None:
        """The run's buffers (finished groups waiting for the trainers) and batch: what the
        autoscaler reads the backlog and the trainers' consumption from."""
        self._buffers, self._groups_per_batch = list(buffers), groups_per_batch
        self._batch_size = batch_size

    def _ready(self) -> float:
        if not self._buffers:
            return 0.0
        return min(len(b) for b in self._buffers) / self._groups_per_batch

    def _steps(self) -> int:
        return min(self.published.values())

    def _consumed(self) -> float:
        return sum(self.published.values()) / len(self.published) * self._batch_size

    def _finished(self) -> tuple[int, int]:
        return self._episodes_done, self._tokens_done

    def _trainer_stepped(self) -> float:
        if not self.train_pools:
            return 0.0
        return sum(p.stepped for p in self.train_pools) / len(self.train_pools)

    def _trainer_busy(self, now: float) -> float:
        if not self.train_pools:
            return 0.0
        return sum(p.busy_seconds(now) for p in self.train_pools) / len(self.train_pools)

    def _event(self) -> anyio.Event:
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class RegionPublisher(Publisher):
    """Announces each trained version of one policy to the regions (`contracts.Publisher`);
    does not wait for them: each region fetches it at the pace of its link.

    Args:
        rollout: the regions' pools.
        name: the policy's name.
        trainer: the policy's trainer (whose versions are announced).
    """

    where = "simulated rollout regions"
    checksum = None

    def __init__(self, rollout: RegionRollout, name: str, trainer: Trainer):
        self.rollout, self.name, self.trainer = rollout, name, trainer

    async def publish(self) -> dict[str, Any]:
        # how far the slowest pool still was from the previous version when this one came out
        behind = max(self.rollout.lag(p, [self.name]) for p in self.rollout.pools)
        self.rollout.announce(self.name, self.trainer.version)
        return {"transfer_kind": "announced", "transfer_seconds": 0.0,
                "pools_behind": float(behind)}


# -- helpers -----------------------------------------------------------------------------------

async def _all(jobs) -> None:
    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(job)


def _check(regions, pools, lengths, weights, sync, routing, max_lag, full_every) -> None:
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if max_lag < 0 or full_every < 0:
        raise ValueError(f"need max_lag >= 0 and full_every >= 0, got max_lag={max_lag}, "
                         f"full_every={full_every}")
    check_layout(regions, pools)
    missing = set(lengths) ^ set(weights)
    if missing:
        raise ValueError(f"every policy needs both lengths and weights; mismatched: "
                         f"{sorted(missing)}")


def check_layout(regions: Sequence[Region], pools: Sequence[Pool]) -> None:
    """Unique names, at least one pool, and every pool in one of the regions."""
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise ValueError(f"region names must be unique, got {names}")
    pool_names = [p.name for p in pools]
    if not pools or len(set(pool_names)) != len(pool_names):
        raise ValueError(f"need at least one pool, with unique names; got {pool_names}")
    for p in pools:
        if p.region not in names:
            raise ValueError(f"pool {p.name!r} is in region {p.region!r}, which is not one of "
                             f"the regions {names}; add Region({p.region!r}, link=...)")
