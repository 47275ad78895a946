"""Programming tasks in one shape, read from MBPP or HumanEval rows, plus generated ones.

A task is a dict with:
    prompt       what the model is asked (HumanEval: the signature and docstring to complete)
    tests        Python statements, each one test (an assert); they run after the program, in
                 its namespace
    setup        code run before the program (imports the tests need), maybe ""
    entry_point  the function the tests call, when known

`normalize(row)` accepts:
    MBPP         {"text" or "prompt", "test_list", "test_setup_code"?, "test_imports"?}
    HumanEval    {"prompt", "test" (defines check(candidate)), "entry_point"}
    this shape   {"prompt", "tests", "setup"?, "entry_point"?}

HumanEval's `check(candidate)` is split into one test per top-level assert (its other statements
run before each), so a reward can count the share of asserts passed, as MBPP's list does.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["normalize", "humaneval_tests", "synthetic_tasks", "TaskError"]


class TaskError(ValueError):
    """A row that is not a task in any of the accepted forms."""


def normalize(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row as a task (see the module docstring); TaskError says what is missing."""
    if "tests" in row:
        tests = row["tests"]
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise TaskError("'tests' must be a list of Python statements (strings)")
        return {"prompt": str(row["prompt"]), "tests": list(tests),
                "setup": str(row.get("setup") or ""), "entry_point": row.get("entry_point")}
    if "test" in row and "entry_point" in row:  # HumanEval
        return {"prompt": str(row["prompt"]), "setup": "",
                "tests": humaneval_tests(str(row["test"]), str(row["entry_point"])),
                "entry_point": str(row["entry_point"])}
    if "test_list" in row:  # MBPP (original or sanitized)
        text = row.get("text") or row.get("prompt")
        if not text:
            raise TaskError("an MBPP row needs 'text' (or 'prompt') with the problem")
        tests = [str(t) for t in row["test_list"]]
        setup = "\n".join([*(row.get("test_imports") or []), row.get("test_setup_code") or ""])
        entry = _called(tests[0]) if tests else None
        prompt = str(text) + (f"\nThe function should be called {entry}." if entry else "")
        example = f"\nIt must pass this test:\n{tests[0]}" if tests else ""
        return {"prompt": prompt + example, "tests": tests, "setup": setup.strip(),
                "entry_point": entry}
    raise TaskError(
        f"a task row needs 'tests' (this package's form), 'test' and 'entry_point' (HumanEval) "
        f"or 'test_list' (MBPP); this one has {sorted(row)}")


def humaneval_tests(test_code: str, entry_point: str) -> list[str]:
    """One test per top-level assert of `def check(candidate)` in HumanEval's test code; each
    runs the module's other statements and check's non-assert statements first."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as error:
        raise TaskError(f"the test code does not parse: {error}") from None
    check = next((node for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name == "check"), None)
    if check is None:
        raise TaskError("HumanEval test code must define check(candidate)")
    module = [ast.unparse(node) for node in tree.body if node is not check]
    argument = check.args.args[0].arg if check.args.args else "candidate"
    before = [f"{argument} = {entry_point}", *module]
    tests = []
    for node in check.body:
        if isinstance(node, ast.Assert):
            tests.append("\n".join([*before, ast.unparse(node)]))
        else:
            before.append(ast.unparse(node))
    if not tests:  # no top-level asserts: the whole check is one test
        tests.append("\n".join([*module, ast.unparse(check), f"check({entry_point})"]))
    return tests


def _called(test: str) -> str | None:
    match = re.search(r"assert\s+(?:not\s+)?\(?\s*([A-Za-z_]\w*)\s*\(", test)
    return match.group(1) if match else None


# -- generated tasks -----------------------------------------------------------------------------

_KINDS = (
    ("add_{k}", "Write a Python function add_{k}(x) that returns x plus {k}.",
     "def add_{k}(x):\n    return x + {k}", lambda k, x: x + k),
    ("times_{k}", "Write a Python function times_{k}(x) that returns x multiplied by {k}.",
     "def times_{k}(x):\n    return x * {k}", lambda k, x: x * k),
    ("minus_{k}", "Write a Python function minus_{k}(x) that returns x minus {k}.",
     "def minus_{k}(x):\n    return x - {k}", lambda k, x: x - k),
    ("mod_{k}", "Write a Python function mod_{k}(x) that returns the remainder of x divided by "
     "{k}.", "def mod_{k}(x):\n    return x % {k}", lambda k, x: x % k),
)


def synthetic_tasks(n: int, seed: int = 0, tests_per_task: int = 4,
                    constants: Sequence[int] = range(2, 10)) -> list[dict[str, Any]]:
    """`n` small generated tasks (one-line arithmetic functions of x and a constant k drawn from
    `constants`), each with its reference `solution` and `tests_per_task` asserts: data for
    tests and for a tiny model's first runs, with no download."""
    if n < 1 or tests_per_task < 1:
        raise ValueError(f"need n >= 1 and tests_per_task >= 1, got {n}, {tests_per_task}")
    if not constants or min(constants) < 1:
        raise ValueError(f"constants must be positive integers (k = 0 would make x % k fail), "
                         f"got {constants!r}")
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        name, text, solution, fn = rng.choice(_KINDS)
        k = rng.choice(constants)
        entry = name.format(k=k)
        xs = rng.sample(range(-20, 40), tests_per_task)
        tasks.append({"prompt": text.format(k=k), "entry_point": entry, "setup": "",
                      "solution": solution.format(k=k),
                      "tests": [f"assert {entry}({x}) == {fn(k, x)}" for x in xs]})
    return tasks
