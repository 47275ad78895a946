"""Kept KV caches of finished requests, so a later prompt that extends one prefills only its tail.

A multi-turn episode sends prompt 2 = prompt 1 + completion 1 + observation tokens (token-in /
token-out keeps the ids exact). When a request leaves the batch, `DecodeBatch` hands its row's
keys/values here (they cover every token but the last sampled one, whose keys were never
computed); when a request joins, `lookup` finds the kept sequence sharing the longest prefix with
its prompt, and the batch runs only the remaining tokens through the model (`SlotKV.admit`).

    kept:    [ system + turn 1 prompt | completion 1 ]             (keys/values, all layers)
    prompt:  [ system + turn 1 prompt | completion 1 | observation ] -> prefill observation only

Finding the match without comparing against every entry: each kept sequence is indexed by the
chained hash of every full `BLOCK`-token block of its tokens (block k's hash covers blocks
0..k), so walking a prompt's blocks through the index finds the deepest shared block in
O(len / BLOCK) dict lookups; the candidates there are then compared token by token for the few
tokens past it, and the winner's shared prefix is verified in full (a hash collision is a miss,
never wrong keys). Matches shorter than one block are not worth a copy and count as misses.

An entry whose tokens another kept entry extends is redundant (the longer one matches every
prompt at least as far), so keeping a row that was admitted from an entry drops that entry (and a
sequence already within a kept one is not kept again): a conversation holds one entry, its latest
turn. The store is bounded by `budget_bytes` with LRU
eviction (a lookup hit refreshes an entry).

Single-threaded: only the engine's worker thread calls into it (through `DecodeBatch`); other
threads read `stats()` numbers, plain ints replaced atomically.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "Kept", "BLOCK"]

BLOCK = 16
"""Tokens per hashed block: matches are found at block granularity, then extended per token."""

_CANDIDATES = 32
"""Most entries sharing the deepest block that a lookup compares token by token (newest first)."""


@dataclass(eq=False)
class Kept:
    """One kept sequence."""

    tokens: tuple[int, ...]
    """Tokens whose keys/values `kv` holds, in order from position 0."""
    kv_2L_H_T_D: torch.Tensor
    """Keys and values of every layer stacked: [2 * layers (k0, v0, k1, v1, ...), heads, T, dim]."""
    hashes: tuple[int, ...]
    """Chained hash of each full block of `tokens`."""

    @property
    def nbytes(self) -> int:
        return self.kv_2L_H_T_D.numel() * self.kv_2L_H_T_D.element_size()


def block_hashes(tokens: Sequence[int], limit: int | None = None) -> Iterator[int]:
    """Chained hashes of the full blocks of `tokens[:limit]`, in order."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    h = 0
    for k in range(0, n - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[k : k + BLOCK])))
        yield h


class PrefixCache:
    """LRU store of kept KV sequences under a byte budget.

    Args:
        budget_bytes: most bytes of keys/values kept (0 keeps nothing).
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[int, Kept] = OrderedDict()  # id(entry) -> entry, oldest first
        self.index: dict[int, dict[int, Kept]] = {}  # block hash -> entries holding that block
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    # -- lookup -----------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, Kept | None]:
        """The kept entry sharing the longest prefix with `tokens[:limit]`, and that length.

        Returns (0, None) on a miss (nothing shares a full block). A hit refreshes the entry.
        Counting is left to `count`, called once per distinct joining row.
        """
        best, shared = None, 0
        bucket: dict[int, Kept] | None = None
        for depth, h in enumerate(block_hashes(tokens, limit)):
            found = self.index.get(h)
            if found is None:
                break
            bucket, shared = found, (depth + 1) * BLOCK
        if bucket is None:
            return 0, None
        length = shared
        for i, entry in enumerate(reversed(bucket.values())):
            if i == _CANDIDATES:
                break
            n = _common(entry.tokens, tokens, shared, min(len(entry.tokens), limit))
            if best is None or n > length:
                best, length = entry, n
        assert best is not None
        if tuple(best.tokens[:shared]) != tuple(tokens[:shared]):
            return 0, None  # a hash collision: never hand out another sequence's keys
        self.entries.move_to_end(id(best))
        return length, best

    def count(self, reused: int) -> None:
        """Record one joining row's lookup: `reused` tokens taken from a kept entry (0: a miss)."""
        if reused:
            self.hits += 1
            self.reused_tokens += reused
        else:
            self.misses += 1

    # -- keeping ----------------------------------------------------------------------------------

    def keep(self, tokens: Sequence[int], kv_2L_H_T_D: torch.Tensor,
             supersedes: Kept | None = None) -> None:
        """Keep `tokens`' keys/values; `supersedes` (the entry the row was admitted from) is
        dropped when these tokens extend it whole (not when only an opening was shared).
        Evicts least recently used entries to fit the budget."""
        if (supersedes is not None and self.entries.get(id(supersedes)) is supersedes
                and tuple(tokens[: len(supersedes.tokens)]) == supersedes.tokens):
            self._drop(supersedes)  # only when extended: a shared opening is someone else's
        length, closest = self.lookup(tokens, len(tokens))
        if closest is not None and length == len(tokens):
            return  # already kept, or within a longer kept sequence (a group's twin rows)
        if closest is not None and length == len(closest.tokens):
            self._drop(closest)  # a prefix of these tokens: redundant from now on
        entry = Kept(tuple(tokens), kv_2L_H_T_D, tuple(block_hashes(tokens)))
        if not entry.hashes or entry.nbytes > self.budget_bytes:
            return
        while self.entries and self.bytes + entry.nbytes > self.budget_bytes:
            self._drop(next(iter(self.entries.values())))
            self.evictions += 1
        self.entries[id(entry)] = entry
        self.bytes += entry.nbytes
        for h in entry.hashes:
            self.index.setdefault(h, {})[id(entry)] = entry

    def clear(self) -> int:
        """Drop every entry (the weights changed); returns how many were dropped."""
        dropped = len(self.entries)
        self.entries.clear()
        self.index.clear()
        self.bytes = 0
        return dropped

    def _drop(self, entry: Kept) -> None:
        del self.entries[id(entry)]
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            bucket = self.index.get(h)
            if bucket is not None:
                bucket.pop(id(entry), None)
                if not bucket:
                    del self.index[h]


def _common(a: Sequence[int], b: Sequence[int], start: int, stop: int) -> int:
    """Length of the common prefix of a and b, knowing the first `start` tokens agree, at most
    `stop`."""
    n = start
    while n < stop and a[n] == b[n]:
        n += 1
    return n
