"""Processes astranb starts: out of reach of Ctrl-C and of the kernel's stop button, and gone with
the process that started them.

Ctrl-C in a terminal sends SIGINT to every process of the terminal's foreground process group;
Jupyter's stop button sends it to the kernel's whole process group. A child in that group (the
trainer process, a math-verify worker, a local service) would die of an interrupt that only meant
"stop waiting". So every child astranb starts runs in a session, and process group, of its own
(`shielded()`): no terminal and no kernel signals it by its group.

Out of the group it no longer dies with it: a kernel killed by its manager (or by `kill -9`)
leaves it running. So the child watches the process that started it (`follow_parent()`, called
first thing in the child): the parent's pid travels in the environment, a daemon thread checks
every POLL seconds that it is still the child's parent, and once it is not (the child was handed
to init or a subreaper) it sends SIGTERM to the child's process group (the child and whatever it
started there), then SIGKILL after `grace` seconds. Polling, not Linux's PR_SET_PDEATHSIG: that
signal fires when the *thread* that started the child ends (a worker of a thread pool, often),
not the process, and it does not exist elsewhere.

A program that cannot call `follow_parent()` (the SGLang server) is started through this module,
`python -m astranb.lifeline COMMAND...`: it follows its parent and runs COMMAND in its group.

Standard library only: it runs first in every child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["PARENT_ENV", "follow_parent", "shielded"]

PARENT_ENV = "ASTRANB_PARENT_PID"
POLL = 0.2  # seconds between the child's looks at its parent
GRACE = 10.0  # seconds between SIGTERM and SIGKILL once the parent is gone


def shielded(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`subprocess.Popen` keyword arguments that start a child in a session of its own and tell it
    which process to follow (see `follow_parent`).

    Args:
        env: the child's environment (default: this process's).

    Returns:
        {"start_new_session": True, "env": env plus ASTRANB_PARENT_PID}.
    """
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(os.getpid())
    return {"start_new_session": True, "env": child_env}


def follow_parent(grace: float = GRACE) -> bool:
    """In a child started with `shielded()`: end this process group once the parent is gone.

    Takes ASTRANB_PARENT_PID out of the environment (what this process starts follows it, not
    its grandparent). Does nothing when the variable is absent (started by hand).

    Args:
        grace: seconds between SIGTERM and SIGKILL to the group.

    Returns:
        Whether a parent is followed.
    """
    text = os.environ.pop(PARENT_ENV, "")
    if not text.isdigit():
        return False
    parent = int(text)
    threading.Thread(target=_watch, args=(parent, grace), name="astranb-follow-parent",
                     daemon=True).start()
    return True


def _watch(parent: int, grace: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    print(f"astranb: the process that started this one ({parent}) is gone; stopping",
          file=sys.stderr, flush=True)
    _signal_group(signal.SIGTERM)
    time.sleep(grace)
    _signal_group(signal.SIGKILL)


def _signal_group(sig: int) -> None:
    """Signal this process's group when it leads one (it was started with `shielded()`), else
    only this process."""
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)
    except ProcessLookupError:
        pass


def _run(command: list[str]) -> int:
    """Run COMMAND in this process's group until it ends; follow the parent meanwhile.

    SIGTERM and SIGINT to the group reach COMMAND too; this process waits for it to end (a
    handler, not SIG_IGN, so COMMAND does not inherit the disposition) and exits with its status.
    """
    follow_parent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    return _exit_status(subprocess.Popen(command).wait())  # wait() retries after a handler


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python lifeline.py COMMAND [ARG...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_run(sys.argv[1:]))
