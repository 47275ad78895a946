"""Running untrusted programs and their tests: one subprocess per job, contained, off the loop.

    sandbox = Sandbox(Limits(wall_seconds=5), concurrency=4)
    result = await sandbox.run(program, tests=["assert add(1, 2) == 3"])
    result.passed, result.total, result.fraction, result.error

Each job gets a fresh temporary directory and one `python -I _runner.py` process in its own
process group. The layers, outermost first:

  - the wall clock: past `wall_seconds` the whole process group is killed (SIGKILL);
  - a user of its own: when this process runs as root, the job runs as an unprivileged uid
    (one per concurrent slot, 61000 + slot), so the kernel's permissions keep it out of every
    file it does not own and away from every other process, and after the job every process
    of that uid is killed;
  - resource limits set by the runner before any untrusted code: CPU seconds, address space,
    file size, number of processes, open files, no core dumps;
  - namespaces where the kernel allows unprivileged ones (most Linux distributions): a network
    namespace (no interface but a downed loopback) and a PID namespace (the job's first process
    is its init; when it dies, every process in it dies; the parent is invisible);
  - an audit hook (PEP 578) in the job's interpreter, refusing socket connects, signals to other
    processes, writes outside the directory and running other programs.

Limits: without root the job runs as your own user. Namespaces and the audit hook still stop
the network, signals and writes from Python code, but a program that reaches the C library
(ctypes) could get past the hook: run the pool as root (a container, a CI job) or under a
dedicated user for untrusted models. `Result.isolation` says which layers a job had. Where the
kernel refuses unprivileged namespaces the network is closed only by the audit hook.

Jobs wait for a free slot (`concurrency`, default the number of cores) in a worker thread, so a
slow or hostile program never stalls the event loop's other episodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = ["Limits", "Result", "Sandbox", "SandboxError"]

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner.py")
"""The harness; each job gets a copy in its directory (the job's user may not be able to read
this package's install location)."""
UID_BASE = 61000
"""Slot i of a root-run sandbox runs its jobs as uid/gid UID_BASE + i (no account needed)."""


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

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "file_bytes", "processes",
                     "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Result:
    """What running a program and its tests came to."""

    passed: int
    """Tests that ran without an exception."""
    total: int
    """Tests given."""
    error: str | None = None
    """Why the job did not pass every test: the program's or a test's exception, a timeout, a
    limit, a crash. None when all passed."""
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


class Sandbox:
    """A pool of at most `concurrency` jobs running at once (see the module docstring).

    Args:
        limits: what each job may use.
        concurrency: jobs at once (default: the number of CPUs).
        python: the interpreter jobs run with (default: this one; run as root, the first of
            this one and the system's python3 that an unprivileged user can run). Jobs need
            only its standard library.
    """

    def __init__(self, limits: Limits | None = None, *, concurrency: int | None = None,
                 python: str | None = None):
        self.limits = limits or Limits()
        self.concurrency = concurrency or os.cpu_count() or 1
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        self._root = os.geteuid() == 0
        self.python = python or sys.executable
        if self._root:
            self.python = _python_for_jobs(python)
        self._slots: list[int] = list(range(self.concurrency))
        self._free = threading.Condition()
        self.jobs = 0
        """Jobs run so far."""

    async def run(self, program: str, tests: list[str] | tuple[str, ...], *,
                  setup: str = "", limits: Limits | None = None) -> Result:
        """Run `program`, then each test (Python statements, e.g. an assert) in its namespace.

        `setup` runs first (imports a task's tests rely on). Waits for a slot in a worker
        thread; the event loop stays free. Never raises for what the program does."""
        if not isinstance(program, str) or not all(isinstance(t, str) for t in tests):
            raise TypeError("program and every test must be strings of Python source")
        return await anyio.to_thread.run_sync(self.run_sync, program, list(tests), setup,
                                              limits or self.limits, abandon_on_cancel=True)

    def run_sync(self, program: str, tests: list[str], setup: str = "",
                 limits: Limits | None = None) -> Result:
        """`run` for a caller without an event loop (blocks until a slot is free and the job
        ends)."""
        slot = self._take()
        try:
            return self._job(slot, program, tests, setup, limits or self.limits)
        finally:
            self._give(slot)

    # -- one job ----------------------------------------------------------------------------------
    def _job(self, slot: int, program: str, tests: list[str], setup: str,
             limits: Limits) -> Result:
        uid = UID_BASE + slot if self._root else None
        directory = tempfile.mkdtemp(prefix="astranb-code-")
        started = time.monotonic()
        try:
            with open(os.path.join(directory, "job.json"), "w", encoding="utf-8") as f:
                json.dump({"program": program, "tests": tests, "setup": setup}, f)
            shutil.copyfile(RUNNER, os.path.join(directory, "_runner.py"))
            if uid is not None:
                os.chown(directory, uid, uid)
                os.chmod(directory, 0o700)
            events, out, err, code, timed_out = self._spawn(directory, uid, limits)
        finally:
            if uid is not None:
                _kill_user(uid)
            shutil.rmtree(directory, ignore_errors=True)
        self.jobs += 1
        return _result(events, tests, out, err, code, timed_out, limits,
                       time.monotonic() - started, uid is not None)

    def _spawn(self, directory: str, uid: int | None, limits: Limits):
        read_fd, write_fd = os.pipe()
        env = {"PATH": os.defpath, "HOME": directory, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        wire = dataclasses.asdict(limits)
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "_runner.py", json.dumps(wire), str(write_fd)],
                cwd=directory,
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(write_fd,), process_group=0,
                user=uid, group=uid, extra_groups=[] if uid is not None else None,
            )
        except OSError as error:
            os.close(read_fd)
            os.close(write_fd)
            raise SandboxError(f"cannot start the sandbox's Python ({self.python}): {error}") \
                from error
        os.close(write_fd)
        reader = _Collector(read_fd, 1 << 20)
        out = _Collector(proc.stdout.fileno(), limits.output_bytes)  # type: ignore[union-attr]
        err = _Collector(proc.stderr.fileno(), limits.output_bytes)  # type: ignore[union-attr]
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        proc.wait()
        for collector in (reader, out, err):
            collector.join()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        os.close(read_fd)
        return _events(reader.text()), out.text(), err.text(), proc.returncode, timed_out

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


def _python_for_jobs(given: str | None) -> str:
    """An interpreter the slots' uids can run: `given`, else this one, else the system's
    python3 (a pyenv or conda interpreter in root's home directory is out of their reach)."""
    candidates = [given] if given else [sys.executable, shutil.which("python3", path=os.defpath)]
    for python in candidates:
        if python and _runs_as(UID_BASE, python):
            return python
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


class _Collector:
    """Drains one pipe in a thread, keeping its first `keep` bytes (a job that prints without
    end must not block on a full pipe, nor fill our memory)."""

    def __init__(self, fd: int, keep: int) -> None:
        self.fd, self.keep, self.data = fd, keep, bytearray()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            if len(self.data) < self.keep:
                self.data += chunk[: self.keep - len(self.data)]

    def join(self) -> None:
        self.thread.join(timeout=5)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _events(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a program that wrote into the report pipe: its lines are ignored
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def _result(events: list[dict[str, Any]], tests: list[str], out: str, err: str,
            code: int | None, timed_out: bool, limits: Limits, seconds: float,
            separate_user: bool) -> Result:
    ready = next((e for e in events if e["event"] == "ready"), None)
    isolation = dict(ready.get("isolation", {})) if ready else {}
    isolation["user"] = "separate" if separate_user else "same"
    outcome: dict[int, dict[str, Any]] = {}
    program_error = limit = None
    done = False
    for event in events:
        if event["event"] == "test" and isinstance(event.get("index"), int):
            outcome.setdefault(event["index"], event)
        elif event["event"] == "program" and not event.get("ok"):
            program_error = str(event.get("error"))
        elif event["event"] == "limit":
            limit = str(event.get("error"))
        elif event["event"] == "done":
            done = True
    passed = sum(1 for i in range(len(tests)) if outcome.get(i, {}).get("ok") is True)
    first_failure = next((outcome[i].get("error") for i in sorted(outcome)
                          if not outcome[i].get("ok")), None)
    error: str | None
    if timed_out:
        error = f"timed out after {limits.wall_seconds:g} s (the job was killed)"
    elif limit is not None:
        error = f"stopped: {limit}"
    elif program_error is not None:
        error = f"the program failed: {program_error}"
    elif not done:
        error = _why_it_died(code, limits, err)
    elif first_failure is not None:
        error = f"a test failed: {first_failure}"
    else:
        error = None
    return Result(passed, len(tests), error, timed_out, code, out, err, seconds, isolation)


def _why_it_died(code: int | None, limits: Limits, err: str) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        if -code == signal.SIGXCPU:
            return f"killed by SIGXCPU: over {limits.cpu_seconds:g} CPU seconds"
        if -code == signal.SIGXFSZ:
            return f"killed by SIGXFSZ: a file over {limits.file_bytes} bytes"
        return f"killed by {name}"
    tail = err.strip().splitlines()[-1:] if err.strip() else []
    return f"the job exited with code {code} before finishing" + (
        f": {tail[0]}" if tail else "")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_user(uid: int) -> None:
    """SIGKILL every process of `uid` (a slot's own uid: whatever the job left behind, even
    outside its process group), until none is left."""
    for _ in range(50):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                found = True
                os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return
        time.sleep(0.01)
