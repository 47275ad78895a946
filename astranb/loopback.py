"""Whether an address is this machine's own: services listen beyond it only with a token, and an
episode's OpenAI endpoint answers nothing else."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """True for "localhost" and any loopback IP address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
