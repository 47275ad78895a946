"""Completion ids to text for the engine, and the bounded dict its caches use."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["Bounded", "TextCache"]

K = TypeVar("K")
V = TypeVar("V")


class Bounded(dict, Generic[K, V]):
    """A dict that forgets everything once it holds `limit` items: cheap, and enough for caches
    whose hits come from a working set far smaller than the limit."""

    def __init__(self, limit: int = 1 << 16) -> None:
        super().__init__()
        self.limit = limit

    def keep(self, key: K, value: V) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


class TextCache:
    """Completion ids -> text without special tokens, as `tokenizer.decode` gives it.

    Short completions repeat (answers, tool calls, stop tokens), so decoded texts are kept in a
    bounded dict. A miss goes straight to a fast tokenizer's Rust backend when the tokenizer adds
    no clean-up of its own; transformers' `decode` spends most of its time converting the ids
    in Python first (a quarter of the engine thread's time in bench/vs_trl.py)."""

    def __init__(self, tokenizer: Any, limit: int = 1 << 16) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        direct = (backend is not None and hasattr(backend, "decode")
                  and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
                  and _plain_fast_decode(tokenizer))
        self._backend = backend if direct else None
        self._texts: Bounded[tuple[int, ...], str] = Bounded(limit)

    def __call__(self, ids: tuple[int, ...]) -> str:
        text = self._texts.get(ids)
        if text is None:
            decode = self._backend.decode if self._backend is not None else self._tokenizer.decode
            text = decode(list(ids), skip_special_tokens=True)
            self._texts.keep(ids, text)
        return text


def _plain_fast_decode(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` is transformers' fast-tokenizer decode, not overridden."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    base = getattr(PreTrainedTokenizerFast, "_decode", None)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and base is not None
            and type(tokenizer)._decode is base
            and type(tokenizer).decode is PreTrainedTokenizerFast.decode)
