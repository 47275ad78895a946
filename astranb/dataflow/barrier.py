"""Barrier coordination: the policies of a run advance their versions together.

In `mode="independent"` each policy steps as soon as its own batch is ready, so a fast policy
can run many versions ahead of a slow one. In `mode="barrier"` (AstraFlow's behaviour) a policy
starts its step v only once every policy has published version v, so versions never differ by
more than one. Staleness bounds hold per policy in both modes (the gate and the buffer do that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import anyio

__all__ = ["VersionBarrier"]


class _Versioned(Protocol):
    """Anything with a current weight version (a policy)."""

    @property
    def version(self) -> int: ...


class VersionBarrier:
    """Holds a policy's next step until every policy has caught up with it.

    Args:
        policies: name -> object with a `version` attribute (the run's policies).
    """

    def __init__(self, policies: Mapping[str, _Versioned]):
        self.policies = dict(policies)
        self._changed = anyio.Event()

    def slowest(self) -> int:
        return min(p.version for p in self.policies.values())

    async def wait(self, version: int) -> None:
        """Return once every policy's version is at least `version`."""
        while self.slowest() < version:
            await self._changed.wait()

    def advanced(self) -> None:
        """A policy published a new version."""
        self._changed.set()
        self._changed = anyio.Event()
