"""Running untrusted programs and their tests: one subprocess per job, contained, off the loop.

    sandbox = Sandbox(Limits(wall_seconds=5), concurrency=4)
    result = await sandbox.run(program, tests=["assert add(1, 2) == 3"])
    result.passed, result.total, result.fraction, result.error

Each job (`Sandbox.launch`; `run` launches the program as a server of its functions, see
harness.py) is one `python -I` process in a fresh directory holding only the files it was
given, started in a session of its own (the kernel's or a terminal's SIGINT never reaches it)
from a thread that lives as long as this process (so it dies with this process). The layers,
outermost first; `Result.isolation` names the ones a job had:

  - bubblewrap ("tool": "bubblewrap"), where `bwrap` is installed: a private mount namespace
    with read-only /usr, /lib*, /bin and the interpreter's folders (every site-packages and
    dist-packages folder in them emptied: a package may ship a benchmark's answers; jobs need
    only the standard library), a few /etc files, the job's directory as its only writable
    host folder, a private /tmp and /dev/shm (size-bounded, gone with the job), its own /proc
    of a new PID namespace (no other process to see or signal; when the job's first process
    dies, every process in it dies), no network (an empty network namespace), no
    capabilities, no nested user namespace, dead with its parent. The host's home folders,
    /tmp, /dev/shm, sockets and other processes do not exist in there.
  - a uid of its own ("user": "separate"), when this process runs as root: one per live job,
    held machine-wide through a lock file under /run/astranb (two Sandboxes, in one process or
    two, never share one; a dead holder's leftovers are killed when the uid is next taken).
    The kernel's permissions keep the job out of every file it does not own and away from every
    other process; after the job every process of that uid is killed and whatever it left in
    /tmp, /var/tmp or /dev/shm removed.
  - its directory on a tmpfs of its own ("disk": "tmpfs", as root): `disk_bytes` and
    `max_files` bound what it can write; unmounted after the job. Without root, under
    bubblewrap, a tmpfs bwrap makes with copies of its files ("tmpfs (bytes only)").
  - its memory, all processes together ("memory"): a cgroup of its own (v2's memory.max, else
    v1's memory.limit_in_bytes) where this process may make one, else a watcher that sums the
    resident memory of the job's processes every 20 ms and kills the job past the bound.
  - resource limits set before any of its code runs: CPU seconds, address space, file size,
    processes, open files, no core dumps; the wall clock kills the whole job past
    `wall_seconds`.
  - without bubblewrap, user, network and PID namespaces where the kernel lets an unprivileged
    process make them ("network"/"pid": "namespace");
  - an audit hook (PEP 578) in the job's interpreter: no socket connect, bind or send, no signal
    to other processes, no write, link, rename, mkdir or symlink outside its directory nor
    through a descriptor of another folder, no program started through os or subprocess, no
    ctypes (the C library would step around the hook).

Without bubblewrap (not installed, or ASTRANB_SANDBOX_NO_BWRAP=1, or `bubblewrap=False`) a
warning says so once: the job then sees the host's files, folders and process list (it can read
what is world-readable), and a program that reaches the interpreter's internals (e.g.
`_posixsubprocess`) can start programs the hook does not see; the uid, tmpfs, memory group and
sweep still keep their effects off the host as root. Without root there is no uid or tmpfs of
the job's own (the memory watcher still holds): use bubblewrap, a container or a dedicated user
for models you do not trust.

Jobs wait for a free slot (`concurrency`, default the number of cores) in a worker thread, so a
slow or hostile program never stalls the event loop's other episodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import anyio

from . import _contain

__all__ = ["Job", "Limits", "Result", "Sandbox", "SandboxError"]

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "_jail.py"), encoding="utf-8") as _f:
    _JAIL_SOURCE = _f.read()
"""The in-job layers, passed on the job's command line (see _jail.py)."""
UID_BASE = _contain.UID_BASE
_COUNTER = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox cannot run jobs at all (a setup problem, not a program's fault)."""


@dataclass(frozen=True)
class Limits:
    """What one job may use."""

    wall_seconds: float = 10.0
    """Real time before the job's whole process group is killed."""
    cpu_seconds: float = 5.0
    """CPU time of each process (RLIMIT_CPU)."""
    memory_bytes: int = 512 << 20
    """Address space of each process (RLIMIT_AS)."""
    file_bytes: int = 1 << 20
    """Largest file a process may write (RLIMIT_FSIZE)."""
    processes: int = 32
    """Processes the job's user may have (RLIMIT_NPROC)."""
    open_files: int = 64
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    output_bytes: int = 16 << 10
    """Stdout and stderr kept (each); the rest is dropped."""
    job_memory_bytes: int = 1 << 30
    """Memory of all the job's processes together (a memory cgroup, else a watcher)."""
    disk_bytes: int = 16 << 20
    """Bytes the job's directory may hold (as root: its own tmpfs); under bubblewrap also the
    size of its private /tmp and /dev/shm."""
    max_files: int = 1024
    """Files and folders the job's directory may hold (as root: the tmpfs's inodes)."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "file_bytes", "processes",
                     "open_files", "output_bytes", "job_memory_bytes", "disk_bytes",
                     "max_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Result:
    """What running a program and its tests came to."""

    passed: int
    """Tests the judge passed (count="asserts": asserts that held every time they ran)."""
    total: int
    """Tests given (count="asserts": their asserts that can fail)."""
    error: str | None = None
    """Why the job did not pass every test: the program's or a test's exception, an answer that
    is not plain data, a timeout, a limit, a crash. None when all passed."""
    timed_out: bool = False
    """The wall clock ran out and the job was killed."""
    exit_code: int | None = None
    """The job's exit code (negative: the signal that ended it)."""
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)
    """Which layers the job had: network "namespace" or "audit", pid "namespace" or "group",
    user "separate" or "same"."""

    @property
    def fraction(self) -> float:
        """passed / total (0 when there are no tests)."""
        return self.passed / self.total if self.total else 0.0


class Job:
    """One running job (from `Sandbox.launch`): its process, directory and layers.

    `stdin`, `stdout`, `stderr` are the pipes asked for (or None); `isolation` names the layers
    it has (as in `Result.isolation`); `timed_out` turns True when the wall clock killed it;
    `memory_exceeded` when its memory bound did."""

    def __init__(self) -> None:
        self.pid = -1
        self.directory = ""
        self.isolation: dict[str, str] = {}
        self.timed_out = False
        self.stdin: IO[bytes] | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self._proc: subprocess.Popen | None = None
        self._lease: _contain.UidLease | None = None
        self._memory: _contain.MemoryGroup | None = None
        self._timer: threading.Timer | None = None
        self._members: list[int] = []
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def _start(cls, sandbox: Sandbox, files: dict[str, bytes | str], argv: list[str],
               limits: Limits, pass_fds: tuple[int, ...], stdin: Any, stdout: Any,
               stderr: Any) -> Job:
        if not argv or argv[0] not in files:
            raise ValueError(f"argv[0] must name one of the job's files {sorted(files)}, "
                             f"got {argv[:1]}")
        job = cls()
        try:
            job._setup(sandbox, files, limits)
            job._spawn(sandbox, argv, limits, pass_fds, stdin, stdout, stderr)
        except BaseException:
            job.close()
            raise
        return job

    def _setup(self, sandbox: Sandbox, files: dict[str, bytes | str], limits: Limits) -> None:
        uid = None
        if sandbox._root:
            self._lease = _contain.UidLease.take()
            uid = self._lease.uid
        self.directory, disk = _contain.make_job_dir(uid, limits.disk_bytes, limits.max_files)
        for name, content in files.items():
            if os.sep in name or name in ("", ".", ".."):
                raise ValueError(f"job file names are plain names, got {name!r}")
            data = content.encode() if isinstance(content, str) else content
            path = os.path.join(self.directory, name)
            with open(path, "wb") as f:
                f.write(data)
            if uid is not None:
                os.chown(path, uid, uid)
        name = _contain.group_name(uid) if uid is not None else \
            f"{_contain.GROUP_PREFIX}p{os.getpid()}-{next(_COUNTER)}"
        self._memory = _contain.MemoryGroup(name, limits.job_memory_bytes, self.kill)
        self.isolation = {"tool": "bubblewrap" if sandbox._bwrap else "none",
                          "user": "separate" if uid is not None else "same",
                          "memory": self._memory.kind, "disk": disk}

    def _spawn(self, sandbox: Sandbox, argv: list[str], limits: Limits,
               pass_fds: tuple[int, ...], stdin: Any, stdout: Any, stderr: Any) -> None:
        uid = self._lease.uid if self._lease else None
        status_r, status_w = os.pipe()
        go_r, go_w = os.pipe()
        command, copy_in = self._command(sandbox, argv, limits, status_w, go_r)
        env = {"PATH": os.defpath, "HOME": self.directory, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        try:
            self._proc = _contain.popen(
                command, cwd=self.directory, env=env, stdin=stdin, stdout=stdout,
                stderr=stderr, pass_fds=(status_w, go_r, *pass_fds, *(copy_in or {}).values()),
                start_new_session=True, user=uid, group=uid,
                extra_groups=[] if uid is not None else None)
        finally:
            for fd in (status_w, go_r, *(copy_in or {}).values()):
                os.close(fd)
        self.pid = self._proc.pid
        self.stdin, self.stdout, self.stderr = self._proc.stdin, self._proc.stdout, \
            self._proc.stderr
        self._timer = threading.Timer(limits.wall_seconds, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()
        try:
            self.isolation.update(_read_status(status_r, limits.wall_seconds))
            assert self._memory is not None
            pid = self.pid
            self._memory.admit((lambda: _contain.processes_of(uid)) if uid is not None
                               else (lambda: _contain.family(pid)))
            with contextlib.suppress(OSError):
                os.write(go_w, b"1")
        finally:
            os.close(status_r)
            os.close(go_w)
        if sandbox._bwrap:
            self.isolation.update(network="namespace", pid="namespace", mounts="bubblewrap")
        else:
            self.isolation.setdefault("network", "audit")
            self.isolation.setdefault("pid", "group")
            self.isolation["mounts"] = "host"
        self.isolation["audit"] = "hook" if sandbox._audit_hook else "none"

    def _command(self, sandbox: Sandbox, argv: list[str], limits: Limits, status_fd: int,
                 go_fd: int) -> tuple[list[str], dict[str, int] | None]:
        """The jail's command line, inside bwrap's where there is bubblewrap; and the files
        bwrap copies into a tmpfs of its own where this process could not mount one."""
        config = {"parent": 0 if sandbox._bwrap else os.getpid(), "status_fd": status_fd,
                  "go_fd": go_fd, "namespaces": sandbox._bwrap is not None,
                  "limits": dataclasses.asdict(limits), "audit": sandbox._audit_hook}
        command = [sandbox.python, "-I", "-c", _JAIL_SOURCE, json.dumps(config), *argv]
        if not sandbox._bwrap:
            return command, None
        copy_in = None
        if self.isolation["disk"] != "tmpfs":
            copy_in = {name: os.open(os.path.join(self.directory, name), os.O_RDONLY)
                       for name in os.listdir(self.directory)}
            self.isolation["disk"] = "tmpfs (bytes only)"
        uid = self._lease.uid if self._lease else os.getuid()
        return _contain.bwrap_argv(sandbox._bwrap, self.directory, uid, sandbox._roots,
                                   limits.disk_bytes, copy_in) + command, copy_in

    @property
    def returncode(self) -> int | None:
        """The exit code once the job ended (negative: the signal that ended it)."""
        return self._proc.returncode if self._proc else None

    @property
    def memory_exceeded(self) -> bool:
        return bool(self._memory and self._memory.over())

    def wait(self, timeout: float | None = None) -> int | None:
        """Waits for the job's first process to end (at most `timeout` seconds; the wall clock
        ends it anyway) and gives its exit code, or None while it still runs."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL every process of the job (it may be waited for afterwards)."""
        if self._proc is None:
            return
        if self._lease is None:  # without a uid of its own: its descendants, found first
            self._members = _contain.family(self._proc.pid)
        _contain.kill_group(self._proc.pid)
        if self._lease is not None:
            _contain.kill_user(self._lease.uid)
        else:
            _contain.kill_pids(self._members)

    def close(self) -> None:
        """Kills the job, removes its directory, frees its uid and memory group. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.kill()
        if self._proc is not None:
            self._proc.wait()
            _contain.wait_gone(self._members)
            for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._lease is not None:
            _contain.sweep_shared(self._lease.uid)
        if self.directory:
            _contain.remove_job_dir(self.directory)
        if self._memory is not None:
            self._memory.close()
        if self._lease is not None:
            self._lease.release()

    def _out_of_time(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.timed_out = True
            self.kill()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_status(fd: int, wall: float) -> dict[str, str]:
    """The jail's one status line (its layers), or {} when it died before saying it."""
    data = b""
    deadline = time.monotonic() + wall
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {}
        chunk = os.read(fd, 4096)
        if not chunk:
            return {}
        data += chunk
    try:
        layers = json.loads(data)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in layers.items()} if isinstance(layers, dict) else {}


def _without_bwrap_because(asked: bool, failed: str) -> str:
    if not asked:
        return "Sandbox(bubblewrap=False) was asked for"
    if os.environ.get("ASTRANB_SANDBOX_NO_BWRAP", "") not in ("", "0"):
        return "ASTRANB_SANDBOX_NO_BWRAP is set"
    if shutil.which("bwrap") is None:
        return ("bubblewrap is not installed (apt install bubblewrap, or `make setup` as root "
                "installs it)")
    return (f"bwrap is installed but could not start a job here ({failed}); unprivileged user "
            "namespaces may be off (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0) or the interpreter's folders unreadable by the "
            "job's user")


class Sandbox:
    """A pool of at most `concurrency` jobs running at once (see the module docstring).

    Args:
        limits: what each job may use.
        concurrency: jobs at once (default: the number of CPUs).
        python: the interpreter jobs run with (default: this one; run as root, the first of
            this one and the system's python3 that an unprivileged user can run). Jobs need
            only its standard library.
        bubblewrap: use bubblewrap where it is installed (default); False runs the layers
            beneath it only (as does ASTRANB_SANDBOX_NO_BWRAP=1).
        audit_hook: install the audit hook in each job (default). False only to test what the
            layers outside the job's interpreter contain alone.
    """

    def __init__(self, limits: Limits | None = None, *, concurrency: int | None = None,
                 python: str | None = None, bubblewrap: bool = True, audit_hook: bool = True):
        self.limits = limits or Limits()
        self.concurrency = concurrency or os.cpu_count() or 1
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        self._root = os.geteuid() == 0
        self.python = python or sys.executable
        if self._root:
            _contain.UidLease.reclaim()
            self.python = _python_for_jobs(python)
        self._slots: list[int] = list(range(self.concurrency))
        self._free = threading.Condition()
        self.jobs = 0
        """Jobs run so far."""
        self._audit_hook = audit_hook
        self._bwrap = _contain.bwrap_path() if bubblewrap else None
        self._roots = _contain.python_roots(self.python) if self._bwrap else ()
        failed = self._probe() if self._bwrap else ""
        if failed:
            self._bwrap = None
        if self._bwrap is None:
            why = _without_bwrap_because(bubblewrap, failed)
            _contain.warn_once(why, f"the code sandbox runs without bubblewrap: {why}. Its "
                                    "jobs see the host's files, /tmp and /dev/shm, and only "
                                    "the audit hook stands between a program's C calls and "
                                    "them (see astranb_code.sandbox for each layer)")

    @property
    def bubblewrap(self) -> bool:
        """Jobs run inside bubblewrap."""
        return self._bwrap is not None

    def launch(self, files: Mapping[str, bytes | str], argv: Sequence[str], *,
               limits: Limits | None = None, pass_fds: Sequence[int] = (),
               stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE,
               stderr: Any = subprocess.PIPE) -> Job:
        """Start one job: a fresh directory holding only `files` (name -> content), and in it
        `python -I argv[0] argv[1:]` (argv[0] a file among `files`) under every layer.

        `pass_fds` stay open in the job (pipes to talk to it); stdin/stdout/stderr are as for
        subprocess.Popen. The wall clock starts now: past `limits.wall_seconds` the job is
        killed. Does not take a pool slot (`run` does). Close the handle (or use it as a
        context manager): that kills every process of the job, removes its directory and
        frees its uid."""
        return Job._start(self, dict(files), list(argv), limits or self.limits,
                          tuple(pass_fds), stdin, stdout, stderr)

    def _probe(self) -> str:
        """A first job under bubblewrap: "" when it ran, else what went wrong (bubblewrap is
        unusable here). Once per bwrap and interpreter in a process."""
        key = (self._bwrap, self.python)
        if key not in _PROBED:
            _PROBED[key] = self._probe_now()
        return _PROBED[key]

    def _probe_now(self) -> str:
        try:
            with self.launch({"probe.py": "print('ok')"}, ["probe.py"],
                             limits=dataclasses.replace(self.limits, wall_seconds=30)) as job:
                out = job.stdout.read() if job.stdout else b""  # type: ignore[union-attr]
                err = job.stderr.read() if job.stderr else b""  # type: ignore[union-attr]
                if job.wait() == 0 and out.strip() == b"ok":
                    return ""
                lines = err.decode(errors="replace").strip().splitlines()
                return lines[-1] if lines else f"exit code {job.returncode}"
        except (OSError, _contain.ContainError) as error:
            return str(error)

    async def run(self, program: str, tests: list[str] | tuple[str, ...], *,
                  setup: str = "", entry_point: str | None = None, count: str = "tests",
                  limits: Limits | None = None) -> Result:
        """Run `program` in the sandbox and each test (Python statements, e.g. an assert) in a
        judge that calls the program's functions (see astranb_code.harness).

        `setup` (imports, helper functions) runs before the program in the sandbox and before
        the tests in the judge. The tests' free names (and `entry_point`) are the program's
        functions, called with plain data. `count`: "tests" (each test passes or fails whole)
        or "asserts" (each assert that can fail counts, loops' included). Waits for a slot in a
        worker thread; the event loop stays free. Never raises for what the program does."""
        if not isinstance(program, str) or not all(isinstance(t, str) for t in tests):
            raise TypeError("program and every test must be strings of Python source")
        if count not in ("tests", "asserts"):
            raise ValueError(f"count must be 'tests' or 'asserts', got {count!r}")
        return await anyio.to_thread.run_sync(
            lambda: self.run_sync(program, list(tests), setup, limits, entry_point=entry_point,
                                  count=count), abandon_on_cancel=True)

    def run_sync(self, program: str, tests: list[str], setup: str = "",
                 limits: Limits | None = None, *, entry_point: str | None = None,
                 count: str = "tests") -> Result:
        """`run` for a caller without an event loop (blocks until a slot is free and the job
        ends)."""
        from .harness import run_tests

        slot = self._take()
        try:
            result = run_tests(self, program, list(tests), setup=setup, entry_point=entry_point,
                               count=count, limits=limits or self.limits)
            self.jobs += 1
            return result
        except OSError as error:
            raise SandboxError(f"cannot start a job with the sandbox's Python ({self.python}): "
                               f"{error}") from error
        finally:
            self._give(slot)

    # -- slots ------------------------------------------------------------------------------------
    def _take(self) -> int:
        with self._free:
            while not self._slots:
                self._free.wait()
            return self._slots.pop()

    def _give(self, slot: int) -> None:
        with self._free:
            self._slots.append(slot)
            self._free.notify()


_PROBED: dict[tuple[str | None, str], str] = {}


@functools.cache
def _python_for_jobs(given: str | None) -> str:
    """An interpreter the jobs' uids can run: `given`, else this one, else the system's
    python3 (a pyenv or conda interpreter in root's home directory is out of their reach)."""
    candidates = [given] if given else [sys.executable, shutil.which("python3", path=os.defpath)]
    lease = _contain.UidLease.take()
    try:
        for python in candidates:
            if python and _runs_as(lease.uid, python):
                return python
    finally:
        lease.release()
    raise SandboxError(
        f"no Python the sandbox's unprivileged users (uid {UID_BASE}+) can run: tried "
        f"{', '.join(c for c in candidates if c)}. Install a system python3 or pass "
        "Sandbox(python=...) an interpreter under a directory every user can read")


def _runs_as(uid: int, python: str) -> bool:
    try:
        return subprocess.run([python, "-I", "-c", "pass"], user=uid, group=uid,
                              extra_groups=[], cwd="/", stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
