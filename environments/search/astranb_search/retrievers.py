"""Retrievers: something that answers a query with the top-k passages of a corpus.

    retriever = BM25Retriever(["passage one ...", "passage two ..."])     # in-process, bm25s
    retriever = BM25Retriever(load_dataset(...)["train"], text_field="contents")
    retriever = HTTPRetriever("http://127.0.0.1:7000")                   # a retrieval server
    passages = await retriever.search("who wrote hamlet", k=5)

`HTTPRetriever` speaks the protocol of Search-R1's and ASearcher's retrieval servers (the FAISS
server AstraFlow's search recipe launches): POST {url}/retrieve with {"queries": [...], "topk": k,
"return_scores": true}, answered by {"result": [[{"document": {"id", "contents"}, "score"}, ...]]}
where "contents" is the title in quotes on the first line, then the text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import numpy as np

__all__ = ["Passage", "Retriever", "BM25Retriever", "HTTPRetriever", "RetrieverError"]


class RetrieverError(RuntimeError):
    """The retriever could not answer (a server down, a malformed answer)."""


@dataclass(frozen=True)
class Passage:
    """One retrieved passage."""

    id: str
    title: str
    text: str
    score: float = 0.0


class Retriever(Protocol):
    async def search(self, query: str, k: int = 5) -> list[Passage]: ...


# -- in-process BM25 -----------------------------------------------------------------------------

class BM25Retriever:
    """BM25 over a corpus held in memory (the `bm25s` package: sparse matrices, no server).

    Args:
        corpus: passages: strings, or dicts (a `datasets.Dataset` works) with `text_field` and
            optionally `title_field` and `id_field`.
        text_field, title_field, id_field: where dict passages keep those.
        stopwords: bm25s's stopword list name ("en"), or None.
        k1, b: the BM25 parameters.
    """

    def __init__(self, corpus: Iterable[str | Mapping[str, Any]], *, text_field: str = "text",
                 title_field: str = "title", id_field: str = "id", stopwords: str | None = "en",
                 k1: float = 1.5, b: float = 0.75):
        try:
            import bm25s
        except ImportError as error:  # pragma: no cover - a dependency of this package
            raise ImportError("BM25Retriever needs bm25s: pip install bm25s") from error
        self._bm25s = bm25s
        self.passages: list[Passage] = []
        for index, item in enumerate(corpus):
            if isinstance(item, str):
                self.passages.append(Passage(str(index), "", item))
            elif isinstance(item, Mapping):
                if text_field not in item:
                    raise ValueError(f"passage {index} has no {text_field!r} field (it has "
                                     f"{sorted(item)}); pass text_field=")
                self.passages.append(Passage(str(item.get(id_field, index)),
                                             str(item.get(title_field) or ""),
                                             str(item[text_field])))
            else:
                raise TypeError(f"passage {index} is {type(item).__name__}; give strings or "
                                "dicts")
        if not self.passages:
            raise ValueError("the corpus is empty")
        self.stopwords = stopwords
        texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in self.passages]
        tokens = bm25s.tokenize(texts, stopwords=stopwords, show_progress=False)
        self._index = bm25s.BM25(k1=k1, b=b)
        self._index.index(tokens, show_progress=False)

    def __len__(self) -> int:
        return len(self.passages)

    async def search(self, query: str, k: int = 5) -> list[Passage]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 5) -> list[list[Passage]]:
        """Top-k passages of each query, best first (blocking: ~1 ms a query on 100k passages;
        `Search` runs it in a worker thread)."""
        k = max(1, min(int(k), len(self.passages)))
        tokens = self._bm25s.tokenize(list(queries), stopwords=self.stopwords,
                                      show_progress=False, return_ids=False)
        found: list[list[Passage]] = []
        for words in tokens:
            known = [w for w in words if w in self._index.vocab_dict]
            if not known:
                found.append([])
                continue
            # scores of every passage, then the top k of those that match at all: bm25s's own
            # retrieve() starts a thread pool and a progress bar per call (~6 ms a query)
            scores = self._index.get_scores(known)
            hits = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(k)
            hits = hits[np.argsort(-scores[hits], kind="stable")]
            found.append([_scored(self.passages[int(i)], float(scores[i])) for i in hits
                          if scores[i] > 0])
        return found


def _scored(passage: Passage, score: float) -> Passage:
    return Passage(passage.id, passage.title, passage.text, score)


# -- a retrieval server --------------------------------------------------------------------------

class HTTPRetriever:
    """A Search-R1 / ASearcher retrieval server (see the module docstring), reached with httpx.

    Args:
        url: the server's base URL ("http://host:7000"); "/retrieve" is added.
        timeout: seconds per request.
        headers: extra request headers (a token).
        transport: an httpx transport (tests pass one that reaches an app in-process).
    """

    def __init__(self, url: str, *, timeout: float = 10.0,
                 headers: Mapping[str, str] | None = None, transport: Any = None):
        import httpx

        self.url = url.rstrip("/") + "/retrieve"
        self._client = httpx.AsyncClient(timeout=timeout, headers=dict(headers or {}),
                                         transport=transport)
        self._httpx = httpx

    async def search(self, query: str, k: int = 5) -> list[Passage]:
        try:
            response = await self._client.post(
                self.url, json={"queries": [query], "topk": int(k), "return_scores": True})
        except self._httpx.HTTPError as error:
            raise RetrieverError(f"the retrieval server at {self.url} did not answer: "
                                 f"{type(error).__name__}: {error}") from None
        if response.status_code != 200:
            raise RetrieverError(f"the retrieval server at {self.url} answered "
                                 f"{response.status_code}: {response.text[:200]}")
        try:
            hits = response.json()["result"][0]
            return [_from_server(hit) for hit in hits]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise RetrieverError(f"the retrieval server at {self.url} sent an answer this "
                                 f"client cannot read ({type(error).__name__}: {error})") from None

    async def aclose(self) -> None:
        await self._client.aclose()


def _from_server(hit: Mapping[str, Any]) -> Passage:
    document = hit["document"] if "document" in hit else hit
    contents = str(document.get("contents", document.get("text", "")))
    title, _, text = contents.partition("\n")
    if not text:
        title, text = "", contents
    return Passage(str(document.get("id", "")), title.strip().strip('"'), text.strip(),
                   float(hit.get("score", 0.0)))


async def search_off_loop(retriever: Retriever, query: str, k: int) -> list[Passage]:
    """`retriever.search`, with an in-process BM25 index searched in a worker thread (a big
    corpus would otherwise hold the event loop for a few milliseconds per query)."""
    if isinstance(retriever, BM25Retriever):
        return (await anyio.to_thread.run_sync(retriever.search_many, [query], k))[0]
    return await retriever.search(query, k)
