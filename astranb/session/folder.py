"""The run folder: the name of every file a Session and its runs leave on disk, and the one place
that reads and writes them.

    <session folder>/
      session.lock                  pid, host and time of the live Session (`FolderLock`)
      trainer-<policy>.log          what a trainer child process printed
      run-000/                      one folder per run, numbered on (`next_run_folder`)
        run.json                    what the run was asked for and how it ended (report.py)
        metrics.jsonl               one row per (policy, step) (recorder.py)
        samples.jsonl               per row, the names of the samples it accounts for
                                    (runs of positions: dataflow/ledger.py)
        events.jsonl                rollbacks, "evaluation" windows, "resumed", "stalled", ...
        episodes.jsonl.zst          the kept episodes, one zstd frame per row (episodes.py)
        episodes.index              where each frame starts
        plan.json                   with checkpoint_every: what a resumed run rebuilds
        checkpoints/<policy>/step-000005/
          manifest.json state.json rng.safetensors and the trainer's own files
        metrics.discarded.jsonl     rows of steps a resumed run trains again
        samples.discarded.jsonl     their lines of samples.jsonl
        episodes.discarded.jsonl.zst  episodes a resumed run plays again
        status.json                 how a run ended, in folders of an older astranb (read only)
      run-001/ ...
    <sweep OUTDIR>/<point>/point.json   a sweep point's parameters, above its runs/run-NNN

Everything here is about bytes on disk: the names, a JSON-lines reader that leaves out a torn
last line (a killed writer), JSON read and written whole or not at all (a temporary file,
fsynced, renamed over the old one, then the folder fsynced), the errors a failed write raises
(naming the path and the free space), `RunFiles` (what a run folder says of itself, read when
asked for) and the folder lock. `open_run`, `ab.runs`, the recorder, checkpoints and resuming all
go through it, so a file's name and format are spelled once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..dataflow.ledger import expand
from ..errors import AstranbError, FolderNotWritable
from ..types import jsonable

__all__ = [
    "CHECKPOINTS_DIR", "EPISODES_DISCARDED_FILE", "EPISODES_FILE", "EPISODES_INDEX_FILE",
    "EVALUATION", "EVENTS_FILE", "LOCK_FILE", "MANIFEST_FILE", "METRICS_DISCARDED_FILE",
    "METRICS_FILE", "NAMES", "PLAN_FILE", "POINT_FILE", "PREFIXES", "RNG_FILE", "RUN_FILE",
    "SAMPLES_DISCARDED_FILE", "SAMPLES_FILE", "STATE_FILE", "STATUS_FILE", "STEPS_DIR",
    "WEIGHTS_FILE", "step_trace_file", "step_trace_files", "step_traces_in", "step_traces_of",
    "CheckpointError", "CheckpointWriteError", "FolderLock", "FolderLocked", "RecordWriteError",
    "RunFiles", "append_synced", "atomic_write_bytes", "atomic_write_text", "checkpoint_folder",
    "checkpoint_folders", "checkpoints_of", "evaluation_windows", "fsync_dir", "fsync_file",
    "json_line",
    "jsonl_lines", "next_run_folder", "pid_alive", "read_json", "read_jsonl", "run_folder_path",
    "run_folders", "status_of", "trainer_log", "unfinished_folders", "unfinished_folder",
    "write_json", "write_synced",
]

# -- names -------------------------------------------------------------------------------------
LOCK_FILE = "session.lock"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
EPISODES_FILE = "episodes.jsonl.zst"
EPISODES_INDEX_FILE = "episodes.index"
PLAN_FILE = "plan.json"
CHECKPOINTS_DIR = "checkpoints"
METRICS_DISCARDED_FILE = "metrics.discarded.jsonl"
SAMPLES_FILE = "samples.jsonl"
SAMPLES_DISCARDED_FILE = "samples.discarded.jsonl"
EPISODES_DISCARDED_FILE = "episodes.discarded.jsonl.zst"
STATUS_FILE = "status.json"
POINT_FILE = "point.json"
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
RNG_FILE = "rng.safetensors"
WEIGHTS_FILE = "model.safetensors"
STEPS_DIR = "trained-steps"
"""The trainer's weights in a checkpoint: the Trainer's own format (training/ writes it and
spells it itself, being below this layer), read here to hash the weights."""

NAMES = (LOCK_FILE, RUN_FILE, METRICS_FILE, EVENTS_FILE, EPISODES_FILE, EPISODES_INDEX_FILE,
         PLAN_FILE, CHECKPOINTS_DIR, METRICS_DISCARDED_FILE, EPISODES_DISCARDED_FILE,
         STATUS_FILE, POINT_FILE, MANIFEST_FILE, STATE_FILE, RNG_FILE, SAMPLES_FILE,
         SAMPLES_DISCARDED_FILE, STEPS_DIR)
"""Names only this module spells (tests/test_folder.py checks the package for them)."""

_RUN, _STEP, _TRAINER_LOG, _UNFINISHED = "run-", "step-", "trainer-", ".tmp-"
PREFIXES = (_RUN, _STEP, _TRAINER_LOG)
"""Beginnings of numbered or named entries (run-000, step-000005, trainer-<policy>.log)."""

EVALUATION = "evaluation"
"""The kind of event a held-out evaluation window is recorded as (events.jsonl)."""


def run_folder_path(directory: Path, number: int) -> Path:
    """`<directory>/run-NNN`."""
    return directory / f"{_RUN}{number:03d}"


def run_folders(directory: Path) -> list[Path]:
    """The run-NNN folders of a session folder, oldest first."""
    return sorted(p for p in directory.glob(f"{_RUN}*") if p.name[len(_RUN):].isdigit())


def next_run_folder(directory: Path) -> Path:
    """run-NNN after every run folder already here (from earlier Sessions too)."""
    taken = [int(p.name[len(_RUN):]) for p in run_folders(directory)]
    return run_folder_path(directory, max(taken, default=-1) + 1)


def trainer_log(directory: Path, policy: str) -> Path:
    """Where a trainer child process of `policy` writes what it prints."""
    return directory / f"{_TRAINER_LOG}{policy}.log"


def checkpoints_of(run: Path, policy: str) -> Path:
    """`<run>/checkpoints/<policy>`: one policy's checkpoint folders."""
    return run / CHECKPOINTS_DIR / policy


def checkpoint_folder(root: Path, version: int) -> Path:
    """`<root>/step-NNNNNN`, the checkpoint at `version`."""
    return root / f"{_STEP}{version:06d}"


def checkpoint_folders(root: Path) -> list[Path]:
    """The finished checkpoint folders under `root`, oldest first."""
    return sorted(p for p in root.glob(f"{_STEP}*") if p.is_dir()) if root.is_dir() else []


def step_traces_of(run: Path, policy: str) -> Path:
    """`<run>/trained-steps/<policy>`: the step inspector's recorded steps of one policy."""
    return run / STEPS_DIR / policy


def step_trace_file(root: Path, step: int) -> Path:
    """`<root>/step-NNNNNN.safetensors`, the recorded step `step` (counted from 0)."""
    return root / f"{_STEP}{step:06d}.safetensors"


def step_traces_in(root: Path) -> list[Path]:
    """The recorded steps of one policy (`step_traces_of`), oldest first."""
    return sorted(root.glob(f"{_STEP}*.safetensors"))


def step_trace_files(run: Path) -> list[Path]:
    """Every recorded step of a run, all policies, ordered by step then policy name."""
    found = (run / STEPS_DIR).glob(f"*/{_STEP}*.safetensors")
    return sorted(found, key=lambda p: (p.name, p.parent.name))


def unfinished_folder(final: Path) -> Path:
    """A hidden folder beside `final` to write it in before it is renamed into place."""
    return final.parent / f"{_UNFINISHED}{final.name}-{uuid.uuid4().hex[:8]}"


def unfinished_folders(root: Path) -> list[Path]:
    """Folders a writer killed while writing left under `root`."""
    return sorted(root.glob(f"{_UNFINISHED}*"))


# -- the errors of writing -----------------------------------------------------------------------
class CheckpointError(AstranbError, RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint (or a run's record) failed: a full disk, a read-only folder."""

    def __init__(self, path: Path, error: BaseException):
        free = _free_space(path)
        reason = (error.strerror if isinstance(error, OSError) and error.strerror
                  else str(error).strip().splitlines()[-1] if str(error).strip() else repr(error))
        super().__init__(
            f"could not write {path}: {reason} ({free} free on that disk). The "
            "run stopped; its metrics so far and its last checkpoint stay readable. Free some "
            "space (or make the folder writable) and resume with `session.resume()`")
        self.path, self.error = path, error


class RecordWriteError(CheckpointWriteError):
    """Writing the run's record (metrics, events, episodes) failed: a full disk, a read-only
    folder."""


def _free_space(path: Path) -> str:
    for candidate in (path, *path.parents):
        try:
            free = shutil.disk_usage(candidate).free
        except OSError:
            continue
        return _bytes(free)
    return "unknown"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# -- writing -------------------------------------------------------------------------------------
def fsync_file(path: Path) -> None:
    """Flush a written file's bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to the disk, where the filesystem can."""
    with contextlib.suppress(OSError):  # some cannot fsync a folder: the rename is still atomic
        fsync_file(path)


def write_synced(path: Path, text: str) -> None:
    """Write `path` in UTF-8 and fsync it (a file inside a folder renamed into place later)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def append_synced(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing) and fsync it."""
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsynced, renamed over it,
    the folder fsynced. CheckpointWriteError (an OSError) naming the path and the free space
    when that fails; the temporary file is removed then."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(path, error) from error
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write a JSON object whole or not at all (`atomic_write_text`); NaN and infinities
    become null (`types.jsonable`)."""
    atomic_write_text(path, json.dumps(jsonable(dict(data)), indent=1, allow_nan=False) + "\n")


def json_line(value: Any) -> str:
    """One line of strict JSON: NaN and infinities become null (`types.jsonable`). Records are
    JSON-ready already almost always, so the recursive conversion only runs when the fast
    encoder refuses (an episode holds thousands of token ids and logprobs)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(jsonable(value), allow_nan=False)


# -- reading -------------------------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable, or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def jsonl_lines(path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(line, its object) for every line of a JSON-lines file that is not blank; the object is
    None for a line that is not a JSON object (a torn last line: the writer was killed). A
    missing or unreadable file has no lines."""
    try:  # a character cut in two by a killed writer spoils its line only
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        yield line, value if isinstance(value, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (metrics.jsonl, events.jsonl), in order; blank lines
    and lines that do not parse (a torn last line) are left out."""
    return [value for _, value in jsonl_lines(path) if value is not None]


def evaluation_windows(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluation windows among a run's events, in order."""
    return [dict(e) for e in events if e.get("kind") == EVALUATION]


def pid_alive(pid: int) -> bool | None:
    """Whether process `pid` exists on this host; None where that cannot be asked safely
    (Windows: os.kill with signal 0 would end the process)."""
    if os.name == "nt":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OSError:
        return None
    return True


def status_of(info: Mapping[str, Any], host: str | None = None) -> str:
    """A run.json's status as a reader should see it: "running" only while its process lives;
    a run whose process died on this host without writing its end is "interrupted" (a run on
    another host cannot be checked and stays "running")."""
    status = str(info.get("status", "unknown"))
    if status != "running":
        return status
    if info.get("host") != (host or socket.gethostname()) or not isinstance(info.get("pid"), int):
        return status
    return "interrupted" if pid_alive(info["pid"]) is False else status


class RunFiles:
    """What a run folder says of itself, each file read when first asked for (listing many runs
    reads only their run.json): `info` (run.json), `rows` (metrics.jsonl), `samples`, `events`,
    `evaluations`, `status` and `error`. What `ab.open_run` and `ab.runs` read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def holds_a_run(self) -> bool:
        """Whether the folder has a run's metrics or episodes (run.json alone is not a run to
        open: the run died before its first step)."""
        return any((self.path / name).exists() for name in (METRICS_FILE, EPISODES_FILE))

    @functools.cached_property
    def info(self) -> dict[str, Any] | None:
        """run.json, or None without one (a run of an older astranb) or when unreadable."""
        return read_json(self.path / RUN_FILE)

    @functools.cached_property
    def rows(self) -> list[dict[str, Any]]:
        """The metrics rows (a torn last line left out)."""
        return read_jsonl(self.path / METRICS_FILE)

    @property
    def samples(self) -> list[dict[str, Any]]:
        """Per metrics row, the samples it accounts for, by name: {"policy", "step",
        "trained": [names], "dropped": {reason: [names]}} (samples.jsonl, expanded)."""
        return [{"policy": line.get("policy"), "step": line.get("step"),
                 "trained": expand(line.get("trained") or {}),
                 "dropped": {reason: expand(runs)
                             for reason, runs in (line.get("dropped") or {}).items()}}
                for line in read_jsonl(self.path / SAMPLES_FILE)]

    @property
    def step_traces(self) -> list[Path]:
        """The step inspector's recorded steps (trained-steps/<policy>/step-NNNNNN.safetensors), by
        step then policy; `session.steps.StepLog` reads them."""
        return step_trace_files(self.path)

    @functools.cached_property
    def events(self) -> list[dict[str, Any]]:
        """Things that happened outside the step rhythm (rollbacks, evaluation windows)."""
        return read_jsonl(self.path / EVENTS_FILE)

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """The "evaluation" events, in order."""
        return evaluation_windows(self.events)

    @functools.cached_property
    def _ended(self) -> dict[str, Any]:
        if self.info is not None:
            return self.info
        return read_json(self.path / STATUS_FILE) or {}

    @property
    def status(self) -> str:
        """finished, stopped, failed, running, interrupted (its process died first), or unknown
        (no record of it)."""
        if self.info is not None:
            return status_of(self.info)
        return str(self._ended.get("status", "unknown"))

    @property
    def error(self) -> str | None:
        """The first line of the error that ended a failed run."""
        return self._ended.get("error")


# -- the lock ------------------------------------------------------------------------------------
class FolderLocked(AstranbError, RuntimeError):
    """Another live Session writes to this folder."""


_holders: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""Lock path -> the owner in this process that holds it (a Session's run context)."""


class FolderLock:
    """`<folder>/session.lock`, the folder created first: one live Session per folder.

    A second Session on the same folder while the owner lives is refused, with the owner named.
    A lock whose process is gone (kill -9, a dead kernel) is taken over. Within one process, an
    earlier Session on the folder that runs nothing is closed first, with a warning naming the
    folder (a notebook cell run again); using it afterwards raises `SessionClosed`. One that is
    still training is an error. A folder that cannot be written is `FolderNotWritable`;
    releasing the lock never raises (a lock left behind is taken over by the next Session, its
    owner being gone).

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
        self.path = directory / LOCK_FILE
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
                owner = read_json(self.path)
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
        owner = read_json(self.path)
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
