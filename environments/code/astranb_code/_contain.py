"""The host's side of a job's containment: its uid, its directory, bubblewrap, its memory group.

`sandbox.Sandbox.launch` puts these together; each piece says what it contains and what it
falls back to where the machine lacks it. Everything machine-wide (uids, job directories,
memory groups) is named after the job's uid, and a uid is held through a lock that the kernel
drops when its holder dies, so two processes never share one and a dead one's leftovers are
reclaimed by the next holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

UID_BASE = 61000
"""A root-run sandbox runs each job as a uid of its own in UID_BASE .. UID_BASE + UID_COUNT - 1
(no account needed), held machine-wide while the job lives."""
UID_COUNT = 1000
STATE = "/run/astranb"
"""Root's folder for the uid locks and the job directories (0711: jobs can reach their own
directory, nobody can list them)."""
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""World-writable folders swept of a job uid's files after the job (without bubblewrap a job
can reach them)."""


class ContainError(RuntimeError):
    """The host cannot set up a layer it should have (a setup problem, not a program's)."""


# -- launching from one long-lived thread ---------------------------------------------------------

class _Keeper:
    """Starts every job process from one thread that lives as long as this process.

    A job asks to die with its parent (PR_SET_PDEATHSIG), and to the kernel the parent is the
    *thread* that forked it: a job started from a worker thread would die when that thread
    retired, one started here dies exactly when this process does."""

    def __init__(self) -> None:
        self._work: queue.Queue[tuple[Callable[[], Any], queue.Queue]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="astranb-sandbox-keeper",
                                                daemon=True)
                self._thread.start()
        answer: queue.Queue = queue.Queue(maxsize=1)
        self._work.put((fn, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, answer = self._work.get()
            try:
                answer.put((True, fn()))
            except BaseException as error:  # handed to the caller
                answer.put((False, error))


KEEPER = _Keeper()


# -- uids held machine-wide -----------------------------------------------------------------------

class UidLease:
    """One uid, held through an flock on STATE/uids/<uid> until `release` (or this process's
    death: the kernel drops the lock). Taking one first kills whatever a dead holder left."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid, self._fd = uid, fd

    @classmethod
    def take(cls, wait: float = 30.0) -> UidLease:
        deadline = time.monotonic() + wait
        start = os.getpid() % UID_COUNT  # two processes start their search apart
        while True:
            for i in range(UID_COUNT):
                lease = cls._try(UID_BASE + (start + i) % UID_COUNT)
                if lease is not None:
                    return lease
            if time.monotonic() > deadline:
                raise ContainError(f"all {UID_COUNT} sandbox uids ({UID_BASE}+) are in use on "
                                   "this machine; let some jobs end or run fewer at once")
            time.sleep(0.05)

    @classmethod
    def _try(cls, uid: int) -> UidLease | None:
        """The lease of `uid` if no live process holds it, its last holder's leftovers gone."""
        folder = _state_dir("uids", 0o700)
        fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        kill_user(uid)
        remove_job_dir(job_dir_path(uid))
        for parent in group_parents():
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, group_name(uid)))
        return cls(uid, fd)

    @classmethod
    def reclaim(cls) -> None:
        """Cleans up after holders that died with a job running (its directory, a mounted
        tmpfs, its processes, its memory group), once per process: the next holder of that uid
        would, but it may be a while."""
        if cls._reclaimed:
            return
        cls._reclaimed = True
        names = os.listdir(_state_dir("jobs", 0o711))
        for parent in group_parents():
            with contextlib.suppress(OSError):
                names += [n.removeprefix(GROUP_PREFIX) for n in os.listdir(parent)]
        for name in set(names):
            if name.isdigit() and UID_BASE <= int(name) < UID_BASE + UID_COUNT:
                lease = cls._try(int(name))
                if lease is not None:
                    lease.release()

    _reclaimed = False

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _state_dir(name: str, mode: int) -> str:
    """STATE/name, root's, made on first use. A STATE that is not root's own is refused."""
    for base in (STATE, os.path.join(tempfile.gettempdir(), "astranb-root")):
        try:
            os.makedirs(base, mode=0o711, exist_ok=True)
        except OSError:
            continue
        info = os.lstat(base)
        if info.st_uid != 0 or not os.path.isdir(base) or os.path.islink(base) \
                or info.st_mode & 0o022:
            continue
        path = os.path.join(base, name)
        os.makedirs(path, mode=mode, exist_ok=True)
        os.chmod(path, mode)
        return path
    raise ContainError(f"cannot make a root-owned folder for the sandbox at {STATE} (or under "
                       f"{tempfile.gettempdir()}); check that / is writable")


# -- job directories ------------------------------------------------------------------------------

def job_dir_path(uid: int) -> str:
    return os.path.join(_state_dir("jobs", 0o711), str(uid))


def make_job_dir(uid: int | None, disk_bytes: int, max_files: int) -> tuple[str, str]:
    """A fresh directory for one job and the layer bounding its disk use.

    As root: a tmpfs of its own (size and inode count bounded, owned by the job's uid, 0700),
    mounted at STATE/jobs/<uid>. Otherwise (or where mounting is refused) a temporary folder,
    bounded only by the per-file size limit."""
    if uid is None:
        return tempfile.mkdtemp(prefix="astranb-code-"), "file size only"
    path = job_dir_path(uid)
    os.mkdir(path, 0o700)
    options = f"size={disk_bytes},nr_inodes={max_files},mode=0700,uid={uid},gid={uid}"
    if _mount_tmpfs(path, options):
        return path, "tmpfs"
    os.chown(path, uid, uid)
    return path, "file size only"


def remove_job_dir(path: str) -> None:
    if not os.path.lexists(path):
        return
    if os.path.ismount(path):
        _umount(path)
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _mount_tmpfs(path: str, options: str) -> bool:
    libc = _libc()
    if libc is None:
        return False
    ms_nosuid, ms_nodev = 2, 4
    return libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", ms_nosuid | ms_nodev,
                      options.encode()) == 0


def _umount(path: str) -> None:
    libc = _libc()
    if libc is not None:
        mnt_detach = 2
        libc.umount2(os.fsencode(path), mnt_detach)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes
            _LIBC = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _LIBC = False
    return _LIBC or None


# -- killing --------------------------------------------------------------------------------------

def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def processes_of(uid: int) -> list[int]:
    """The live processes of `uid` (zombies, which can do nothing, left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        found.append(int(entry))
    return found


def family(pid: int) -> list[int]:
    """`pid` and its descendants."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    members, changed = {pid}, True
    while changed:
        changed = False
        for child, parent in parents.items():
            if parent in members and child not in members:
                members.add(child)
                changed = True
    return sorted(members)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Waits until none of `pids` is a live process (killed ones take a moment to go)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.002)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def kill_user(uid: int) -> None:
    """SIGKILL every process of `uid` until none is left (a job uid's: whatever the job left,
    even outside its session)."""
    for _ in range(500):
        pids = processes_of(uid)
        if not pids:
            return
        kill_pids(pids)
        time.sleep(0.002)
    raise ContainError(f"the processes of sandbox uid {uid} outlived 500 SIGKILL rounds")


def sweep_shared(uid: int) -> None:
    """Removes what `uid` left in the world-writable folders (a job without bubblewrap can
    write there through the C library; the next job must not find it)."""
    for folder in SHARED_WRITABLE:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)


# -- bubblewrap -----------------------------------------------------------------------------------

def bwrap_path() -> str | None:
    """bubblewrap's `bwrap`, unless ASTRANB_SANDBOX_NO_BWRAP=1 hides it (to test the layers
    beneath it)."""
    if os.environ.get("ASTRANB_SANDBOX_NO_BWRAP", "") not in ("", "0"):
        return None
    return shutil.which("bwrap", path=os.environ.get("PATH", os.defpath) + ":/usr/bin:/bin")


def bwrap_argv(bwrap: str, directory: str, uid: int, python_roots: tuple[str, ...],
               scratch_bytes: int, copy_in: dict[str, int] | None = None) -> list[str]:
    """bwrap's arguments for one job, run by `uid` (bwrap makes the user namespace itself, so
    it never holds root): read-only system folders, the job's directory its only writable
    host folder, private /tmp, /dev/shm and /proc, no network, no capabilities, no nested
    user namespace, dead with its parent. Installed packages' folders are hidden (a job needs
    only the standard library, and a package may ship a benchmark's answers).

    `copy_in` (file name -> a descriptor to read it from): the job's directory is then a
    tmpfs of `scratch_bytes` made by bwrap, holding copies of those files (where this process
    cannot mount one itself); otherwise the host's `directory` is bound in.

    bwrap runs as `uid` already: run as root with --uid it must make a user namespace, which
    maps the job's uid back to root on the host (the job's processes would be root's)."""
    argv = [bwrap, "--unshare-user", "--disable-userns", "--uid", str(uid), "--gid", str(uid),
            "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/alternatives"):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(scratch_bytes), "--tmpfs", "/tmp",
             "--size", str(scratch_bytes), "--tmpfs", "/dev/shm"]
    for root in python_roots:  # after /tmp's tmpfs: an interpreter may live under /tmp
        if not any((root + "/").startswith(other + "/") for other in ("/usr", *python_roots)
                   if other != root):
            argv += ["--ro-bind", root, root]
    for folder in package_dirs(python_roots):  # only the standard library: no data sets
        argv += ["--tmpfs", folder, "--remount-ro", folder]
    argv += [*(_copied(directory, copy_in, scratch_bytes) if copy_in is not None
               else ("--bind", directory, directory)), "--chdir", directory,
             "--setenv", "HOME", directory, "--"]
    return argv


def _copied(directory: str, copy_in: dict[str, int], size: int) -> list[str]:
    argv = ["--size", str(size), "--tmpfs", directory]
    for name, fd in copy_in.items():
        argv += ["--file", str(fd), os.path.join(directory, name)]
    return argv


# -- memory per job -------------------------------------------------------------------------------

class MemoryGroup:
    """Bounds the memory of all a job's processes together.

    A cgroup of its own when the machine lets this process make one: cgroup v2's memory.max
    (swap off), else cgroup v1's memory.limit_in_bytes (and memsw). Elsewhere a watcher thread
    sums the resident memory of the job's processes (its uid's, as root; else the descendants
    of its first process) every 20 ms and kills the job past the bound. `kind` names which
    applied."""

    def __init__(self, name: str, limit: int, on_exceeded: Callable[[], None]) -> None:
        self.limit, self.path, self.kind = limit, None, "watcher"
        self._stop = threading.Event()
        self._on_exceeded = on_exceeded
        self.exceeded = False
        for make in (_cgroup_v2, _cgroup_v1):
            made = make(name, limit)
            if made is not None:
                self.path, self.kind = made
                return

    def admit(self, members: Callable[[], list[int]]) -> None:
        """Moves the job's first processes (`members()`: they have run nothing untrusted yet)
        into the group, or starts the watcher over `members()` where there is no group."""
        if self.path is not None:
            for pid in members():
                with contextlib.suppress(OSError):
                    with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                        f.write(str(pid))
        else:
            threading.Thread(target=self._watch, args=(members,), daemon=True,
                             name="astranb-memory").start()

    def over(self) -> bool:
        """The group's kernel counted an out-of-memory kill (or the watcher killed the job)."""
        if self.exceeded:
            return True
        if self.path is None:
            return False
        for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.path, name)) as f:
                    for line in f:
                        if line.startswith(key + " ") and int(line.split()[1]) > 0:
                            return True
        return False

    def close(self) -> None:
        self._stop.set()
        self.exceeded = self.over()  # asked after the group is gone, too
        if self.path is not None:
            for _ in range(100):
                try:
                    os.rmdir(self.path)
                    return
                except FileNotFoundError:
                    return
                except OSError:
                    time.sleep(0.01)

    def _watch(self, members: Callable[[], list[int]]) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.02):
            total = 0
            for pid in members():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{pid}/statm") as f:
                        total += int(f.read().split()[1]) * page
            if total > self.limit:
                self.exceeded = True
                self._on_exceeded()
                return


GROUP_PREFIX = "astranb-job-"


def group_name(uid: int) -> str:
    """The memory group of the job running as `uid` (this machine's alone while it runs)."""
    return f"{GROUP_PREFIX}{uid}"


def group_parents() -> list[str]:
    """Where this process makes memory groups: its own cgroup, in v2 and v1's memory."""
    parents = []
    own = _own_cgroup("")
    for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if own is not None and os.path.exists(os.path.join(mount, "cgroup.controllers")):
            parents.append(os.path.join(mount, own.lstrip("/")))
    own = _own_cgroup("memory")
    if own is not None:
        parents.append(os.path.join("/sys/fs/cgroup/memory", own.lstrip("/")))
    return [p for p in parents if os.path.isdir(p)]


def _own_cgroup(hierarchy: str) -> str | None:
    """This process's cgroup path in a hierarchy ('' for v2, else a v1 controller's name)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers.split(",") == [hierarchy] or (hierarchy == "" and controllers == ""):
                    return path
    except OSError:
        pass
    return None


def _cgroup_v2(name: str, limit: int) -> tuple[str, str] | None:
    own = _own_cgroup("")
    for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if own is None or not os.path.exists(os.path.join(mount, "cgroup.controllers")):
            continue
        parent = os.path.join(mount, own.lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    continue
        except OSError:
            continue
        path = os.path.join(parent, name)
        try:
            with contextlib.suppress(OSError):  # a dead holder's, empty by now
                os.rmdir(path)
            os.mkdir(path)
            with open(os.path.join(path, "memory.max"), "w") as f:
                f.write(str(limit))
            with contextlib.suppress(OSError), open(os.path.join(path, "memory.swap.max"),
                                                   "w") as f:
                f.write("0")
            return path, "cgroup v2"
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
    return None


def _cgroup_v1(name: str, limit: int) -> tuple[str, str] | None:
    own = _own_cgroup("memory")
    if own is None:
        return None
    path = os.path.join("/sys/fs/cgroup/memory", own.lstrip("/"), name)
    with contextlib.suppress(OSError):  # a dead holder's, empty by now
        os.rmdir(path)
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        with contextlib.suppress(OSError), open(os.path.join(path, "memory.memsw.limit_in_bytes"),
                                               "w") as f:
            f.write(str(limit))
        return path, "cgroup v1"
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None


WARNED: set[str] = set()
"""The warnings given so far (each once per process)."""


def warn_once(key: str, message: str) -> None:
    if key not in WARNED:
        WARNED.add(key)
        import warnings
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen from the keeper thread (see _Keeper)."""
    return KEEPER.call(lambda: subprocess.Popen(argv, **kw))


@functools.cache
def python_roots(python: str) -> tuple[str, ...]:
    """The folders `python` needs (its prefixes, a venv's included: site.py finds those, so
    not -S; and where it and its link target are), for bubblewrap to mount read-only."""
    try:
        out = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); "
                              "print(sys.base_prefix); print(sys.exec_prefix)"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise ContainError(f"cannot run the sandbox's Python ({python}): {error}") from error
    roots = {os.path.realpath(p) for p in out.split()}
    roots.add(os.path.dirname(os.path.realpath(python)))  # a venv's python: a link to its base
    roots.add(os.path.dirname(os.path.abspath(python)))
    return tuple(sorted(r for r in roots if r and r != "/"))


@functools.cache
def package_dirs(python_roots: tuple[str, ...]) -> tuple[str, ...]:
    """The site-packages and dist-packages folders under the interpreter's folders and /usr."""
    found: set[str] = set()
    for root in {*python_roots, "/usr", "/usr/local"}:
        for pattern in ("lib/python3*/site-packages", "lib/python3*/dist-packages",
                        "lib/python3/dist-packages", "local/lib/python3*/dist-packages",
                        "lib64/python3*/site-packages"):
            found.update(os.path.realpath(p) for p in glob.glob(os.path.join(root, pattern)))
    visible = ("/usr", *python_roots)
    return tuple(sorted(f for f in found if os.path.isdir(f) and any(
        (f + "/").startswith(r.rstrip("/") + "/") for r in visible)))
