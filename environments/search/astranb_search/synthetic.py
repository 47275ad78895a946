"""A made-up world of facts, for tests, benchmarks and first runs without a download.

`facts(n, seed)` invents `n` places, each with a country, a river and a founder, and writes:
    passages   one short passage per place ("Velmora is a town in Drask. ..."), plus
               `distractors` passages that name no place
    questions  {"question", "answers"} asking for one fact of one place; only the passage of
               that place holds the answer, so a question is answered by searching its name
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["facts", "invented_name", "demonstrations"]

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s",
           "st", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "n", "r", "s", "l", "th", "x", "m")
_ASKS = {
    "country": "In which country is {place}?",
    "river": "Which river runs through {place}?",
    "founder": "Who founded {place}?",
}


def invented_name(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables)).capitalize()


def facts(n: int, seed: int = 0, distractors: int = 0) -> tuple[list[dict[str, Any]],
                                                                 list[dict[str, Any]]]:
    """(passages, questions) of `n` invented places; see the module docstring."""
    if n < 1 or distractors < 0:
        raise ValueError(f"need n >= 1 and distractors >= 0, got {n}, {distractors}")
    rng = random.Random(seed)
    countries = [invented_name(rng, 2) for _ in range(max(3, n // 50))]
    rivers = [invented_name(rng, 2) for _ in range(max(3, n // 20))]
    names: set[str] = set()
    passages, questions = [], []
    while len(passages) < n:
        place = invented_name(rng, 3)
        if place in names:
            continue
        names.add(place)
        fact = {"country": rng.choice(countries), "river": rng.choice(rivers),
                "founder": f"{invented_name(rng, 2)} {invented_name(rng, 2)}"}
        passages.append({
            "id": f"p{len(passages)}", "title": place,
            "text": (f"{place} is a town in {fact['country']}. The river {fact['river']} runs "
                     f"through {place}. {place} was founded by {fact['founder']}.")})
        ask = rng.choice(sorted(_ASKS))
        questions.append({"question": _ASKS[ask].format(place=place), "answers": [fact[ask]],
                          "place": place})
    for i in range(distractors):
        passages.append({"id": f"d{i}", "title": "",
                         "text": f"The weather was {rng.choice(['mild', 'cold', 'wet'])} in "
                                 f"the year {1000 + i}."})
    return passages, questions


def demonstrations(questions: list[dict[str, Any]], retriever: Any, system_prompt: str,
                   k: int = 2) -> list[dict[str, Any]]:
    """Conversations for `policy.sft`: search the question's place by name, read the passages
    the retriever really returns for that query, answer with the gold answer. The warm start
    teaches the format (and where answers sit); RL then has the searching and reading to do."""
    from .env import render

    out = []
    for question in questions:
        query = str(question["place"])
        found = retriever.search_many([query], k)[0]
        out.append({"messages": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": f"Question: {question['question']}"},
            {"role": "assistant", "content": f"<search>{query}</search>"},
            {"role": "user", "content": render(found)},
            {"role": "assistant", "content": f"<answer>{question['answers'][0]}</answer>"}]})
    return out
