"""`Math`: one solver, three ways to play a problem (one answer, a retry, a calculator)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from astranb import SamplingParams

from ._base import MathEnvironment, feedback, gold_of
from .calculator import calculator
from .verify import AnswerVerifier

MODES = ("single", "retry", "tools")

SYSTEM_PROMPT = ("Solve the math problem. Reason step by step, then give the final answer as "
                 "\\boxed{answer}.")
TOOLS_PROMPT = SYSTEM_PROMPT + " Use the calculator tool for arithmetic you cannot do exactly."


class Math(MathEnvironment):
    """Math problems (GSM8K, MATH, DeepScaleR, DAPO-Math, your own), answers checked with
    math-verify in a worker process.

    Modes:
        "single": one answer; reward 1 if it is right, else 0.
        "retry": after a wrong answer the user says so (naming the answer) and the model tries
            once more; reward 1 right at once, `retry_discount` right on the retry, else 0.
        "tools": the model may call `calculator` (and any other `tools`) over up to `max_turns`
            assistant turns; the first message without tool calls is final; reward 1 if its
            answer is right.

    The final answer is read from the last `\\boxed{}` of the message's content (reasoning in a
    `<think>` block is left out), else from a `#### answer` line. Counted on the episode
    (`count/<name>` in the run's metrics): `no_answer`, `verify_timeout`, `out_of_turns`; the chat
    context counts `malformed_tool_calls` and `tool_errors` itself. An episode that reaches the
    context or `max_episode_tokens` ends as truncated with reward 0.

    Args:
        data: what `astranb.data.DataSource` reads (a Hugging Face Dataset or DatasetDict, a
            .jsonl/.json/.parquet path, a list of dicts, a dict split -> any of those), or a
            DataSource. Samples need a "question" and an "answer" field.
        mode: "single", "retry" or "tools".
        columns: field -> dataset column, e.g. {"question": "problem", "answer": "solution"}
            for MATH.
        test_size: hold out this fraction (or number) of rows as split "test" (single-split
            data only).
        system_prompt: the system message (default: reason, then \\boxed{} the answer).
        retry_discount: reward of a right answer on the retry ("retry" mode).
        max_turns: most assistant turns in "tools" mode.
        tools: the functions the model may call in "tools" mode.
        verify_timeout: seconds one answer check may take (past it the answer scores 0).
        sampling: SamplingParams, or a dict of its fields (default: max_new_tokens=1024).
        max_episode_tokens: most tokens sampled over the whole episode (None: the context only).
        verifier: an AnswerVerifier to share between environments (default: a new one).

    Example:
        env = Math("gsm8k_train.jsonl", mode="retry", test_size=0.05)
        session.wire(env, solver=policy)
    """

    roles = ("solver",)

    def __init__(self, data: Any, *, mode: str = "single",
                 columns: Mapping[str, str] | None = None,
                 test_size: float | int | None = None, system_prompt: str | None = None,
                 retry_discount: float = 0.5, max_turns: int = 4,
                 tools: Sequence[Callable[..., Any]] = (calculator,),
                 verify_timeout: float = 5.0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None,
                 verifier: AnswerVerifier | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 <= retry_discount <= 1.0:
            raise ValueError(f"retry_discount must be in [0, 1], got {retry_discount!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if mode == "tools" and not tools:
            raise ValueError("mode='tools' needs at least one tool; pass tools=[calculator]")
        super().__init__(data, columns=columns, test_size=test_size,
                         verify_timeout=verify_timeout, sampling=sampling,
                         max_episode_tokens=max_episode_tokens, verifier=verifier)
        self.mode = mode
        self.system_prompt = system_prompt or (TOOLS_PROMPT if mode == "tools" else SYSTEM_PROMPT)
        self.retry_discount = retry_discount
        self.max_turns = max_turns
        self.tools = tuple(tools)

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        gold = gold_of(sample)
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": str(sample["question"])}]
        if self.mode == "tools":
            return await self._with_tools(ctx, messages, gold)
        first = await ctx.chat("solver", messages)
        right, answer = await self.judge(ctx, first.content, gold)
        if right or self.mode == "single":
            return 1.0 if right else 0.0
        messages.append({"role": "user", "content": feedback(answer)})
        retry = await ctx.chat("solver", messages)
        right, _ = await self.judge(ctx, retry.content, gold)
        return self.retry_discount if right else 0.0

    async def _with_tools(self, ctx: Any, messages: list[dict[str, Any]], gold: str) -> float:
        for turn in range(self.max_turns):
            message = await ctx.chat("solver", messages, tools=self.tools)
            if not message.tool_calls and not message.errors:
                break
            if turn == self.max_turns - 1:
                ctx.count("out_of_turns")  # still calling tools: its content is all there is
            else:
                await ctx.run_tools(messages, message, self.tools)
        right, _ = await self.judge(ctx, message.content, gold)
        return 1.0 if right else 0.0
