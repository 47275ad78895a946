"""Ties one `astranb serve` process (and everything it starts) to the Ray actor that launched it.

Run by path, never imported (`python _keeper.py ACTOR_PID COMMAND...`), so it loads nothing but
the standard library. ray_launch's supervisor actor starts it in a new process group; it starts
COMMAND in that same group and waits.

Why a separate process: when Ray kills the actor (`ray.kill`, a crashed node agent, the driver
going away), the service must go too, or it keeps its port and the restarted actor cannot take the
URL back. Ray may SIGKILL the actor's direct children along with it, so the keeper forks a
*sentinel* first, in the same group: it waits for the keeper to go, however it goes, and then kills
the whole process group, which also holds torchrun for `astranb serve trainer --nproc N` (the
ranks run in sessions of their own and exit when torchrun dies). On Linux the kernel also sends
the keeper SIGTERM the moment the actor dies (PR_SET_PDEATHSIG), for the cases where Ray leaves
the keeper alone. SIGTERM, from the kernel or from the actor's clean shutdown, stops the service:
SIGTERM to it, SIGKILL to the group after GRACE seconds. When the service exits, the keeper exits
with its status (the actor sees it) and the sentinel ends the rest of the group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE = 10.0  # seconds the service gets to shut down after SIGTERM
POLL = 0.2  # seconds between the sentinel's looks at the keeper
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the sentinel still cleans up
        pass


def _sentinel(keeper: int) -> None:
    """In a forked child: once the keeper is gone (reparented), kill the whole group."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == keeper:
        time.sleep(POLL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    _die_with_parent()
    if os.getppid() != parent:  # the actor died before the death signal was armed
        return 1
    keeper = os.getpid()
    if os.fork() == 0:  # this process is single-threaded: forking is safe
        _sentinel(keeper)
        os._exit(0)
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    child = subprocess.Popen(command)  # same process group as the keeper
    deadline = None
    while child.poll() is None:
        if stopping and deadline is None:
            child.terminate()
            deadline = time.monotonic() + GRACE
        if deadline is not None and time.monotonic() > deadline:
            print("astranb keeper: service still running after SIGTERM; killing its process "
                  "group", file=sys.stderr, flush=True)
            os.killpg(os.getpgrp(), signal.SIGKILL)  # this keeper too
        time.sleep(0.1)
    code = child.returncode
    print(f"astranb keeper: service {'stopped' if stopping else 'exited'} with status {code}",
          file=sys.stderr, flush=True)
    # the sentinel sees this keeper go and kills what is left of the group (torchrun)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
