"""Chat turns that keep their tokens: token-in/token-out conversations.

A conversation is the list of messages an environment passes to `ctx.chat`. The first call renders
it with the policy tokenizer's chat template and tokenizes the text. Every later call on the same
list does not re-render the history into tokens again: the next prompt is the previous prompt,
plus the completion exactly as it was sampled, plus only the tokens of what was added since (the
tool results, the next user message, the generation prompt):

    turn 1   [ prompt_1 .................. ][ completion_1 ]
    turn 2   [ prompt_1 .................. ][ completion_1 ][ delta_2 ][ completion_2 ]
                                                             ^ tokenized on its own

A later call continues a conversation when its messages start with exactly what an earlier call
left (its messages plus the reply it appended): the same list appended to, or a new one built
from it (`messages = messages + [...]`). One that repeats an earlier turn's messages followed by
another assistant message than the reply (rebuilt from `msg.content`, say) cannot keep the
sampled tokens: it is tokenized afresh, counted as `count/retokenized`, and warned about once.

`delta_2` is the text the template renders after what the ids already decode to. That only makes
sense when the template is append-only for this conversation: the new rendering must start with
the decoded ids. A template that rewrites history (Qwen3's strips past `<think>` blocks) breaks
that; the turn then falls back to a fresh tokenization of the whole rendering, and the training
batch, which merges a conversation into one sequence only where every prompt extends the previous
sequence token for token, trains such turns as separate rows.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..chat import encode, extend, render
from ..types import Generation

__all__ = ["ChatMessage", "ToolOutcome", "Conversations", "REBUILT"]


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
    """The list the turn was asked on (held so that its id cannot be reused by another list)."""
    seen: list[dict[str, Any]]
    """A copy of the conversation as the turn left it: its messages and the appended reply."""
    ids: tuple[int, ...]
    """Prompt + completion of the turn."""
    tools: str
    """The tool schemas the conversation was rendered with (a change re-renders)."""


REBUILT = (
    "ctx.chat got a conversation whose earlier turns differ from what ctx.chat left in it "
    "(an assistant message replaced or edited, e.g. rebuilt from msg.content): its prompt was "
    "tokenized afresh and the sampled tokens are lost for training (counted as "
    "count/retokenized). Keep the assistant message ctx.chat appended as it is: append to the "
    "list (messages.append / messages + [...] both work), or use msg.text as its content")
"""The warning (shown once per place) for a conversation rebuilt by the environment."""

_KEEP = 16
"""Conversations remembered per episode (the most recent turns' ones)."""


@dataclass
class Conversations:
    """The token state of each conversation of one episode, found by content.

    A turn's messages continue a conversation when they start with exactly the messages an
    earlier turn left (its messages and the reply appended to them), whether in the same list
    or a new one (`messages = messages + [...]`). A list that repeats an earlier turn's
    messages but then has another assistant message than the reply was rebuilt by the caller:
    it is tokenized afresh, counted in `rebuilt` and warned about.
    """

    states: list[_State] = field(default_factory=list)
    fallbacks: int = 0
    """Turns whose prompt could not extend the conversation's tokens (history re-rendered)."""
    rebuilt: int = 0
    """Of those, turns whose conversation the environment changed (see `REBUILT`)."""

    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, Any]],
                   schemas: Sequence[Mapping[str, Any]], warning: str = REBUILT
                   ) -> tuple[int, ...]:
        """The next prompt of `messages`: the kept ids plus the tokens of what was added
        (`warning`: what to warn with when the caller changed the conversation's history)."""
        text = render(tokenizer, messages, schemas)
        tools = repr(schemas)
        state = self._continued(messages, tools)
        if state is not None:
            extended = extend(tokenizer, state.ids, text)
            if extended is not None:
                return extended
            self.fallbacks += 1  # the template rewrote the history
        elif self._changed(messages, tools):
            self.fallbacks += 1
            self.rebuilt += 1
            warnings.warn(warning, RuntimeWarning, stacklevel=4)
        return encode(tokenizer, text)

    def keep(self, messages: list[dict[str, Any]], schemas: Sequence[Mapping[str, Any]],
             generation: Generation) -> None:
        """Remember the sampled turn: `messages` now ends with its reply, and the conversation's
        tokens with its completion."""
        tools = repr(schemas)
        continued = self._continued(messages[:-1], tools)
        if continued is not None:
            self.states.remove(continued)  # the conversation's newer state replaces it
        self.states.append(_State(messages, copy.deepcopy(messages),
                                  generation.prompt_ids + generation.completion_ids, tools))
        del self.states[:-_KEEP]

    def _continued(self, messages: list[dict[str, Any]], tools: str) -> _State | None:
        """The newest state whose conversation `messages` start with (same tools)."""
        for state in reversed(self.states):
            n = len(state.seen)
            if state.tools == tools and len(messages) >= n and messages[:n] == state.seen:
                return state
        return None

    def _changed(self, messages: list[dict[str, Any]], tools: str) -> bool:
        """Whether `messages` is an earlier turn's conversation with its history changed: the
        same list edited in place, or the turn's messages followed by another assistant message
        than the reply."""
        for state in self.states:
            if state.messages is messages:
                return True
            asked = len(state.seen) - 1  # the turn's messages, before its reply
            if (state.tools == tools and len(messages) > asked
                    and messages[asked].get("role") == "assistant"
                    and messages[:asked] == state.seen[:asked]):
                return True
        return False


def completion_text(tokenizer: Any, generation: Generation) -> str:
    """The completion as the conversation keeps it: decoded as sampled, the EOS left out (the
    template writes its own end of turn)."""
    ids = list(generation.completion_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))
