"""The program's side of a job: `_runner.py REQUEST_FD ANSWER_FD`, run in the job's directory
under every layer of the sandbox.

It executes the task's setup and then the program (program.py, setup.py: the only files it is
given; the tests never reach this process or its directory), then serves the program's functions
to the judge, one JSON line per request and per answer:

    {"id": 1, "describe": ["f", "g"]}        -> {"id": 1, "ok": true, "value": {"f": "function",
                                                   "g": "missing"}} (or ["value", DATA],
                                                   ["module", "math"])
    {"id": 2, "call": "f", "args": [DATA...], "kwargs": {"k": DATA}}
                                             -> {"id": 2, "ok": true, "value": DATA}
                                             or {"id": 2, "ok": false, "error": "ValueError: .."}

DATA is `_wire`'s plain-data encoding. When the program itself fails, every answer is
{"ok": false, "program_error": "..."}.

Nothing here is trusted. The program shares this interpreter and may replace any of it, write
anything on ANSWER_FD, exit or hang: the judge (another process, out of the program's reach)
reads an answer only as plain data for the call it made, so all a program can choose is what its
functions return, which is what the tests judge.
"""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _wire  # noqa: E402  (a file beside this one in the job's directory)


def main() -> None:
    requests = os.fdopen(int(sys.argv[1]), "rb")
    answers = os.fdopen(int(sys.argv[2]), "wb", buffering=0)
    namespace: dict = {"__name__": "__main__"}
    failure = _load(namespace)
    for line in requests:
        try:
            request = json.loads(line)
        except ValueError:
            return
        answer = {"id": request.get("id")}
        if failure is not None:
            answer.update(ok=False, program_error=failure)
        elif "describe" in request:
            answer.update(ok=True, value={n: _describe(namespace, n) for n in request["describe"]})
        else:
            answer.update(_call(namespace, request))
        answers.write(_line(answer))


def _load(namespace: dict) -> str | None:
    """Runs setup.py then program.py in `namespace`; the program's error, or None."""
    try:
        for name in ("setup.py", "program.py"):
            with open(name, encoding="utf-8") as file:
                source = file.read()
            exec(compile(source, name, "exec"), namespace)
    except BaseException as error:  # SystemExit and KeyboardInterrupt included
        return _error(error)
    return None


def _describe(namespace: dict, name: str):
    if name not in namespace:
        return "missing"
    thing = namespace[name]
    if isinstance(thing, types.ModuleType):
        return ["module", thing.__name__]
    if callable(thing):
        return "function"
    try:
        return ["value", _wire.encode(thing)]
    except _wire.WireError as error:
        return ["unusable", str(error)]


def _call(namespace: dict, request: dict) -> dict:
    try:
        function = namespace[request["call"]]
        args = [_wire.decode(a) for a in request["args"]]
        kwargs = {k: _wire.decode(v) for k, v in request["kwargs"].items()}
        value = function(*args, **kwargs)
    except BaseException as error:  # the program's exception, even SystemExit
        return {"ok": False, "error": _error(error), "type": type(error).__name__}
    try:
        return {"ok": True, "value": _wire.encode(value)}
    except (_wire.WireError, RecursionError, MemoryError) as error:
        return {"ok": False, "error": f"returned {str(error)[:300]}", "type": "NotPlainData"}


def _line(answer: dict) -> bytes:
    try:
        return (json.dumps(answer, allow_nan=True, separators=(",", ":")) + "\n").encode()
    except (ValueError, RecursionError, MemoryError) as error:
        return (json.dumps({"id": answer.get("id"), "ok": False, "type": "NotPlainData",
                            "error": f"unencodable answer: {_error(error)}"}) + "\n").encode()


def _error(error: BaseException) -> str:
    """One line: "SyntaxError: expected ':' (program.py, line 1)", "AssertionError"."""
    text = f"{type(error).__name__}: {error}".rstrip(": ").replace("\n", " ")
    return text[:2000]


if __name__ == "__main__":
    main()
