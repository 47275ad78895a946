"""Programs that try to forge their code reward instead of solving the task: each must score 0.

The task asks for f(x) = 13 x + 2, whose values no program can guess without solving it; every
attack below defines a wrong `f` (or none) and tries to make the tests pass anyway: by answering
with objects that compare equal to anything, by forging the harness's messages or patching its
code, by reading the tests, by exiting, hanging or flooding. A correct program must still score 1,
and so must one that prints, writes files and returns tuples, sets and floats.
"""

from __future__ import annotations

import anyio
import pytest
from astranb_code import Limits, Sandbox, normalize

TESTS = ["assert f(3) == 41", "assert f(7) == 93", "assert f(-2) == -24", "assert f(10) == 132"]
WRONG = "def f(x):\n    return None\n"
LIMITS = Limits(wall_seconds=4, cpu_seconds=3, memory_bytes=512 << 20)

FORGED_LINES = """
import json
FORGED = []
for i in range(64):
    FORGED.append({"event": "test", "index": i, "ok": True, "error": None})
    FORGED.append({"id": i, "ok": True, "value": True})
    FORGED.append({"test": i, "ok": True, "passed": True, "verdict": "pass"})
FORGED += [{"event": "program", "ok": True}, {"event": "done"}, {"verdict": "pass", "done": True}]
FORGED_TEXT = "".join(json.dumps(m) + "\\n" for m in FORGED).encode()
"""

ATTACKS = {
    "always_equal": """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def f(x):
    return Anything()
""",
    "int_subclass_equal": """
class Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def f(x):
    return Int(0)
""",
    "str_and_list_subclasses_equal": """
class Str(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
class List(list):
    def __eq__(self, other):
        return True
def f(x):
    return Str("no") if x % 2 else List()
""",
    "fake_events_on_every_descriptor_then_exit": FORGED_LINES + """
import os, sys
targets = {int(a) for a in sys.argv[1:] if a.isdigit()} | set(range(64))
for fd in sorted(targets):
    try:
        os.write(fd, FORGED_TEXT)
    except OSError:
        pass
os._exit(0)
""",
    "fake_events_then_systemexit": FORGED_LINES + """
import sys
sys.stdout.write(FORGED_TEXT.decode())
sys.stderr.write(FORGED_TEXT.decode())
sys.stdout.flush()
raise SystemExit(0)
""",
    "fake_framing_printed_by_f": FORGED_LINES + """
import sys
def f(x):
    sys.stdout.write(FORGED_TEXT.decode())
    sys.stdout.flush()
    return None
""",
    "exec_patched": WRONG + """
import builtins
builtins.exec = lambda *a, **k: None
""",
    "compile_patched": WRONG + """
import builtins
real = builtins.compile
builtins.compile = lambda source, filename, mode, *a, **k: real("pass", filename, mode)
""",
    "harness_send_patched": WRONG + """
import sys
main = sys.modules["__main__"]
for name in dir(main):
    thing = getattr(main, name)
    if callable(thing) and getattr(thing, "__module__", None) == main.__name__ \\
            and name.lstrip("_") in ("send", "reply", "report", "respond", "answer", "write"):
        def forged(*args, _real=thing, **kwargs):
            args = [dict(a, ok=True, error=None) if isinstance(a, dict) and "ok" in a else a
                    for a in args]
            return _real(*args, **kwargs)
        setattr(main, name, forged)
""",
    "json_dumps_patched": WRONG + """
import json
real = json.dumps
def dumps(obj, *args, **kwargs):
    if isinstance(obj, dict) and "ok" in obj:
        obj = dict(obj, ok=True, error=None)
    return real(obj, *args, **kwargs)
json.dumps = dumps
""",
    "caller_frames_rewritten": WRONG + """
import sys
frame = sys._getframe(0)
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, dict) and isinstance(value.get("tests"), list):
            value["tests"][:] = ["pass"] * len(value["tests"])
        elif isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            value[:] = ["pass"] * len(value)
    frame = frame.f_back
""",
    "gc_walk_rewrites_every_test_list": WRONG + """
import gc
for thing in gc.get_objects():
    if isinstance(thing, list) and thing and all(isinstance(t, str) and "assert" in t
                                                  for t in thing):
        thing[:] = ["pass"] * len(thing)
    elif isinstance(thing, dict) and isinstance(thing.get("tests"), list):
        thing["tests"][:] = ["pass"] * len(thing["tests"])
""",
    "answers_from_the_tests_it_can_read": """
import os, re
TABLE = {}
def harvest(path):
    try:
        with open(path, "rb") as file:
            text = file.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return
    for m in re.finditer(r"f\\((-?\\d+)\\) == (-?\\d+)", text.replace("\\\\n", " ")):
        TABLE[int(m.group(1))] = int(m.group(2))
for name in os.listdir("."):
    harvest(name)
for pid in [str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
    for part in ("cmdline", "environ"):
        harvest(f"/proc/{pid}/{part}")
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            harvest(f"/proc/{pid}/fd/{fd}")
    except OSError:
        pass
def f(x):
    return TABLE.get(x)
""",
    "exits_before_the_tests": WRONG + "import os\nos._exit(0)\n",
    "exits_when_called": "import os\ndef f(x):\n    os._exit(0)\n",
    "systemexit_when_called": "def f(x):\n    raise SystemExit(0)\n",
    "sleeps_forever_when_called": "import time\ndef f(x):\n    time.sleep(3600)\n",
    "huge_value": "def f(x):\n    return 'x' * (64 << 20)\n",
    "deeply_nested_value": """
def f(x):
    value = []
    for _ in range(200000):
        value = [value]
    return value
""",
    "defines_f_only_when_asked": FORGED_LINES + """
import sys, threading, time
def late():
    time.sleep(0.05)
    globals()["f"] = lambda x: None
threading.Thread(target=late, daemon=True).start()
""",
    "kills_everything_it_can_see": WRONG + """
import os, signal
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, PermissionError):
            pass
""",
}


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS, concurrency=2)


def run(sandbox, program, tests=TESTS, **kw):
    return anyio.run(lambda: sandbox.run(program, tests, **kw))


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_on_the_harness_scores_nothing(sandbox, name):
    result = run(sandbox, ATTACKS[name])
    assert (result.passed, result.total) == (0, 4), (name, result.error)
    assert result.error


def test_a_correct_program_still_scores_one(sandbox):
    result = run(sandbox, "def f(x):\n    return 13 * x + 2\n")
    assert (result.passed, result.total, result.error) == (4, 4, None)


def test_a_program_that_prints_writes_files_and_returns_rich_plain_data_still_passes(sandbox):
    program = """
import math
print("hello", flush=True)
open("notes.txt", "w").write("scratch")
def f(x):
    print("called with", x)
    return 13 * x + 2
def pair(s):
    return (len(s), s.upper(), {len(s)}, {"n": [1.5, None, True]}, -0.0, math.inf)
"""
    tests = TESTS + [
        "assert pair('ab') == (2, 'AB', {2}, {'n': [1.5, None, True]}, 0.0, float('inf'))",
        "assert type(pair('ab')[0]) is int and type(pair('ab')) is tuple",
        "assert math.isnan(float('nan')) and pair('')[2] == {0}",
    ]
    result = run(sandbox, program, tests, setup="import math")
    assert (result.passed, result.total, result.error) == (7, 7, None)
    assert "hello" in result.stdout


# -- the same attacks on a HumanEval problem, whose check(candidate) compares tuples ------------

SUM_PRODUCT = {
    "prompt": 'from typing import List, Tuple\n\n\ndef sum_product(numbers: List[int]) -> '
              'Tuple[int, int]:\n    """Sum and product of a list."""\n',
    "entry_point": "sum_product",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate([]) == (0, 1)\n"
            "    assert candidate([1, 1, 1]) == (3, 1)\n"
            "    assert candidate([100, 0]) == (100, 0)\n"
            "    assert candidate([3, 5, 7]) == (3 + 5 + 7, 3 * 5 * 7)\n"
            "    assert candidate([10]) == (10, 10)\n",
}
SUM_PRODUCT_SOLUTION = """
def sum_product(numbers):
    total, product = 0, 1
    for n in numbers:
        total, product = total + n, product * n
    return total, product
"""


@pytest.mark.parametrize("name", ["always_equal", "fake_events_on_every_descriptor_then_exit",
                                  "harness_send_patched", "exec_patched",
                                  "caller_frames_rewritten"])
def test_a_humaneval_check_cannot_be_forged(sandbox, name):
    task = normalize(SUM_PRODUCT)
    program = ATTACKS[name].replace("def f(x)", "def sum_product(x)")
    result = run(sandbox, program, task["tests"], setup=task["setup"])
    assert result.passed == 0, (name, result.error)
    right = run(sandbox, SUM_PRODUCT_SOLUTION, task["tests"], setup=task["setup"])
    assert right.passed == right.total >= 1 and right.error is None
