"""Chat turns that keep their tokens: token-in/token-out conversations.

A conversation is the list of messages an environment passes to `ctx.chat`. The first call renders
it with the policy tokenizer's chat template and tokenizes the text. Every later call on the same
list does not re-render the history into tokens again: the next prompt is the previous prompt,
plus the completion exactly as it was sampled, plus only the tokens of what was added since (the
tool results, the next user message, the generation prompt):

    turn 1   [ prompt_1 .................. ][ completion_1 ]
    turn 2   [ prompt_1 .................. ][ completion_1 ][ delta_2 ][ completion_2 ]
                                                             ^ tokenized on its own

`delta_2` is the text the template renders after what the ids already decode to. That only makes
sense when the template is append-only for this conversation: the new rendering must start with
the decoded ids. A template that rewrites history (Qwen3's strips past `<think>` blocks) breaks
that; the turn then falls back to a fresh tokenization of the whole rendering, and the training
batch, which merges a conversation into one sequence only where every prompt extends the previous
sequence token for token, trains such turns as separate rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..types import Generation

__all__ = ["ChatMessage", "ToolOutcome", "Conversations"]


@dataclass(frozen=True)
class ChatMessage:
    """An assistant message as `ctx.chat` returns it: parsed, with the generation behind it."""

    content: str
    """The text without reasoning and tool-call blocks."""
    reasoning: str | None
    """The text of a leading `<think>` block, if any."""
    tool_calls: tuple[Any, ...]
    """Well-formed tool calls (`astranb.chat.ToolRequest`), in order."""
    errors: tuple[Any, ...]
    """Tool calls that failed to parse (`astranb.chat.ToolCallError`): the environment decides
    whether to show them to the model (`ctx.run_tools` does) or to end the episode."""
    text: str
    """The raw completion as decoded (stop token left out); what the conversation keeps."""
    generation: Generation = field(repr=False)
    """Tokens, logprobs and weight versions of the completion."""

    @property
    def finish_reason(self) -> str:
        """"stop" or "length" (the completion ran out of tokens)."""
        return self.generation.finish_reason


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call of an assistant message came to, as `ctx.run_tools` reports it."""

    name: str
    """The tool the model asked for."""
    result: Any = None
    """What the tool returned (None when it failed)."""
    error: str | None = None
    """Why the call failed: malformed, unknown tool, bad arguments, or the tool raised."""


@dataclass
class _State:
    messages: list[dict[str, Any]]
    """The conversation (held so that its id cannot be reused by another list)."""
    ids: tuple[int, ...]
    """Prompt + completion of the last turn."""
    tools: str
    """The tool schemas the conversation was rendered with (a change re-renders)."""


@dataclass
class Conversations:
    """The token state of each conversation of one episode, keyed by the messages list."""

    states: dict[int, _State] = field(default_factory=dict)
    fallbacks: int = 0
    """Turns whose prompt could not extend the conversation's tokens (history re-rendered)."""

    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, Any]],
                   schemas: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
        """The next prompt of `messages`: the kept ids plus the tokens of what was added."""
        text = render(tokenizer, messages, schemas)
        tools = repr(schemas)
        state = self.states.get(id(messages))
        if state is not None and state.messages is messages and state.tools == tools:
            extended = extend(tokenizer, state.ids, text)
            if extended is not None:
                return extended
            self.fallbacks += 1
        return encode(tokenizer, text)

    def keep(self, messages: list[dict[str, Any]], schemas: Sequence[Mapping[str, Any]],
             generation: Generation) -> None:
        """Remember the sampled turn: the conversation now ends with its completion tokens."""
        self.states[id(messages)] = _State(
            messages, generation.prompt_ids + generation.completion_ids, repr(schemas))


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
           schemas: Sequence[Mapping[str, Any]]) -> str:
    """The chat template's text for `messages`, ending with the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "ctx.chat needs a tokenizer with a chat template; this policy's tokenizer has none. "
            "Use a chat model (astranb.models.tiny_chat() or an instruct model via "
            "astranb.models.hf(...)), or call ctx.generate with a text prompt"
        )
    text = tokenizer.apply_chat_template(
        list(messages), tools=list(schemas) or None, add_generation_prompt=True, tokenize=False)
    return str(text)


def extend(tokenizer: Any, ids: Sequence[int], text: str) -> tuple[int, ...] | None:
    """`ids` plus the tokens of the part of `text` after what `ids` decode to (the kept tokens are
    never tokenized again); None when `text` does not start with them (the template rewrote the
    history)."""
    before = tokenizer.decode(list(ids), skip_special_tokens=False)
    if not text.startswith(before):
        return None
    return tuple(ids) + encode(tokenizer, text[len(before):])


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of template text (its special tokens are written out; none are added)."""
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def completion_text(tokenizer: Any, generation: Generation) -> str:
    """The completion as the conversation keeps it: decoded as sampled, the EOS left out (the
    template writes its own end of turn)."""
    ids = list(generation.completion_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def schemas_of(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas of the tool functions (from their signatures and docstrings)."""
    from ..chat import tool_schema

    return [tool_schema(fn) for fn in tools]
