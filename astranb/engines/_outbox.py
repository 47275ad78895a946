"""Answers from an engine's worker thread to the asyncio loops that await them, handed over once
per decode step (one `call_soon_threadsafe` per loop, not one per request).

    outbox = Outbox()                            # the worker's
    handle = LoopFuture(asyncio_future, outbox)  # the request's future, as the worker sees it
    handle.set_result(generation)                # worker thread: collected
    outbox.flush()                               # end of the step: resolved on each loop
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Outbox", "LoopFuture"]


class Outbox:
    """Answers for requests awaited on event loops, handed over once per decode step.

    Worker thread only: `post` collects (future, result, error) per loop; `flush` schedules one
    callback per loop that resolves them all on that loop's thread.
    """

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any,
             exc: BaseException | None) -> None:
        self._by_loop.setdefault(loop, []).append((future, result, exc))

    def flush(self) -> None:
        if not self._by_loop:
            return
        by_loop, self._by_loop = self._by_loop, {}
        for loop, answers in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, answers)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _resolve(answers: list[tuple]) -> None:
    """On the loop's thread: resolve each future unless its task was cancelled meanwhile."""
    for future, result, exc in answers:
        if future.done():
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


class LoopFuture:
    """Worker-side handle of a request awaited on an event loop: the `Future` methods the worker
    uses (`cancelled`, `set_result`, `set_exception`), answered through an `Outbox`."""

    __slots__ = ("future", "loop", "outbox")

    def __init__(self, future: asyncio.Future, outbox: Outbox) -> None:
        self.future, self.loop, self.outbox = future, future.get_loop(), outbox

    def cancelled(self) -> bool:
        return self.future.cancelled()

    def set_result(self, result: Any) -> None:
        self.outbox.post(self.loop, self.future, result, None)

    def set_exception(self, exc: BaseException) -> None:
        self.outbox.post(self.loop, self.future, None, exc)
