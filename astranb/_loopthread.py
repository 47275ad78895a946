"""Stop the background loops of Sessions a script never closed, before the interpreter exits.

A Session runs its event loop in a thread of anyio's blocking portal. A script that trains,
waits and ends without `session.close()` used to hang at exit (or abort with "terminate called
without an active exception"):

* current anyio (4.16 here) runs the portal in a *daemon* thread (its AnyIO worker threads
  inherit that), so nothing joins it; the interpreter goes on to finalize with the loop still
  serving. When the Session's ExitStack is then garbage-collected, the `finally` of the
  `start_blocking_portal` generator calls `portal.call(portal.stop)` and waits for a loop thread
  that finalization has frozen for good (daemon threads never get the GIL back): a hang. A daemon
  thread still inside torch's C++ frames (an engine decoding, a train step) is unwound by
  pthread_exit when it asks for the GIL, through a noexcept destructor: std::terminate, SIGABRT.
* older anyio releases ran it in a ThreadPoolExecutor worker, which concurrent.futures joins at
  shutdown: a hang there, before finalization.

Why `threading._register_atexit` (and not `atexit`, `weakref.finalize`, or a daemon thread of our
own): `atexit` handlers run only after `threading._shutdown()` has joined non-daemon threads,
too late for the executor case; a daemon loop thread of our own is what anyio does today and is
exactly what hangs/aborts above, since a frozen daemon loop can no longer stop engines or finish
cleanup. Hooks registered with `threading._register_atexit` run at the start of
`threading._shutdown()`, while every thread still runs, before any thread is joined, in reverse
order of registration. concurrent.futures registers its own joining hook (`_python_exit`) when
`concurrent.futures.thread` is first imported; we import it here, before registering, so ours is
always the later registration and therefore runs first: the loops are stopped (runs cancelled,
engines and clients closed, portal stopped and its thread joined) while they can still be.

Sessions are held weakly: one that was garbage-collected is not kept alive by this registry, and
one that was closed explicitly is removed from it (`Session.close` is idempotent anyway).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its joining hook first (see above)
import os
import sys
import threading
import traceback
import weakref
from typing import Any

__all__ = ["track", "untrack"]

_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.Lock()
_registered = False


def track(session: Any) -> None:
    """Close `session` at interpreter shutdown unless it is closed (or collected) before."""
    global _registered
    with _lock:
        if not _registered:
            _registered = True
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is not None:
                    register(_close_all)
                else:  # an interpreter without the private hook: better late than never
                    atexit.register(_close_all)
            except RuntimeError:  # "can't register atexit after shutdown": nothing to do then
                pass
        _live[id(session)] = session


def untrack(session: Any) -> None:
    with _lock:
        if _live.get(id(session)) is session:
            del _live[id(session)]


def _close_all() -> None:
    """Close every Session still open, newest first (runs during threading shutdown)."""
    with _lock:
        sessions = list(_live.values())
        _live.clear()
    for session in reversed(sessions):
        try:
            session.close()
        except Exception:  # noqa: BLE001 - one failing close must not keep the others open
            print(f"astranb: closing {type(session).__name__} at exit failed:", file=sys.stderr)
            traceback.print_exc()


def _forget_in_child() -> None:
    # a forked child has no loop threads: it must not wait on its parent's portals at its exit
    global _lock
    _lock = threading.Lock()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
