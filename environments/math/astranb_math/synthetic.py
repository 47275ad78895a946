"""Generated problems and cold-start demonstrations, for runs without a dataset download.

`sum_problems` writes two-number additions in GSM8K's format ("... #### 85"): too hard for a
tiny model to do in its head, easy with the calculator. `demonstrations` turns problems into
format demonstrations for `policy.sft`: a share of them call the calculator and copy its result
into `\\boxed{}`, the rest answer at once without it (the way a model answers before it has
learned that the tool pays). RL then has something real to learn: when to call the tool.
`gsm8k_demonstrations` does the same for GSM8K rows, from their worked solutions.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .calculator import calculator

__all__ = ["sum_problems", "demonstrations", "gsm8k_demonstrations"]


def sum_problems(n: int, seed: int = 0, low: int = 10, high: int = 49) -> list[dict[str, Any]]:
    """`n` problems "What is a + b?" with a, b drawn uniformly from [low, high] (seeded).

    Each has "question", "answer" ("#### a+b", as GSM8K writes it) and "expression" ("a + b").
    """
    if n < 1 or low > high:
        raise ValueError(f"need n >= 1 and low <= high, got n={n}, low={low}, high={high}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        problems.append({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}",
                         "expression": f"{a} + {b}"})
    return problems


def demonstrations(problems: Sequence[Mapping[str, Any]], system_prompt: str,
                   tool_share: float = 0.5, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations for `policy.sft`: with probability `tool_share` a problem is solved by a
    calculator call whose result is copied into the answer, else answered directly."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share!r}")
    rng = random.Random(seed)
    out = []
    for problem in problems:
        value = calculator(str(problem["expression"]))
        start = [{"role": "system", "content": system_prompt},
                 {"role": "user", "content": str(problem["question"])}]
        answer = {"role": "assistant", "content": f"The answer is \\boxed{{{value}}}."}
        if rng.random() < tool_share:
            call = json.dumps({"name": "calculator",
                               "arguments": {"expression": problem["expression"]}})
            middle = [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                      {"role": "tool", "name": "calculator", "content": value}]
        else:
            middle = []
        out.append({"messages": start + middle + [answer], "tools": [calculator]})
    return out


_ANNOTATION = re.compile(r"<<[^<>]*>>")


def gsm8k_demonstrations(rows: Sequence[Mapping[str, Any]], system_prompt: str
                         ) -> list[dict[str, Any]]:
    """Format demonstrations from GSM8K rows ("question", "answer" = worked solution ending in
    "#### x"): the solution's reasoning without its calculator annotations, then \\boxed{x}."""
    out = []
    for row in rows:
        solution, _, final = str(row["answer"]).rpartition("####")
        reasoning = _ANNOTATION.sub("", solution).strip()
        content = f"{reasoning}\nThe answer is \\boxed{{{final.strip()}}}."
        out.append({"messages": [{"role": "system", "content": system_prompt},
                                 {"role": "user", "content": str(row["question"])},
                                 {"role": "assistant", "content": content}],
                    "tools": [calculator]})
    return out
