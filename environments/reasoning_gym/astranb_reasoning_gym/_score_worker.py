"""The scoring worker: `python path/to/_score_worker.py`, one JSON object per line.

Many reasoning-gym scorers `eval` the answer they are given (string_insertion, n_queens,
spiral_matrix, binary_matrix) or hand it to SymPy's `parse_expr`, which evals too (countdown,
puzzle24, polynomial_multiplication, the integration tasks). The answer is model text, so the
scorer never runs in the episode's process. This worker builds the same datasets from their
spec, then scores each answer in a child forked for it alone: whatever an answer changes in its
child (a patched scorer, a patched builtin) ends with that child, so no answer can touch another
answer's score. Before the child calls the scorer it closes the worker's protocol channel,
sets resource limits, removes the os module's raw write functions, and adds an audit hook. The
hook refuses anything a hostile answer would want: starting processes, sockets, ctypes, mmap,
opening files for writing, renaming or removing files, signals, and reaching frames or the
garbage collector's object lists (where the child's result channel could be found). A refused
action raises inside the scorer, which scores the answer as it scores any unreadable one. An
answer that the scorer evals still runs inside that scorer, so it can change what the scorer
returns for it: the reward of one episode, never anything outside the child. The parent
(`astranb_reasoning_gym.scorer.Scorer`) owns the timeout and kills the worker's process group
(children included) past it.

Protocol: a first line {"spec": {...}} (see `build`) answered by {"ready": true} or
{"ready": false, "error": ...}; then {"split": "train" | "test", "index": int, "answer": str}
answered by {"score": float, "error": str | null}. Only this module's writes reach the parent:
file descriptor 1 is kept for the protocol and stdout points at stderr.

It runs as a script (importing neither astranb nor torch), in a session of its own, and ends
when the process named in ASTRANB_PARENT_PID is no longer its parent.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import threading
import time
from typing import IO, Any

PARENT_ENV = "ASTRANB_PARENT_PID"
POLL = 0.2  # seconds between looks at the parent
MEMORY_BYTES = 2 << 30  # address space a scorer may add to what the worker has mapped

_REFUSED_PREFIXES = ("subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "socket.", "ctypes.",
                     "shutil.", "pty.", "winreg.", "_winapi.")
_REFUSED = {"os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.remove",
            "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
            "os.link", "os.symlink", "os.utime", "os.putenv", "os.unsetenv", "os.chdir",
            "os.startfile", "signal.pthread_kill", "sys.addaudithook", "code.__new__",
            "urllib.Request", "webbrowser.open", "sys._getframe", "sys._current_frames",
            "sys._current_exceptions", "sys.settrace", "sys.setprofile", "gc.get_objects",
            "gc.get_referrers", "gc.get_referents", "mmap.__new__"}
_FRAME_ATTRIBUTES = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals",
                     "f_globals"}
_RAW_WRITES = ("write", "writev", "pwrite", "pwritev", "sendfile", "splice", "copy_file_range",
               "dup", "dup2", "fork", "forkpty", "system", "posix_spawn", "posix_spawnp")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def build(spec: dict[str, Any], split: str) -> Any:
    """The reasoning-gym dataset of `split` ("train" or "test") described by `spec`:
    {"tasks": [[name, weight, config], ...], "size", "seed", "test_size", "test_seed"}. One task
    is `create_dataset(name, size=, seed=, **config)`; several are reasoning-gym's composite.
    The test dataset is twice `test_size` long (its questions that also occur in train are
    left out by the environment)."""
    import reasoning_gym

    size, seed = ((spec["size"], spec["seed"]) if split == "train"
                  else (2 * spec["test_size"], spec["test_seed"]))
    tasks = spec["tasks"]
    if len(tasks) == 1:
        name, _, config = tasks[0]
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name, float(weight), dict(config)) for name, weight, config in tasks]
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)


def main() -> None:
    _follow_parent()
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # the package's modules must not shadow others
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        spec = json.loads(sys.stdin.readline())["spec"]
        datasets = {split: build(spec, split) for split in ("train", "test")}
        _warm(datasets["train"])
        gc.freeze()  # children do not walk (and so copy) the objects built so far
    except Exception as error:
        _send(protocol, {"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    _send(protocol, {"ready": True})
    entries: dict[tuple[str, int], Any] = {}  # generating an entry can take longer than scoring
    for line in sys.stdin:
        request = json.loads(line)
        key = (request["split"], int(request["index"]))
        if key not in entries:
            entries[key] = datasets[key[0]][key[1]]
        reply = _in_child(datasets[key[0]], entries[key], request["answer"], protocol.fileno())
        _send(protocol, reply)


def _warm(dataset: Any) -> None:
    """Score the first entry's own gold answer (task text, not model text) once, so that what the
    scorer imports on first use is imported before the fork and not again in every child."""
    entry = dataset[0]
    try:
        dataset.score_answer(entry.get("answer"), entry)
    except Exception:  # a scorer that cannot score its own answer fails on the real ones
        pass


def _in_child(dataset: Any, entry: Any, answer: str, protocol: int) -> dict[str, Any]:
    """Score one answer in a forked child; its one JSON line comes back on a fresh pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        os.close(protocol)
        _child(dataset, entry, answer, os.fdopen(write, "w", encoding="utf-8"))
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as result:
        lines = result.read().splitlines()
    _, status = os.waitpid(pid, 0)
    if len(lines) != 1 or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return {"score": 0.0, "error": None}  # the answer ended its scorer (or wrote to it)
    reply = json.loads(lines[0])
    score = float(reply["score"])
    if not math.isfinite(score):
        return {"score": 0.0, "error": f"the scorer returned {score}"}
    return {"score": score, "error": reply["error"]}


def _child(dataset: Any, entry: Any, answer: str, result: IO[str]) -> None:
    # bound before the answer runs: an answer that patches json, float or str reaches only
    # the module attributes and builtins, not these names
    dumps, to_float, to_str, exit_now = json.dumps, float, str, os._exit
    try:
        _contain()
        score, error = to_float(dataset.score_answer(answer, entry)), None
    except BaseException as failure:  # the scorer's own failure, or a refused action
        score, error = 0.0, to_str(f"{type(failure).__name__}: {failure}")[:500]
    try:
        result.write(dumps({"score": score, "error": error}) + "\n")
        result.flush()
    finally:
        exit_now(0)


def _contain() -> None:
    """Limits, no raw writes and the audit hook, set in the child before the scorer runs."""
    import _posixsubprocess  # subprocess's fork_exec raises no audit event of its own
    import posix
    import resource

    for name in _RAW_WRITES:
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, _refused(name))
    _posixsubprocess.fork_exec = _refused("fork_exec")

    bound = _mapped() + MEMORY_BYTES
    for limit, value in ((resource.RLIMIT_AS, bound), (resource.RLIMIT_FSIZE, 0),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # above the hard limit already set for us: keep that
            pass
    sys.addaudithook(_refuse)


def _mapped() -> int:
    """Bytes of address space this process has mapped (threads and arenas reserve much more
    than they use, so the bound is set above it, not as a fixed total)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _refused(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(f"{name} is not allowed while scoring an answer")
    return refused


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    if event in _REFUSED or event.startswith(_REFUSED_PREFIXES):
        raise PermissionError(f"{event} is not allowed while scoring an answer")
    if event == "object.__getattr__" and len(args) > 1 and args[1] in _FRAME_ATTRIBUTES:
        raise PermissionError(f"reaching .{args[1]} is not allowed while scoring an answer")
    if event == "open" and _writes(args):
        raise PermissionError(f"opening {args[0]!r} for writing is not allowed while scoring")


def _writes(args: tuple[Any, ...]) -> bool:
    mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _follow_parent() -> None:
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        threading.Thread(target=_watch, args=(int(parent),), daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    os._exit(1)


def _send(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


if __name__ == "__main__":
    main()
