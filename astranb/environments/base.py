"""Environments: what an agent does in one episode, and the context it does it through.

An environment declares its `roles` and writes one coroutine, `episode(ctx, sample)`, that drives
turns with `await ctx.generate(role, prompt)`, calls tools with `await ctx.tool(name, fn, ...)`
and returns a reward (a float for every role, or a dict role -> float). Everything the episode
generates and every tool it calls is recorded on the context, so the episode can be trained on,
replayed and stepped through (`run.episodes[i].show()`, `ab.debug`). An exception in `episode`
fails that episode only; the run records it and goes on.

    import operator

    class Echo(Environment):
        roles = ("solver",)

        def samples(self, seed=0):
            while True:
                yield {"prompt": "say 7:", "answer": "7"}

        async def episode(self, ctx, sample):
            out = await ctx.generate("solver", sample["prompt"], max_new_tokens=2)
            right = await ctx.tool("check", operator.eq, out.text.strip(), sample["answer"])
            return float(right)
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..types import Generation, GenerationRequest, SamplingParams, ToolCall, Turn, jsonable

if TYPE_CHECKING:
    from ..contracts import PolicyHandle

__all__ = ["Environment", "EpisodeContext"]


class Environment(ABC):
    """Base class of every environment. Subclasses set `roles` and implement two methods."""

    roles: tuple[str, ...] = ("policy",)
    """Names of the agents that act in an episode; each is wired to a policy."""

    sampling: SamplingParams = SamplingParams()
    """Default sampling settings for generate() calls (per-call keywords override them)."""

    # Set on instances by `environments.load` only (how a rollout service rebuilds the same
    # environment); read with getattr and a default, since others do not have them.
    registry_name: str
    registry_kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return type(self).__name__

    @abstractmethod
    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Training samples (dicts); may be endless. Same seed, same order."""

    @abstractmethod
    async def episode(self, ctx: EpisodeContext, sample: Mapping[str, Any]) -> Any:
        """Play one episode; return a float (every role gets it) or a dict role -> float."""

    def rewards_for(self, result: Any) -> dict[str, float]:
        """Turn episode()'s return value into a reward per role, with a clear error if malformed."""
        if isinstance(result, Mapping):
            missing = set(self.roles) - set(result)
            if missing:
                raise ValueError(
                    f"{self.name}.episode returned rewards for {sorted(result)} but roles "
                    f"{sorted(missing)} have none; return a reward for every role in {self.roles}"
                )
            return {role: float(result[role]) for role in self.roles}
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return {role: float(result) for role in self.roles}
        raise TypeError(
            f"{self.name}.episode must return a float or a dict role -> float, got {result!r}"
        )


class EpisodeContext:
    """The handle an episode acts through: generate per role, tools, and a record of both."""

    def __init__(self, env: Environment, wiring: Mapping[str, PolicyHandle]):
        self.env = env
        self._wiring = dict(wiring)
        self.turns: list[Turn] = []
        """Every generate() call so far, in order."""
        self.tool_calls: list[ToolCall] = []
        """Every tool() call so far, in order."""

    @property
    def wiring(self) -> dict[str, PolicyHandle]:
        """Role -> the policy wired to it."""
        return dict(self._wiring)

    def tokenizer(self, role: str):
        """The tokenizer of the policy wired to `role`."""
        return self._policy(role).tokenizer

    async def generate(
        self, role: str, prompt: str | Sequence[int], **sampling: Any
    ) -> Generation:
        """Sample one completion from the policy wired to `role` and record it.

        Args:
            role: one of the environment's roles.
            prompt: text (tokenized with the policy's tokenizer) or token ids.
            **sampling: SamplingParams fields (temperature, top_p, max_new_tokens, stop_token_ids)
                overriding the environment's defaults. The tokenizer's EOS always stops.

        Returns:
            The Generation, with per-token logprobs and weight versions.
        """
        policy = self._policy(role)
        params = self._sampling(policy, sampling)
        if isinstance(prompt, str):
            prompt_ids = tuple(policy.tokenizer.encode(prompt))
        else:
            prompt_ids = tuple(int(t) for t in prompt)
        if not prompt_ids:
            raise ValueError(f"role {role!r}: empty prompt; pass text or at least one token id")
        engine = policy.engine
        if engine is None:
            raise RuntimeError(
                f"role {role!r}: policy {policy.name!r} has no engine in this process (its "
                "episodes run on rollout services)"
            )
        generation = await engine.generate(GenerationRequest(prompt_ids, params))
        self.turns.append(Turn(role, policy.name, generation, params))
        return generation

    async def tool(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call a tool (a checker, a calculator, a code runner) and record the call.

        Recorded tool calls show up between the turns in the episode debugger, and a re-scored
        episode calls its tools again, so the reward follows whatever the tools say.

        Args:
            name: what the debugger calls the tool.
            fn: a function, or an async function (anything returning an awaitable is awaited).
                A sync function runs on the event loop: keep it quick, or make it async.
            *args, **kwargs: passed to `fn`; recorded by parameter name.

        Returns:
            What `fn` returned.

        Raises:
            Whatever `fn` raised (the call is recorded with the error first).
        """
        position = len(self.turns)
        arguments = _arguments(fn, args, kwargs)
        try:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:
            self.tool_calls.append(ToolCall(name, arguments, None,
                                            f"{type(error).__name__}: {error}", position))
            raise
        self.tool_calls.append(ToolCall(name, arguments, jsonable(result), None, position))
        return result

    def _policy(self, role: str) -> PolicyHandle:
        try:
            return self._wiring[role]
        except KeyError:
            raise KeyError(
                f"role {role!r} is not wired; {self.env.name} has roles {self.env.roles} "
                f"and the session wired {sorted(self._wiring)}"
            ) from None

    def _sampling(self, policy: PolicyHandle, overrides: Mapping[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown sampling option(s) {sorted(unknown)}; use {sorted(known)}")
        params = dataclasses.replace(self.env.sampling, **overrides)
        stop = tuple(params.stop_token_ids)
        eos = policy.tokenizer.eos_token_id
        if eos is not None and eos not in stop:
            stop = (*stop, eos)
        return dataclasses.replace(params, stop_token_ids=stop)


def _arguments(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's arguments by parameter name (positional ones as arg0, arg1, ... when the
    signature cannot be read or does not fit), as JSON values."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call that will fail
        return jsonable({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs})
    return jsonable(dict(bound.arguments))
