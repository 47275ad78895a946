"""A Session's run context: the state its runs share, in one object the run layer receives.

`Session` is the front users call: it checks their arguments, builds policies, and hands this
context to the modules that do the work: `launch.start` (a run on the loop), `heldout` (what
`evaluate` plays), `restore.resume` (a run brought back) and `Wiring` (the wiring's live view).
None of them sees the Session, so none reaches into it, and nothing here imports it.

    session.context.loop()          # the event loop's portal, started on first use
    session.context.call(fn, *a)    # run a coroutine function (or a function) on it, wait
    session.context.runs[-1].done   # the runs it started, oldest first
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, overload

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..errors import SessionClosed
from .folder import FolderLock

if TYPE_CHECKING:
    from ..dataflow.flow import Dataflow
    from ..environments.base import Environment
    from ..remote.client import TrainerClient
    from ..remote.pool import RolloutPool
    from .policy import Policy
    from .run import Run

__all__ = ["RunContext"]

T = TypeVar("T")
Args = TypeVarTuple("Args")


class RunContext:
    """Everything a Session's runs share: its loop, folder, policies, wiring and runs.

    One Session makes one context and holds it for its life (`session.context`); closing the
    Session closes it. The Session fills it (policies and their recipes, the wiring, the pool
    and the trainer client); the run layer reads it and adds to it (`launch` appends each run
    and sets `flow`). Nothing here checks a user's arguments: the Session did.

    Owned, and closed by `close()`, in this order: the runs (stopped), the rollout pool and the
    trainer client (closed on the loop), the ExitStack (engines, child trainers, contexts
    entered on the loop, then the loop itself) and the folder's lock.

    Args:
        directory: the Session's folder; created, then locked (`folder.FolderLock`).
    """

    def __init__(self, directory: Path):
        self.directory = directory
        """The Session's folder: its runs are folders run-NNN inside it."""
        self.closed = False
        """Whether `close()` was called; `check_open` then raises SessionClosed."""
        # the warning for an earlier Session on the folder names the line that made this one
        self.lock = FolderLock(directory, self, stacklevel=4)
        """The folder's lock (`<folder>/session.lock`), released by `close()`."""
        self.policies: dict[str, Policy] = {}
        """Name -> policy, in creation order (`Session.policies` is this dict)."""
        self.recipes: dict[str, dict[str, Any]] = {}
        """Name -> the options `Session.policy` took besides the model (for plan.json)."""
        self.wiring: list[tuple[Environment, dict[str, Policy], float]] = []
        """(environment, role -> policy, weight) per wired environment (`wire` replaces)."""
        self.runs: list[Run] = []
        """The runs started on this context, oldest first (`launch.start` appends)."""
        self.flow: Dataflow | None = None
        """The newest run's Dataflow (set by `launch`; read by its accounting, checkpoints)."""
        self.pool: RolloutPool | None = None
        """The rollout services, when episodes are played there (None: in this process)."""
        self.trainer: TrainerClient | None = None
        """The trainer service's client, when policies train there."""
        self.stack = ExitStack()
        """What `close()` unwinds: engines, child trainers, the loop and what was entered on
        it after the loop (those first, while the loop still runs)."""
        self._portal: BlockingPortal | None = None

    @property
    def portal(self) -> BlockingPortal | None:
        """The loop's portal if it was started (never starts it: see `loop`)."""
        return self._portal

    def loop(self) -> BlockingPortal:
        """The portal of the event loop every run executes in, started on first use in a
        background thread.

        Raises:
            SessionClosed: the context was closed.
        """
        if self._portal is None:
            self.check_open()
            from .._loopthread import track

            self._portal = self.stack.enter_context(start_blocking_portal("asyncio"))
            # a script that ends without close() must not hang at exit: the loop is stopped
            # during threading shutdown, before threads are joined (see _loopthread)
            track(self)
        return self._portal

    @overload
    def call(self, fn: Callable[[*Args], Awaitable[T]], *args: *Args) -> T: ...

    @overload
    def call(self, fn: Callable[[*Args], T], *args: *Args) -> T: ...

    def call(self, fn: Callable[[*Args], Any], *args: *Args) -> Any:
        """Run `fn(*args)` on the loop (awaited when it is a coroutine function) and return
        its result; from any thread but the loop's."""
        return self.loop().call(fn, *args)

    def check_open(self) -> None:
        """Raise SessionClosed once `close()` was called."""
        if self.closed:
            raise SessionClosed(self.directory)

    def wire(self, env: Environment, roles: dict[str, Policy], weight: float) -> None:
        """Wire `env` (its earlier wiring replaced, moved to the end); checked by the caller."""
        self.wiring[:] = [(e, w, x) for e, w, x in self.wiring if e is not env]
        self.wiring.append((env, roles, weight))

    def close(self) -> None:
        """Stop the runs, close the pool and trainer client, the stack (engines, the loop) and
        release the folder. Idempotent."""
        from .._loopthread import untrack

        untrack(self)
        self.closed = True
        try:
            for run in self.runs:
                run.stop()
            if self._portal is not None:
                # A run whose task had not started yet when stop() came had no cancel scope to
                # cancel (train() then exit at once): stop it again until it has ended, so the
                # portal's exit does not wait for it to train to the end.
                while pending := [run for run in self.runs if not run.done]:
                    time.sleep(0.02)
                    for run in pending:
                        run.stop()
                if self.pool is not None:
                    self._portal.call(self.pool.close)
                if self.trainer is not None:
                    self._portal.call(self.trainer.close)
        finally:
            # the portal stops with the stack: what was entered after it (contexts wrapped by
            # the portal) unwinds first, while the loop still runs
            self.stack.close()
            self._portal = None
            self.lock.release()
