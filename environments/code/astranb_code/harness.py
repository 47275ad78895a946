"""How a program's tests are run so that the program cannot forge their verdicts.

Two processes per job, and the tests live in only one of them:

    parent (this process) ── job on stdin ──▶ judge ── requests ──▶ program (in the sandbox)
           ◀── verdicts (a pipe only the judge holds)   ◀── answers ──┘

  - the program runs in the sandbox (`Sandbox.launch`: every containment layer) as a server of
    its own functions (`_runner.py`): its directory holds the program and the task's setup,
    never a test or an expected value;
  - the judge (`_judge.py`) runs beside it, outside the sandbox, in its own session, with its
    own resource limits, not dumpable: it executes the tests, and each call the tests make to
    the program's functions crosses to the program as plain data and back as plain data
    (`_wire`: None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, by
    exact type);
  - the verdicts come to this process over a pipe only the judge holds, each line with the
    job's random token (given to the judge on its stdin, written and closed before the program
    starts); nothing the program writes (its answers, its stdout, its exit code) is read as a
    verdict.

So the program can choose only what its functions return. An object whose `__eq__` is always
True, a subclass of int, a patched exec or json, forged report lines, a rewritten test list:
none of these can cross, or reach the judge. A program that answers too late, too much, out of
turn or not at all fails the test it is in and every later one.

The judge trusts the task (its setup and tests are data set text, run as written, e.g. HumanEval's
`check(candidate)` with the prompt's helper functions); the program's exceptions reach the test
as the built-in exception of the same name (a test may expect a ValueError).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from . import _contain
from ._judge import count_asserts

if TYPE_CHECKING:
    from .sandbox import Limits, Result, Sandbox

_HERE = os.path.dirname(os.path.abspath(__file__))
JUDGE = os.path.join(_HERE, "_judge.py")
ANSWER_BYTES = 8 << 20
"""The longest answer of one call the judge reads (a longer one fails the call)."""
JUDGE_GRACE = 5.0
"""Seconds the judge gets beyond the job's wall clock to report (it stops waiting on the
program at the wall clock itself)."""


def _source(name: str) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        return f.read()


SERVER_FILES = {"_runner.py": _source("_runner.py"), "_wire.py": _source("_wire.py")}
"""What every job's directory holds besides the program and its setup."""


def run_tests(sandbox: Sandbox, program: str, tests: list[str], *, setup: str,
              entry_point: str | None, count: str, limits: Limits) -> Result:
    """The program in the sandbox, the tests in a judge; their Result (see the module doc)."""
    started = time.monotonic()
    request_r, request_w = os.pipe()
    answer_r, answer_w = os.pipe()
    files = {**SERVER_FILES, "program.py": program, "setup.py": setup}
    try:  # the program's pipe ends are closed here once the job has them, or on any failure
        judge = _Judge({"setup": setup, "tests": tests, "entry_point": entry_point,
                        "count": count, "seconds": limits.wall_seconds,
                        "answer_bytes": ANSWER_BYTES, "token": secrets.token_hex(16)},
                       request_w, answer_r)  # starts while the sandbox sets the job up
        try:
            job = sandbox.launch(files, ["_runner.py", str(request_r), str(answer_w)],
                                 limits=limits, pass_fds=(request_r, answer_w))
        except BaseException:
            judge.finish(0)
            raise
    finally:
        os.close(request_r)
        os.close(answer_w)
    with job:
        out = _Collector(job.stdout.fileno(), limits.output_bytes)  # type: ignore[union-attr]
        err = _Collector(job.stderr.fileno(), limits.output_bytes)  # type: ignore[union-attr]
        judge.finish(limits.wall_seconds + JUDGE_GRACE)
        job.wait(0.2)  # the judge is done with it: it ends on its own (its own exit code)...
        job.kill()  # ...or is killed, with whatever it left holding its stdout
        job.wait()
        out.join()
        err.join()
    totals = [count_asserts(t) if count == "asserts" else 1 for t in tests]
    return _result(judge.events, totals, job, out.text(), err.text(), limits,
                   time.monotonic() - started, judge.error, judge.late)


class _Judge:
    """The judge process (see _judge.py), holding the request pipe's write end and the answer
    pipe's read end (closed here once it has them) and the only write end of the verdicts."""

    def __init__(self, job: dict[str, Any], request_w: int, answer_r: int) -> None:
        self.token = job["token"]
        verdict_r, verdict_w = os.pipe()
        try:
            self.process = _contain.popen(
                [sys.executable, "-I", JUDGE, str(request_w), str(answer_r), str(verdict_w)],
                cwd="/", env={"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(request_w, answer_r, verdict_w), start_new_session=True)
        except BaseException:
            os.close(verdict_r)
            raise
        finally:
            for fd in (request_w, answer_r, verdict_w):
                os.close(fd)
        stdin, stderr = self.process.stdin, self.process.stderr
        assert stdin is not None and stderr is not None
        self.verdict_r = verdict_r
        self.reader = _Collector(verdict_r, 1 << 20)
        self.stderr = _Collector(stderr.fileno(), 16 << 10)
        with contextlib.suppress(OSError):  # a judge that died at once: finish() says so
            stdin.write(json.dumps(job, allow_nan=True).encode())
            stdin.close()
        self.events: list[dict[str, Any]] = []
        self.error: str | None = None
        """Why the judge itself failed (None when it exited cleanly)."""
        self.late = False
        """The judge ran past the job's time and was killed."""

    def finish(self, seconds: float) -> None:
        """Waits up to `seconds` for the judge to end, then kills it; reads its verdicts."""
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.late = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.reader.join()
        self.stderr.join()
        self.process.stderr.close()  # type: ignore[union-attr]
        os.close(self.verdict_r)
        tail = self.stderr.text().strip().splitlines()[-1:]
        if self.process.returncode != 0:
            self.error = f"the judge exited with code {self.process.returncode}" + (
                f": {tail[0]}" if tail else "")
        self.events = _events(self.reader.text(), self.token)


def _events(text: str, token: str) -> list[dict[str, Any]]:
    """The judge's verdict lines: those that carry this job's token."""
    events = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and isinstance(event.get("event"), str) \
                    and event.get("token") == token:
                events.append(event)
    return events


def _result(events: list[dict[str, Any]], totals: list[int], job: Any, out: str, err: str,
            limits: Limits, seconds: float, judge_error: str | None, late: bool) -> Result:
    from .sandbox import Result

    outcome = {e["index"]: e for e in events if e["event"] == "test"
               and isinstance(e.get("index"), int) and 0 <= e["index"] < len(totals)}
    first_failure = next((outcome[i].get("error") for i in sorted(outcome)
                          if outcome[i].get("error")), None)
    said = {e["event"]: e for e in events}
    timed_out = late or job.timed_out or "timeout" in said
    error: str | None
    if timed_out:
        error = f"timed out after {limits.wall_seconds:g} s (the job was killed)"
    elif job.memory_exceeded:
        error = (f"killed: its processes together used over {limits.job_memory_bytes} bytes "
                 "of memory")
    elif "program" in said:
        error = _program_failed(str(said["program"].get("error")), job.returncode, limits, err)
    elif "setup" in said:
        error = f"the task's setup failed in the judge: {said['setup'].get('error')}"
    elif "done" not in said:
        error = judge_error or "the judge ended before finishing"
    elif first_failure is not None:
        error = f"a test failed: {first_failure}"
        if "the program ended" in first_failure:
            error += f" ({why_it_died(job.returncode, limits, err)})"
    else:
        error = None
    score = sum(min(int(outcome[i].get("passed", 0)), totals[i]) for i in outcome)
    return Result(score, sum(totals), error, timed_out, job.returncode, out, err, seconds,
                  dict(job.isolation))


def _program_failed(error: str, code: int | None, limits: Limits, err: str) -> str:
    if error.startswith("the program ended"):
        return why_it_died(code, limits, err)
    return error if error.startswith("the program") else f"the program failed: {error}"


def why_it_died(code: int | None, limits: Limits, err: str) -> str:
    """A job's end in words: the signal (and the limit behind it) or its exit code. Under
    bubblewrap (and a PID namespace's init) a signal's end arrives as exit code 128 + signal."""
    number = -code if code is not None and code < 0 else (
        code - 128 if code is not None and code - 128 in signal.valid_signals() else None)
    if number is not None:
        if number == signal.SIGXCPU:
            return f"killed by SIGXCPU: over {limits.cpu_seconds:g} CPU seconds"
        if number == signal.SIGXFSZ:
            return f"killed by SIGXFSZ: a file over {limits.file_bytes} bytes"
        return f"killed by {signal.Signals(number).name}"
    tail = err.strip().splitlines()[-1:] if err.strip() else []
    return f"the program exited with code {code} before finishing" + (
        f": {tail[0]}" if tail else "")


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
