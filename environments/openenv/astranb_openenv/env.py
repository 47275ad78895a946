"""`OpenEnv`: an OpenEnv environment, reached through its client, played as a conversation.

    episode(ctx, sample)
      client = the environment's client on base_url (a WebSocket session of its own)
      result = client.reset(seed=sample["seed"], **reset_kwargs)
      user: instructions + render(result.observation)
      repeat up to max_turns:
        assistant reply  ->  action(reply)   an action for client.step, or None (invalid: counted,
                                             the turn is spent, the user says so)
        result = client.step(action)         the server may refuse the action (its schema):
                                             counted invalid, answered the same way
        reward: result.reward added ("sum") or kept ("last")
        result.done: stop
      client.close()

Observations become text through `render` (default `render_observation`: a lone text field as
it is, anything else as JSON); the reply becomes an action through `action` (default
`text_action`: {"message": reply}, the shape of OpenEnv's text environments). The client is
`JSONClient` (actions are dicts, observations dicts), or an environment's own `EnvClient`
subclass with its typed actions and observations (then `action` must build those).

The reply is the policy's, so it is hostile: it only ever reaches the server as a field of a
JSON message that the server validates against its action schema; it is never evaluated here.
Every call to the server has a deadline (`timeout`): a server that stops answering, closes the
session or is not there fails the episode with an `OpenEnvError` that says which, never a hang.
openenv-core's 0.2 client is synchronous: its calls run in a worker thread, one session per
episode; an asynchronous client (openenv-core 0.3) is awaited on the episode's loop.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from astranb import Environment, SamplingParams

__all__ = ["JSONClient", "OpenEnv", "OpenEnvError", "render_observation", "text_action"]

_SERVER_ERROR = re.compile(r"\(code: ([A-Z_]+)\)\s*$")
# fields of every OpenEnv observation that are not what the agent sees
_NOT_SHOWN = frozenset({"done", "reward", "metadata"})


class OpenEnvError(RuntimeError):
    """The OpenEnv server could not be reached, stopped answering, closed the session, or sent
    something that is not a step result; or the environment raised on an action."""


class JSONClient(EnvClient):  # type: ignore[misc]  # openenv-core is untyped
    """An OpenEnv client for any environment: actions are dicts (or pydantic models, sent as
    their fields), observations come back as dicts of the observation's fields."""

    def _step_payload(self, action: Any) -> dict[str, Any]:
        if hasattr(action, "model_dump"):
            return dict(action.model_dump())
        if not isinstance(action, Mapping):
            raise TypeError(
                f"an action for JSONClient is a dict of the action's fields, "
                f"got {type(action).__name__}"
            )
        return dict(action)

    def _parse_result(self, payload: Mapping[str, Any]) -> StepResult:
        observation = payload.get("observation", {})
        return StepResult(
            observation=observation
            if isinstance(observation, dict)
            else {"observation": observation},
            reward=payload.get("reward"),
            done=bool(payload.get("done", False)),
        )

    def _parse_state(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return dict(payload)


def text_action(reply: str) -> dict[str, Any]:
    """The default action: the reply as the `message` of a text action ({"message": reply})."""
    return {"message": reply}


def _fields(observation: Any) -> dict[str, Any] | None:
    if isinstance(observation, Mapping):
        return dict(observation)
    if hasattr(observation, "model_dump"):
        return dict(observation.model_dump())
    if hasattr(observation, "__dataclass_fields__"):
        return {name: getattr(observation, name) for name in observation.__dataclass_fields__}
    return None


def render_observation(observation: Any) -> str:
    """The default rendering: a text observation as it is; an observation whose one shown field
    is text, that text; any other, its shown fields (all but done, reward and metadata) as
    JSON with sorted keys."""
    if isinstance(observation, str):
        return observation
    fields = _fields(observation)
    if fields is None:
        return repr(observation)
    shown = {k: v for k, v in fields.items() if k not in _NOT_SHOWN}
    if len(shown) == 1 and isinstance(text := next(iter(shown.values())), str):
        return text
    return json.dumps(shown, ensure_ascii=False, sort_keys=True, default=str)


class _Refused(Exception):
    """The server answered the action with a schema error (VALIDATION_ERROR)."""


class OpenEnv(Environment):
    """An OpenEnv environment served at `base_url`, one session per episode.

    A sample is {"seed": the reset seed, "split"}: "train" draws even seeds from `seed`'s
    stream, "test" odd ones.

    Args:
        base_url: the server ("http://127.0.0.1:8000"; its WebSocket is `base_url/ws`).
        client: the environment's `EnvClient` subclass (its typed actions and observations),
            built as `client(base_url, connect_timeout_s=..., message_timeout_s=...)`
            (default `JSONClient`: dict actions and observations).
        action: reply text -> the action `client.step` takes, or None when the reply is not
            one (default `text_action`: {"message": reply}). An action function that raises
            on a reply is counted `action_error` and treated as an invalid action.
        render: observation -> text (default `render_observation`).
        instructions: the first user message's opening, before the first observation
            (default: none, the observation alone).
        reward: "sum" (default) adds up the step rewards; "last" takes the last step's reward
            (for environments that score the episode at its end). A step without a reward
            counts 0.
        max_turns: most replies an episode takes, invalid ones included; an episode still
            going then ends with the reward so far, counted `out_of_turns`.
        reset_kwargs: keyword arguments of every reset besides the seed (the environment's
            own options).
        timeout: seconds each call to the server may take (connecting, reset, step); past it
            the episode fails with an `OpenEnvError`. A server at capacity (it holds a fixed
            number of sessions) is retried within the same time.
        seed: the training seeds' stream.
        sampling: SamplingParams, or a dict of its fields (default: max_new_tokens=32).

    Raises:
        ValueError: a bad setting (max_turns, reward, timeout, base_url).

    Example:
        env = ab.environments.load("openenv", base_url="http://127.0.0.1:8000", max_turns=8)
        session.wire(env, agent=policy)
    """

    roles = ("agent",)
    splits = ("train", "test")

    def __init__(
        self,
        base_url: str,
        *,
        client: Callable[..., Any] | None = None,
        action: Callable[[str], Any] | None = None,
        render: Callable[[Any], str] | None = None,
        instructions: str | None = None,
        reward: str = "sum",
        max_turns: int = 16,
        reset_kwargs: Mapping[str, Any] | None = None,
        timeout: float = 30.0,
        seed: int = 0,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
    ):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive integer, got {max_turns!r}")
        if reward not in ("sum", "last"):
            raise ValueError(f"reward must be 'sum' or 'last', got {reward!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (0 < timeout < math.inf)
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(base_url, str) or not re.match(r"(?i)(https?|wss?)://[^/]", base_url):
            raise ValueError(
                f"base_url must be the server's http:// (or ws://) URL, got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self._client = client if client is not None else JSONClient
        self._action = action if action is not None else text_action
        self._render = render if render is not None else render_observation
        self.instructions = instructions
        self.reward, self.max_turns, self.timeout = reward, max_turns, float(timeout)
        self.reset_kwargs = dict(reset_kwargs or {})
        self.seed = seed
        if sampling is None:
            sampling = SamplingParams(max_new_tokens=32)
        self.sampling = (
            sampling if isinstance(sampling, SamplingParams) else SamplingParams(**sampling)
        )

    @property
    def name(self) -> str:
        return f"openenv:{self.base_url}"

    # -- samples ----------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        return self.split_samples("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {self.splits}, not {split!r}")
        rng = random.Random(f"openenv-{split}-{self.seed}-{seed}")
        parity = 0 if split == "train" else 1
        while True:
            yield {"seed": 2 * rng.randrange(2**30) + parity, "split": split}

    # -- an episode -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        client, result = await self._open({**self.reset_kwargs, "seed": int(sample["seed"])})
        try:
            total = last = self._reward_of(result)
            if result.done:
                ctx.count("done")
                return total if self.reward == "sum" else last
            first = self._text(result.observation)
            messages = [
                {
                    "role": "user",
                    "content": first
                    if self.instructions is None
                    else f"{self.instructions}\n\n{first}",
                }
            ]
            for _ in range(self.max_turns):
                reply = await ctx.chat("agent", messages)  # with self.sampling
                action = self._parse(ctx, reply.content)
                if action is None:
                    ctx.count("invalid_action")
                    messages.append({"role": "user", "content": "That is not a valid action."})
                    continue
                try:
                    result = await self._call(client, "step", action)
                except _Refused as refused:
                    ctx.count("invalid_action")
                    messages.append(
                        {
                            "role": "user",
                            "content": f"The environment refused that action ({refused}).",
                        }
                    )
                    continue
                ctx.count("steps")
                last = self._reward_of(result)
                total += last
                if result.done:
                    ctx.count("done")
                    break
                messages.append({"role": "user", "content": self._text(result.observation)})
            else:
                ctx.count("out_of_turns")
            return total if self.reward == "sum" else last
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(client)

    def _parse(self, ctx: Any, text: str) -> Any:
        try:
            return self._action(text)
        except Exception:
            ctx.count("action_error")
            return None

    def _text(self, observation: Any) -> str:
        text = self._render(observation)
        if not isinstance(text, str):
            raise TypeError(f"render must return text, returned {type(text).__name__}")
        return text or "(empty observation)"

    def _reward_of(self, result: Any) -> float:
        if not isinstance(result, StepResult) and not all(
            hasattr(result, a) for a in ("observation", "reward", "done")
        ):
            raise OpenEnvError(
                f"the OpenEnv client returned {type(result).__name__}, not a "
                "step result (observation, reward, done)"
            )
        value = result.reward
        if value is None:
            return 0.0
        if isinstance(value, str) or not isinstance(value, (int, float)):
            raise OpenEnvError(
                f"the OpenEnv server at {self.base_url} sent a reward that is "
                f"not a number: {value!r:.80}"
            )
        if not math.isfinite(float(value)):
            raise OpenEnvError(f"the OpenEnv server at {self.base_url} sent a reward of {value}")
        return float(value)

    # -- the server -------------------------------------------------------------------------------
    def _new_client(self) -> Any:
        connect = min(self.timeout, 10.0)
        return self._client(
            self.base_url, connect_timeout_s=connect, message_timeout_s=self.timeout
        )

    async def _open(self, reset: Mapping[str, Any]) -> tuple[Any, Any]:
        """A new session and its first observation; a server at capacity is retried until
        `timeout` (it frees a session when another episode ends)."""
        deadline, pause = time.monotonic() + self.timeout, 0.05
        while True:
            client = self._new_client()
            try:
                return client, await self._call(client, "reset", **reset)
            except OpenEnvError as error:
                await self._close(client)
                # a server at capacity answers so and closes, and the close can come first
                busy = "CAPACITY_REACHED" in str(error) or "closed the session" in str(error)
                if not busy or time.monotonic() > deadline:
                    raise
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._close(client)
                raise
            await anyio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _call(self, client: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """`client.method(...)` with the errors said plainly: a sync client in a worker thread
        (its own deadlines bound it), an async one awaited within `timeout`."""
        fn = getattr(client, method)
        try:
            if inspect.iscoroutinefunction(fn):
                with anyio.fail_after(self.timeout + 1):
                    return await fn(*args, **kwargs)
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except Exception as error:
            raise self._explain(method, error) from error

    def _explain(self, method: str, error: Exception) -> Exception:
        url, what = self.base_url, f"{type(error).__name__}: {error}"
        code = _SERVER_ERROR.search(str(error)) if isinstance(error, RuntimeError) else None
        if code is not None:
            if code.group(1) == "VALIDATION_ERROR" and method == "step":
                return _Refused("it does not match the action's schema")
            if code.group(1) == "EXECUTION_ERROR":
                return OpenEnvError(
                    f"the OpenEnv environment at {url} raised on {method} "
                    f"({error}); the episode fails, the run goes on"
                )
            return OpenEnvError(f"the OpenEnv server at {url} refused {method}: {error}")
        if isinstance(error, TimeoutError):
            return OpenEnvError(
                f"the OpenEnv server at {url} did not answer {method} within "
                f"{self.timeout:g} s ({what})"
            )
        if isinstance(error, ConnectionError) and "Failed to connect" in str(error):
            return OpenEnvError(
                f"cannot reach the OpenEnv server at {url}: is it running? ({what})"
            )
        name = type(error).__name__
        if name.startswith("ConnectionClosed") and "message too big" in str(error):
            return OpenEnvError(
                f"the OpenEnv server at {url} sent a message larger than the client takes "
                f"during {method} ({what})"
            )
        if name.startswith("ConnectionClosed") or isinstance(error, (ConnectionError, OSError)):
            return OpenEnvError(
                f"the OpenEnv server at {url} closed the session during {method} ({what})"
            )
        if isinstance(error, (ValueError, TypeError)) and method == "step":
            return OpenEnvError(
                f"the action could not be sent to the OpenEnv server at {url} "
                f"({what}); `action` must return what the client's step takes"
            )
        return OpenEnvError(f"the OpenEnv client failed on {method} ({what})")

    async def _close(self, client: Any) -> None:
        close = getattr(client, "close", None)
        if close is None:
            return
        try:
            if inspect.iscoroutinefunction(close):
                with anyio.move_on_after(5):
                    await close()
            else:
                await anyio.to_thread.run_sync(close)
        except Exception:
            pass  # the session is over either way; the server drops it when the socket closes
