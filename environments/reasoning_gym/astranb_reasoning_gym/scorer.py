"""Scoring answers with the task's own scorer, in a worker process, with a hard timeout.

`Scorer` keeps one worker subprocess (`_score_worker.py`, run as a script; each answer is scored
in a contained child of it, as its docstring says) that rebuilds the environment's datasets from
their JSON spec, and talks to it in
JSON lines: (split, index, answer) in, the scorer's float out. The blocking pipe reads run in a
thread, one request at a time. A request past `timeout` kills the worker's process group and
raises `ScoreTimeout`; the next request starts a fresh worker. No pickle: entries never cross
(the worker regenerates them from the seed), only the answer text and the index do.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import anyio

__all__ = ["Scorer", "ScoreError", "ScoreTimeout"]

PARENT_ENV = "ASTRANB_PARENT_PID"  # _score_worker.PARENT_ENV (this module imports no package)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_score_worker.py")


class ScoreError(RuntimeError):
    """The scoring worker could not start or stopped (the episode fails with this)."""


class ScoreTimeout(ScoreError):
    """The scorer took longer than the timeout; its worker was replaced."""


class Scorer:
    """The task's `score_answer` in a contained worker process.

    Args:
        spec: the datasets' JSON spec (see `_score_worker.build`).
        timeout: seconds one answer's scoring may take.
        startup_timeout: seconds the worker may take to import reasoning-gym and build datasets.
    """

    def __init__(self, spec: dict[str, Any], timeout: float = 5.0,
                 startup_timeout: float = 120.0):
        if timeout <= 0 or startup_timeout <= 0:
            raise ValueError(f"timeouts must be > 0, got timeout={timeout}, "
                             f"startup_timeout={startup_timeout}")
        self.spec = spec
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._state: dict[str, Any] = {"proc": None, "pending": b""}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill, self._state)

    async def score(self, split: str, index: int, answer: str) -> tuple[float, str | None]:
        """(the task's score of `answer` for entry `index` of `split`, the scorer's error or
        None). A scorer that raised scores 0 with its error; a timeout raises ScoreTimeout."""
        request = {"split": split, "index": index, "answer": answer}
        return await anyio.to_thread.run_sync(self._ask, request, abandon_on_cancel=True)

    def close(self) -> None:
        """Stop the worker (a later score starts a new one)."""
        with self._lock:
            _kill(self._state)

    def _ask(self, request: dict[str, Any]) -> tuple[float, str | None]:
        with self._lock:
            if self._state["proc"] is None or self._state["proc"].poll() is not None:
                self._start()
            try:
                self._write(request)
                reply = self._read(self.timeout)
            except ScoreTimeout:
                _kill(self._state)
                raise ScoreTimeout(f"the scorer took longer than {self.timeout:g} s; the worker "
                                   "was restarted") from None
            except ScoreError:
                _kill(self._state)
                raise
        return float(reply["score"]), reply.get("error")

    def _start(self) -> None:
        _kill(self._state)
        self._state["proc"] = subprocess.Popen(
            [sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # a session of its own: Ctrl-C does not reach it, a kill takes what it spawned
            start_new_session=True, env={**os.environ, PARENT_ENV: str(os.getpid())})
        try:
            self._write({"spec": self.spec})
            hello = self._read(self.startup_timeout)
        except ScoreError as error:
            _kill(self._state)
            raise ScoreError(f"the reasoning-gym scoring worker did not start ({error}); check "
                             f"that `{sys.executable} {WORKER}` runs") from None
        if not hello.get("ready"):
            _kill(self._state)
            raise ScoreError(f"the scoring worker cannot build the datasets "
                             f"({hello.get('error')})")

    def _write(self, message: dict[str, Any]) -> None:
        proc = self._state["proc"]
        try:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise ScoreError("the scoring worker stopped") from None

    def _read(self, timeout: float) -> dict[str, Any]:
        proc = self._state["proc"]
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._state["pending"]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ScoreTimeout(f"no answer within {timeout:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ScoreError("the scoring worker closed its output")
            self._state["pending"] += chunk
        line, self._state["pending"] = self._state["pending"].split(b"\n", 1)
        return dict(json.loads(line))


def _kill(state: dict[str, Any]) -> None:
    proc, state["proc"], state["pending"] = state["proc"], None, b""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
