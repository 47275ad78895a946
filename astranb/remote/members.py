"""Who the session's rollout services are, and how healthy: the pool's membership.

A member moves through

    new ──catch up──► ready ◄──answers again── suspect
                        │                         ▲
                        └── a call fails ─────────┘
    suspect ──failure_timeout s without an answer──► dead ──catch up──► ready

A member that is not ready gets no new work. One that dies hands its in-flight episodes back
(`on_dead`, the dispatch's `take_back`), so they are played elsewhere. A removed member stays in
the table (its URL may join again later as a new member); a draining one takes no new work and
leaves once what it holds is in. When no member has answered for `patience` seconds the run
fails with `NoRolloutService` instead of waiting forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import NoRolloutService
from .client import RolloutClient
from .routing import Pace

__all__ = ["Member", "Members"]


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


class Members:
    """The table of members by URL and the rules of their health (see the module docstring).

    Args:
        token: bearer token of the services.
        transport: httpx transport factory (tests): url -> transport.
        failure_timeout: seconds without an answer before a member is declared dead.
        patience: seconds with no member answering before the run gives up.
        on_dead: called with a member just declared dead, before its in-flight work is
            forgotten (the dispatch puts that work back in its queue).
    """

    def __init__(self, token: str | None, transport: Any, failure_timeout: float,
                 patience: float, on_dead: Callable[[Member], None]):
        self.token, self.transport = token, transport
        self.failure_timeout, self.patience, self.on_dead = failure_timeout, patience, on_dead
        self.by_url: dict[str, Member] = {}

    def new(self, url: str) -> Member:
        """A new member for `url` (a removed one's URL may come back); not ready yet."""
        url = url.rstrip("/")
        if url in self.by_url and not self.by_url[url].removed:
            raise ValueError(f"{url} is a rollout service of this session already")
        transport = self.transport(url) if self.transport else None
        member = Member(url, RolloutClient(url, self.token, transport=transport))
        self.by_url[url] = member
        return member

    def get(self, url: str) -> Member:
        """The member serving `url`; a clear error if there is none."""
        member = self.by_url.get(url.rstrip("/"))
        if member is None or member.removed:
            raise ValueError(f"{url} is not a rollout service of this session: "
                             f"{sorted(self.by_url)}")
        return member

    def ready(self) -> list[Member]:
        """Members that may get work and weights now."""
        return [m for m in self.by_url.values() if m.state == "ready" and not m.removed]

    def missed(self, member: Member) -> None:
        """A call to `member` failed: suspect at once, dead after `failure_timeout` of
        silence."""
        if time.monotonic() - member.last_ok > self.failure_timeout:
            self.fail_over(member)
        elif member.state == "ready":
            member.state = "suspect"

    def fail_over(self, member: Member) -> None:
        """Declare the member dead; its in-flight episodes go back for the others."""
        self.on_dead(member)
        member.inflight.clear()
        member.acks.clear()
        member.state = "dead"

    def check_patience(self) -> None:
        """Give up when no member has answered for `patience` seconds."""
        newest = max((m.last_ok for m in self.by_url.values() if not m.removed), default=0.0)
        if time.monotonic() - newest > self.patience:
            raise NoRolloutService(
                f"no rollout service has answered for {self.patience:.0f} s "
                f"({', '.join(self.by_url)}); start one and call session.add_rollout(url)"
            )
