"""`MathActorVerifier`: an actor solves, a verifier judges the solution, a rejected actor retries.

The math version of AstraFlow's actor-verifier recipe, with the reward rule of the
`actor_verifier` toy (`astranb_actor_verifier.episode_rewards`), so that "reject everything and
fix it on the retry" is not a resting point:

    actor     [system, problem]                        -> a solution ending in \\boxed{answer}
    verifier  [system, problem + the actor's solution] -> a short check, then \\boxed{yes} or
                                                          \\boxed{no}
    actor     [..., "a reviewer thinks ... is wrong:"  -> a second solution, only after a reject
               + the verifier's reply]                    (or a reply that is neither)

    actor    = 1 right at once (and not given up on the retry), retry_discount right only on
               the retry, else 0
    verifier = (1 - team_weight) * judgement of the first answer + team_weight * actor

Both answers are checked against the gold answer with math-verify (the recorded "verify" tool).
The verifier reads the actor's content only (a `<think>` block stays private).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astranb_actor_verifier import episode_rewards

from astranb import SamplingParams

from ._base import MathEnvironment, gold_of
from .answers import extract_answer
from .solver import SYSTEM_PROMPT
from .verify import AnswerVerifier

VERIFIER_PROMPT = ("You check solutions to math problems. Read the solution, check its steps and "
                   "its final answer briefly, then reply \\boxed{yes} if the final answer is "
                   "correct or \\boxed{no} if it is not.")

_YES = {"yes", "y", "correct", "true", "right"}
_NO = {"no", "n", "incorrect", "false", "wrong"}


class MathActorVerifier(MathEnvironment):
    """An actor answers a math problem, a verifier judges it, a rejected actor retries once.

    Roles "actor" and "verifier", meant for two policies (or one policy wired to both). Counted
    on the episode: `no_answer`, `verify_timeout`, and `no_verdict` (a verifier reply without
    \\boxed{yes} or \\boxed{no}, which counts as a reject that earns no judgement).

    Args:
        data, columns, test_size, verify_timeout, sampling, max_episode_tokens, verifier: as
            for `Math`.
        retry: give the actor a second try after a reject (False: its first answer is final).
        retry_discount: the actor's reward for a wrong first answer fixed on the retry.
        team_weight: the share of the verifier's reward that is the actor's reward.
        actor_prompt, verifier_prompt: the roles' system messages.

    Example:
        env = MathActorVerifier("math_train.parquet",
                                columns={"question": "problem", "answer": "solution"})
        session.wire(env, actor=actor_policy, verifier=verifier_policy)
    """

    roles = ("actor", "verifier")

    def __init__(self, data: Any, *, columns: Mapping[str, str] | None = None,
                 test_size: float | int | None = None, retry: bool = True,
                 retry_discount: float = 0.5, team_weight: float = 0.5,
                 actor_prompt: str = SYSTEM_PROMPT, verifier_prompt: str = VERIFIER_PROMPT,
                 verify_timeout: float = 5.0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None,
                 verifier: AnswerVerifier | None = None):
        for name, value in (("retry_discount", retry_discount), ("team_weight", team_weight)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        super().__init__(data, columns=columns, test_size=test_size,
                         verify_timeout=verify_timeout, sampling=sampling,
                         max_episode_tokens=max_episode_tokens, verifier=verifier)
        self.retry = retry
        self.retry_discount = retry_discount
        self.team_weight = team_weight
        self.actor_prompt = actor_prompt
        self.verifier_prompt = verifier_prompt

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> dict[str, float]:
        gold, question = gold_of(sample), str(sample["question"])
        actor = [{"role": "system", "content": self.actor_prompt},
                 {"role": "user", "content": question}]
        solution = (await ctx.chat("actor", actor)).content
        review = [{"role": "system", "content": self.verifier_prompt},
                  {"role": "user", "content": review_request(question, solution)}]
        reply = (await ctx.chat("verifier", review)).content
        said = read_verdict(reply)
        if said is None:
            ctx.count("no_verdict")
        first_right, _ = await self.judge(ctx, solution, gold)
        retry_right = None
        if said != "y" and self.retry:
            actor.append({"role": "user", "content": rejection(reply)})
            retry_right, _ = await self.judge(ctx, (await ctx.chat("actor", actor)).content, gold)
        actor_reward, verifier_reward = episode_rewards(
            first_right, said, retry_right, retry_discount=self.retry_discount,
            team_weight=self.team_weight)
        return {"actor": actor_reward, "verifier": verifier_reward}


def read_verdict(reply: str) -> str | None:
    """"y" for a reply whose final answer is yes (\\boxed{yes}, `#### correct`, ...), "n" for no,
    None for anything else."""
    said = (extract_answer(reply) or "").strip().strip(".").lower()
    said = said.removeprefix("\\text{").removesuffix("}").strip()
    return "y" if said in _YES else "n" if said in _NO else None


def review_request(question: str, solution: str) -> str:
    """What the verifier is asked."""
    return (f"Problem:\n{question}\n\nProposed solution:\n{solution}\n\nIs the final answer "
            "correct? Answer \\boxed{yes} or \\boxed{no}.")


def rejection(reply: str) -> str:
    """What a rejected actor reads before its retry: the verifier's reply."""
    return (f"A reviewer thinks your answer is wrong:\n{reply}\n\nSolve the problem again and "
            "give the final answer as \\boxed{answer}.")
