"""The judge: runs a task's tests against a program it can only call, and alone decides verdicts.

`python -I _judge.py REQUEST_FD ANSWER_FD VERDICT_FD`, started by the sandbox beside the job (not
in it): its own session, resource limits it sets itself, not dumpable (a process of the same
user can neither trace it nor read its memory or descriptors), holding none of the program's
descriptors. It reads the job on stdin:

    {"setup": "...", "tests": ["...", ...], "entry_point": "f" | null,
     "count": "tests" | "asserts", "seconds": 10.0, "answer_bytes": 8388608, "token": "..."}

executes `setup` (trusted task code: imports, HumanEval's prompt with its helpers), binds every
name the tests use but neither setup nor the tests define (and the entry point) to the program's
function of that name, a `_Remote` that crosses the boundary as plain data (`_wire`), then runs
each test here. Each verdict goes to VERDICT_FD, which only the judge and the sandbox hold,
with the job's random `token` (a line without it is not the judge's):

    {"event": "program", "ok": false, "error": "..."}      the program failed to load
    {"event": "test", "index": i, "passed": p, "total": t, "error": "..." | null}
    {"event": "timeout", "error": "..."}                   the program stopped answering
    {"event": "done"}

count "tests": each test is one, passed when it runs without an exception. count "asserts":
each `assert` of a test that can fail (`assert True` cannot) is one, passed when it held every
time it ran (an assert in a loop runs many times); an assert that failed does not stop the test,
and one never reached fails.

A call fails the test it is in, whatever the test code catches, when the program answers with
anything but plain data, answers late (past the job's `seconds`), too much (`answer_bytes`), out
of turn, or not at all; after such a failure the program is not asked again.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import resource
import select
import signal
import sys
import time
from typing import Any, NoReturn

if __package__:  # imported by the sandbox's side (count_asserts, can_fail)
    from . import _wire
else:  # run as the judge: the codec is the file beside this one
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _wire  # type: ignore[no-redef]

PR_SET_DUMPABLE, PR_SET_PDEATHSIG = 4, 1
MODULES = frozenset({
    "array", "bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions",
    "functools", "hashlib", "heapq", "itertools", "json", "math", "operator", "random", "re",
    "statistics", "string", "sys", "typing", "unicodedata"})
"""Modules the tests may use through the program's imports (MBPP's tests call `math.isclose`
when the program imported math): the judge imports its own copy, and only these."""
JUDGE_MEMORY = 2 << 30


class Misconduct(BaseException):
    """The program broke the protocol (not plain data, late, too much, gone): the test fails even
    if its code catches exceptions, so this is no `Exception`."""


class _Program:
    """The program's end of the two pipes: one request, one answer, in turn."""

    def __init__(self, requests: int, answers: int, deadline: float, answer_bytes: int) -> None:
        self.requests, self.answers = requests, answers
        self.deadline, self.answer_bytes = deadline, answer_bytes
        self.next_id, self.pending = 1, bytearray()
        self.gone: str | None = None
        """Why the program is no longer asked (None while it answers)."""
        self.timed_out = False
        self.misconduct = False
        """Set by any misconduct; the judge clears it before each test."""

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.gone is not None:
            self._fail(self.gone)
        request["id"], self.next_id = self.next_id, self.next_id + 1
        try:
            os.write(self.requests, (json.dumps(request, allow_nan=True) + "\n").encode())
        except OSError:
            self._stop("the program ended (it stopped reading its requests)")
        try:
            answer = _wire.loads(self._line())
        except _wire.WireError as error:
            self._stop(f"the program's answer is {error}")
        if type(answer) is not dict or answer.get("id") != request["id"]:
            self._stop("the program answered out of turn")
        if "program_error" in answer:
            self._stop(f"the program failed: {str(answer['program_error'])[:2000]}")
        return answer

    def _line(self) -> bytes:
        while b"\n" not in self.pending:
            if len(self.pending) > self.answer_bytes:
                self._stop(f"the program answered more than {self.answer_bytes} bytes")
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                self.timed_out = True
                self._stop("the program did not answer in time")
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                self._stop("the program ended")
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending = bytearray(rest)
        if len(line) > self.answer_bytes:
            self._stop(f"the program answered more than {self.answer_bytes} bytes")
        return line

    def _stop(self, why: str) -> NoReturn:
        self.gone = self.gone or why
        self._fail(why)

    def _fail(self, why: str) -> NoReturn:
        self.misconduct = True
        raise Misconduct(why)


class _Remote:
    """A function of the program, called with plain data, returning plain data."""

    def __init__(self, program: _Program, name: str) -> None:
        self._program, self.__name__ = program, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            request = {"call": self.__name__, "args": [_wire.encode(a) for a in args],
                       "kwargs": {str(k): _wire.encode(v) for k, v in kwargs.items()}}
        except _wire.WireError as error:
            raise TypeError(f"the test passes {self.__name__} {error}") from None
        answer = self._program.ask(request)
        if answer.get("ok") is True:
            try:
                return _wire.decode(answer.get("value"))
            except _wire.WireError as error:
                self._program._fail(f"{self.__name__} returned {error}")
        if answer.get("type") == "NotPlainData":
            self._program._fail(f"{self.__name__} {str(answer.get('error'))[:300]}")
        raise _as_exception(str(answer.get("type")), str(answer.get("error"))[:2000])

    def __repr__(self) -> str:
        return f"<the program's {self.__name__}>"


def _as_exception(kind: str, message: str) -> Exception:
    """The program's exception as the built-in of that name (tests may expect a ValueError),
    else a RuntimeError; never one that is not an Exception (SystemExit, KeyboardInterrupt)."""
    found = getattr(builtins, kind, None)
    if isinstance(found, type) and issubclass(found, Exception) and not issubclass(
            found, (StopIteration, StopAsyncIteration)):
        try:
            return found(message)
        except Exception:  # one that takes other arguments (UnicodeDecodeError)
            pass
    return RuntimeError(f"{kind}: {message}")


# -- which names are the program's ----------------------------------------------------------------

def program_names(setup: str, tests: list[str], entry_point: str | None) -> list[str]:
    """Names the tests use that neither `setup` nor the tests bind, nor Python's builtins (and
    the entry point): what the tests expect from the program."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for source in (setup, *tests):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    names = loaded - bound - set(dir(builtins))
    return sorted(names | {entry_point} if entry_point else names)


# -- counting asserts -----------------------------------------------------------------------------

def can_fail(node: ast.Assert) -> bool:
    """False for an assert whose condition is a true constant (`assert True, "..."`)."""
    return not (isinstance(node.test, ast.Constant) and bool(node.test.value))


def count_asserts(test: str) -> int:
    """The asserts of `test` that can fail (1 when it has none: the test itself counts)."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return 1
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Assert) and can_fail(n)) or 1


class _Sites(ast.NodeTransformer):
    """Rewrites each assert that can fail into `__assert__(k, lambda: condition)`."""

    def __init__(self) -> None:
        self.count = 0

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        if not can_fail(node):
            return node
        call = ast.Call(ast.Name("__assert__", ast.Load()),
                        [ast.Constant(self.count), ast.Lambda(_no_arguments(), node.test)], [])
        self.count += 1
        return ast.copy_location(ast.Expr(call), node)


def _no_arguments() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                         kwarg=None, defaults=[])


# -- running the job ------------------------------------------------------------------------------

class _Judge:
    def __init__(self, job: dict[str, Any], program: _Program, verdicts: int) -> None:
        self.job, self.program, self.verdicts = job, program, verdicts
        self.namespace: dict[str, Any] = {"__name__": "__judge__"}

    def send(self, message: dict[str, Any]) -> None:
        message["token"] = self.job["token"]
        os.write(self.verdicts, (json.dumps(message) + "\n").encode())

    def run(self) -> None:
        exec(compile(self.job["setup"], "setup.py", "exec"), self.namespace)
        if self.bind():
            for index, test in enumerate(self.job["tests"]):
                self.send(self.test(index, test))
        if self.program.timed_out:
            self.send({"event": "timeout", "error": self.program.gone})
        self.send({"event": "done"})

    def bind(self) -> bool:
        """The program's names into the namespace; False when the program failed to load."""
        entry = self.job.get("entry_point")
        names = [n for n in program_names(self.job["setup"], self.job["tests"], entry)
                 if n == entry or n not in self.namespace]
        try:
            described = self.program.ask({"describe": names}).get("value")
        except Misconduct as error:
            self.send({"event": "program", "ok": False, "error": str(error)})
            return False
        for name in names:
            kind = described.get(name) if type(described) is dict else None
            self.namespace.pop(name, None)
            if kind == "function":
                self.namespace[name] = _Remote(self.program, name)
            elif type(kind) is list and len(kind) == 2 and kind[0] == "value":
                try:
                    self.namespace[name] = _wire.decode(kind[1])
                except _wire.WireError:
                    pass
            elif type(kind) is list and len(kind) == 2 and kind[0] == "module" \
                    and kind[1] in MODULES:  # the judge's own copy of a module the tests use
                self.namespace[name] = importlib.import_module(kind[1])
        return True

    def test(self, index: int, source: str) -> dict[str, Any]:
        self.program.misconduct = False
        if self.job["count"] == "asserts":
            return self.asserts(index, source)
        error = self.execute(source, f"test_{index}.py")
        return {"event": "test", "index": index, "passed": int(error is None), "total": 1,
                "error": error}

    def asserts(self, index: int, source: str) -> dict[str, Any]:
        sites = _Sites()
        try:
            tree: Any = ast.fix_missing_locations(sites.visit(ast.parse(source)))
        except SyntaxError:
            tree = source  # execute() reports the SyntaxError
        held: dict[int, bool] = {}
        first: list[str] = []

        def check(site: int, condition: Any) -> None:
            try:
                ok = bool(condition())
                why = None if ok else "AssertionError"
            except BaseException as error:
                ok, why = False, _describe(error)
            if ok and self.program.misconduct:  # the test swallowed a Misconduct
                ok, why = False, "the program misbehaved"
            held[site] = held.get(site, True) and ok
            if why and not first:
                first.append(why)

        self.namespace["__assert__"] = check
        error = self.execute(tree, f"test_{index}.py")
        total = sites.count or 1  # no assert that can fail: the test itself counts
        passed = sum(held.values()) if sites.count else int(error is None)
        return {"event": "test", "index": index, "passed": passed, "total": total,
                "error": (first[0] if first else error) if passed < total else None}

    def execute(self, source: Any, filename: str) -> str | None:
        """Runs a test (source or syntax tree); its error in one line, or None."""
        try:
            exec(compile(source, filename, "exec"), self.namespace)
        except BaseException as error:
            return _describe(error)
        return "the program misbehaved" if self.program.misconduct else None


def _describe(error: BaseException) -> str:
    if isinstance(error, Misconduct):
        return str(error)
    text = f"{type(error).__name__}: {error}".rstrip(": ").replace("\n", " ")
    return text[:2000]


def _undumpable() -> None:
    """No ptrace of this process, no /proc/<pid>/mem, environ or fd of it, for any other
    process of its user; and it ends with the process that started it."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _limit(seconds: float) -> None:
    """Bounds this process: the tests are trusted, not infallible."""
    cpu = int(seconds) + 5
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (JUDGE_MEMORY, JUDGE_MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    _undumpable()  # before the job is read: no other process may read it from us
    requests, answers, verdicts = (int(a) for a in sys.argv[1:4])
    job = json.loads(sys.stdin.buffer.read())
    _limit(job["seconds"])
    program = _Program(requests, answers, time.monotonic() + job["seconds"], job["answer_bytes"])
    judge = _Judge(job, program, verdicts)
    try:
        judge.run()
    except BaseException as error:  # the task's own setup failed: no test can run
        judge.send({"event": "setup", "error": _describe(error)})
        judge.send({"event": "done"})


if __name__ == "__main__":
    main()
