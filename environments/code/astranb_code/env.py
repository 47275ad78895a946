"""`Code` (a coder writes a program, it runs in the sandbox while a judge runs its tests) and
`CodeVerifier` (a second policy predicts whether the program passes)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

from astranb import Environment, SamplingParams
from astranb.data import DataSource

from .sandbox import Limits, Result, Sandbox
from .tasks import normalize

SYSTEM_PROMPT = ("You write Python. Answer with the complete program in one ```python code "
                 "block: the function the task asks for, and any imports it needs.")
VERIFIER_PROMPT = ("You review Python programs. Read the task and the program, then reply "
                   "\\boxed{pass} if the program solves the task or \\boxed{fail} if not.")

_BLOCK = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def extract_code(content: str) -> str | None:
    """The last fenced code block of a reply (```python ... ```), else the reply itself when it
    defines a function; None when there is no program in it."""
    text = _THINK.sub("", content)
    blocks = _BLOCK.findall(text)
    if blocks:
        return blocks[-1].strip("\n") or None
    if re.search(r"^\s*def \w+\s*\(", text, re.MULTILINE):
        return text.strip("\n")
    return None


def read_prediction(reply: str) -> bool | None:
    """True for a reply ending in \\boxed{pass}, False for \\boxed{fail}, None otherwise."""
    found = re.findall(r"\\boxed\{\s*(pass|fail|yes|no)\s*\}", _THINK.sub("", reply), re.I)
    if not found:
        return None
    return found[-1].lower() in ("pass", "yes")


class _CodeBase(Environment):
    def __init__(self, data: Any, *, columns: Mapping[str, str] | None = None,
                 test_size: float | int | None = None, sandbox: Sandbox | None = None,
                 limits: Limits | None = None, system_prompt: str | None = None,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None, partial_credit: bool = False):
        self.data = data if isinstance(data, DataSource) else DataSource(
            data, columns=columns, test_size=test_size)
        self.splits = self.data.splits
        self.partial_credit = partial_credit
        for split in self.splits:  # a clear error now, not in the first episode
            normalize(self.data.rows(split, n=1)[0])
        self.sandbox = sandbox or Sandbox(limits)
        self.system_prompt = system_prompt or SYSTEM_PROMPT
        self.sampling = SamplingParams.of(sampling, max_new_tokens=512)
        self.max_episode_tokens = max_episode_tokens

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.data.stream("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.data.stream(split, seed, shuffle=split == "train")

    async def write_and_test(self, ctx: Any, role: str,
                             task: Mapping[str, Any]) -> tuple[str, str | None, float]:
        """The `role` writes a program for `task`; its tests run in the sandbox (the recorded
        tool call "run_tests"). Returns (reply, program or None, fraction of tests passed)."""
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": task["prompt"]}]
        reply = (await ctx.chat(role, messages)).content
        program = extract_code(reply)
        if program is None:
            ctx.count("no_code")
            return reply, None, 0.0
        outcome = await ctx.tool("run_tests", self._report, program, task)
        if outcome["timed_out"]:
            ctx.count("sandbox_timeout")
        elif outcome["error"] and outcome["passed"] == 0:
            ctx.count("sandbox_error")
        return reply, program, float(outcome["fraction"])

    def task(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The sample as a task, as this environment scores it (see astranb_code.tasks)."""
        return normalize(sample, self.partial_credit)

    async def run_tests(self, program: str, sample: Mapping[str, Any]) -> Result:
        """Score `program` on `sample` as an episode would (the sandbox, the judge, the task's
        tests): for evaluating given programs, e.g. reference solutions."""
        return await self._score(program, self.task(sample))

    async def _score(self, program: str, task: Mapping[str, Any]) -> Result:
        return await self.sandbox.run(program, task["tests"], setup=task["setup"],
                                      entry_point=task["entry_point"], count=task["count"])

    async def _report(self, program: str, task: Mapping[str, Any]) -> dict[str, Any]:
        result = await self._score(program, task)
        report = dataclasses.asdict(result)
        report["fraction"] = result.fraction
        return report


class Code(_CodeBase):
    """Programming tasks (MBPP, HumanEval, your own) scored in a sandbox.

    The coder gets the task and answers with a program in a ```python block; the program runs
    in a `Sandbox` (see astranb_code.sandbox) as a server of its functions, and a judge outside
    it runs the task's tests, calling them with plain data (see astranb_code.harness): the
    program cannot reach the tests nor forge their verdicts. Reward: the fraction of tests
    passed (a HumanEval problem is one test, its whole `check`, unless `partial_credit`).
    Counted on the episode: `no_code` (no program in the reply),
    `sandbox_timeout`, `sandbox_error` (the program failed before passing any test). A hostile
    program ends only its episode: it scores what it passed, with the reason recorded on the
    "run_tests" tool call.

    Args:
        data: what `astranb.data.DataSource` reads (a Hugging Face Dataset or DatasetDict, a
            .jsonl/.json/.parquet path, a list of dicts), in MBPP, HumanEval or this package's
            form (see astranb_code.tasks), or a DataSource.
        columns, test_size: as for DataSource.
        sandbox: a Sandbox to share between environments (default: a new one with `limits`).
        limits: what each program may use (default Limits()).
        system_prompt: the coder's system message.
        sampling: SamplingParams or a dict of its fields (default max_new_tokens=512).
        partial_credit: HumanEval rows score the share of their check's asserts that held
            (asserts that cannot fail left out) instead of 1 or 0 for the whole check.

    Example:
        env = Code(load_dataset("google-research-datasets/mbpp", "sanitized"))
        session.wire(env, coder=policy)
    """

    roles = ("coder",)

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        _, _, fraction = await self.write_and_test(ctx, "coder", self.task(sample))
        return fraction


class CodeVerifier(_CodeBase):
    """Two policies, as in AstraFlow's code multi-agent recipe: a coder writes the program, a
    verifier reads the task and the program and predicts \\boxed{pass} or \\boxed{fail}; then the
    tests run.

        coder    = fraction of tests passed
        verifier = 1 when its prediction matches whether every test passed, else 0 (0 for a
                   reply with no prediction, counted `no_prediction`)

    Wire two policies (or one to both roles): session.wire(env, coder=a, verifier=b).
    Arguments as for `Code`, plus `verifier_prompt`.
    """

    roles = ("coder", "verifier")

    def __init__(self, data: Any, *, verifier_prompt: str | None = None, **kwargs: Any):
        super().__init__(data, **kwargs)
        self.verifier_prompt = verifier_prompt or VERIFIER_PROMPT

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> dict[str, float]:
        task = self.task(sample)
        reply, program, fraction = await self.write_and_test(ctx, "coder", task)
        review = (f"Task:\n{task['prompt']}\n\nProgram:\n```python\n{program or reply}\n```\n\n"
                  "Does the program solve the task? Answer \\boxed{pass} or \\boxed{fail}.")
        verdict = await ctx.chat("verifier", [{"role": "system", "content": self.verifier_prompt},
                                              {"role": "user", "content": review}])
        prediction = read_prediction(verdict.content)
        if prediction is None:
            ctx.count("no_prediction")
        right = prediction is not None and prediction == (fraction == 1.0)
        return {"coder": fraction, "verifier": 1.0 if right else 0.0}
