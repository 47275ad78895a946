"""`ReasoningGym`: any reasoning-gym task (or a weighted mix of tasks) as a one-turn environment."""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from astranb import Environment, SamplingParams

from ._score_worker import build
from .answers import extract_answer
from .scorer import ScoreError, Scorer, ScoreTimeout

TEST_SEED_OFFSET = 1_000_000_007
"""Default distance of the held-out seed from the training seed. Many tasks seed entry i with
`seed + i`, so a nearby seed would replay training entries shifted by one."""

PLAIN_SUFFIX = "\nAnswer: "
"""What a plain-text prompt (a model without a chat template) ends with after the question."""

TAG_PROMPT = ("Answer the question. Give only the final answer between <answer> and </answer> "
              "tags.")
BARE_PROMPT = "Answer the question. Reply with the final answer only, nothing else."


class ReasoningGym(Environment):
    """reasoning-gym's procedurally generated tasks, each scored by its own `score_answer`.

    A sample is one entry of `reasoning_gym.create_dataset(task, size=size, seed=seed)` (or of
    its composite dataset for a mix): "question", "answer" (the gold answer), "task" (the entry's
    source task), "split", "index" and the entry's "metadata". The "test" split is generated
    from `test_seed` and leaves out every question that also occurs in "train", so no held-out
    question was trained on.

    An episode is one turn. A policy whose tokenizer has a chat template gets a system message
    and the question as the user message (`ctx.chat`); a plain model gets the question followed
    by "\\nAnswer: " (`ctx.generate`). The answer is the bare reply (reasoning-gym's scorers
    expect the bare answer; a chat reply's `<think>` block is left out, a plain completion's
    first line is taken) or, with `answer_tag=True`, the content of the last
    `<answer>...</answer>` (reasoning-gym's own prompt convention; no tag counts `no_answer`
    and scores 0). The reward is the task's score, partial credit included (spell_backward
    gives 0.86 for one letter wrong), computed in a child process forked for that answer alone,
    which may not start processes, open sockets, write files or reach frames, since many
    scorers `eval` the answer (see `_score_worker`). A scorer that raises fails its episode
    only; one past `score_timeout` scores 0 and is counted `score_timeout`.

    Args:
        task: a task name ("basic_arithmetic", "spell_backward", ... any name in
            `reasoning_gym.factory.DATASETS`), or a mix: a sequence of (name, weight) or
            (name, weight, config) tuples, or a dict name -> weight (reasoning-gym's composite
            dataset draws each entry's task by weight).
        size: training entries (the "train" split; streamed in a new seeded order each epoch).
        seed: the training entries' seed.
        test_size: held-out entries drawn for "test" (fewer if many collide with "train").
        test_seed: the held-out entries' seed (default `seed + 1_000_000_007`).
        config: the task's own settings (its config dataclass's fields), single task only.
        answer_tag: read the answer from `<answer>...</answer>` instead of the bare reply.
        system_prompt: the chat system message (default: answer only, in tags if answer_tag).
        score_timeout: seconds one answer's scoring may take.
        sampling: SamplingParams, or a dict of its fields (default: max_new_tokens=256).
        max_episode_tokens: most tokens sampled over the episode (None: the context only).

    Raises:
        ValueError: an unknown task name (the message lists the closest names), or bad sizes.

    Example:
        env = ab.environments.load("reasoning_gym", task="basic_arithmetic", size=1000, seed=0)
        mix = ab.environments.load("reasoning_gym", task=[("chain_sum", 2), ("spell_backward", 1)])
        session.wire(env, solver=policy)
    """

    roles = ("solver",)
    splits = ("train", "test")

    def __init__(self, task: str | Sequence[Sequence[Any]] | Mapping[str, float], *,
                 size: int = 500, seed: int = 0, test_size: int = 100,
                 test_seed: int | None = None, config: Mapping[str, Any] | None = None,
                 answer_tag: bool = False, system_prompt: str | None = None,
                 score_timeout: float = 5.0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None):
        if size < 1 or test_size < 1:
            raise ValueError(f"size and test_size must be >= 1, got {size} and {test_size}")
        tasks = _tasks(task, config)
        test_seed = seed + TEST_SEED_OFFSET if test_seed is None else test_seed
        if test_seed == seed:
            raise ValueError(f"test_seed must differ from seed ({seed}); the held-out entries "
                             "would be the training entries")
        self.tasks = tasks
        self.spec = {"tasks": [list(t) for t in tasks], "size": size, "seed": seed,
                     "test_size": test_size, "test_seed": test_seed}
        self.answer_tag = answer_tag
        self.system_prompt = system_prompt or (TAG_PROMPT if answer_tag else BARE_PROMPT)
        self.sampling = SamplingParams.of(sampling, max_new_tokens=256)
        self.max_episode_tokens = max_episode_tokens
        self._train = _entries(build(self.spec, "train"), "train", range(size))
        seen = {s["question"] for s in self._train}
        test = _entries(build(self.spec, "test"), "test", range(2 * test_size))
        self._test = [s for s in test if s["question"] not in seen][:test_size]
        self.scorer = Scorer(self.spec, timeout=score_timeout)
        self.compared = frozenset(name for name, _, _ in tasks if compares_strings(name))
        """The tasks whose score is reasoning-gym's plain string comparison (`string_score`),
        scored in the episode's process: no answer is evaluated, so no fence is needed."""

    @property
    def name(self) -> str:
        return "ReasoningGym(" + "+".join(t[0] for t in self.tasks) + ")"

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """The training entries, every one once per epoch, in an order drawn from `seed`."""
        epoch = 0
        while True:
            order = list(range(len(self._train)))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            for i in order:
                yield {**self._train[i], "_epoch": epoch}
            epoch += 1

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """"train" as `samples(seed)`; "test" in its generated order (finite)."""
        if split == "test":
            return iter([dict(s) for s in self._test])
        return super().split_samples(split, seed)

    def close(self) -> None:
        """Stop the scoring worker (it restarts if the environment is used again)."""
        self.scorer.close()

    def prompt(self, sample: Mapping[str, Any], chat: bool) -> list[dict[str, str]] | str:
        """The chat messages (`chat=True`) or the plain-text prompt of a sample."""
        if chat:
            return [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": str(sample["question"])}]
        return str(sample["question"]) + PLAIN_SUFFIX

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        chat = getattr(ctx.tokenizer("solver"), "chat_template", None) is not None
        prompt = self.prompt(sample, chat)
        if chat:
            text = (await ctx.chat("solver", prompt)).content
        else:
            text = (await ctx.generate("solver", prompt)).text
        answer = extract_answer(text, tag=self.answer_tag, first_line=not chat)
        if answer is None:
            ctx.count("no_answer")
            return 0.0
        if sample["task"] in self.compared:
            return float(await ctx.tool("score", string_score, answer, sample["answer"]))
        result = await ctx.tool("score", self._score, sample["split"], sample["index"], answer)
        if result["timed_out"]:
            ctx.count("score_timeout")
        return float(result["score"])

    async def _score(self, split: str, index: int, answer: str) -> dict[str, Any]:
        try:
            score, error = await self.scorer.score(split, int(index), answer)
        except ScoreTimeout as timeout:
            return {"score": 0.0, "timed_out": True, "error": str(timeout)}
        if error is not None:
            raise ScoreError(f"the task's scorer failed on this answer: {error}")
        return {"score": score, "timed_out": False, "error": None}


def compares_strings(task: str) -> bool:
    """Whether `task` keeps reasoning-gym's base `score_answer` (33 of 0.1.25's 106 tasks, e.g.
    basic_arithmetic, gcd, letter_counting): that scorer only
    compares the answer with the gold string, so `string_score` gives the same reward without
    a process per answer. Every task that overrides it (many `eval` or parse the answer) is
    scored in the fenced worker."""
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    found = DATASETS.get(task)
    return found is not None and found[0].score_answer is ProceduralDataset.score_answer


def string_score(answer: str, gold: str | None) -> float:
    """reasoning-gym's default reward, computed here: 1 for the gold answer exactly; when the
    answer contains the gold answer among other text, the gold's share of the answer's length
    (so "8." scores 0.5 against "8"); otherwise 0. An empty answer scores 0."""
    if not isinstance(answer, str) or not answer or gold is None:
        return 0.0
    if answer == gold:
        return 1.0
    return len(gold) / len(answer) if gold in answer else 0.0


def task_names() -> list[str]:
    """Every task reasoning-gym 0.1.25 registers (its composite dataset aside)."""
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name != "composite")


def _tasks(task: Any, config: Mapping[str, Any] | None) -> list[tuple[str, float, dict]]:
    if isinstance(task, str):
        tasks = [(task, 1.0, dict(config or {}))]
    else:
        if config is not None:
            raise ValueError("config is for a single task; give a mix's tasks their settings "
                             "as (name, weight, config) tuples")
        items: list[Sequence[Any]] = list(task.items() if isinstance(task, Mapping) else task)
        tasks = [(str(t[0]), float(t[1]), dict(t[2]) if len(t) > 2 else {}) for t in items]
        if not tasks:
            raise ValueError("a task mix needs at least one (name, weight)")
    known = task_names()
    for name, weight, _ in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            hint = f"closest: {', '.join(close)}" if close else f"tasks: {', '.join(known)}"
            raise ValueError(f"reasoning-gym has no task {name!r} ({hint}); "
                             "astranb_reasoning_gym.task_names() lists them all")
        if weight <= 0:
            raise ValueError(f"task {name!r} has weight {weight}; weights must be > 0")
    return tasks


def _entries(dataset: Any, split: str, indices: range) -> list[dict[str, Any]]:
    return [_sample(dataset[i], split, i) for i in indices]


def _sample(entry: Mapping[str, Any], split: str, index: int) -> dict[str, Any]:
    """An entry as plain JSON data (metadata holds tuples and, in some tasks, other objects)."""
    metadata = json.loads(json.dumps(entry.get("metadata", {}), default=str))
    answer = entry.get("answer")
    return {"question": str(entry["question"]),
            "answer": None if answer is None else str(answer),
            "task": str(metadata.get("source_dataset", "")), "split": split, "index": index,
            "metadata": metadata}
