"""`Gymnasium`: a Gymnasium environment played as a conversation, one action per assistant turn.

    episode(ctx, sample)
      env = gymnasium.make(id, render_mode="ansi")   a fresh one per episode, closed at its end
      obs = env.reset(seed=sample["seed"])
      user: instructions + the observation as text
      repeat up to max_turns:
        assistant reply  ->  parse_action  ->  an action of the space, or invalid (counted,
                                               the turn is spent, the user says what is allowed)
        env.step(action) ->  reward added; the next observation as the next user message
        terminated or truncated: stop
      reward = the sum of the step rewards

Observations become text through `render` (default: the environment's ANSI rendering with its
escape codes turned into plain marks, else the observation's repr). Actions: a `Discrete(n)`
space takes names (`actions=[...]`, or the names of `ACTION_NAMES` for Gymnasium's toy-text
environments, else "0".."n-1"), read from the reply by `parse_action` (the last name it
contains, as a whole word, case-insensitive; a bare index counts too); a `Text` space takes the
reply itself when the space contains it. Anything else is refused when the environment is built:
say how to render and parse with `render=` and `parse=`.

The reply is the policy's, so it is hostile: it is only ever matched against the allowed names
(no eval, no format string), and what reaches `env.step` is an element of the action space.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from astranb import Environment, SamplingParams

__all__ = ["ACTION_NAMES", "Gymnasium", "parse_action", "text_of"]

ACTION_NAMES: dict[str, tuple[str, ...]] = {
    "FrozenLake": ("left", "down", "right", "up"),
    "CliffWalking": ("up", "right", "down", "left"),
    "Taxi": ("south", "north", "east", "west", "pickup", "dropoff"),
    "Blackjack": ("stick", "hit"),
}
"""Action names of Gymnasium's toy-text environments, in their action spaces' order (from each
environment's documentation), by the environment's name without its version."""

_HIGHLIGHT = re.compile(r"\x1b\[4[0-7]m(.*?)\x1b\[0m", re.S)
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def text_of(rendered: Any) -> str:
    """An ANSI rendering as plain text: a highlighted cell becomes [cell], other escape codes go."""
    text = rendered if isinstance(rendered, str) else str(rendered)
    return _ESCAPE.sub("", _HIGHLIGHT.sub(r"[\1]", text)).strip("\n")


def parse_action(reply: str, names: Sequence[str]) -> int | None:
    """The index of the action named last in `reply` (a whole word, any case), or of a bare
    index ("2") when the reply is only that; None when it names none."""
    stripped = reply.strip()
    if stripped.isdigit() and int(stripped) < len(names):
        return int(stripped)
    best: tuple[int, int] | None = None  # (position, index)
    lowered = reply.lower()
    for index, name in enumerate(names):
        for match in re.finditer(rf"(?<![\w-]){re.escape(name.lower())}(?![\w-])", lowered):
            if best is None or match.start() > best[0]:
                best = (match.start(), index)
    return None if best is None else best[1]


class Gymnasium(Environment):
    """A Gymnasium environment (`gymnasium.make(id)`) with text observations and actions.

    A sample is {"seed": the reset seed, "split"}: "train" draws even seeds from `seed`'s
    stream, "test" odd ones, so no held-out start was trained on.

    Args:
        id: the Gymnasium id ("FrozenLake-v1", "CliffWalking-v1", ...), or a function returning
            a new environment (called once per episode).
        actions: names of a Discrete space's actions, in order (default: `ACTION_NAMES` for the
            toy-text environments, else "0".."n-1").
        render: observation (and info) -> text (default: the ANSI rendering, else repr).
        parse: reply text -> an action of the space, or None when it names none (default:
            `parse_action` over the names; a Text space's reply as it is).
        instructions: the first user message's opening (default: what the actions are and how
            to answer).
        max_turns: most actions an episode takes (each invalid reply spends one).
        make_kwargs: keyword arguments of `gymnasium.make` (e.g. {"is_slippery": False}).
        seed: the training seeds' stream.
        sampling: SamplingParams, or a dict of its fields (default: max_new_tokens=16).

    Raises:
        ValueError: an unknown id (the message suggests registered ones), an action space that
            is neither Discrete nor Text without `parse=`, or names that do not match the space.

    Example:
        env = ab.environments.load("gymnasium", id="FrozenLake-v1",
                                   make_kwargs={"is_slippery": False})
        session.wire(env, agent=policy)
    """

    roles = ("agent",)
    splits = ("train", "test")

    def __init__(self, id: str | Callable[[], Any], *, actions: Sequence[str] | None = None,
                 render: Callable[[Any, Mapping[str, Any]], str] | None = None,
                 parse: Callable[[str], Any] | None = None, instructions: str | None = None,
                 max_turns: int = 32, make_kwargs: Mapping[str, Any] | None = None,
                 seed: int = 0, sampling: SamplingParams | Mapping[str, Any] | None = None):
        import gymnasium

        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive integer, got {max_turns!r}")
        self._gym = gymnasium
        self.id, self.make_kwargs = id, dict(make_kwargs or {})
        self.seed, self.max_turns = seed, max_turns
        self._label = f"gymnasium:{id if isinstance(id, str) else getattr(id, '__name__', 'env')}"
        probe = self._make()
        try:  # rendered as ANSI text where the environment can (its metadata says)
            self._ansi = "ansi" in (getattr(probe, "metadata", None) or {}).get("render_modes", ())
            self.space = probe.action_space
            self.kind, self.actions = self._actions(actions, parse is not None)
        finally:
            probe.close()
        self._render, self._parse = render, parse
        self.instructions = instructions if instructions is not None else self._instructions()
        if sampling is None:
            sampling = SamplingParams(max_new_tokens=16)
        self.sampling = (sampling if isinstance(sampling, SamplingParams)
                         else SamplingParams(**sampling))

    @property
    def name(self) -> str:
        return self._label

    # -- building ---------------------------------------------------------------------------------
    def _make(self) -> Any:
        if callable(self.id):
            return self.id()
        ansi = {"render_mode": "ansi"} if getattr(self, "_ansi", False) else {}
        try:
            return self._gym.make(self.id, **ansi, **self.make_kwargs)
        except self._gym.error.Error as error:
            known = sorted(self._gym.envs.registry)
            close = [k for k in known if k.split("-")[0].lower() in str(self.id).lower()][:5]
            raise ValueError(f"gymnasium cannot make {self.id!r} ({error}); registered ids "
                             f"include {close or known[:8]}") from error

    def _actions(self, names: Sequence[str] | None, custom: bool) -> tuple[str, tuple[str, ...]]:
        spaces = self._gym.spaces
        if isinstance(self.space, spaces.Discrete):
            n = int(self.space.n)
            base = str(self.id).split("-")[0] if isinstance(self.id, str) else ""
            chosen = tuple(names) if names is not None else ACTION_NAMES.get(
                base, tuple(str(i) for i in range(n)))
            if len(chosen) != n or len(set(chosen)) != n or not all(chosen):
                raise ValueError(f"{self.name}'s action space is Discrete({n}): give {n} "
                                 f"distinct names in order, got {list(chosen)}")
            return "discrete", chosen
        if isinstance(self.space, spaces.Text):
            return "text", ()
        if custom:
            return "custom", ()
        raise ValueError(f"{self.name}'s action space {self.space} is neither Discrete nor Text: "
                         "pass parse= (reply text -> an action of the space, or None)")

    def _instructions(self) -> str:
        if self.kind == "discrete":
            return (f"You are playing {self.id}. Each turn, reply with one action: "
                    f"{', '.join(self.actions)}.")
        return f"You are playing {self.id}. Each turn, reply with your action."

    # -- samples ----------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        return self.split_samples("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {self.splits}, not {split!r}")
        rng = random.Random(f"gymnasium-{split}-{self.seed}-{seed}")
        parity = 0 if split == "train" else 1
        while True:
            yield {"seed": 2 * rng.randrange(2**30) + parity, "split": split}

    # -- an episode -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        env = self._make()
        try:
            observation, info = env.reset(seed=int(sample["seed"]))
            messages = [{"role": "user",
                         "content": f"{self.instructions}\n\n{self._text(env, observation, info)}"}]
            total = 0.0
            for _ in range(self.max_turns):
                reply = await ctx.chat("agent", messages)  # with self.sampling
                action = self._action(reply.content)
                if action is None:
                    ctx.count("invalid_action")
                    messages.append({"role": "user", "content": self._invalid()})
                    continue
                observation, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                ctx.count("actions")
                if terminated or truncated:
                    ctx.count("terminated" if terminated else "truncated")
                    return total
                messages.append({"role": "user", "content": self._text(env, observation, info)})
            ctx.count("out_of_turns")
            return total
        finally:
            env.close()

    def _text(self, env: Any, observation: Any, info: Mapping[str, Any]) -> str:
        if self._render is not None:
            return str(self._render(observation, info))
        if getattr(env, "render_mode", None) == "ansi":
            return text_of(env.render())
        return repr(observation)

    def _action(self, reply: str) -> Any:
        if self._parse is not None:
            action = self._parse(reply)
            return action if action is not None and self.space.contains(action) else None
        if self.kind == "discrete":
            index = parse_action(reply, self.actions)
            return None if index is None else index
        text = reply.strip()
        return text if self.space.contains(text) else None

    def _invalid(self) -> str:
        if self.kind == "discrete":
            return f"That is not an action. Reply with one of: {', '.join(self.actions)}."
        return "That is not a valid action. Reply with an action of the game."
