"""The garbage collector's full passes, kept off a training run's hot path.

A notebook's process holds millions of long-lived objects before a run starts (torch,
transformers, pandas, the models' modules). CPython's full collection walks every one of them,
and it runs whenever enough new objects have survived, which episodes by the thousand a second
make happen every second or two: each pass held the GIL ~0.2 s, ~15 % of the wall clock of a
CPU run (bench/vs_trl.py, measured with `gc.callbacks`).

While at least one run is going, everything that existed when the first started sits in the
collector's permanent generation (`gc.freeze`), so full passes walk only what the runs made.
When the last run ends it goes back (`gc.unfreeze`), and cyclic garbage among those objects is
collected as before. Reference counting frees everything else meanwhile, as always.

Only the young generations are collected before freezing, not the whole heap: a full pass
over a long-lived process (a notebook after many runs, a test session) takes seconds, and the
cyclic garbage it would find among old objects is only held until the last run ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

__all__ = ["hold_frozen"]

_lock = threading.Lock()
_holders = 0


def hold_frozen() -> Callable[[], None]:
    """Freeze the heap as it is now (collected first) for the length of a run; returns the
    release function, to call once when the run ends (a second call does nothing)."""
    global _holders
    with _lock:
        if _holders == 0:
            gc.collect(1)  # the young generations only: see the module's docstring
        gc.freeze()  # later runs also move what was made since the first one began
        _holders += 1
    released = False

    def release() -> None:
        global _holders
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()

    return release
