"""Play a recorded episode again with some completions edited: how the debugger re-scores.

`replay(env, episode, edits, ...)` runs the environment's own `episode(ctx, sample)` with a
`ReplayContext`. Its generate() answers from the recording instead of a model:

- turns before the first edited one return their recorded generations;
- an edited turn returns the edited text (tokenized with the role's tokenizer when one is known;
  its logprobs and versions are unknown, since no model sampled it);
- turns after the first edit are sampled afresh when a policy is wired to their role (the
  episode now goes somewhere the recording never went), and otherwise replay the recorded
  completion, with a note when the prompt they get differs from the recorded one.

Tool calls are not replayed: the environment calls its tools again, so the new rewards are
whatever the environment makes of the edited completions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..environments.base import Environment, EpisodeContext
from ..environments.play import play_episode
from ..errors import ReplayError
from ..types import Generation, SamplingParams, Turn

if TYPE_CHECKING:
    from ..session.policy import Policy
    from ..session.recorder import Episode

__all__ = ["ReplayContext", "Replayed", "ReplayError", "replay", "encode"]


@dataclass(frozen=True)
class Replayed:
    """What a replayed episode did: the turns (as episode turn records), tools and rewards."""

    turns: tuple[dict[str, Any], ...]
    """Turn records (see `recorder.turn_record`) plus "origin" and "note"."""
    tool_calls: tuple[dict[str, Any], ...]
    """The tool calls the replay made (name, args, result, error, position)."""
    rewards: dict[str, float]
    """Reward per role ({} if the episode raised)."""
    error: str | None
    """Traceback text if the episode raised."""


class ReplayContext(EpisodeContext):
    """An EpisodeContext whose generate() answers from a recorded episode, with edits.

    Args:
        env: the environment being replayed.
        wiring: role -> policy; roles wired here are sampled afresh after the first edit.
        recorded: the recorded turn records, in order.
        edits: turn index -> the completion text that turn returns instead.
        tokenizers: policy name -> tokenizer, for roles without a policy.
    """

    def __init__(self, env: Environment, wiring: Mapping[str, Policy],
                 recorded: Sequence[Mapping[str, Any]], edits: Mapping[int, str],
                 tokenizers: Mapping[str, Any]):
        super().__init__(env, wiring)
        self._recorded = list(recorded)
        self._edits = dict(edits)
        self._first_edit = min(self._edits, default=len(self._recorded))
        self._tokenizers = dict(tokenizers)
        self.records: list[dict[str, Any]] = []
        """One turn record per generate() call, with its "origin" and "note"."""

    async def generate(self, role: str, prompt: str | Sequence[int], **sampling: Any) -> Generation:
        """The recorded, edited or freshly sampled completion of the next turn (see module doc)."""
        i = len(self.turns)
        recorded = self._recorded[i] if i < len(self._recorded) else None
        if i not in self._edits and i >= self._first_edit and role in self._wiring:
            generation = await super().generate(role, prompt, **sampling)
            policy = self._wiring[role]
            self._add(role, policy.name, prompt, generation, "sampled", "", policy.tokenizer)
            return generation
        if recorded is None:
            raise ReplayError(
                f"the episode asks for turn {i} ({role!r}), which the recording never made, and no "
                f"policy is wired to {role!r} to sample it; open the episode with policies "
                f"(episode.debugger({role}=policy) or ab.debug(env, sample, {role}=policy))")
        policy_name = self._wiring[role].name if role in self._wiring else recorded["policy"]
        tokenizer = self._tokenizer(role, policy_name)
        note = self._difference(i, role, prompt, recorded, tokenizer, reused=i not in self._edits)
        if i in self._edits:
            prompt_ids = self._prompt_ids(prompt, recorded, tokenizer)
            generation = _edited(self._edits[i], prompt_ids, tokenizer)
            origin = "edited"
        else:
            generation = _recorded(recorded, self._prompt_ids(prompt, recorded, tokenizer))
            origin = "replayed"
        self.turns.append(Turn(role, policy_name, generation, SamplingParams()))
        self._add(role, policy_name, prompt, generation, origin, note, tokenizer)
        return generation

    def tokenizer(self, role: str):
        """The role's tokenizer: its policy's, else that of the policy that recorded its turns."""
        if role in self._wiring:
            return super().tokenizer(role)
        names = [t["policy"] for t in self._recorded if t["role"] == role]
        tokenizer = self._tokenizers.get(names[0]) if names else None
        if tokenizer is None:
            raise ReplayError(f"the episode asks for the tokenizer of role {role!r}, which the "
                              f"recording does not hold; open it with a policy for {role!r} "
                              f"(episode.debugger({role}=policy))")
        return tokenizer

    # -- internals -------------------------------------------------------------------------------
    def _tokenizer(self, role: str, policy_name: str) -> Any:
        if role in self._wiring:
            return self._wiring[role].tokenizer
        return self._tokenizers.get(policy_name)

    @staticmethod
    def _prompt_ids(prompt, recorded, tokenizer) -> tuple[int, ...]:
        if not isinstance(prompt, str):
            return tuple(int(t) for t in prompt)
        if tokenizer is not None:
            return tuple(encode(tokenizer, prompt))
        return tuple(recorded["prompt_ids"])  # best we can do: text compared in _difference

    def _difference(self, i, role, prompt, recorded, tokenizer, reused: bool) -> str:
        """A note when this turn's role or prompt is not the recorded one ("" when the same)."""
        notes = []
        if role != recorded["role"]:
            notes.append(f"recorded turn {i} was made by {recorded['role']!r}, not {role!r}")
        if isinstance(prompt, str) and tokenizer is None:
            same = prompt == recorded["prompt"]
        else:
            same = self._prompt_ids(prompt, recorded, tokenizer) == tuple(recorded["prompt_ids"])
        if not same:
            notes.append("the prompt differs from the recorded one" + (
                "; the recorded completion (sampled for the recorded prompt) was reused"
                if reused else ""))
        return "; ".join(notes)

    def _add(self, role, policy_name, prompt, generation, origin, note, tokenizer) -> None:
        if isinstance(prompt, str):
            text = prompt
        elif tokenizer is not None:
            text = tokenizer.decode(list(prompt), skip_special_tokens=False)
        else:
            text = ""
        self.records.append({
            "role": role, "policy": policy_name, "prompt": text, "completion": generation.text,
            "prompt_ids": list(generation.prompt_ids),
            "completion_ids": list(generation.completion_ids),
            "logprobs": list(generation.logprobs), "versions": list(generation.versions),
            "finish_reason": generation.finish_reason, "origin": origin, "note": note,
        })


async def replay(env: Environment, episode: Episode, edits: Mapping[int, str],
                 wiring: Mapping[str, Policy] | None = None) -> Replayed:
    """Run `env.episode` again on the episode's sample with `edits` applied (see module doc).

    Raises:
        ReplayError: the episode needs a turn the recording lacks and no policy can sample it.
    """
    ctx = ReplayContext(env, wiring or {}, episode.turns, edits, episode.tokenizers)
    traj = await play_episode(env, ctx.wiring, dict(episode.sample), context=ctx,
                              reraise=(ReplayError,))
    calls = tuple({"name": c.name, "args": dict(c.args), "result": c.result, "error": c.error,
                   "position": c.position} for c in traj.tool_calls)
    return Replayed(tuple(ctx.records), calls, dict(traj.rewards), traj.error)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, without special tokens when the tokenizer can leave them out."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _recorded(turn: Mapping[str, Any], prompt_ids: tuple[int, ...]) -> Generation:
    return Generation(prompt_ids, tuple(turn["completion_ids"]), tuple(turn["logprobs"]),
                      tuple(turn["versions"]), turn["finish_reason"], turn["completion"])


def _edited(text: str, prompt_ids: tuple[int, ...], tokenizer) -> Generation:
    """The edited completion: tokens when a tokenizer is known; no logprobs or versions (no
    model sampled it)."""
    ids = tuple(encode(tokenizer, text)) if tokenizer is not None else ()
    return Generation(prompt_ids, ids, (), (), "edited", text)
