"""The math-verify worker: `python path/to/_verify_worker.py`, one JSON object per line.

It reads requests {"answer": str, "gold": str} on stdin and writes {"correct": bool,
"error": str | null} on stdout, one line each, after a first line {"ready": true} (or
{"ready": false, "error": ...} when math-verify cannot be imported). The parent
(`astranb_math.verify.AnswerVerifier`) owns the timeout: math-verify's own signal-based timeouts
are switched off, and a request that takes too long gets this process killed and replaced.

It runs as a script, not with `-m`, so that it imports neither this package nor astranb (and
their torch): only the standard library and math-verify. Only this module's writes reach the
parent: file descriptor 1 is kept for the protocol and the
process's stdout is pointed at stderr, so a library that prints cannot corrupt the stream.

The parent starts it in a session of its own (out of reach of Ctrl-C and the kernel's stop
button) and names itself in ASTRANB_PARENT_PID; once that process is no longer this one's parent,
the worker ends, also in the middle of a check (its stdin closing is only seen between checks).
astranb.lifeline does the same for astranb's own children; this script cannot import it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import IO, Any

HANG_FOR_TESTS = "ASTRANB_MATH_VERIFY_HANG_ON"
"""Tests set this variable to an answer on which the worker then never returns (a stand-in for
math-verify stuck on an adversarial string)."""


PARENT_ENV = "ASTRANB_PARENT_PID"
POLL = 0.2  # seconds between looks at the parent


def main() -> None:
    _follow_parent()
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # the package's modules (verify, answers, ...) must not shadow others
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        from math_verify import parse, verify
    except Exception as error:  # ImportError, or a broken install
        _send(protocol, {"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" notices
    _send(protocol, {"ready": True})
    hang_on = os.environ.get(HANG_FOR_TESTS)
    for line in sys.stdin:
        request = json.loads(line)
        if hang_on is not None and request.get("answer") == hang_on:
            while True:
                time.sleep(3600)
        _send(protocol, _check(parse, verify, request))


def _follow_parent() -> None:
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        threading.Thread(target=_watch, args=(int(parent),), daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    os._exit(1)


def _check(parse: Any, verify: Any, request: dict[str, Any]) -> dict[str, Any]:
    try:
        gold = parse(_boxed(request["gold"]), parsing_timeout=None)
        if not gold:
            return {"correct": False, "error": f"math-verify cannot read the gold answer "
                                               f"{request['gold']!r}"}
        answer = parse(_boxed(request["answer"]), parsing_timeout=None)
        correct = bool(answer) and verify(gold, answer, timeout_seconds=None)
        return {"correct": bool(correct), "error": None}
    except Exception as error:
        return {"correct": False, "error": f"math-verify failed: {type(error).__name__}: {error}"}


def _boxed(text: str) -> str:
    """Answers arrive already extracted; boxing them makes math-verify read them as one LaTeX
    expression (`\\frac{1}{2}`, `0.5` and `1/2` alike)."""
    return f"\\boxed{{{text}}}"


def _send(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


if __name__ == "__main__":
    main()
