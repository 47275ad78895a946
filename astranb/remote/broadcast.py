"""New weights out to the rollout services: the pool's weight broadcast and its regional relays.

After a train step the policy's `ServicesPublisher` brings every ready member to the new version,
either by telling it to pull from the trainer service (delta when its base matches, else full)
or, with a trainer in this process, by pushing the store's payload
(`astranb.weights.publish.deliver` heals a rejected delta with a full snapshot). A member that
fails is failed over; it catches up when it answers again.

Regions: members whose services declare a region pull through a relay. Per region and version,
the relay (the current one while it is ready, else the first ready member by URL) pulls from the
trainer and keeps the payload; then the region's other members pull it from the relay. A relay
that fails is failed over like any member and the next one is chosen within the same publish;
a receiver whose relay fails mid-pull goes to the trainer itself, so no version is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from ..weights.publish import deliver
from .client import ServiceError, ServiceUnavailable
from .members import Member, Members

if TYPE_CHECKING:
    from .pool import ServicesPublisher

__all__ = ["WeightBroadcast"]


class WeightBroadcast:
    """Brings members to a policy's version, straight, through their region's relay, or pushed.

    Args:
        members: the pool's members (who is ready; failing ones are failed over).
    """

    def __init__(self, members: Members):
        self.members = members
        self.trainer_url: str | None = None
        """The trainer service members pull from (None: weights are pushed from a store)."""
        self.relays: dict[str, str] = {}
        """region -> URL of the member that relays weights to the rest of that region."""
        self.lock = anyio.Lock()
        """Held while weights move: one publish at a time, and none while a member catches up."""

    async def publish(self, name: str, version: int,
                      publisher: ServicesPublisher) -> dict[str, Any]:
        """Bring every ready member to `version` of policy `name`; transfer metrics."""
        async with self.lock:
            answers: dict[str, dict] = {}
            regions: dict[str, list[Member]] = {}
            async with anyio.create_task_group() as tg:
                for member in self.members.ready():
                    if member.region and self.trainer_url is not None:
                        regions.setdefault(member.region, []).append(member)
                    else:
                        tg.start_soon(self._one, answers, member, name, version, publisher)
                for members in regions.values():
                    tg.start_soon(self._region, answers, members, name, version, publisher)
        return _metrics(answers)

    async def catch_up(self, member: Member, policies: Mapping[str, Any]) -> None:
        """Bring a (re)joining member to every policy's current version (call with `lock`
        held). The first of a region to catch up relays for it: it pulls once and keeps the
        payload for the others."""
        relay = self.relay_of(member)
        share = bool(member.region) and relay is None and self.trainer_url is not None
        for policy in policies.values():
            await self.sync(member, policy.name, policy.version, policy.publisher,
                            relay=relay.url if relay is not None else None, share=share)
        if share:
            self.relays[member.region] = member.url

    async def _one(self, answers: dict[str, dict], member: Member, name: str, version: int,
                   publisher: ServicesPublisher, relay: Member | None = None,
                   share: bool = False) -> bool:
        """Sync one member (from `relay` if given); a failure fails it over."""
        try:
            answers[member.url] = answer = await self.sync(
                member, name, version, publisher,
                relay=relay.url if relay is not None else None, share=share)
            member.sync_seconds = float(answer.get("seconds", 0.0))
            return True
        except (ServiceUnavailable, ServiceError):
            self.members.fail_over(member)  # it catches up when it answers again
            return False

    async def _region(self, answers: dict[str, dict], members: list[Member], name: str,
                      version: int, publisher: ServicesPublisher) -> None:
        """The region's relay first (the next one if it fails), then the rest from it,
        together."""
        relay = None
        for candidate in self._relay_candidates(members):
            if await self._one(answers, candidate, name, version, publisher, share=True):
                relay = candidate
                break
        if relay is None:
            return
        self.relays[relay.region] = relay.url
        async with anyio.create_task_group() as tg:
            for member in members:
                if member is not relay and member.state == "ready":
                    tg.start_soon(self._one, answers, member, name, version, publisher, relay)

    def _relay_candidates(self, members: list[Member]) -> list[Member]:
        """The region's relay first while it is ready, then the others by URL."""
        current = self.relays.get(members[0].region)
        ordered = sorted(members, key=lambda m: (m.draining, m.url != current, m.url))
        return [m for m in ordered if m.state == "ready"]

    def relay_of(self, member: Member) -> Member | None:
        """The ready relay a (re)joining member can pull from, if its region has one."""
        url = self.relays.get(member.region) if member.region else None
        relay = self.members.by_url.get(url) if url else None
        if relay is None or relay is member or relay.state != "ready" or relay.removed:
            return None
        return relay

    async def sync(self, member: Member, name: str, version: int,
                   publisher: ServicesPublisher, relay: str | None = None,
                   share: bool = False) -> dict:
        """Bring one member to `version` of `name`: told to pull (from the trainer service, or
        `relay`; `share`: keep the payload for the region) or pushed from the publisher's
        store. The member's answer."""
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


def _metrics(answers: Mapping[str, dict]) -> dict[str, Any]:
    """The metrics row's transfer columns from the members' answers."""
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
