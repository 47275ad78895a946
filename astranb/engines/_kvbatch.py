"""A slot-based, right-aligned KV cache that lets requests join and leave a running decode batch.

Every row of the batch keeps its keys/values in one preallocated buffer per layer, shaped
[rows, kv_heads, columns, head_dim]. All rows end at the same column `end`, so one decode step
writes the new token of every row into column `end` with a single slice assignment; shorter rows
simply start further right (left padding), and the attention mask hides the columns before a row's
`start`. Because a row's start column never moves while it decodes, nothing per-row changes
between steps: the position of a row's next token is `end - start`.

    columns:      0 1 2 3 4 5 6 7 | end
    row 0 (long)  a a a a a a a a |      start 0
    row 1 (short) . . . . . b b b |      start 5 (masked before)

Joining requests are prefilled together (right padded, so no query row is ever fully masked and
no NaN can reach the buffer; identical rows, such as a group's samples of one prompt, only once)
and shifted into place; the prefill can also return the logits after
each row's last token, so a new request's first token needs no decode step of its own. A leaving
request's slot is refilled by moving the last row into it, so live rows stay contiguous in [0, n).
Columns left of every live row's start are simply not shown to the model (the window starts at
min(start)), which trims padding for free when a long request leaves.

A joining row may bring kept keys/values for the start of its tokens (prefix reuse across turns,
`_prefix`): such rows skip the plain prefill and run only their new tokens, right padded, against
their own prefix (left padded to the longest), through the lean forward's `extend`; the result is
placed like any other row (models the lean forward cannot run go through the model with a
`DynamicCache` holding the prefixes and a 4D mask):

    columns:    0 .. P-1 | P .. P+S-1
    row i       . . p p p | s s s .     kept prefix right-aligned at P, new tokens after it

The model sees the buffer through `SlotCache`, a transformers `Cache` whose layers write into the
buffer and return views; it never copies the whole cache per step, unlike `DynamicCache`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from ._fastlm import FastLM
from ._prefix import Kept

__all__ = ["SlotKV"]

_MIN_GROWTH = 64  # columns added past what is needed when the buffer is (re)allocated


class _SlotLayer(CacheLayerMixin):
    """One layer's view of `SlotKV`: writes new keys at column `end` and returns the live window."""

    is_sliding = False

    def __init__(self, owner: SlotKV, layer: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        owner, n, end = self.owner, self.owner.n, self.owner.end
        q = key_states.shape[-2]
        keys, values = owner.keys[self.layer], owner.values[self.layer]
        keys[:n, :, end : end + q] = key_states
        values[:n, :, end : end + q] = value_states
        return keys[:n, :, owner.start : end + q], values[:n, :, owner.start : end + q]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The transformers `Cache` the model is called with during decode steps."""

    def __init__(self, layers: Sequence[_SlotLayer]) -> None:
        super().__init__(layers=list[Any](layers))


class SlotKV:
    """KV buffers plus the column bookkeeping of a continuous batch.

    Args:
        model: the causal LM (probed once for its per-layer KV shapes).
        max_rows: most rows ever live at once.
        device: where buffers live.
        fast: run the model through `FastLM` when it supports the model (same logits, far less
            Python per call); otherwise, or with False, call the model with `SlotCache`.
    """

    def __init__(self, model, max_rows: int, device: torch.device, fast: bool = True) -> None:
        self.model = model
        self.fast = FastLM.build(model) if fast else None
        self.max_rows = max_rows
        self.device = device
        self.shapes = _probe_kv_shapes(model, device)
        self._cache_keyword = next(iter(cache_argument(model, None)))  # read once, not per step
        self.n = 0
        """Live rows, always rows [0, n)."""
        self.computed = 0
        """Tokens the last `admit` ran through the model (identical rows count once)."""
        self.end = 0
        """Column where the next decode step writes; every live row's data ends just before it."""
        self.starts: list[int] = []
        """First column of each live row's data (python copy, for cheap min())."""
        self.start_R = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.start = 0
        """Window start: min(starts), or end when no row is live."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._alloc(_MIN_GROWTH)
        self._layers = [_SlotLayer(self, i) for i in range(len(self.shapes))]
        self.cache = SlotCache(self._layers)  # the same layers, seen by the model's forward

    # -- geometry ---------------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Columns the model attends to before the new token."""
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [n, 1] and attention mask [n, width + 1] for the next decode step."""
        if self.end >= self.capacity:
            self._relayout(self.width)
        start_B = self.start_R[: self.n]
        position_ids_B_1 = (self.end - start_B).unsqueeze(1)
        cols_W = self._cols[self.start : self.end + 1]
        mask_B_W = cols_W.unsqueeze(0) >= start_B.unsqueeze(1)
        return position_ids_B_1, mask_B_W

    def decode(self, ids_B_1: torch.Tensor) -> torch.Tensor:
        """Run one decode step for the live rows (`ids_B_1`: each row's pending token); its
        keys/values are written at column `end`. Returns the logits [n, vocab]. Call `advance`
        after it."""
        position_ids_B_1, mask_B_W = self.step_inputs()
        if self.fast is not None:
            return self.fast.decode(ids_B_1, position_ids_B_1, mask_B_W, self)
        out = self.model(input_ids=ids_B_1, attention_mask=mask_B_W,
                         position_ids=position_ids_B_1, use_cache=True, logits_to_keep=1,
                         **{self._cache_keyword: self.cache})
        return out.logits[:, -1]

    def write(self, layer: int, keys: torch.Tensor,
              values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FastLM's sink: store a decode step's keys/values, return the layer's live window."""
        return self._layers[layer].update(keys, values)

    def advance(self) -> None:
        """Account for the token column every live row has just written."""
        self.end += 1

    # -- membership -------------------------------------------------------------------------------

    def admit(self, cached: Sequence[Sequence[int]], *, last_logits: bool = False,
              reuse: Sequence[Reuse | None] | None = None) -> torch.Tensor | None:
        """Append rows [n, n + k) whose caches hold `cached[i]` (prefilled here, in one batch).

        Args:
            cached: token ids each new row has already seen (may be empty).
            last_logits: also return the logits after each row's last token, [k, vocab]
                (every row must then be non-empty).
            reuse: per row, None or (m, kept): the first m < len(cached[i]) tokens' keys/values
                are `kept`'s (a finished request's, see `_prefix`); only the rest is run through
                the model.

        Returns:
            The last logits when asked for, else None.
        """
        k = len(cached)
        if self.n + k > self.max_rows:
            raise RuntimeError(f"SlotKV holds at most {self.max_rows} rows")
        lengths = [len(c) for c in cached]
        longest = max(lengths, default=0)
        self.computed = 0
        if not longest:
            self._append(k, lengths)
            return None
        # identical rows (a group's samples of one prompt) are prefilled once and shared
        unique: dict[tuple[int, ...], int] = {}
        source_K = [unique.setdefault(tuple(c), len(unique)) for c in cached]
        reuse_U: list[Reuse | None] = [None] * len(unique)
        if reuse is not None:
            for i, u in enumerate(source_K):
                reuse_U[u] = reuse[i]
        distinct = [list(c) for c in unique]
        fresh_U = [u for u in range(len(distinct)) if reuse_U[u] is None]
        kept_U = [u for u in range(len(distinct)) if reuse_U[u] is not None]
        placed, logits_K_V = [], None
        for group in (fresh_U, kept_U):
            if not group:
                continue
            rows = [distinct[u] for u in group]
            if group is fresh_U:
                kv, logits_G_V = _prefill(self.model, rows, self.device, last_logits, self.fast)
                offset_G = [0] * len(group)
                self.computed += sum(len(c) for c in rows)
            else:
                reuse_G = [r for r in (reuse_U[u] for u in group) if r is not None]
                kv, logits_G_V, offset_G = _extend(self.model, self.fast, rows, reuse_G,
                                                   self.device, last_logits)
                self.computed += sum(len(c) - m for c, (m, _) in zip(rows, reuse_G, strict=True))
            at = {u: g for g, u in enumerate(group)}
            members_M = [i for i in range(k) if source_K[i] in at]
            src_M = [at[source_K[i]] for i in members_M]
            placed.append((members_M, src_M, kv, offset_G))
            if logits_G_V is not None:
                if logits_K_V is None:
                    logits_K_V = logits_G_V.new_empty(k, logits_G_V.shape[-1])
                logits_K_V[members_M] = logits_G_V[src_M]
        if longest > self.end:
            self._relayout(longest)
        for members_M, src_M, kv, offset_G in placed:
            self._place(members_M, src_M, kv, [lengths[i] for i in members_M],
                        [offset_G[g] for g in src_M])
        self._append(k, lengths)
        return logits_K_V

    def snapshot(self, row: int) -> torch.Tensor:
        """Row `row`'s keys/values of every layer, stacked [2 * layers, H, T, D] (a copy)."""
        lo = self.starts[row]
        return torch.stack([buf[row, :, lo : self.end]
                            for pair in zip(self.keys, self.values, strict=True) for buf in pair])

    def _append(self, k: int, lengths: list[int]) -> None:
        """Account for k rows just written right-aligned at `end`."""
        rows = slice(self.n, self.n + k)
        new_starts = [self.end - c for c in lengths]
        self.start_R[rows] = torch.tensor(new_starts, dtype=torch.long).to(self.device)
        self.starts.extend(new_starts)
        self.n += k
        self.start = min(self.starts)

    def remove(self, rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """Drop rows and refill the holes from the tail so live rows stay contiguous.

        Returns:
            (holes, movers): row `movers[i]` now lives at `holes[i]`; callers move their own
            per-row state the same way.
        """
        gone = set(rows)
        n_left = self.n - len(gone)
        holes = sorted(r for r in gone if r < n_left)
        movers = [r for r in range(n_left, self.n) if r not in gone]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for buf in (*self.keys, *self.values):
                window = buf[:, :, self.start : self.end]
                window[dst] = window[src]
            self.start_R[dst] = self.start_R[src]
            for h, m in zip(holes, movers, strict=True):
                self.starts[h] = self.starts[m]
        del self.starts[n_left:]
        self.n = n_left
        self.start = min(self.starts, default=self.end)
        return holes, movers

    def reset(self) -> None:
        """Forget every row (buffers are kept)."""
        self.n, self.end, self.start, self.starts = 0, 0, 0, []

    # -- internals --------------------------------------------------------------------------------

    def _alloc(self, columns: int) -> None:
        """Fresh zeroed buffers with at least `columns` columns."""
        # Zeros, not empty: masked columns still enter the attention matmul (with weight 0), and
        # 0 * NaN from uninitialised memory would poison every row.
        columns = -(-columns // _MIN_GROWTH) * _MIN_GROWTH
        self.keys = [
            torch.zeros(self.max_rows, h, columns, d, dtype=dt, device=self.device)
            for h, d, dt in self.shapes
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._cols = torch.arange(columns + 1, device=self.device)

    def _relayout(self, new_end: int) -> None:
        """Move the live window so it ends at `new_end`, growing the buffers only if needed.

        Columns outside the window keep stale values; those are always finite (zeros or real
        keys/values), so the mask hides them exactly and no re-zeroing is needed.
        """
        n, width, old_start, old_end = self.n, self.width, self.start, self.end
        new_end = max(new_end, width)
        windows = [buf[:n, :, old_start:old_end].clone() for buf in (*self.keys, *self.values)]
        needed = new_end + max(new_end, _MIN_GROWTH)  # doubling keeps relayouts rare
        if needed > self.capacity:
            self.keys = self.values = []  # drop the old buffers before allocating the new ones
            self._alloc(needed)
        for buf, window in zip((*self.keys, *self.values), windows, strict=True):
            buf[:n, :, new_end - width : new_end] = window
        shift = new_end - old_end
        self.start_R[:n] += shift
        self.starts = [s + shift for s in self.starts]
        self.end = new_end
        self.start = old_start + shift if n else new_end

    def _place(self, members: list[int], src: list[int],
               kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int],
               offsets: list[int]) -> None:
        """Copy right-padded KV into new rows, right-aligned so every row ends at `end`.

        New row `members[i]` (counted from `n`) takes source row `src[i]`, whose data starts at
        source column `offsets[i]` and spans `lengths[i]` columns."""
        longest = max(lengths)
        lengths_M = torch.tensor(lengths, device=self.device)
        offsets_M = torch.tensor(offsets, device=self.device)
        # Destination column t (of the last `longest`) holds source column
        # t - (longest - len) + offset.
        cols_T = torch.arange(longest, device=self.device)
        src_M_T = cols_T.unsqueeze(0) - (longest - lengths_M).unsqueeze(1)
        valid_M_T = src_M_T >= 0
        src_M_T = (src_M_T + offsets_M.unsqueeze(1)).clamp(min=0)
        lo, hi = self.end - longest, self.end
        dst = torch.tensor([self.n + i for i in members], device=self.device)
        select = None if src == list(range(len(src))) and len(src) == kv[0][0].shape[0] else \
            torch.tensor(src, device=self.device)
        keep = valid_M_T[:, None, :, None]
        for layer, (k, v) in enumerate(kv):
            if select is not None:
                k, v = k.index_select(0, select), v.index_select(0, select)
            index = src_M_T[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.keys[layer][dst, :, lo:hi] = torch.where(keep, k.gather(2, index), 0)
            self.values[layer][dst, :, lo:hi] = torch.where(keep, v.gather(2, index), 0)


Reuse = tuple[int, Kept]
"""(m, kept): a joining row's first m tokens have `kept`'s keys/values."""


def _extend(model, fast: FastLM | None, rows: Sequence[Sequence[int]], reuse: Sequence[Reuse],
            device, last_logits: bool
            ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None, list[int]]:
    """Run each row's tokens past its kept prefix through the model against that prefix.

        columns:  0 ..  P-1 | P .. P+S-1
        row i     . . p p p | s s s .       prefix right-aligned at P, new tokens left-aligned

    Returns each layer's (keys, values) [K, H, P + S, D] with row i's data in columns
    [P - m_i, P + s_i), the logits after each row's last token [K, V] with `last_logits`, and
    each row's first data column (P - m_i).
    """
    prefix_K = [m for m, _ in reuse]
    suffix_K = [len(c) - m for c, m in zip(rows, prefix_K, strict=True)]
    K, P, S = len(rows), max(prefix_K), max(suffix_K)
    first = reuse[0][1].kv_2L_H_T_D
    layers2, heads, dim = first.shape[0], first.shape[1], first.shape[3]
    # zeros, not empty: masked columns still enter the attention matmul (see `_alloc`)
    kv_2L_K_H_W_D = first.new_zeros(layers2, K, heads, P + S, dim)
    ids_K_S = torch.zeros(K, S, dtype=torch.long)
    for i, (c, (m, kept)) in enumerate(zip(rows, reuse, strict=True)):
        kv_2L_K_H_W_D[:, i, :, P - m : P] = kept.kv_2L_H_T_D[:, :, :m]
        ids_K_S[i, : len(c) - m] = torch.tensor(c[m:], dtype=torch.long)
    ids_K_S = ids_K_S.to(device)
    prefix_t = torch.tensor(prefix_K, device=device)
    position_ids_K_S = prefix_t.unsqueeze(1) + torch.arange(S, device=device)
    cols_W = torch.arange(P + S, device=device)
    own_prefix_K_W = cols_W.unsqueeze(0) >= (P - prefix_t).unsqueeze(1)
    causal_S_W = (cols_W.unsqueeze(0) - P) <= torch.arange(S, device=device).unsqueeze(1)
    mask_K_S_W = own_prefix_K_W.unsqueeze(1) & causal_S_W.unsqueeze(0)
    last_K = torch.tensor(suffix_K, device=device) - 1
    if fast is not None:
        logits_K_V = fast.extend(ids_K_S, position_ids_K_S, kv_2L_K_H_W_D, mask_K_S_W, last_K)
    else:
        logits_K_V = _extend_model(model, ids_K_S, position_ids_K_S, kv_2L_K_H_W_D, mask_K_S_W,
                                   last_K)
    kv = [(kv_2L_K_H_W_D[2 * layer], kv_2L_K_H_W_D[2 * layer + 1])
          for layer in range(layers2 // 2)]
    return kv, logits_K_V if last_logits else None, [P - m for m in prefix_K]


def _extend_model(model, ids_K_T: torch.Tensor, positions_K_T: torch.Tensor,
                  kv_2L_K_H_W_D: torch.Tensor, mask_K_T_W: torch.Tensor,
                  last_K: torch.Tensor) -> torch.Tensor:
    """`FastLM.extend` through the model itself: a `DynamicCache` holding the prefixes and the
    4D keep-mask (transformers uses a 4D mask as given)."""
    P = kv_2L_K_H_W_D.shape[3] - ids_K_T.shape[1]
    cache = DynamicCache(config=model.config)
    for layer in range(kv_2L_K_H_W_D.shape[0] // 2):
        cache.update(kv_2L_K_H_W_D[2 * layer, :, :, :P], kv_2L_K_H_W_D[2 * layer + 1, :, :, :P],
                     layer)
    logits_K_T_V = model(input_ids=ids_K_T, position_ids=positions_K_T,
                         attention_mask=mask_K_T_W[:, None], cache=cache, use_cache=True,
                         logits_to_keep=0).logits
    for layer, cached in enumerate(cache.layers):
        keys, values = _filled(cached)
        kv_2L_K_H_W_D[2 * layer, :, :, P:] = keys[:, :, P:]
        kv_2L_K_H_W_D[2 * layer + 1, :, :, P:] = values[:, :, P:]
    return logits_K_T_V[torch.arange(ids_K_T.shape[0], device=ids_K_T.device), last_K]


def _prefill(
    model, cached: Sequence[Sequence[int]], device, last_logits: bool = False,
    fast: FastLM | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Run `cached` through the model right padded; return each layer's (keys, values)
    [K, H, T, D], and with `last_logits` the logits after each row's last token [K, V].

    Right padding keeps every real token's causal context free of padding, so plain causal
    attention (no padding mask) gives the same keys/values as running each row alone.
    """
    longest = max(len(c) for c in cached)
    lengths = [len(c) for c in cached]
    ids_K_T = torch.zeros(len(cached), longest, dtype=torch.long)
    for i, c in enumerate(cached):
        ids_K_T[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    ids_K_T = ids_K_T.to(device)
    position_ids_K_T = torch.arange(longest, device=device).expand(len(cached), -1)
    if fast is not None:
        kv, logits_K_T_V = fast.prefill(ids_K_T, position_ids_K_T, all_logits=last_logits)
    else:
        cache = DynamicCache(config=model.config)
        logits_K_T_V = model(
            input_ids=ids_K_T,
            position_ids=position_ids_K_T,
            use_cache=True,
            **cache_argument(model, cache),
            logits_to_keep=0 if last_logits else 1,  # 0: every position
        ).logits
        kv = [_filled(layer) for layer in cache.layers]
    logits_K_V = None
    if last_logits:
        last_K = torch.tensor(lengths, device=device) - 1
        logits_K_V = logits_K_T_V[torch.arange(len(cached), device=device), last_K]
    return kv, logits_K_V


def cache_argument(model: Any, cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword a model's forward takes its cache by: `cache` from transformers 5.2x on,
    `past_key_values` before (an unknown keyword is swallowed by `**kwargs` there, and the cache
    stays empty). Read from the forward's signature, looking through wrappers (PEFT) whose
    forward takes only `**kwargs`."""
    seen: Any = model
    for _ in range(4):
        params = inspect.signature(seen.forward).parameters
        if "cache" in params:
            return {"cache": cache}
        if "past_key_values" in params:
            return {"past_key_values": cache}
        inner = getattr(seen, "get_base_model", None)
        if inner is None or inner() is seen:
            break
        seen = inner()
    return {"past_key_values": cache}


def _probe_kv_shapes(model, device) -> list[tuple[int, int, torch.dtype]]:
    """(kv_heads, head_dim, dtype) of every layer, read from a one-token forward."""
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        use_cache=True,
        **cache_argument(model, cache),
        logits_to_keep=1,
    )
    if any(cache.is_sliding) or any(cache.is_linear):
        raise NotImplementedError(
            "HFEngine supports full-attention models only (this model has sliding-window or "
            "linear-attention layers)"
        )
    keys = [_filled(layer)[0] for layer in cache.layers]
    return [(k.shape[1], k.shape[3], k.dtype) for k in keys]


def _filled(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a full-attention cache layer after a forward (None before one)."""
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None
    return keys, values
