"""The Session's view of its rollout services: routing, heartbeats, failover, weight broadcast.

Each member (one rollout service) has a loop that pulls finished episodes with a short long-poll;
every answer doubles as a heartbeat and carries the service's instance id and availability. A
member that stops answering is *suspect* (it gets no new work) and, after `failure_timeout`
seconds without an answer, *dead*: its in-flight episodes go back in the queue for the others.
A dead member keeps being probed; when it answers again (a restart is a new instance id, whose
in-flight work is treated as lost and resubmitted) it first catches up: policies created, weights
synced to the current version, environments registered; only then does it get work again.

Episodes are identified by id. The first result for an id wins; any later one (a resubmitted
episode whose first copy still arrived) is acknowledged and discarded, so no episode is trained
twice and, since nothing leaves the accounting before its result is in, none is lost. A result
of an episode nobody waits for any more (abandoned when the training rollouts stopped, while a
held-out evaluation window still plays) is acknowledged and counted as `late`. `accounting()`
reports the totals.

Weights: after a train step the policy's `ServicesPublisher` brings every ready member to the new
version, either by telling it to pull from the trainer service (delta when its base matches, else
full) or, with a trainer in this process, by pushing the store's payload
(`astranb.weights.publish.deliver` heals a rejected delta with a full snapshot).

Routing: queued episodes go to the services that would finish them first, from each one's
measured pace and weight-update time (astranb.remote.routing), so a slow or far service gets less.

Regions: members whose services declare a region pull through a relay. Per region and version,
the relay (the current one while it is ready, else the first ready member by URL) pulls from the
trainer and keeps the payload; then the region's other members pull it from the relay. A relay
that fails is failed over like any member and the next one is chosen within the same publish;
a receiver whose relay fails mid-pull goes to the trainer itself, so no version is skipped.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..contracts import Publisher, RemoteEpisodes, Trainer
from ..environments.base import Environment
from ..errors import NoRolloutService, ServiceRejected
from ..types import Trajectory
from ..weights.publish import deliver
from ..weights.store import WeightStore
from .client import RolloutClient, ServiceError, ServiceUnavailable
from .routing import Pace, split
from .serialize import spec_to_wire, trajectory_from_wire
from .trainer import RemoteTrainer

__all__ = ["RolloutPool", "ServicesPublisher", "NoRolloutService", "ServiceRejected"]


@dataclass(eq=False)
class Member:
    """One rollout service as the pool sees it."""

    url: str
    client: RolloutClient
    state: str = "new"  # new -> ready <-> suspect -> dead -> ready (after catching up)
    instance_id: str | None = None
    last_ok: float = field(default_factory=time.monotonic)
    capacity: int = 0
    engine: str = ""
    updating: bool = False
    inflight: dict[str, dict] = field(default_factory=dict)
    acks: list[str] = field(default_factory=list)
    env_ids: dict[int, str] = field(default_factory=dict)
    removed: bool = False
    last_error: str = ""
    region: str = ""
    draining: bool = False  # takes no new work; removed once what it holds is in
    pace: Pace = field(default_factory=Pace)  # episodes per second while it has work
    last_pull: float = field(default_factory=time.monotonic)
    sync_seconds: float = 0.0  # how long its last weight update took

    @property
    def room(self) -> int:
        """Episodes to send it now: its capacity minus what this session has in flight there
        (counted here exactly), none while it applies weights or is not ready."""
        if self.state != "ready" or self.updating or self.draining:
            return -1
        return self.capacity - len(self.inflight)


@dataclass
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    result: Trajectory | None = None


class RolloutPool(RemoteEpisodes):
    """Rollout services of a Session.

    Args:
        urls: base URLs of rollout services.
        token: bearer token.
        policies: name -> Policy (created on every member).
        failure_timeout: seconds without an answer before a member is declared dead.
        poll_wait: long-poll seconds of each pull (also the heartbeat period).
        transport: httpx transport factory (tests): url -> transport.
    """

    def __init__(self, urls, token: str | None, policies: Mapping[str, Any], *,
                 failure_timeout: float = 5.0, poll_wait: float = 0.2, patience: float = 600.0,
                 transport=None):
        self.token, self.policies = token, policies
        self.failure_timeout, self.poll_wait, self.patience = failure_timeout, poll_wait, patience
        self._transport = transport
        self.members: dict[str, Member] = {}
        for url in urls:
            self._new_member(url)
        self.trainer_url: str | None = None
        self._queue: deque[dict] = deque()
        self._queued = anyio.Event()
        self._waiting: dict[str, _Waiter] = {}
        self._abandoned: set[str] = set()
        self._envs: dict[int, tuple[Environment, dict[str, str], dict]] = {}
        self._weights_lock = anyio.Lock()
        self.relays: dict[str, str] = {}
        """region -> URL of the member that relays weights to the rest of that region."""
        self._tg: anyio.abc.TaskGroup | None = None
        self.epoch = 0
        self.counts: dict[str, int] = {}
        """This run's episode accounting (see `accounting()`)."""
        self.reset_accounting()

    def start_run(self, sources) -> None:
        """A run begins: new episode ids and accounting; its environments are registered."""
        self.reset_accounting()
        for source in sources:
            self.register_env(source.env, source.wiring)

    def reset_accounting(self) -> None:
        """Episode ids and accounting are per run: results of an earlier run are recognised and
        ignored (acknowledged so the service forgets them)."""
        self.tag = uuid.uuid4().hex[:8]
        self._queue.clear()
        self._abandoned.clear()
        self.counts = dict.fromkeys(("submitted", "completed", "resubmitted", "duplicates",
                                     "abandoned", "late", "stale_results", "failovers",
                                     "rejoins"), 0)

    # -- membership --------------------------------------------------------------------------------
    def _new_member(self, url: str) -> Member:
        url = url.rstrip("/")
        if url in self.members and not self.members[url].removed:
            raise ValueError(f"{url} is a rollout service of this session already")
        transport = self._transport(url) if self._transport else None
        member = Member(url, RolloutClient(url, self.token, transport=transport))
        self.members[url] = member
        return member

    def add(self, url: str) -> None:
        """A new rollout service; it gets work once it has caught up."""
        member = self._new_member(url)
        if self._tg is not None:
            self._tg.start_soon(self._member_loop, member)

    def remove(self, url: str) -> None:
        """Stop using a rollout service; its in-flight episodes are resubmitted elsewhere."""
        member = self.members.get(url.rstrip("/"))
        if member is None or member.removed:
            raise ValueError(f"{url} is not a rollout service of this session: "
                             f"{sorted(self.members)}")
        member.removed = True
        self._fail_over(member)

    async def drain(self, url: str) -> None:
        """Give a rollout service no new work, wait until the episodes it holds are in, then
        remove it. If it dies meanwhile, what it held is resubmitted (as for any failure)."""
        member = self.members.get(url.rstrip("/"))
        if member is None or member.removed:
            raise ValueError(f"{url} is not a rollout service of this session: "
                             f"{sorted(self.members)}")
        member.draining = True
        while member.inflight and member.state in ("ready", "suspect", "new"):
            await anyio.sleep(self.poll_wait)
        self.remove(url)

    @property
    def queued(self) -> int:
        """Episodes waiting for a rollout slot."""
        return len(self._queue)

    def ready(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == "ready" and not m.removed]

    async def prepare(self) -> None:
        """Catch every member up now (policy creation): a service that cannot is an error here."""
        for member in self.members.values():
            if not member.removed and not await self._catch_up(member, strict=True):
                raise ServiceUnavailable(
                    f"rollout service {member.url} could not be prepared: {member.last_error}. "
                    "Start it (`astranb serve rollout`) or leave it out of Session(rollout=...)"
                )

    # -- running -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Member loops and the submitter, until cancelled (owned by the run's task group)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                for member in list(self.members.values()):
                    if member.state != "dead":
                        member.state = "new"  # catch up (idempotent) before the first episode
                    tg.start_soon(self._member_loop, member)
                tg.start_soon(self._submitter)
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def _member_loop(self, member: Member) -> None:
        while not member.removed:
            if member.state in ("new", "dead"):
                if not await self._catch_up(member):
                    if member.inflight:  # work it held before it stopped answering moves on
                        self._missed(member)
                    await anyio.sleep(min(1.0, self.poll_wait * 5))
                continue
            await self._pull(member)

    async def _catch_up(self, member: Member, strict: bool = False) -> bool:
        """Bring a (re)joining member to the session's policies, weights and environments."""
        try:
            status = await member.client.status(timeout=5)
            for name, policy in self.policies.items():
                await member.client.add_policy(name, spec_to_wire(policy.spec),
                                               max_batch_size=policy.max_batch_size,
                                               seed=policy.seed)
            member.region = str(status.get("region") or "")
            async with self._weights_lock:
                relay = self._relay_of(member)
                # the first of a region to catch up relays for it (pulls once, keeps the payload)
                share = bool(member.region) and relay is None and self.trainer_url is not None
                for policy in self.policies.values():
                    await self._sync(member, policy.name, policy.version, policy.publisher,
                                     relay=relay.url if relay is not None else None, share=share)
                if share:
                    self.relays[member.region] = member.url
                for key, (env, roles, kwargs) in self._envs.items():
                    member.env_ids[key] = await member.client.register(_env_name(env), roles,
                                                                       kwargs)
                fresh = member.instance_id != status["instance_id"]
                if member.instance_id is not None and fresh:
                    self.counts["rejoins"] += 1
                member.instance_id, member.capacity = status["instance_id"], status["capacity"]
                member.engine = status["engine"]
                member.state, member.last_ok = "ready", time.monotonic()
                member.last_pull = member.last_ok
        except ServiceUnavailable as error:
            member.last_error = str(error)
            return False
        except ServiceError as error:
            # 5xx: the service failed; 424 mid-run: it could not get weights from a trainer that
            # is restarting. Both are retried; a refusal (4xx) is an error, and so is 424 at setup.
            if error.status >= 500 or (error.status == 424 and not strict):
                member.last_error = str(error)
                return False
            raise ServiceRejected(
                f"rollout service {member.url} refused to set up: {error}"
            ) from None
        self._queued.set()
        return True

    async def _pull(self, member: Member) -> None:
        acks, member.acks = member.acks, []
        try:
            answer = await member.client.pull(acks, wait=self.poll_wait)
        except (ServiceUnavailable, ServiceError):
            member.acks = acks + member.acks
            self._missed(member)
            await anyio.sleep(self.poll_wait)
            return
        if answer.get("instance_id") != member.instance_id:  # restarted in between: work lost
            self._fail_over(member)
            return
        now = time.monotonic()
        member.pace.observe(now - member.last_pull, len(answer["results"]), bool(member.inflight))
        member.last_ok, member.last_pull = now, now
        member.updating = answer.get("updating", False)
        if member.state == "suspect":
            member.state = "ready"
            self._queued.set()
        for result in answer["results"]:
            member.acks.append(result["id"])
            member.inflight.pop(result["id"], None)
            self._deliver(result)
        if answer["results"]:
            self._queued.set()  # room freed

    def _missed(self, member: Member) -> None:
        if time.monotonic() - member.last_ok > self.failure_timeout:
            self._fail_over(member)
        elif member.state == "ready":
            member.state = "suspect"

    def _fail_over(self, member: Member) -> None:
        """Declare the member dead and put its in-flight episodes back in the queue."""
        if member.inflight:
            self.counts["failovers"] += 1
        for item in member.inflight.values():
            if item["id"] in self._waiting:
                self.counts["resubmitted"] += 1
                self._queue.appendleft(item)
        member.inflight.clear()
        member.acks.clear()
        member.state = "dead"
        self._queued.set()

    def _deliver(self, result: dict) -> None:
        if not result["id"].startswith(self.tag):
            self.counts["stale_results"] += 1  # from an earlier run
            return
        waiter = self._waiting.get(result["id"])
        if waiter is None and result["id"] in self._abandoned:
            # nobody waits any more (the training rollouts stopped while a held-out evaluation
            # window still plays on): acknowledged and dropped, not a duplicate
            self._abandoned.discard(result["id"])
            self.counts["late"] += 1
            return
        if waiter is None or waiter.result is not None:
            self.counts["duplicates"] += 1
            return
        waiter.result = trajectory_from_wire(result)
        self.counts["completed"] += 1
        waiter.event.set()

    async def _submitter(self) -> None:
        while True:
            if not self._queue:
                await self._wait_queued()
                continue
            targets = [m for m in self.ready() if m.room > 0]
            if not targets:
                await self._wait_queued(timeout=self.poll_wait)
                if not self.ready():
                    self._check_patience()
                continue
            # each episode to the service that would finish it first (astranb.remote.routing)
            counts = split(min(len(self._queue), 4096), [m.room for m in targets],
                           [len(m.inflight) for m in targets], [m.pace.rate for m in targets],
                           [m.sync_seconds for m in targets])
            for member, count in zip(targets, counts, strict=True):
                items = [self._queue.popleft() for _ in range(count)]
                items = [i for i in items if i["id"] in self._waiting]  # not abandoned meanwhile
                if items:
                    await self._submit(member, items)

    async def _submit(self, member: Member, items: list[dict]) -> None:
        for item in items:
            member.inflight[item["id"]] = item
        wire = [dict(i, env_id=member.env_ids[i["env"]]) for i in items]
        for w in wire:
            w.pop("env")
        try:
            await member.client.submit(wire)
        except (ServiceUnavailable, ServiceError):
            self._missed(member)
            if member.state == "ready":
                member.state = "suspect"
            # the service may or may not have them: keep them in its accounting until it answers
            # (then they arrive) or it is declared dead (then they are resubmitted)

    async def _wait_queued(self, timeout: float | None = None) -> None:
        self._queued = anyio.Event()
        with anyio.move_on_after(timeout if timeout is not None else math.inf):
            await self._queued.wait()

    def _check_patience(self) -> None:
        newest = max((m.last_ok for m in self.members.values() if not m.removed), default=0.0)
        if time.monotonic() - newest > self.patience:
            raise NoRolloutService(
                f"no rollout service has answered for {self.patience:.0f} s "
                f"({', '.join(self.members)}); start one and call session.add_rollout(url)"
            )

    # -- episodes ----------------------------------------------------------------------------------
    def register_env(self, env: Environment, wiring: Mapping[str, Any]) -> None:
        """Play `env` with these role -> policy names; members register it when they catch up."""
        roles = {role: p.name for role, p in wiring.items()}
        self._envs[id(env)] = (env, roles, getattr(env, "registry_kwargs", {}))
        for member in self.members.values():
            if member.state != "dead":
                member.state = "new"  # catch up (idempotent) before the next episode

    async def play(
        self, env: Environment, samples: Sequence[tuple[str, dict[str, Any], int, int]]
    ) -> list[Trajectory]:
        """Play episodes (id, sample, group, admitted_version) on the services; results in order."""
        key = id(env)
        if key not in self._envs:
            raise RuntimeError(f"{env.name} is not wired to the rollout services")
        waiters = []
        for episode_id, sample, group, admitted in samples:
            waiter = self._waiting.setdefault(episode_id, _Waiter())
            waiters.append(waiter)
            self._queue.append({"id": episode_id, "env": key, "sample": sample, "group": group,
                                "started_version": admitted})
            self.counts["submitted"] += 1
        self._queued.set()
        try:
            for waiter in waiters:
                await waiter.event.wait()
        finally:
            for episode_id, *_ in samples:
                left = self._waiting.pop(episode_id, None)
                if left is not None and left.result is None:
                    self.counts["abandoned"] += 1  # the run ended (or was stopped) first
                    self._abandoned.add(episode_id)
        results = []
        for waiter in waiters:
            assert waiter.result is not None  # its event is set only once the result is in
            results.append(waiter.result)
        return results

    def episode_ids(self, group: int, n: int) -> list[str]:
        return [f"{self.tag}.{self.epoch}.{group}.{i}" for i in range(n)]

    def accounting(self) -> dict[str, int]:
        """This run's episode accounting. Every submitted episode is completed, still awaited, or
        abandoned because the run ended first; `lost` counts the rest and must be 0."""
        waiting = len(self._waiting)
        c = self.counts
        lost = c["submitted"] - c["completed"] - c["abandoned"] - waiting
        return {**c, "awaited": waiting, "lost": lost}

    # -- weights -----------------------------------------------------------------------------------
    async def publish(
        self, name: str, version: int, publisher: ServicesPublisher
    ) -> dict[str, Any]:
        """Bring every ready member to `version` of policy `name`; transfer metrics."""
        async with self._weights_lock:
            answers: dict[str, dict] = {}

            async def one(member: Member, relay: Member | None = None, share: bool = False) -> bool:
                try:
                    answers[member.url] = answer = await self._sync(
                        member, name, version, publisher,
                        relay=relay.url if relay is not None else None, share=share)
                    member.sync_seconds = float(answer.get("seconds", 0.0))
                    return True
                except (ServiceUnavailable, ServiceError):
                    self._fail_over(member)  # it catches up when it answers again
                    return False

            async def region(members: list[Member]) -> None:
                # the relay first (the next one if it fails), then the rest from it, together
                relay = None
                for candidate in self._relay_candidates(members):
                    if await one(candidate, share=True):
                        relay = candidate
                        break
                if relay is None:
                    return
                self.relays[relay.region] = relay.url
                async with anyio.create_task_group() as tg:
                    for member in members:
                        if member is not relay and member.state == "ready":
                            tg.start_soon(one, member, relay)

            regions: dict[str, list[Member]] = {}
            async with anyio.create_task_group() as tg:
                for member in self.ready():
                    if member.region and self.trainer_url is not None:
                        regions.setdefault(member.region, []).append(member)
                    else:
                        tg.start_soon(one, member)
                for members in regions.values():
                    tg.start_soon(region, members)
        kinds = sorted({a["kind"] for a in answers.values()})
        relayed = [a for a in answers.values() if a.get("source") == "relay"]
        return {
            "transfer_kind": "+".join(kinds) or "none",
            "transfer_bytes": sum(a.get("bytes", 0) for a in answers.values()),
            "transfer_bytes_relayed": sum(a.get("bytes", 0) for a in relayed),
            "transfer_seconds": max((a.get("seconds", 0.0) for a in answers.values()), default=0.0),
            "rollout_services": len(answers),
            "rollout_checksums": ",".join(str(a["checksum"]) for a in answers.values()),
            "rollout_versions": ",".join(str(a["version"]) for a in answers.values()),
        }

    def _relay_candidates(self, members: list[Member]) -> list[Member]:
        """The region's relay first while it is ready, then the others by URL."""
        current = self.relays.get(members[0].region)
        ordered = sorted(members, key=lambda m: (m.draining, m.url != current, m.url))
        return [m for m in ordered if m.state == "ready"]

    def _relay_of(self, member: Member) -> Member | None:
        """The ready relay a (re)joining member can pull from, if its region has one."""
        url = self.relays.get(member.region) if member.region else None
        relay = self.members.get(url) if url else None
        if relay is None or relay is member or relay.state != "ready" or relay.removed:
            return None
        return relay

    async def _sync(self, member: Member, name: str, version: int,
                    publisher: ServicesPublisher, relay: str | None = None,
                    share: bool = False) -> dict:
        if self.trainer_url is not None:
            return await member.client.notify_version(name, version, self.trainer_url,
                                                      publisher.checksum, relay=relay,
                                                      share=share)
        store = publisher.store
        if store is None:
            raise RuntimeError(f"policy {name!r}: no trainer service and no weight store to push "
                               "from; build its ServicesPublisher with the trainer's WeightStore")
        status = (await member.client.status())["policies"][name]
        if status["version"] == version and status["checksum"] == store.checksum:
            return status | {"kind": "none", "bytes": 0}

        async def fetch(full: bool) -> bytes:
            return store.pull_full() if full else store.pull(status["version"], status["checksum"])

        _, answer, _ = await deliver(
            fetch, lambda payload: member.client.push_weights(name, payload),
            rejected=lambda e: isinstance(e, ServiceError) and e.status == 409)
        return answer

    async def close(self) -> None:
        for member in self.members.values():
            await member.client.close()


def _env_name(env: Environment) -> str:
    return getattr(env, "registry_name", None) or env.name


class ServicesPublisher(Publisher):
    """Publishes a policy's weights to the session's rollout services (`contracts.Publisher`).

    With a trainer service the services pull each version from it (`store` is None and the
    checksum is the remote trainer's); with a trainer in this process the weights are encoded into
    `store` here and pushed to each service.

    Args:
        pool: the session's rollout services.
        name: the policy's name.
        trainer: the policy's trainer: a `RemoteTrainer` when `store` is None.
        store: the versioned store a trainer in this process publishes into.
    """

    def __init__(self, pool: RolloutPool, name: str, trainer: Trainer,
                 store: WeightStore | None = None):
        if store is None and not isinstance(trainer, RemoteTrainer):
            raise TypeError(
                f"policy {name!r}: the rollout services pull weights from a trainer service "
                f"(a RemoteTrainer), and this trainer is a {type(trainer).__name__}; pass "
                "store=WeightStore(name) to push its weights from this process instead")
        self.pool, self.name, self.trainer, self.store = pool, name, trainer, store

    @property
    def where(self) -> str:
        return f"{len(self.pool.members)} rollout service(s)"

    @property
    def checksum(self) -> int | None:
        if self.store is not None:
            return self.store.checksum
        assert isinstance(self.trainer, RemoteTrainer)  # checked when built
        return self.trainer.checksum

    def publish_initial(self) -> None:
        """Version 0 into the store (the services get it when they catch up)."""
        if self.store is not None:
            self.store.publish(self.trainer.version, self.trainer.weights())

    async def publish(self) -> dict[str, Any]:
        trainer = self.trainer
        metrics: dict[str, Any] = {}
        if self.store is not None:
            store = self.store
            stats = await anyio.to_thread.run_sync(
                lambda: store.publish(trainer.version, trainer.weights()))
            metrics = {"changed_fraction": stats.changed_fraction,
                       "encode_seconds": stats.encode_seconds}
        metrics.update(await self.pool.publish(self.name, trainer.version, self))
        metrics["weights_checksum"] = self.checksum
        return metrics
