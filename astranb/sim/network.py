"""Network links on the virtual clock: a round trip, then bytes at a fair share of the bandwidth.

Weights reach a rollout region over a link from the trainer (a 4 Gbit/s, 300 ms wide-area link
in AstraFlow's cross-region runs; a datacenter network for the trainer's own region), and the
services of a region reach each other over a fast local network. What a transfer costs is the
question that decides whether rollouts far away are worth having, so the model is kept small
enough to check by hand.

The model. A link has a bandwidth (bits per second) and a round-trip time. A pull of B bytes
that has the link to itself takes

    rtts * rtt + 8 * B / bandwidth

seconds: `rtts` round trips before the bytes flow (1 by default: the request out and the first
byte back; use ~3 to also charge a TCP + TLS handshake and slow start), then the bytes at the
full bandwidth. Pulls that overlap share the bandwidth equally while they overlap (processor
sharing: what TCP flows through one bottleneck settle to): with n pulls moving bytes, each moves
at bandwidth / n, and when one ends the others speed up. Two pulls of B bytes started together
therefore both end at `rtts * rtt + 2 * 8 * B / bandwidth`. Not modelled: packet loss, a
window too small for the bandwidth-delay product, compression on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import anyio

__all__ = ["LinkSpec", "Link", "transfer_seconds"]


def transfer_seconds(nbytes: float, bandwidth: float, rtt: float, rtts: float = 1.0,
                     sharing: int = 1) -> float:
    """Seconds to pull `nbytes` over a link of `bandwidth` bits/s and round trip `rtt` s, with
    `sharing` pulls of the same size started together (the model in the module docstring)."""
    return rtts * rtt + 8.0 * nbytes * sharing / bandwidth


@dataclass(frozen=True)
class LinkSpec:
    """A link's figures (see the module docstring for what a transfer costs)."""

    bandwidth: float
    """Bits per second (4 Gbit/s: 4e9)."""
    rtt: float
    """Round-trip time in seconds (300 ms: 0.3)."""
    rtts: float = 1.0
    """Round trips a pull waits before its bytes flow."""

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be a finite number of bits/s > 0, got "
                             f"{self.bandwidth!r} (4 Gbit/s is 4e9)")
        if not (self.rtt >= 0 and self.rtts >= 0):
            raise ValueError(f"need rtt >= 0 and rtts >= 0 seconds, got rtt={self.rtt!r}, "
                             f"rtts={self.rtts!r} (300 ms is rtt=0.3)")

    def seconds(self, nbytes: float, sharing: int = 1) -> float:
        """A pull of `nbytes`, `sharing` equal pulls started together."""
        return transfer_seconds(nbytes, self.bandwidth, self.rtt, self.rtts, sharing)


@dataclass(eq=False)
class _Flow:
    bits: float
    left: float


@dataclass(eq=False)
class Link:
    """A link in a simulation: concurrent pulls share its bandwidth (call from inside
    `sim.run_virtual`; every pull is one awaiting task, no background task needed).

    Args:
        spec: bandwidth, round-trip time and round trips per pull.
        name: for reports.
    """

    spec: LinkSpec
    name: str = ""
    bytes: float = 0.0
    """Bytes moved so far (pulls finished)."""
    pulls: int = 0
    """Pulls finished so far."""
    busy_seconds: float = 0.0
    """Seconds during which at least one pull was moving bytes."""
    _flows: list[_Flow] = field(default_factory=list, repr=False)
    _stamp: float = field(default=0.0, repr=False)
    _changed: anyio.Event | None = field(default=None, repr=False)

    async def transfer(self, nbytes: float) -> float:
        """Pull `nbytes` over the link; returns the seconds it took."""
        if nbytes < 0:
            raise ValueError(f"cannot transfer {nbytes} bytes")
        start = anyio.current_time()
        await anyio.sleep(self.spec.rtts * self.spec.rtt)
        flow = _Flow(8.0 * nbytes, 8.0 * nbytes)
        self._advance()
        self._flows.append(flow)
        self._notify()
        try:
            while flow.left > 1e-9 * flow.bits + 1e-3:  # a thousandth of a bit: float dust
                rate = self.spec.bandwidth / len(self._flows)
                changed = self._event()
                with anyio.move_on_after(flow.left / rate):
                    await changed.wait()
                self._advance()
        finally:
            self._advance()
            self._flows.remove(flow)
            self._notify()
        self.bytes += nbytes
        self.pulls += 1
        return anyio.current_time() - start

    @property
    def active(self) -> int:
        """Pulls moving bytes now."""
        return len(self._flows)

    def _advance(self) -> None:
        """Move every flow on to now at its fair share since the last change."""
        now = anyio.current_time()
        elapsed = now - self._stamp
        self._stamp = now
        if self._flows and elapsed > 0:
            share = self.spec.bandwidth / len(self._flows) * elapsed
            for f in self._flows:
                f.left = max(0.0, f.left - share)
            self.busy_seconds += elapsed

    def _event(self) -> anyio.Event:
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    def _notify(self) -> None:
        """The number of flows changed: every waiting flow recomputes its end."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None
