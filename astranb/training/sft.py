"""Supervised warm-start ("cold start"): demonstrations as training rows, loss on assistant tokens.

Real recipes teach a model the format of its answers and tool calls with a few supervised steps
before RL. A demonstration is a chat conversation; it is tokenized exactly the way `ctx.chat`
builds prompts during RL (the template's rendering, extended message by message, never
re-tokenized), so what the model is taught is token for token what it will later see:

    [ system/user ... <|im_start|>assistant\\n ][ content <tool_call>..</tool_call> <|im_end|> ]
      loss 0                                       loss 1
    [ \\n<|im_start|>user\\n<tool_response>.. <|im_start|>assistant\\n ][ 85 <|im_end|> ]
      loss 0                                                           loss 1

The loss is the token mean of the negative log-likelihood over the assistant tokens (their end of
turn included, so the model learns to stop). A template that rewrites the history (it is not
append-only) makes each assistant message a row of its own. Plain (prompt, completion) text pairs
serve models without a chat template.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..chat import encode, extend, render, schemas_of
from ..types import Batch

__all__ = ["sft_rows", "sft_batches", "Demonstration"]

Demonstration = Sequence[Mapping[str, Any]] | Mapping[str, Any] | tuple[str, str]
"""A conversation (a list of messages), {"messages": [...], "tools": [fn, ...]}, or a
(prompt, completion) text pair."""


def sft_rows(tokenizer: Any, example: Demonstration) -> list[tuple[list[int], list[int]]]:
    """Token ids and loss mask (1 on assistant tokens) of one demonstration, one or more rows."""
    if isinstance(example, tuple):
        return [_pair(tokenizer, example)]
    if isinstance(example, Mapping):
        if "messages" not in example:
            raise ValueError(f"a demonstration dict needs 'messages' (and optionally 'tools'); "
                             f"got keys {sorted(example)}")
        messages, tools = list(example["messages"]), list(example.get("tools") or ())
    else:
        messages, tools = list(example), []
    return _conversation(tokenizer, messages, tools)


def sft_batches(tokenizer: Any, examples: Sequence[Demonstration], batch_size: int, seed: int,
                pad_id: int) -> Iterator[Batch]:
    """Endless batches of `batch_size` demonstrations, reshuffled each pass (seeded)."""
    rows = [row for example in examples for row in sft_rows(tokenizer, example)]
    if not rows:
        raise ValueError("no demonstrations: pass at least one conversation or (prompt, "
                         "completion) pair")
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            chosen = [rows[i] for i in order[start:start + batch_size]]
            if len(chosen) == batch_size or len(rows) < batch_size:
                yield _collate(chosen, pad_id)


# -- one demonstration ----------------------------------------------------------------------------

def _pair(tokenizer: Any, pair: tuple[str, str]) -> tuple[list[int], list[int]]:
    prompt, completion = pair
    prompt_ids = list(tokenizer.encode(prompt))
    completion_ids = list(tokenizer.encode(completion, add_special_tokens=False))
    if tokenizer.eos_token_id is not None:
        completion_ids.append(int(tokenizer.eos_token_id))
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)


def _conversation(tokenizer: Any, messages: list[Mapping[str, Any]],
                  tools: Sequence[Callable[..., Any] | Mapping[str, Any]]
                  ) -> list[tuple[list[int], list[int]]]:
    schemas = [t if isinstance(t, Mapping) else schemas_of([t])[0] for t in tools]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistant:
        raise ValueError("a demonstration has no assistant message: nothing to learn from")
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    mask: list[int] = []
    for i in assistant:
        prompt = render(tokenizer, messages[:i], schemas)
        extended = extend(tokenizer, ids, prompt) if ids else None
        if extended is not None:
            delta = list(extended[len(ids):])
        else:  # first turn, or a template that rewrote the history: a new row
            if ids:
                rows.append((ids, mask))
            ids, mask, delta = [], [], list(encode(tokenizer, prompt))
        answer = _assistant_ids(tokenizer, messages[: i + 1], prompt, schemas)
        ids += delta + answer
        mask += [0] * len(delta) + [1] * len(answer)
    rows.append((ids, mask))
    return rows


def _assistant_ids(tokenizer: Any, messages: list[Mapping[str, Any]], prompt: str,
                   schemas: list[Mapping[str, Any]]) -> list[int]:
    """The tokens the model should produce for the last (assistant) message: the template's own
    rendering of it, up to and including its end-of-turn token."""
    full = tokenizer.apply_chat_template(list(messages), tools=schemas or None,
                                         add_generation_prompt=False, tokenize=False)
    eos = tokenizer.eos_token
    if not full.startswith(prompt) or eos is None or eos not in full[len(prompt):]:
        raise ValueError(
            "the chat template renders an assistant message in a way a demonstration cannot be "
            "cut from (its rendering does not follow the generation prompt, or has no "
            f"{eos!r}); use a template whose assistant turns end with the EOS token")
    body = full[len(prompt):]
    body = body[: body.index(eos)]
    return list(encode(tokenizer, body)) + [int(tokenizer.eos_token_id)]


def _collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    B, T = len(rows), max(len(ids) for ids, _ in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    zeros = torch.zeros((B, T))
    return Batch(input_ids, attention, loss_mask, zeros, zeros, torch.full((B, T), -1),
                 torch.ones(B), torch.zeros(B))
