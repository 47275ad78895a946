"""What a relay keeps so the other rollout services of its region can pull from it.

In a region far from the trainer, one service (the relay) pulls each version over the slow link;
the others pull the same bytes from it over the region's own network:

    trainer ==(one pull per version, across the link)==> relay --> service
                                                            +----> service

A relay answers exactly as the trainer's store would (astranb.weights.store): the delta it
received, to a receiver holding that delta's base (version and checksum); otherwise a full
snapshot of its version, either the one it received or one encoded from the weights it holds
(the same bits, so the same checksum). It never serves a version other than the one asked for:
a receiver that wants version v from a relay still at v-1 is told so and goes to the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .codec import Header, encode_full

__all__ = ["NotHeld", "RelayCache"]


class NotHeld(LookupError):
    """The relay does not hold the version asked for (the receiver pulls from the trainer)."""


class RelayCache:
    """The payloads of the latest version one policy's relay received (not thread-safe: the
    rollout service calls it under the policy's lock)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.checksum: int | None = None
        self._delta: bytes | bytearray | None = None
        self._delta_header: Header | None = None
        self._full: bytes | bytearray | None = None
        self.served = {"delta": 0, "full": 0, "bytes": 0}

    def received(self, payload: bytes | bytearray, header: Header) -> None:
        """Keep a payload the relay has just applied (verified by the engine)."""
        self.version, self.checksum = header.version, header.checksum
        if header.kind == "delta":
            self._delta, self._delta_header, self._full = payload, header, None
        else:
            self._delta, self._delta_header, self._full = None, None, payload

    def holds(self, version: int, checksum: int | None) -> None:
        """The relay is at `version` without a payload to pass on (it became the relay after
        pulling it): every receiver gets a full snapshot encoded from its weights."""
        self.forget()
        self.version, self.checksum = version, checksum

    def forget(self) -> None:
        """Drop everything (the service stopped relaying, or its weights changed otherwise)."""
        self.version = self.checksum = None
        self._delta = self._delta_header = self._full = None

    def serve(
        self,
        version: int,
        have_version: int | None,
        have_checksum: int | None,
        held: Callable[[], Mapping[str, torch.Tensor] | None],
        policy: str,
    ) -> bytes | bytearray:
        """The payload that brings a receiver holding (have_version, have_checksum) to `version`.

        Args:
            held: the weights the relay holds now (to encode a full snapshot when it received
                only a delta); None when it has none.

        Raises:
            NotHeld: the relay is not at `version` (or cannot produce a full snapshot of it).
        """
        if self.version != version:
            raise NotHeld(f"this relay holds version {self.version} of {policy!r}, not {version}")
        header = self._delta_header
        if (self._delta is not None and header is not None
                and (have_version, have_checksum) == (header.base_version, header.base_checksum)):
            return self._count("delta", self._delta)
        if self._full is None:
            tensors = held()
            if tensors is None:
                raise NotHeld(f"this relay holds no weights of {policy!r} to send in full")
            self._full = encode_full(tensors, policy=policy, version=version)
        return self._count("full", self._full)

    def _count(self, kind: str, payload: bytes | bytearray) -> bytes | bytearray:
        self.served[kind] += 1
        self.served["bytes"] += len(payload)
        return payload
