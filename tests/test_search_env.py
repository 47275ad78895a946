"""The search environment: answer scoring against hand-computed values, BM25 over a generated
corpus, the Search-R1 retrieval-server client against an in-process fake, and episodes played
through the real EpisodeContext with scripted engines (right, wrong, partial, malformed, a
server that is down)."""

from __future__ import annotations

import anyio
import httpx
import pytest
from astranb_search import (
    BM25Retriever,
    HTTPRetriever,
    RetrieverError,
    Search,
    exact_match,
    f1_score,
    facts,
    golds_of,
    normalize_answer,
    read_action,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import astranb as ab
from tests.test_math_env import play, scripted

PASSAGES, QUESTIONS = facts(200, seed=1, distractors=50)


# -- scoring --------------------------------------------------------------------------------------

def test_answers_are_normalized_as_squad_does():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an Apple, a day") == "apple day"


@pytest.mark.parametrize("prediction, golds, em, f1", [
    ("Paris", ["paris"], 1.0, 1.0),                                   # right
    ("London", ["Paris"], 0.0, 0.0),                                  # wrong
    ("the city of Paris", ["Paris"], 0.0, 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # partial: P=1/3, R=1
    ("Marie Curie", ["Pierre Curie", "Marie Curie"], 1.0, 1.0),       # the best gold counts
    ("Curie", ["Marie Curie"], 0.0, 2 / 3),                           # P=1, R=1/2
    ("", ["Paris"], 0.0, 0.0),                                        # empty
    ("a", ["the"], 1.0, 1.0),                                         # both normalize to ""
])
def test_exact_match_and_f1(prediction, golds, em, f1):
    assert exact_match(prediction, golds) == em
    assert f1_score(prediction, golds) == pytest.approx(f1)


def test_gold_answers_in_each_dataset_form():
    assert golds_of({"answers": ["a", "b"]}) == ["a", "b"]
    assert golds_of({"answers": {"text": ["x"]}}) == ["x"]            # SQuAD
    assert golds_of({"golden_answers": ["y"]}) == ["y"]               # Search-R1 / FlashRAG
    assert golds_of({"answer": "z"}) == ["z"]                         # HotpotQA
    with pytest.raises(ValueError, match="needs 'answers'"):
        golds_of({"question": "?"})


@pytest.mark.parametrize("reply, action", [
    ("<search>river of Velmora</search>", ("search", "river of Velmora")),
    ("<think><answer>no</answer></think><answer> Tobin </answer>", ("answer", "Tobin")),
    ("<search>a</search> then <answer>b</answer>", ("answer", "b")),  # the last action
    ("I think it is Tobin.", None),
    ("<search>unclosed", None),
])
def test_read_action(reply, action):
    assert read_action(reply) == action


# -- retrievers -----------------------------------------------------------------------------------

def test_bm25_finds_the_passage_of_each_place():
    retriever = BM25Retriever(PASSAGES)
    hits = 0
    for question in QUESTIONS[:50]:
        found = anyio.run(retriever.search, question["question"], 3)
        assert len(found) <= 3 and all(p.score > 0 for p in found)
        hits += any(p.title == question["place"] for p in found)
    assert hits >= 48  # the place's invented name is in its passage only
    assert anyio.run(retriever.search, "zzzz qqqq", 3) == []  # no known word: nothing


def test_bm25_reads_strings_and_dicts_and_says_what_is_wrong():
    assert len(BM25Retriever(["alpha beta", "gamma delta"])) == 2
    with pytest.raises(ValueError, match="no 'text' field.*text_field="):
        BM25Retriever([{"contents": "x"}])
    with pytest.raises(ValueError, match="empty"):
        BM25Retriever([])


def _fake_server(passages, calls):
    """A Search-R1 retrieval server: POST /retrieve {"queries", "topk", "return_scores"}."""
    index = BM25Retriever(passages)

    async def retrieve(request: Request):
        body = await request.json()
        calls.append(body)
        results = index.search_many(body["queries"], body["topk"])
        return JSONResponse({"result": [[
            {"document": {"id": p.id, "contents": f'"{p.title}"\n{p.text}'}, "score": p.score}
            for p in found] for found in results]})

    return Starlette(routes=[Route("/retrieve", retrieve, methods=["POST"])])


def test_the_http_client_speaks_the_search_r1_protocol():
    calls = []
    app = _fake_server(PASSAGES, calls)
    retriever = HTTPRetriever("http://retriever", transport=httpx.ASGITransport(app))
    place = QUESTIONS[0]["place"]
    found = anyio.run(retriever.search, f"Which river runs through {place}?", 2)
    assert calls == [{"queries": [f"Which river runs through {place}?"], "topk": 2,
                      "return_scores": True}]
    assert found[0].title == place and place in found[0].text and found[0].score > 0


def test_a_server_that_is_down_or_broken_is_a_clear_error():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    down = HTTPRetriever("http://127.0.0.1:9", transport=httpx.MockTransport(refuse))
    with pytest.raises(RetrieverError, match="did not answer: ConnectError"):
        anyio.run(down.search, "q", 1)
    broken = HTTPRetriever("http://x", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"oops": 1})))
    with pytest.raises(RetrieverError, match="cannot read"):
        anyio.run(broken.search, "q", 1)
    failing = HTTPRetriever("http://x", transport=httpx.MockTransport(
        lambda r: httpx.Response(503, text="overloaded")))
    with pytest.raises(RetrieverError, match="answered 503: overloaded"):
        anyio.run(failing.search, "q", 1)


# -- episodes -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env():
    return Search(QUESTIONS, BM25Retriever(PASSAGES), k=2, max_turns=3)


def test_search_then_answer(env):
    question = QUESTIONS[0]
    gold = question["answers"][0]
    policy = scripted("s", f"<search>{question['place']}</search>", f"<answer>{gold}</answer>")
    trajectory = play(env, question, searcher=policy)
    assert trajectory.rewards == {"searcher": 1.0} and trajectory.error is None
    search, score = trajectory.tool_calls
    assert search.name == "search" and search.result[0]["title"] == question["place"]
    assert score.result == {"em": 1.0, "f1": 1.0}
    assert gold in policy.engine.prompts[1] and "<information>Doc 1" in policy.engine.prompts[1]


@pytest.mark.parametrize("replies, reward, counts", [
    (["<answer>Nobody Knows</answer>"], 0.0, {}),                         # wrong
    (["<answer>{gold} river</answer>"], 2 / 3, {}),                       # partial F1
    (["hmm", "<answer>{gold}</answer>"], 1.0, {"malformed_action": 1}),   # malformed, recovered
    (["<search>x</search>"] * 3, 0.0, {"out_of_turns": 1}),               # never answers
])
def test_rewards_and_counts(env, replies, reward, counts):
    question = QUESTIONS[3]
    gold = question["answers"][0]
    policy = scripted("s", *[r.format(gold=gold) for r in replies])
    trajectory = play(env, question, searcher=policy)
    assert trajectory.rewards["searcher"] == pytest.approx(reward)
    assert dict(trajectory.counts) == {"retokenized": 0, **counts}


def test_exact_match_reward():
    env = Search(QUESTIONS, BM25Retriever(PASSAGES), reward="em")
    gold = QUESTIONS[0]["answers"][0]
    trajectory = play(env, QUESTIONS[0], searcher=scripted("s", f"<answer>{gold} x</answer>"))
    assert trajectory.rewards == {"searcher": 0.0}


def test_a_retriever_that_is_down_ends_only_the_episode():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    env = Search(QUESTIONS, HTTPRetriever("http://127.0.0.1:9",
                                          transport=httpx.MockTransport(refuse)))
    trajectory = play(env, QUESTIONS[0], searcher=scripted("s", "<search>q</search>"))
    assert trajectory.rewards == {"searcher": 0.0} and trajectory.error is None
    assert dict(trajectory.counts) == {"retokenized": 0, "retriever_down": 1}
    assert "did not answer" in trajectory.tool_calls[0].error


def test_arguments_and_data_are_checked(tmp_path):
    with pytest.raises(ValueError, match="reward must be 'f1' or 'em'"):
        Search(QUESTIONS, BM25Retriever(PASSAGES), reward="bleu")
    with pytest.raises(TypeError, match="async search"):
        Search(QUESTIONS, object())
    with pytest.raises(ValueError, match="needs 'answers'"):
        Search([{"question": "?"}], BM25Retriever(PASSAGES))
    corpus = tmp_path / "passages.jsonl"
    corpus.write_text("".join(f'{{"id": "{p["id"]}", "title": "{p["title"]}", '
                              f'"text": "{p["text"]}"}}\n' for p in PASSAGES[:20]))
    by_name = ab.environments.load("search", data=QUESTIONS[:20],
                                   retriever={"corpus": str(corpus)})
    assert isinstance(by_name, Search) and len(by_name.retriever) == 20


def test_demonstrations_follow_the_environments_own_turns():
    from astranb_search.env import SYSTEM_PROMPT, render
    from astranb_search.synthetic import demonstrations

    retriever = BM25Retriever(PASSAGES)
    (demo,) = demonstrations(QUESTIONS[:1], retriever, SYSTEM_PROMPT, k=2)
    roles = [m["role"] for m in demo["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    place, gold = QUESTIONS[0]["place"], QUESTIONS[0]["answers"][0]
    assert read_action(demo["messages"][2]["content"]) == ("search", place)
    assert demo["messages"][3]["content"] == render(retriever.search_many([place], 2)[0])
    assert read_action(demo["messages"][4]["content"]) == ("answer", gold)
