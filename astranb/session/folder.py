"""A Session's folder: created if missing, and locked so that one live Session writes it.

A Session writes `<folder>/session.lock` (pid, host, time) and removes it on close. A
second Session on the same folder while the owner lives is refused, with the owner named. A lock
whose process is gone (kill -9, a dead kernel) is taken over. Within one process, an earlier
Session on the folder that runs nothing is closed first, with a warning naming the folder (a
notebook cell run again); using it afterwards raises `SessionClosed`. One that is still
training is an error. A folder that cannot be written is `FolderNotWritable`; releasing the lock
never raises (a lock left behind is taken over by the next Session, its owner being gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import AstranbError, FolderNotWritable
from .report import pid_alive

__all__ = ["FolderLock", "FolderLocked"]


class FolderLocked(AstranbError, RuntimeError):
    """Another live Session writes to this folder."""


_holders: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""Lock path -> the owner in this process that holds it (a Session's run context)."""


class FolderLock:
    """`<folder>/session.lock`, the folder created first: one live Session per folder (see the
    module docstring).

    Args:
        directory: the folder (created if missing).
        owner: what holds the folder in this process (a Session's run context): its `runs`
            and `close()` are used when another owner asks for the folder.
        stacklevel: of the warning that closes an earlier owner, so that it names the line
            that opened the new Session.
    """

    def __init__(self, directory: Path, owner: Any, *, stacklevel: int = 3):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FolderNotWritable(directory, error) from None
        self.path = directory / "session.lock"
        key = str(self.path.resolve())
        earlier = _holders.get(key)
        if earlier is not None and earlier is not owner:
            if any(not run.done for run in earlier.runs):
                raise FolderLocked(
                    f"another Session of this process trains in {directory} right now; stop "
                    "it first (run.stop(), then session.close()), or use another folder")
            warnings.warn(
                f"another Session of this process had {directory} open and ran nothing; it is "
                "closed now, since one Session writes a folder (using it raises SessionClosed). "
                "Close a Session you are done with (session.close()), or give each its own "
                "folder", RuntimeWarning, stacklevel=stacklevel)
            earlier.close()  # a notebook cell run again: the old Session is done with
        self._take(directory)
        _holders[key] = owner
        self._key = key
        self._owner = weakref.ref(owner)

    def _take(self, directory: Path) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read_owner(self.path)
                if owner is not None and _alive(owner):
                    since = time.strftime("%Y-%m-%d %H:%M:%S",
                                          time.localtime(owner.get("since", 0)))
                    raise FolderLocked(
                        f"{directory} is in use by a Session of pid {owner.get('pid')} on host "
                        f"{owner.get('host')} (since {since}); close it there "
                        "(session.close()) or use another folder. If that process is gone, "
                        f"delete {self.path}") from None
                self._remove()  # its owner is gone: take it over
                continue
            except OSError as error:  # a read-only folder, no permission
                raise FolderNotWritable(directory, error) from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except OSError as error:  # a full disk
                raise FolderNotWritable(directory, error) from None
            return
        raise FolderLocked(f"could not take {self.path}: another process keeps creating it")

    def release(self) -> None:
        """Remove the lock if this process holds it; never raises (a lock that cannot be removed,
        on a folder gone read-only, is taken over later: its owner will be gone)."""
        owner = _read_owner(self.path)
        if owner is not None and owner.get("pid") == os.getpid() and \
                owner.get("host") == socket.gethostname():
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
        if _holders.get(self._key) is self._owner():
            _holders.pop(self._key, None)

    def _remove(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            raise FolderNotWritable(self.path.parent, error) from None


def _read_owner(path: Path) -> dict[str, Any] | None:
    try:
        owner: dict[str, Any] | None = json.loads(path.read_text())
        return owner
    except (OSError, ValueError):
        return None


def _alive(owner: Mapping[str, Any]) -> bool:
    """Whether the lock's owner may still be running (another host's process: assume so)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return False  # this process took it in a Session that is gone (collected)
    alive = pid_alive(pid)
    if alive is None:  # cannot be asked here: assume the owner still runs
        return True
    return alive and not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"
