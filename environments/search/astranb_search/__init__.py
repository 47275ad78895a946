"""Question answering with a search tool (Search-R1 / ASearcher style) for LLM agents.

    from astranb_search import Search, BM25Retriever, HTTPRetriever, facts

    passages, questions = facts(1000)                    # an invented world, no download
    env = Search(questions, BM25Retriever(passages))
    env = Search(load_dataset("RUC-NLPIR/FlashRAG_datasets", "nq"), "http://127.0.0.1:7000")

The model writes <search>query</search> to get the top-k passages back in <information>, and
<answer>…</answer> to finish; the answer is scored by F1 (or exact match) against the gold
answers, SQuAD-normalized. Retrieval is an in-process BM25 index (bm25s) or a Search-R1 /
ASearcher retrieval server over HTTP (`HTTPRetriever`); a server that is down ends only the
episode, counted as `retriever_down`.
"""

from __future__ import annotations

from .env import Search, exact_match, f1_score, golds_of, normalize_answer, read_action
from .retrievers import BM25Retriever, HTTPRetriever, Passage, Retriever, RetrieverError
from .synthetic import facts

__all__ = ["Search", "BM25Retriever", "HTTPRetriever", "Passage", "Retriever", "RetrieverError",
           "exact_match", "f1_score", "golds_of", "normalize_answer", "read_action", "facts"]
