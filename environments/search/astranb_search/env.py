"""`Search`: a question, a retriever as the model's tool, answers scored by exact match and F1."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from astranb import Environment, SamplingParams
from astranb.data import DataSource

from .retrievers import (
    BM25Retriever,
    HTTPRetriever,
    Passage,
    Retriever,
    RetrieverError,
    search_off_loop,
)

SYSTEM_PROMPT = (
    "Answer the question. You may search a knowledge base first: write <search>a query"
    "</search> and the results come back in <information>...</information>. Search as often as "
    "you need, then give the final answer, a few words only, as <answer>the answer</answer>.")

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


# -- scoring -------------------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1 when the normalized prediction equals any normalized gold answer, else 0."""
    guess = normalize_answer(prediction)
    return 1.0 if any(guess == normalize_answer(g) for g in golds) else 0.0


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """The best token F1 of the normalized prediction against any gold answer."""
    guess = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        truth = normalize_answer(gold).split()
        common = sum((Counter(guess) & Counter(truth)).values())
        if not guess or not truth or common == 0:
            best = max(best, float(guess == truth))
            continue
        precision, recall = common / len(guess), common / len(truth)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def golds_of(sample: Mapping[str, Any]) -> list[str]:
    """The sample's gold answers: "answers" (a list, or a dict with "text" as in SQuAD) or
    "answer" / "golden_answers" (a string or a list)."""
    for key in ("answers", "golden_answers", "answer"):
        if key in sample:
            value = sample[key]
            if isinstance(value, Mapping):
                value = value.get("text", [])
            golds = [value] if isinstance(value, str) else [str(v) for v in value]
            if golds:
                return golds
    raise ValueError(f"a search sample needs 'answers' (or 'answer', 'golden_answers'); this "
                     f"one has {sorted(sample)}")


def read_action(content: str) -> tuple[str, str] | None:
    """The last <search>…</search> or <answer>…</answer> of a reply (outside <think>), as
    ("search" | "answer", text); None when there is neither."""
    found = _ACTION.findall(_THINK.sub("", content))
    if not found:
        return None
    kind, text = found[-1]
    return kind.lower(), text.strip()


def render(passages: Sequence[Passage]) -> str:
    if not passages:
        return "<information>No results.</information>"
    lines = [f"Doc {i + 1}" + (f" ({p.title})" if p.title else "") + f": {p.text}"
             for i, p in enumerate(passages)]
    return "<information>" + "\n".join(lines) + "</information>"


# -- the environment -----------------------------------------------------------------------------

class Search(Environment):
    """Search-R1 / ASearcher style question answering with a retriever as the tool.

    Each turn the model either searches (<search>query</search>: the top `k` passages come back
    as a user message in <information>) or answers (<answer>…</answer>, which ends the
    episode). Reward: F1 of the answer against the gold answers (`reward="f1"`) or exact match
    (`reward="em"`); both are recorded on the "score" tool call. Counted: `malformed_action` (a
    reply with neither tag: the model is told the format and the turn is spent),
    `out_of_turns`, `retriever_down` (the retriever failed: the episode ends with 0 and the
    reason on its "search" tool call).

    Args:
        data: what `astranb.data.DataSource` reads; samples need "question" and "answers"
            (or "answer", "golden_answers": NQ, HotpotQA and Search-R1's data work as they are).
        retriever: a `BM25Retriever`, an `HTTPRetriever`, anything with
            `async search(query, k) -> list[Passage]`; or, so that a rollout service can build
            the environment by name, a retrieval server's URL, or {"corpus": path} (a
            .jsonl/.json/.parquet file of passages for a BM25 index, plus BM25Retriever's
            keyword arguments).
        k: passages per search.
        max_turns: most assistant turns (searches plus the answer).
        reward: "f1" or "em".
        columns, test_size: as for DataSource.
        system_prompt, sampling, max_episode_tokens: as for other environments.
    """

    roles = ("searcher",)

    def __init__(self, data: Any, retriever: Retriever, *, k: int = 5, max_turns: int = 4,
                 reward: str = "f1", columns: Mapping[str, str] | None = None,
                 test_size: float | int | None = None, system_prompt: str | None = None,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None):
        if reward not in ("f1", "em"):
            raise ValueError(f"reward must be 'f1' or 'em', got {reward!r}")
        if k < 1 or max_turns < 1:
            raise ValueError(f"k and max_turns must be >= 1, got k={k}, max_turns={max_turns}")
        retriever = _retriever(retriever)
        self.data = data if isinstance(data, DataSource) else DataSource(
            data, columns=columns, required=("question",), test_size=test_size)
        for split in self.data.splits:
            golds_of(self.data.rows(split, n=1)[0])
        self.splits = self.data.splits
        self.retriever, self.k, self.max_turns, self.reward = retriever, k, max_turns, reward
        self.system_prompt = system_prompt or SYSTEM_PROMPT
        self.sampling = SamplingParams.of(sampling, max_new_tokens=128)
        self.max_episode_tokens = max_episode_tokens

    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.data.stream("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.data.stream(split, seed, shuffle=split == "train")

    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        golds = golds_of(sample)
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": f"Question: {sample['question']}"}]
        for _ in range(self.max_turns):
            reply = await ctx.chat("searcher", messages)
            action = read_action(reply.content)
            if action is None:
                ctx.count("malformed_action")
                messages.append({"role": "user", "content": (
                    "Use <search>query</search> to search or <answer>…</answer> to answer.")})
                continue
            kind, text = action
            if kind == "answer":
                scores = await ctx.tool("score", self._score, text, golds)
                return scores[self.reward]
            try:
                passages = await ctx.tool("search", self._search, text)
            except RetrieverError:
                ctx.count("retriever_down")
                return 0.0
            messages.append({"role": "user", "content": render(
                [Passage(**p) for p in passages])})
        ctx.count("out_of_turns")
        return 0.0

    async def _search(self, query: str) -> list[dict[str, Any]]:
        found = await search_off_loop(self.retriever, query, self.k)
        return [{"id": p.id, "title": p.title, "text": p.text, "score": p.score} for p in found]

    def _score(self, answer: str, golds: list[str]) -> dict[str, float]:
        return {"em": exact_match(answer, golds), "f1": f1_score(answer, golds)}


def _retriever(spec: Any) -> Retriever:
    if isinstance(spec, str):
        return HTTPRetriever(spec)
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "corpus" not in options:
            raise ValueError("a retriever given as a dict needs 'corpus': a passages file")
        rows = DataSource(options.pop("corpus")).rows("train")
        return BM25Retriever(rows, **options)
    if not callable(getattr(spec, "search", None)):
        raise TypeError("retriever must have `async search(query, k)`: use BM25Retriever, "
                        "HTTPRetriever, a server URL or {'corpus': path}")
    return spec
