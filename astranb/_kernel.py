"""The Jupyter kernel `astranb run` executes a notebook in: quiet, and stopped cleanly by Ctrl-C.

Quiet: jupyter_client starts kernels on TCP by default, and the kernel warns on every start that
its traffic is not encrypted. On loopback the warning says nothing useful, and IPC transport (unix
sockets, here in a private folder per kernel, readable by its user only) has nothing to warn
about. So kernels use IPC where the platform has unix sockets and their paths fit the length
limit, TCP elsewhere.

Ctrl-C: jupyter_client starts the kernel in a session of its own, so Ctrl-C in the terminal
reaches `astranb run` alone; Python would stop it wherever it is, with the kernel mid-cell and a
traceback from deep inside papermill. `interrupt_on_ctrl_c` turns the first Ctrl-C into what
Jupyter's stop button does (SIGINT to the kernel's process group: the running cell stops) and
stops the notebook before its next cell; the kernel is then shut down as after a failed cell. A
second Ctrl-C stops at once and kills the kernel (whatever it started follows it: see
astranb/lifeline.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Interrupted", "KernelWatch", "interrupt_on_ctrl_c", "ipc_fits", "kernel_manager_class"]

SOCKET_PATH_LIMIT = 100  # bytes of a unix socket path (107 on Linux, 103 on macOS), with room
SOCKET_NAME = len("/astranb-kernel-12345678/kernel-ipc-65535")


class Interrupted(Exception):
    """Ctrl-C stopped the notebook before its next cell."""


def ipc_fits(temp_dir: str | None = None) -> bool:
    """Whether kernels here can use IPC transport: unix sockets exist and their paths, in a
    folder of the temporary directory, fit the limit."""
    if os.name != "posix":
        return False
    folder = tempfile.gettempdir() if temp_dir is None else temp_dir
    return len(os.fsencode(folder)) + SOCKET_NAME <= SOCKET_PATH_LIMIT


@dataclass
class KernelWatch:
    """The kernels one execution started, their socket folders, and whether Ctrl-C was
    pressed."""

    managers: list[Any] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    pressed: int = 0
    last_cell: Any = None
    """The last cell started (a notebook cell node), None before the first."""

    def signal_kernels(self, sig: int) -> None:
        """Send `sig` to each kernel's process group (what the stop button does for SIGINT)."""
        for manager in self.managers:
            group = getattr(manager.provisioner, "pgid", None)  # a local kernel's; else none
            if group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, sig)

    def before_cell(self, cell: Any = None, cell_index: int | None = None, **_: Any) -> None:
        """nbclient's on_cell_start hook: after a Ctrl-C no further cell starts; else notes
        the cell (`last_cell`)."""
        if self.pressed:
            raise Interrupted("Ctrl-C")
        self.last_cell = cell

    def remove_folders(self) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


def kernel_manager_class(watch: KernelWatch) -> type:
    """An AsyncKernelManager class (what papermill uses) whose instances `watch` lists, each
    on IPC where it fits: its connection file and sockets in a folder of its own (made by
    mkdtemp, so two kernels on one machine never share a name), removed by `watch`."""
    from jupyter_client.manager import AsyncKernelManager

    class QuietKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            watch.managers.append(self)
            if ipc_fits():
                folder = tempfile.mkdtemp(prefix="astranb-kernel-")
                watch.folders.append(folder)
                self.transport = "ipc"
                self.connection_file = os.path.join(folder, "kernel.json")
                self.ip = os.path.join(folder, "kernel-ipc")

    return QuietKernelManager


@contextlib.contextmanager
def interrupt_on_ctrl_c(watch: KernelWatch) -> Iterator[None]:
    """While inside: the first Ctrl-C interrupts the kernels (and `watch.before_cell` stops the
    next cell), the second raises KeyboardInterrupt here. Only in the main thread, and not where
    SIGINT is ignored (a job started in the background by a script). On the way out the kernels'
    socket folders are removed."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        try:
            yield
        finally:
            watch.remove_folders()
        return

    def press(signum: int, frame: Any) -> None:
        watch.pressed += 1
        if watch.pressed > 1:
            raise KeyboardInterrupt
        print("\nastranb: Ctrl-C: interrupting the running cell; no further cell runs "
              "(Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        watch.signal_kernels(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, press)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        watch.remove_folders()
