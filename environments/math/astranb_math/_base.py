"""What every math environment shares: its data, gold answers, and a recorded answer check."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from astranb import Environment, SamplingParams
from astranb.data import DataError, DataSource

from .answers import extract_answer, gold_answer
from .verify import AnswerVerifier

FIELDS = ("question", "answer")
"""What a sample must hold: the problem text, and the gold answer (a bare answer, a GSM8K
`#### 72` line or a MATH solution with `\\boxed{}`)."""


class MathEnvironment(Environment):
    """Problems from a dataset, answers checked with math-verify (see `Math` for the arguments)."""

    def __init__(self, data: Any, *, columns: Mapping[str, str] | None = None,
                 test_size: float | int | None = None, verify_timeout: float = 5.0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None,
                 verifier: AnswerVerifier | None = None):
        self.data = _source(data, columns, test_size)
        self.splits = self.data.splits
        self.sampling = _sampling(sampling)
        self.max_episode_tokens = max_episode_tokens
        self.verifier = verifier if verifier is not None else AnswerVerifier(verify_timeout)

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.data.stream("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """"train" reshuffled every epoch by seed; other splits in their stored order."""
        return self.data.stream(split, seed, shuffle=split == "train")

    def close(self) -> None:
        """Stop the verifier's worker processes (they restart if the environment is used again)."""
        self.verifier.close()

    async def judge(self, ctx: Any, content: str, gold: str) -> tuple[bool, str | None]:
        """(whether `content`'s final answer is right, that answer). The check is a recorded
        tool call, "verify"; a completion without an answer counts `no_answer`, a check that
        timed out counts `verify_timeout` (both score 0)."""
        answer = extract_answer(content)
        if answer is None:
            ctx.count("no_answer")
            return False, None
        verdict = await ctx.tool("verify", self._verify, answer, gold)
        if verdict["timed_out"]:
            ctx.count("verify_timeout")
        return bool(verdict["correct"]), answer

    async def _verify(self, answer: str, gold: str) -> dict[str, Any]:
        return dataclasses.asdict(await self.verifier.check(answer, gold))


def gold_of(sample: Mapping[str, Any]) -> str:
    """The sample's gold answer (see `gold_answer`)."""
    return gold_answer(sample["answer"])


def feedback(answer: str | None) -> str:
    """What a solver is told after a wrong answer, before it tries again."""
    if answer is None:
        return ("I could not find a final answer. Solve the problem again and give the final "
                "answer as \\boxed{answer}.")
    return (f"Your answer {answer} is not correct. Find the mistake, then give the final answer "
            "as \\boxed{answer}.")


def _source(data: Any, columns: Mapping[str, str] | None,
            test_size: float | int | None) -> DataSource:
    if not isinstance(data, DataSource):
        return DataSource(data, columns=columns, required=FIELDS, test_size=test_size)
    if columns is not None or test_size is not None:
        raise ValueError("columns and test_size belong to the DataSource when you pass one; "
                         "give them to DataSource(...) instead")
    for split in data.splits:
        missing = [f for f in FIELDS if f not in data.rows(split, n=1)[0]]
        if missing:
            raise DataError(f"samples of split {split!r} have no {missing}; build the "
                            f"DataSource with columns mapping {missing} to dataset columns")
    return data


def _sampling(sampling: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    return SamplingParams.of(sampling, max_new_tokens=1024)
