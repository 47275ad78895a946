"""Waiting in tests: poll a condition up to a generous deadline instead of sleeping a guessed
time, so a test is as fast as the thing it waits for and fails with what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.02) -> T:
    """Return `predicate()`'s first truthy value; fail the test after `timeout` seconds, saying
    `what` was awaited (a text, or a callable giving one: for state worth showing then)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float,
                           what: str | Callable[[], str], interval: float = 0.005) -> T:
    """`wait_until` inside an event loop: the loop keeps running while it waits."""
    deadline = anyio.current_time() + timeout
    while not (value := predicate()):
        if anyio.current_time() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        await anyio.sleep(interval)
    return value
