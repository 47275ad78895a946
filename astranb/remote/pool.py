"""The Session's view of its rollout services: one object the session, the autoscaler and the
notebook talk to, composed of three parts with one job each:

    members.py     Members: who the services are and how healthy (ready, suspect, dead), when a
                   silent one is declared dead, when none has answered for too long
    dispatch.py    Dispatch: the episode queue, routing to the fastest finisher, first result
                   wins, a dead member's work resubmitted; the run's accounting
    broadcast.py   WeightBroadcast: each new version out to the services, straight, pushed, or
                   through a region's relay

`RolloutPool` runs them: a loop per member pulls finished episodes with a short long-poll; every
answer doubles as a heartbeat and carries the service's instance id and availability. A dead
member keeps being probed; when it answers again (a restart is a new instance id, whose in-flight
work is treated as lost and resubmitted) it first catches up: policies created, weights synced to
the current version, environments registered; only then does it get work again.

`ServicesPublisher` is a policy's `contracts.Publisher` over the pool.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.abc

from ..contracts import Publisher, RemoteEpisodes, Trainer
from ..environments.base import Environment
from ..errors import NoRolloutService, ServiceRejected
from ..types import Trajectory
from ..weights.store import WeightStore
from .broadcast import WeightBroadcast
from .client import ServiceError, ServiceUnavailable
from .dispatch import Dispatch
from .members import Member, Members
from .serialize import spec_to_wire
from .trainer import RemoteTrainer

__all__ = ["RolloutPool", "ServicesPublisher", "Member", "NoRolloutService", "ServiceRejected"]


class RolloutPool(RemoteEpisodes):
    """Rollout services of a Session.

    Args:
        urls: base URLs of rollout services.
        token: bearer token.
        policies: name -> Policy (created on every member).
        failure_timeout: seconds without an answer before a member is declared dead.
        poll_wait: long-poll seconds of each pull (also the heartbeat period).
        patience: seconds with no service answering before the run fails.
        transport: httpx transport factory (tests): url -> transport.
    """

    def __init__(self, urls, token: str | None, policies: Mapping[str, Any], *,
                 failure_timeout: float = 5.0, poll_wait: float = 0.2, patience: float = 600.0,
                 transport=None):
        self.token, self.policies = token, policies
        self.failure_timeout, self.poll_wait, self.patience = failure_timeout, poll_wait, patience
        self.membership = Members(token, transport, failure_timeout, patience,
                                  on_dead=lambda member: self.dispatch.take_back(member))
        self.dispatch = Dispatch(self.membership, poll_wait)
        self.weights = WeightBroadcast(self.membership)
        for url in urls:
            self.membership.new(url)
        self._envs: dict[int, tuple[Environment, dict[str, str], dict]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.epoch = 0

    # -- the parts' state, under the names the session, the autoscaler and the notebook read --
    @property
    def members(self) -> dict[str, Member]:
        """URL -> member (removed ones included, marked `removed`)."""
        return self.membership.by_url

    @property
    def relays(self) -> dict[str, str]:
        """region -> URL of the member that relays weights to the rest of that region."""
        return self.weights.relays

    @property
    def trainer_url(self) -> str | None:
        """The trainer service the members pull weights from (None: pushed from here)."""
        return self.weights.trainer_url

    @trainer_url.setter
    def trainer_url(self, url: str | None) -> None:
        self.weights.trainer_url = url

    @property
    def tag(self) -> str:
        """This run's episode-id prefix."""
        return self.dispatch.tag

    @property
    def counts(self) -> dict[str, int]:
        """This run's episode accounting (see `accounting()`)."""
        return self.dispatch.counts

    @property
    def queued(self) -> int:
        """Episodes waiting for a rollout slot."""
        return len(self.dispatch.queue)

    def ready(self) -> list[Member]:
        """Members that may get work and weights now."""
        return self.membership.ready()

    # -- runs -----------------------------------------------------------------------------------
    def start_run(self, sources) -> None:
        """A run begins: new episode ids and accounting; its environments are registered."""
        self.reset_accounting()
        for source in sources:
            self.register_env(source.env, source.wiring)

    def reset_accounting(self) -> None:
        """Episode ids and accounting are per run: results of an earlier run are recognised and
        ignored (acknowledged so the service forgets them)."""
        self.dispatch.reset()

    def register_env(self, env: Environment, wiring: Mapping[str, Any]) -> None:
        """Play `env` with these role -> policy names; members register it when they catch up."""
        roles = {role: p.name for role, p in wiring.items()}
        self._envs[id(env)] = (env, roles, dict(env.registry_kwargs))
        for member in self.members.values():
            if member.state != "dead":
                member.state = "new"  # catch up (idempotent) before the next episode

    async def play(
        self, env: Environment, samples: Sequence[tuple[str, dict[str, Any], int, int]]
    ) -> list[Trajectory]:
        """Play episodes (id, sample, group, admitted_version) on the services; results in order."""
        if id(env) not in self._envs:
            raise RuntimeError(f"{env.name} is not wired to the rollout services")
        return await self.dispatch.play(id(env), samples)

    def episode_ids(self, group: int, n: int) -> list[str]:
        return [f"{self.tag}.{self.epoch}.{group}.{i}" for i in range(n)]

    def accounting(self) -> dict[str, int]:
        """This run's episode accounting. Every submitted episode is completed, still awaited, or
        abandoned because the run ended first; `lost` counts the rest and must be 0."""
        return self.dispatch.accounting()

    async def publish(self, name: str, version: int,
                      publisher: ServicesPublisher) -> dict[str, Any]:
        """Bring every ready member to `version` of policy `name`; transfer metrics."""
        return await self.weights.publish(name, version, publisher)

    # -- membership -----------------------------------------------------------------------------
    def add(self, url: str) -> None:
        """A new rollout service; it gets work once it has caught up."""
        member = self.membership.new(url)
        if self._tg is not None:
            self._tg.start_soon(self._member_loop, member)

    def remove(self, url: str) -> None:
        """Stop using a rollout service; its in-flight episodes are resubmitted elsewhere."""
        member = self.membership.get(url)
        member.removed = True
        self.membership.fail_over(member)

    async def drain(self, url: str) -> None:
        """Give a rollout service no new work, wait until the episodes it holds are in, then
        remove it. If it dies meanwhile, what it held is resubmitted (as for any failure)."""
        member = self.membership.get(url)
        member.draining = True
        while member.inflight and member.state in ("ready", "suspect", "new"):
            await anyio.sleep(self.poll_wait)
        self.remove(url)

    async def prepare(self) -> None:
        """Catch every member up now (policy creation): a service that cannot is an error here."""
        for member in self.members.values():
            if not member.removed and not await self._catch_up(member, strict=True):
                raise ServiceUnavailable(
                    f"rollout service {member.url} could not be prepared: {member.last_error}. "
                    "Start it (`astranb serve rollout`) or leave it out of Session(rollout=...)"
                )

    # -- running --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Member loops and the dispatch, until cancelled (owned by the run's task group)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                for member in list(self.members.values()):
                    if member.state != "dead":
                        member.state = "new"  # catch up (idempotent) before the first episode
                    tg.start_soon(self._member_loop, member)
                tg.start_soon(self.dispatch.run)
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def _member_loop(self, member: Member) -> None:
        while not member.removed:
            if member.state in ("new", "dead"):
                if not await self._catch_up(member):
                    if member.inflight:  # work it held before it stopped answering moves on
                        self.membership.missed(member)
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
            async with self.weights.lock:
                await self.weights.catch_up(member, self.policies)
                for key, (env, roles, kwargs) in self._envs.items():
                    member.env_ids[key] = await member.client.register(_env_name(env), roles,
                                                                       kwargs)
                self._joined(member, status)
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
        self.dispatch.wake()
        return True

    def _joined(self, member: Member, status: Mapping[str, Any]) -> None:
        """A member has caught up: it is ready (a new instance id after one it had is a
        rejoin)."""
        fresh = member.instance_id != status["instance_id"]
        if member.instance_id is not None and fresh:
            self.counts["rejoins"] += 1
        member.instance_id, member.capacity = status["instance_id"], status["capacity"]
        member.engine = status["engine"]
        member.state, member.last_ok = "ready", time.monotonic()
        member.last_pull = member.last_ok

    async def _pull(self, member: Member) -> None:
        """One long-poll of a member: its finished episodes, and a heartbeat."""
        acks, member.acks = member.acks, []
        try:
            answer = await member.client.pull(acks, wait=self.poll_wait)
        except (ServiceUnavailable, ServiceError):
            member.acks = acks + member.acks
            self.membership.missed(member)
            await anyio.sleep(self.poll_wait)
            return
        if answer.get("instance_id") != member.instance_id:  # restarted in between: work lost
            self.membership.fail_over(member)
            return
        now = time.monotonic()
        member.pace.observe(now - member.last_pull, len(answer["results"]), bool(member.inflight))
        member.last_ok, member.last_pull = now, now
        member.updating = answer.get("updating", False)
        if member.state == "suspect":
            member.state = "ready"
            self.dispatch.wake()
        for result in answer["results"]:
            member.acks.append(result["id"])
            member.inflight.pop(result["id"], None)
            self.dispatch.deliver(result)
        if answer["results"]:
            self.dispatch.wake()  # room freed

    async def close(self) -> None:
        for member in self.members.values():
            await member.client.close()


def _env_name(env: Environment) -> str:
    return env.registry_name or env.name


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
