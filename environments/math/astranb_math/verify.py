"""Checking answers with math-verify, off the event loop, with a hard timeout.

math-verify turns both answers into SymPy expressions and compares them (so `1/2`, `0.5` and
`\\frac{1}{2}` agree). Parsing LaTeX can take unbounded time on adversarial strings, so it never
runs in the episode's process: each `AnswerVerifier` keeps a small pool of worker subprocesses
(`_verify_worker.py`, run as a script) and talks to them in JSON lines over stdin/stdout. A
call that takes longer than `timeout` kills its worker's process group, scores the answer 0 and
says so (`Verdict.timed_out`); the next call starts a fresh worker. The blocking pipe reads run in
a thread, so concurrent episodes keep generating while one waits, and one verifier can be shared
by episodes on any event loop. Workers stop at `close()`, when the verifier is garbage collected,
or at interpreter exit; a worker whose parent dies exits, even in the middle of a check.

    verifier = AnswerVerifier(timeout=5.0)
    verdict = await verifier.check("0.5", "\\\\frac{1}{2}")   # Verdict(correct=True, ...)
    verifier.close()
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import anyio

__all__ = ["AnswerVerifier", "Verdict", "VerifierUnavailable"]

PARENT_ENV = "ASTRANB_PARENT_PID"  # _verify_worker.PARENT_ENV (this module imports no package)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_verify_worker.py")


@dataclass(frozen=True)
class Verdict:
    """What checking one answer came to."""

    correct: bool
    """The answer equals the gold answer (False on a timeout or an error)."""
    timed_out: bool = False
    """The check took longer than the verifier's timeout; its worker was replaced."""
    error: str | None = None
    """Why the answer could not be checked (timeout, unreadable gold, a dead worker), if so."""


class VerifierUnavailable(RuntimeError):
    """The worker process cannot start (math-verify missing or broken): a setup error."""


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


class _Worker:
    """One worker subprocess and the partial line read from it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending = b""

    def ask(self, request: dict[str, Any], timeout: float, startup_timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start(startup_timeout)
        proc = self.proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise _Died(self.exit_note(proc)) from None
        return self.read(proc, timeout)

    def start(self, startup_timeout: float) -> None:
        self.kill()
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            # a session of its own: Ctrl-C and the kernel's stop button do not reach it, and a
            # kill takes anything it spawned; it ends when this process does (the worker
            # watches the pid it is given, as astranb.lifeline.shielded children do)
            start_new_session=True, env={**os.environ, PARENT_ENV: str(os.getpid())},
        )
        try:
            hello = self.read(self.proc, startup_timeout)
        except (_Timeout, _Died) as error:
            self.kill()
            why = str(error) or f"no answer within {startup_timeout:g} s"
            raise VerifierUnavailable(f"the math-verify worker did not start ({why}); check that "
                                      f"`{sys.executable} {WORKER}` runs") from None
        if not hello.get("ready"):
            self.kill()
            raise VerifierUnavailable(f"the math-verify worker cannot load math-verify "
                                      f"({hello.get('error')}); pip install math-verify")

    def read(self, proc: subprocess.Popen[bytes], timeout: float) -> dict:
        """The next line from `proc`, decoded; _Timeout after `timeout` seconds."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise _Timeout()
                chunk = os.read(fd, 65536)
            except (OSError, ValueError):  # close() from another thread closed the pipe
                raise _Died("the verifier was closed") from None
            if not chunk:
                raise _Died(self.exit_note(proc))
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return dict(json.loads(line))

    def exit_note(self, proc: subprocess.Popen[bytes]) -> str:
        try:
            code = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "the worker closed its output"
        return f"the worker exited with code {code}"

    def kill(self) -> None:
        proc, self.proc, self.pending = self.proc, None, b""
        if proc is None:
            return
        if proc.poll() is None:  # not reaped yet, so its pid (and group) is still its own
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()  # reaped: no zombie
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()


class AnswerVerifier:
    """Checks answers against gold answers with math-verify in worker subprocesses.

    Args:
        timeout: seconds one check may take; past it the answer scores 0 and the worker is
            replaced.
        workers: worker processes (checks beyond that many wait their turn).
        startup_timeout: seconds a worker may take to start (importing SymPy is slow).
        max_chars: answers longer than this are not parsed (they score 0, with an error).

    Example:
        verifier = AnswerVerifier()
        (await verifier.check("72", "72.0")).correct      # True
    """

    def __init__(self, timeout: float = 5.0, *, workers: int = 1,
                 startup_timeout: float = 60.0, max_chars: int = 1000):
        if timeout <= 0 or startup_timeout <= 0:
            raise ValueError(f"timeouts must be > 0, got timeout={timeout}, "
                             f"startup_timeout={startup_timeout}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.max_chars = max_chars
        self._workers = [_Worker() for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __repr__(self) -> str:
        live = sum(w.proc is not None for w in self._workers)
        return (f"AnswerVerifier(timeout={self.timeout}, workers={len(self._workers)}, "
                f"{live} running)")

    async def check(self, answer: str, gold: str) -> Verdict:
        """Whether `answer` equals `gold` (both already extracted, e.g. by `extract_answer`).

        Never raises for the answer's sake: a timeout or an unreadable gold answer is a Verdict
        with `correct=False` and the reason. Raises `VerifierUnavailable` only when no worker can
        start at all.
        """
        if len(answer) > self.max_chars:
            return Verdict(False, error=f"the answer has {len(answer)} characters; answers over "
                                        f"max_chars={self.max_chars} are not checked")
        request = {"answer": answer, "gold": gold}
        return await anyio.to_thread.run_sync(self._check, request, abandon_on_cancel=True)

    def close(self) -> None:
        """Stop the workers (a later check starts new ones)."""
        _stop_all(self._workers)

    def _check(self, request: dict[str, Any]) -> Verdict:
        worker = self._idle.get()
        try:
            reply = worker.ask(request, self.timeout, self.startup_timeout)
        except _Timeout:
            worker.kill()
            return Verdict(False, timed_out=True, error=(
                f"math-verify took longer than {self.timeout:g} s; the answer scores 0 and the "
                "worker was restarted"))
        except _Died as died:
            worker.kill()
            return Verdict(False, error=f"the math-verify worker stopped ({died}); the next "
                                        "check starts a new one")
        finally:
            self._idle.put(worker)
        return Verdict(bool(reply.get("correct")), error=reply.get("error"))
