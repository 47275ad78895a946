"""The running decode batch of `HFEngine`: rows, their sampling state, and one decode step.

Single-threaded by design: only the engine's worker thread calls into it, so there are no locks
here. Other threads may read `rows` (a tuple replaced, never mutated, on every membership change)
to count requests.

Per-row sampling state lives in preallocated device tensors indexed like the KV slots, so a decode
step builds no tensors from Python lists: it feeds `pending_R[:n]` (each row's last token, whose
keys/values are not cached yet), samples, and writes the new tokens back into `pending_R`.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..types import GenerationRequest
from ._kvbatch import Reuse, SlotKV
from ._prefix import Kept, PrefixCache
from ._sampling import sample

__all__ = ["Row", "DecodeBatch", "PREFILL_LOGITS_BUDGET"]

PREFILL_LOGITS_BUDGET = 1 << 24
"""Most logit elements (rows x prompt length x vocabulary) a prefill may return so that new rows
sample their first token from it (64 MB in fp32)."""


@dataclass(eq=False)
class Row:
    """Worker-side state of one request."""

    request: GenerationRequest
    future: Future
    tokens: list[int]
    """Prompt followed by the completion so far."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kept_from: Kept | None = None
    """The kept sequence this row's prompt was admitted from (prefix reuse), if any."""

    @property
    def completion(self) -> list[int]:
        return self.tokens[len(self.request.prompt_ids) :]


class DecodeBatch:
    """Rows decoding together over one `SlotKV`.

    Args:
        model: the causal LM.
        max_rows: most rows decoding at once.
        device: model device.
        seed: seed of the sampling generator.
        fast: use the lean forward for models it supports (see `SlotKV`).
        prefix: where finished rows' keys/values are kept for later prompts that extend them
            (`_prefix`); None keeps nothing.
    """

    def __init__(self, model, max_rows: int, device: torch.device, seed: int,
                 fast: bool = True, prefix: PrefixCache | None = None) -> None:
        self.model = model
        self.max_rows = max_rows
        self.device = device
        self.kv = SlotKV(model, max_rows, device, fast=fast)
        self.rows: tuple[Row, ...] = ()
        self.prefill_tokens = 0
        self.prefix = prefix
        self.pending_R = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.temperature_R = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_p_R = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 1 << 30)
        self._any_sampled = self._any_top_p = False

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def admit(self, rows: list[Row], version: int | None = None) -> list[tuple[Row, str]]:
        """Prefill `rows` together and append them to the batch.

        With `version` (new requests, none of them sampled yet) each row's whole prompt is
        prefilled and its first token is sampled from the prefill's last logits, carrying
        `version`: a request costs one forward less. Rows that this first token already finishes
        leave again and are returned, as `step` returns its finished rows. Without `version`
        (rows being rebuilt) each row's cache gets every token but its last, which becomes the
        row's pending input for the next decode step. On error nothing is admitted.

        The first-token path is taken when the prefill's logits for every position stay within
        `PREFILL_LOGITS_BUDGET` elements (small vocabularies, short prompts); otherwise new rows
        are admitted like rebuilt ones and sample their first token in the next decode step.
        """
        if not rows:
            return []
        longest = max(len(row.tokens) for row in rows)
        sample_now = (version is not None and len(rows) * longest * self.vocab_size
                      <= PREFILL_LOGITS_BUDGET)
        cached = [row.tokens if sample_now else row.tokens[:-1] for row in rows]
        reuse = self._lookup(rows, cached) if version is not None else None
        logits_K_V = self.kv.admit(cached, last_logits=sample_now, reuse=reuse)
        slots = slice(len(self.rows), len(self.rows) + len(rows))
        sampling = [row.request.sampling for row in rows]
        self.temperature_R[slots] = self._tensor([s.temperature for s in sampling], torch.float32)
        self.top_p_R[slots] = self._tensor([s.top_p for s in sampling], torch.float32)
        self.prefill_tokens += self.kv.computed
        self._set_rows(self.rows + tuple(rows))
        if not sample_now:
            self.pending_R[slots] = self._tensor([row.tokens[-1] for row in rows], torch.long)
            return []
        assert logits_K_V is not None and version is not None
        tokens_K, logp_K = sample(
            logits_K_V, self.temperature_R[slots], self.top_p_R[slots], self.generator,
            any_sampled=any(s.temperature > 0 for s in sampling),
            any_top_p=any(s.temperature > 0 and s.top_p < 1 for s in sampling),
        )
        self.pending_R[slots] = tokens_K
        return self._record(rows, tokens_K, logp_K, version)

    def _lookup(self, rows: list[Row], cached: list[list[int]]) -> list[Reuse | None] | None:
        """Each new row's kept prefix, if any (identical prompts are looked up and counted once).
        At least one token of every row is left to run, for the logits after it."""
        prefix = self.prefix
        if prefix is None:
            return None
        found: dict[tuple[int, ...], Reuse | None] = {}
        reuse: list[Reuse | None] = []
        for row, c in zip(rows, cached, strict=True):
            key = tuple(c)
            if key not in found:
                length, kept = prefix.lookup(c, len(c) - 1)
                found[key] = None if kept is None else (length, kept)
                prefix.count(length if kept is not None else 0)
            hit = found[key]
            row.kept_from = None if hit is None else hit[1]
            reuse.append(hit)
        return reuse

    def step(self, version: int) -> list[tuple[Row, str]]:
        """Sample one token for every row; rows that finished leave the batch.

        Args:
            version: weight version to record on the sampled tokens.

        Returns:
            (row, finish_reason) for each finished row.
        """
        n = self.kv.n
        logits_B_V = self.kv.decode(self.pending_R[:n].unsqueeze(1))
        tokens_B, logp_B = sample(
            logits_B_V,
            self.temperature_R[:n],
            self.top_p_R[:n],
            self.generator,
            any_sampled=self._any_sampled,
            any_top_p=self._any_top_p,
        )
        self.kv.advance()
        self.pending_R[:n] = tokens_B
        return self._record(self.rows, tokens_B, logp_B, version)

    def _record(self, rows: Iterable[Row], tokens_B: torch.Tensor, logp_B: torch.Tensor,
                version: int) -> list[tuple[Row, str]]:
        """Append each row's sampled token; rows that finished leave the batch (returned)."""
        finished: list[tuple[Row, str]] = []
        for row, token, logp in zip(rows, tokens_B.tolist(), logp_B.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logp)
            row.versions.append(version)
            sampling = row.request.sampling
            if token in sampling.stop_token_ids:
                finished.append((row, "stop"))
            elif len(row.logprobs) >= sampling.max_new_tokens:
                finished.append((row, "length"))
        if finished:
            if self.prefix is not None:
                self._keep([row for row, _ in finished])
            self.remove(row for row, _ in finished)
        return finished

    def _keep(self, rows: list[Row]) -> None:
        """Hand finished rows' keys/values (every token but the last sampled) to `prefix`."""
        prefix = self.prefix
        assert prefix is not None
        slot = {id(row): i for i, row in enumerate(self.rows)}
        for row in rows:
            kv_2L_H_T_D = self.kv.snapshot(slot[id(row)])
            assert kv_2L_H_T_D.shape[2] == len(row.tokens) - 1
            prefix.keep(row.tokens[:-1], kv_2L_H_T_D, supersedes=row.kept_from)
            row.kept_from = None

    def remove(self, rows: Iterable[Row]) -> None:
        """Drop rows from the batch (their slots are refilled from the tail)."""
        gone = {id(row) for row in rows}
        indices = [i for i, row in enumerate(self.rows) if id(row) in gone]
        if not indices:
            return
        holes, movers = self.kv.remove(indices)
        order = list(self.rows)
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for state_R in (self.pending_R, self.temperature_R, self.top_p_R):
                state_R[dst] = state_R[src]
            for h, m in zip(holes, movers, strict=True):
                order[h] = order[m]
        self._set_rows(tuple(order[: self.kv.n]))

    def rebuild(self) -> None:
        """Re-prefill every row (prompt + tokens so far) under the model's current weights."""
        rows = self.rows
        self.clear()
        self.admit(list(rows))

    def clear(self) -> tuple[Row, ...]:
        """Drop every row; returns them."""
        rows = self.rows
        self.kv.reset()
        self._set_rows(())
        return rows

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device)

    def _set_rows(self, rows: tuple[Row, ...]) -> None:
        self.rows = rows
        sampling = [row.request.sampling for row in rows]
        self._any_sampled = any(s.temperature > 0 for s in sampling)
        self._any_top_p = any(s.temperature > 0 and s.top_p < 1 for s in sampling)

