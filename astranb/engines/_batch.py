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
from ._kvbatch import SlotKV
from ._sampling import sample

__all__ = ["Row", "DecodeBatch"]


@dataclass(eq=False)
class Row:
    """Worker-side state of one request."""

    request: GenerationRequest
    future: Future
    tokens: list[int]
    """Prompt followed by the completion so far."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

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
    """

    def __init__(self, model, max_rows: int, device: torch.device, seed: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.device = device
        self.kv = SlotKV(model, max_rows, device)
        self.rows: tuple[Row, ...] = ()
        self.prefill_tokens = 0
        self.pending_R = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.temperature_R = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_p_R = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._any_sampled = self._any_top_p = False

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def admit(self, rows: list[Row]) -> None:
        """Prefill `rows` together and append them to the batch.

        Each row's cache gets every token but its last, which becomes the row's pending input, so
        the next decode step samples the row's next token. On error nothing is admitted.
        """
        if not rows:
            return
        self.kv.admit([row.tokens[:-1] for row in rows])
        slots = slice(len(self.rows), len(self.rows) + len(rows))
        sampling = [row.request.sampling for row in rows]
        self.pending_R[slots] = self._tensor([row.tokens[-1] for row in rows], torch.long)
        self.temperature_R[slots] = self._tensor([s.temperature for s in sampling], torch.float32)
        self.top_p_R[slots] = self._tensor([s.top_p for s in sampling], torch.float32)
        self.prefill_tokens += sum(len(row.tokens) - 1 for row in rows)
        self._set_rows(self.rows + tuple(rows))

    def step(self, version: int) -> list[tuple[Row, str]]:
        """Sample one token for every row; rows that finished leave the batch.

        Args:
            version: weight version to record on the sampled tokens.

        Returns:
            (row, finish_reason) for each finished row.
        """
        n = self.kv.n
        position_ids_B_1, mask_B_W = self.kv.step_inputs()
        out = self.model(
            input_ids=self.pending_R[:n].unsqueeze(1),
            attention_mask=mask_B_W,
            position_ids=position_ids_B_1,
            cache=self.kv.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens_B, logp_B = sample(
            out.logits[:, -1],
            self.temperature_R[:n],
            self.top_p_R[:n],
            self.generator,
            any_sampled=self._any_sampled,
            any_top_p=self._any_top_p,
        )
        self.kv.advance()
        self.pending_R[:n] = tokens_B
        finished: list[tuple[Row, str]] = []
        for row, token, logp in zip(self.rows, tokens_B.tolist(), logp_B.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logp)
            row.versions.append(version)
            sampling = row.request.sampling
            if token in sampling.stop_token_ids:
                finished.append((row, "stop"))
            elif len(row.logprobs) >= sampling.max_new_tokens:
                finished.append((row, "length"))
        if finished:
            self.remove(row for row, _ in finished)
        return finished

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

