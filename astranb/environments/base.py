"""Environments: what an agent does in one episode, and the context it does it through.

An environment declares its `roles` and writes one coroutine, `episode(ctx, sample)`, that drives
turns with `await ctx.generate(role, prompt)` (or `ctx.chat`, or an OpenAI client from
`ctx.openai_client`), calls tools with `await ctx.tool(name, fn, ...)` and returns a reward (a
float for every role, or a dict role -> float). Everything the episode generates and every tool
it calls is recorded on the context, so the episode can be trained on, replayed and stepped
through (`run.episodes[i].show()`, `ab.debug`). An exception in `episode` fails that episode
only; the run records it and goes on.

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
import functools
import inspect
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio

from ..chat import schemas_of
from ..errors import EpisodeTruncated
from ..types import Generation, GenerationRequest, SamplingParams, ToolCall, Turn, jsonable
from .conversation import REBUILT, ChatMessage, Conversations, ToolOutcome, completion_text

if TYPE_CHECKING:
    from ..contracts import PolicyHandle

__all__ = ["Environment", "EpisodeContext", "ChatMessage", "ToolOutcome", "SpawnRefused"]


class Environment(ABC):
    """Base class of every environment. Subclasses set `roles` and implement two methods."""

    roles: tuple[str, ...] = ("policy",)
    """Names of the agents that act in an episode; each is wired to a policy."""

    sampling: SamplingParams = SamplingParams()
    """Default sampling settings for generate() calls (per-call keywords override them)."""

    splits: tuple[str, ...] = ("train",)
    """Sample splits `split_samples` serves; held-out evaluation reads "test"."""

    max_episode_tokens: int | None = None
    """Most tokens an episode may sample over all its turns (None: only the context limits it);
    past it the episode ends as truncated."""

    truncated_reward: float | Mapping[str, float] = 0.0
    """Reward of an episode that reached the context or `max_episode_tokens`."""
    max_spawn_depth: int = 3
    """Deepest sub-agent `ctx.spawn` may create (the episode's own agent is depth 0)."""
    max_spawn_children: int = 4
    """Most sub-agents one `ctx.spawn` call may start."""
    max_agent_turns: int | None = None
    """Most generate() calls across the episode's whole agent tree (None: no limit); past it
    the episode ends as truncated."""

    registry_name: str | None = None
    """The registry name `environments.load` built it from (how a rollout service rebuilds the
    same environment); None for an environment built directly."""
    registry_kwargs: Mapping[str, Any] = MappingProxyType({})
    """The keyword arguments `environments.load` passed (empty otherwise)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    @abstractmethod
    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Training samples (dicts); may be endless. Same seed, same order."""

    @abstractmethod
    async def episode(self, ctx: EpisodeContext, sample: Mapping[str, Any]) -> Any:
        """Play one episode; return a float (every role gets it) or a dict role -> float."""

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Samples of a named split. "train" is `samples(seed)`; environments with held-out data
        list their other splits in `splits` and override this."""
        if split == "train":
            return iter(self.samples(seed))
        raise ValueError(
            f"{self.name} has no {split!r} split (it has {list(self.splits)}); give it held-out "
            "data (e.g. a dataset with a test split) or evaluate with split='train'"
        )

    def solved(self, reward: float) -> bool:
        """Whether an episode with this reward solved its sample (what pass@k counts)."""
        return reward >= 1.0

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

    def __init__(self, env: Environment, wiring: Mapping[str, PolicyHandle], *,
                 parent: EpisodeContext | None = None, agent: str = ""):
        self.env = env
        self._wiring = dict(wiring)
        self.agent = agent
        """Where this context sits in the episode's agent tree: "" for the episode's own agent,
        "0", "1", ... for the sub-agents it spawned, "0.1" for the second child of "0"."""
        self.depth: int = 0 if parent is None else parent.depth + 1
        self._root: EpisodeContext = self if parent is None else parent._root
        root = self._root
        self.turns: list[Turn] = [] if parent is None else root.turns
        """Every generate() call so far, in order (the whole agent tree shares one list)."""
        self.tool_calls: list[ToolCall] = [] if parent is None else root.tool_calls
        """Every tool() call so far, in order (shared by the tree)."""
        self.counts: dict[str, int] = {} if parent is None else root.counts
        """What `count` counted (shared by the tree)."""
        self._conversations = Conversations()
        self.truncation: EpisodeTruncated | None = None
        """Set when a turn asked for through the OpenAI endpoint hit the context or the token
        budget (the agent saw an error); the episode then ends as truncated (root only)."""
        self._bindings: dict[tuple[str, str], Any] = {}  # (agent, role) -> endpoint (root only)
        self._clients: dict[tuple[str, str], Any] = {}  # (agent, role) -> client (root only)
        self._shared_clients: set[tuple[str, str]] = set()  # those on the loop's HTTP client
        self._sampled = 0  # tokens sampled so far (the episode's token budget; root only)
        self._children = 0  # sub-agents spawned so far (numbers their paths)

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
        if isinstance(prompt, str):
            prompt_ids = _cached(_encode, policy.tokenizer, prompt)
        else:
            prompt_ids = tuple(int(t) for t in prompt)
        return await self._sample(role, policy, prompt_ids, sampling)

    async def chat(
        self,
        role: str,
        messages: list[dict[str, Any]],
        tools: Sequence[Callable[..., Any]] = (),
        **sampling: Any,
    ) -> ChatMessage:
        """One assistant turn of a conversation: render, generate, parse, append.

        The conversation keeps its tokens across calls (token-in/token-out): the prompt of a
        later call whose messages extend what an earlier call left (the same list appended to,
        or a new list `messages + [...]`) is the earlier prompt and completion, exactly as
        sampled, plus only the tokens of the messages added since. History is never tokenized
        again, unless the chat template rewrote it or the environment changed an earlier
        assistant message (then the whole conversation is tokenized afresh and counted as
        `count/retokenized`, with a warning in the second case).

        Args:
            role: one of the environment's roles.
            messages: the conversation, {"role", "content"} dicts; the assistant message is
                appended to it, with the completion's raw text as content.
            tools: functions the model may call; their JSON schemas (from signatures and
                docstrings) go into the template.
            **sampling: SamplingParams fields overriding the environment's defaults.

        Returns:
            The parsed assistant message (content, reasoning, tool calls, parse errors).

        Raises:
            EpisodeTruncated: the prompt reaches the model's context, or the episode's
                `max_episode_tokens` are spent (the episode ends there as truncated).
        """
        from ..chat import parse_assistant

        tokenizer = self.tokenizer(role)
        schemas = schemas_of(tools)
        prompt_ids = self._chat_prompt(role, messages, schemas, REBUILT)
        generation = await self.generate(role, prompt_ids, **sampling)
        text = completion_text(tokenizer, generation)
        messages.append({"role": "assistant", "content": text})
        self._conversations.keep(messages, schemas, generation)
        parsed = parse_assistant(text)
        if parsed.errors:
            self.count("malformed_tool_calls", len(parsed.errors))
        return ChatMessage(parsed.content, parsed.reasoning, parsed.tool_calls, parsed.errors,
                           text, generation)

    def openai_base_url(self, role: str) -> str:
        """The base URL of an OpenAI-compatible endpoint for `role`, live until the episode ends.

        For agent code that builds its own client (any `api_key` will do: the token is in the
        URL). `chat.completions.create` calls on it are turns of this episode, recorded as
        `ctx.chat` records them; see `astranb.environments.openai_endpoint`.
        """
        return self._endpoint(role).base_url

    def openai_client(self, role: str, **options: Any) -> Any:
        """An `openai.AsyncOpenAI` client whose calls sample from the policy wired to `role`.

        Every `chat.completions.create` call is a turn of this episode, recorded as `ctx.chat`
        records them (token ids as sampled, logprobs, versions, tool calls parsed into the
        answer's `tool_calls`), and a conversation's tokens are kept across calls when each
        request extends the previous one with the returned message. The client is closed when
        the episode ends; later calls fail at once.

        Args:
            role: one of the environment's roles.
            **options: passed to `openai.AsyncOpenAI` (`timeout`, ...); `max_retries`
                defaults to 0 (a refused request is the agent's to see, not to repeat).

        Raises:
            ImportError: the `openai` package is not installed (`pip install astranb[openai]`).

        Example:
            client = ctx.openai_client("agent")
            reply = await client.chat.completions.create(model="agent", messages=messages)
        """
        clients, key = self._root._clients, (self.agent, role)
        if key not in clients:
            try:
                from openai import AsyncOpenAI
            except ImportError as missing:
                raise ImportError("ctx.openai_client needs the openai package: pip install "
                                  "'astranb[openai]' (or use ctx.openai_base_url)") from missing
            options.setdefault("max_retries", 0)
            if "http_client" not in options:  # one per event loop: a new one costs ~70 ms
                options["http_client"] = _loop_http_client()
                root_shared = self._root._shared_clients
                root_shared.add(key)
            clients[key] = AsyncOpenAI(base_url=self.openai_base_url(role),
                                       api_key="astranb-episode", **options)
            _reuse_platform(clients[key])
        return clients[key]

    async def aclose(self) -> None:
        """Close what the episode opened: its OpenAI endpoints and clients (play_episode calls
        it when the episode ends; later calls to the endpoints get HTTP 410)."""
        root = self._root
        if not root._bindings and not root._clients:
            return  # most episodes: nothing opened (kept cheap, it runs for every episode)
        from .openai_endpoint import endpoints

        for binding in root._bindings.values():
            endpoints.close(binding)
        root._bindings.clear()
        # a client on the loop's shared HTTP client is left open (closing it would close that
        # for every episode): its calls fail anyway, the endpoint's bindings being closed
        clients = [c for k, c in root._clients.items() if k not in root._shared_clients]
        root._clients, root._shared_clients = {}, set()
        with anyio.CancelScope(shield=True):
            for client in clients:
                await client.close()

    def _endpoint(self, role: str) -> Any:
        from .openai_endpoint import endpoints

        self._policy(role)  # a clear error for a role that is not wired
        bindings, key = self._root._bindings, (self.agent, role)
        if key not in bindings:  # a sub-agent's turns are its own (its path, its conversations)
            bindings[key] = endpoints.open(self, role)
        return bindings[key]

    def _chat_prompt(self, role: str, messages: list[dict[str, Any]],
                     schemas: Sequence[Mapping[str, Any]], warning: str) -> tuple[int, ...]:
        """The next prompt of a conversation (ids kept across turns), counting `retokenized`."""
        fallbacks = self._conversations.fallbacks
        prompt_ids = self._conversations.prompt_ids(self.tokenizer(role), messages, schemas,
                                                    warning)
        # counted on every turn (0 or 1), so runs report the column from the first row
        self.count("retokenized", self._conversations.fallbacks - fallbacks)
        return prompt_ids

    def _truncate(self, cut: EpisodeTruncated) -> None:
        """Remember that a turn the agent asked for through its endpoint hit the context or the
        budget: the episode ends as truncated even if the agent went on."""
        if self._root.truncation is None:
            self._root.truncation = cut

    async def run_tools(
        self,
        messages: list[dict[str, Any]],
        message: ChatMessage,
        tools: Sequence[Callable[..., Any]],
    ) -> list[ToolOutcome]:
        """Run the message's tool calls through `tool` (recorded) and append their results.

        Every call, and every call that failed to parse, adds one {"role": "tool"} message: the
        tool's result, or what went wrong (malformed, unknown tool, bad arguments, the tool
        raised), so the model can read it. Nothing here raises on the model's behalf.

        Returns:
            One outcome per call, parse errors first.
        """
        from ..chat import render_tool_result

        by_name = {getattr(fn, "__name__", repr(fn)): fn for fn in tools}
        outcomes = [ToolOutcome("", None, f"malformed tool call: {e.message}")
                    for e in message.errors]
        for request in message.tool_calls:
            fn = by_name.get(request.name)
            if fn is None:
                outcomes.append(ToolOutcome(request.name, None, (
                    f"unknown tool {request.name!r}; the tools are {sorted(by_name)}")))
                continue
            try:
                result = await self.tool(request.name, fn, **request.arguments)
            except Exception as error:  # the model's call, not the episode, failed
                self.count("tool_errors")
                outcomes.append(ToolOutcome(request.name, None, f"{type(error).__name__}: {error}"))
            else:
                outcomes.append(ToolOutcome(request.name, result, None))
        for outcome in outcomes:
            content = (f"error: {outcome.error}" if outcome.error is not None
                       else render_tool_result(outcome.result))
            messages.append({"role": "tool", "name": outcome.name, "content": content})
        return outcomes

    async def spawn(self, fn: Callable[..., Any], subtasks: Sequence[Any], /) -> list[Any]:
        """Run sub-agents: `await fn(child, subtask)` for each subtask, concurrently.

        Each child is an EpisodeContext of its own (its own conversations, `child.agent` its
        path in the tree, `child.depth` one more than this one's) on the same wiring: the turns
        it generates are recorded on this episode, tagged with its path, and trained like any
        other turn, credited to the policy wired to the role it generates as. What the children
        return comes back in order; how it feeds this agent's next observation and the
        episode's rewards is the environment's choice. The episode's token and turn budgets
        (`max_episode_tokens`, `max_agent_turns`) count the whole tree.

        Raises:
            SpawnRefused: past the environment's `max_spawn_depth` or `max_spawn_children`
                (nothing was started; the environment may tell the model so, or let the
                episode fail).
            Whatever a child raised (the first, once every child has stopped).
        """
        depth, limit = self.depth + 1, self.env.max_spawn_depth
        if depth > limit:
            self.count("spawn_refused")
            raise SpawnRefused(f"a sub-agent at depth {depth} is past max_spawn_depth={limit}")
        if len(subtasks) > self.env.max_spawn_children:
            self.count("spawn_refused")
            raise SpawnRefused(f"{len(subtasks)} sub-agents in one spawn; "
                               f"max_spawn_children={self.env.max_spawn_children}")
        children = []
        for _ in subtasks:
            path = f"{self.agent}.{self._children}" if self.agent else str(self._children)
            self._children += 1
            children.append(EpisodeContext(self.env, self._wiring, parent=self, agent=path))
        results: list[Any] = [None] * len(subtasks)
        failures: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                results[i] = await fn(children[i], subtasks[i])
            except Exception as error:  # kept until the siblings stop, then re-raised
                failures.append(error)

        async with anyio.create_task_group() as tg:
            for i in range(len(subtasks)):
                tg.start_soon(one, i)
        if failures:
            truncations = [f for f in failures if isinstance(f, EpisodeTruncated)]
            raise (truncations or failures)[0]
        return results

    def count(self, name: str, n: int = 1) -> None:
        """Count a fact about this episode (a timeout, a malformed call); the run's metrics sum
        it as `count/<name>`."""
        self.counts[name] = self.counts.get(name, 0) + int(n)

    async def _sample(self, role: str, policy: PolicyHandle, prompt_ids: tuple[int, ...],
                      sampling: Mapping[str, Any]) -> Generation:
        params = self._sampling(policy, sampling)
        if not prompt_ids:
            raise ValueError(f"role {role!r}: empty prompt; pass text or at least one token id")
        engine = policy.engine
        if engine is None:
            raise RuntimeError(
                f"role {role!r}: policy {policy.name!r} has no engine in this process (its "
                "episodes run on rollout services)"
            )
        params = self._within_limits(policy, prompt_ids, params)
        turns = self.env.max_agent_turns
        if turns is not None and len(self.turns) >= turns:
            raise EpisodeTruncated(f"turns: {len(self.turns)} generate() calls across the agent "
                                   f"tree, max_agent_turns={turns}")
        generation = await engine.generate(GenerationRequest(prompt_ids, params))
        self._root._sampled += len(generation.completion_ids)
        self.turns.append(Turn(role, policy.name, generation, params, self.agent))
        return generation

    def _within_limits(self, policy: PolicyHandle, prompt_ids: tuple[int, ...],
                       params: SamplingParams) -> SamplingParams:
        """Cap max_new_tokens by the context and the token budget; truncate when nothing is
        left (generation never starts past the context)."""
        room = params.max_new_tokens
        context = context_length(policy)
        if context is not None:
            if len(prompt_ids) >= context:
                raise EpisodeTruncated(f"context: the prompt has {len(prompt_ids)} tokens and "
                                       f"the model's context is {context}")
            room = min(room, context - len(prompt_ids))
        budget, sampled = self.env.max_episode_tokens, self._root._sampled
        if budget is not None:
            if sampled >= budget:
                raise EpisodeTruncated(f"budget: {sampled} tokens sampled, "
                                       f"max_episode_tokens={budget}")
            room = min(room, budget - sampled)
        if room == params.max_new_tokens:
            return params
        return dataclasses.replace(params, max_new_tokens=room)

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
        eos = _cached(_eos_id, policy.tokenizer)
        return _cached(_sampling_params, self.env.sampling, tuple(sorted(overrides.items())), eos)


class SpawnRefused(Exception):
    """`ctx.spawn` past the environment's depth or breadth budget."""


def _cached(function: Any, *args: Any) -> Any:
    """`function(*args)` through its lru_cache, or uncached when an argument cannot be hashed (a
    stop-token list among the overrides, a tokenizer that defines __eq__ without __hash__)."""
    try:
        hash(args)
    except TypeError:
        return function.__wrapped__(*args)
    return function(*args)


@functools.lru_cache(maxsize=4096)
def _sampling_params(base: SamplingParams, overrides: tuple[tuple[str, Any], ...],
                     eos: int | None) -> SamplingParams:
    """The environment's defaults with a call's overrides, stopping at EOS. Cached (through
    `_cached`): every episode of a run asks for the same few combinations."""
    SamplingParams.check_names(name for name, _ in overrides)
    params = dataclasses.replace(base, **dict(overrides))
    stop = tuple(params.stop_token_ids)
    if eos is not None and eos not in stop:
        stop = (*stop, eos)
    return dataclasses.replace(params, stop_token_ids=stop)


@functools.lru_cache(maxsize=256)
def _eos_id(tokenizer: Any) -> int | None:
    """The tokenizer's EOS id (a slow attribute on Hugging Face tokenizers; read once each)."""
    return tokenizer.eos_token_id


@functools.lru_cache(maxsize=65_536)
def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of a text prompt. Episodes of one group (and of many groups) share prompts, so
    each distinct (tokenizer, text) is tokenized once; tokenizers hash by identity."""
    return tuple(int(t) for t in tokenizer.encode(text))


def context_length(policy: PolicyHandle) -> int | None:
    """The policy model's context in tokens, if known: the policy's or its engine's
    `max_context`, else the tokenizer's `model_max_length` when it is a real limit."""
    limit = getattr(policy, "max_context", None)
    if limit is None:
        limit = getattr(policy.engine, "max_context", None)
    if limit is None:
        limit = getattr(policy.tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    return None


def _arguments(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's arguments by parameter name (positional ones as arg0, arg1, ... when the
    signature cannot be read or does not fit), as JSON values."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call that will fail
        return jsonable({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs})
    return jsonable(dict(bound.arguments))


_LOOP_HTTP_CLIENTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


_PLATFORM: list[Any] = []  # the openai package's platform probe, made once per process


def _reuse_platform(client: Any) -> None:
    """Give a new `AsyncOpenAI` the platform its first request would otherwise probe for.

    The client reads the platform (for its `X-Stainless-*` headers) on its first request, in a
    worker thread: with a client per episode that is one thread hop per episode, ~6% of an
    episode's time on a small model. The value is the process's and does not change, so it is
    probed once and handed to each new client; a client without the attribute (another openai
    release) is left to probe for itself.
    """
    if getattr(client, "_platform", "unknown") is not None:
        return
    if not _PLATFORM:
        try:
            from openai._base_client import get_platform
        except ImportError:
            return
        _PLATFORM.append(get_platform())
    client._platform = _PLATFORM[0]


def _loop_http_client() -> Any:
    """The running event loop's `httpx.AsyncClient` for `ctx.openai_client`'s clients.

    Its transport calls the endpoint server's ASGI app in this loop (httpx's ASGITransport, as
    the loopback client 127.0.0.1): the same routes, token check and recording as a request over
    the socket, without the socket, the HTTP parsing and the server thread's hop. Building an
    `openai.AsyncOpenAI` otherwise builds an HTTP client with its TLS context (~70 ms of CPU);
    made once per loop and shared, a client per episode costs ~0.1 ms. Agents that build their
    own client from `ctx.openai_base_url` go over the socket as before.
    """
    import asyncio

    import httpx

    from .openai_endpoint import create_app, endpoints

    loop = asyncio.get_running_loop()
    client = _LOOP_HTTP_CLIENTS.get(loop)
    if client is None or client.is_closed:
        transport = httpx.ASGITransport(app=create_app(endpoints), client=("127.0.0.1", 0))
        client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(None),
                                   trust_env=False)
        _LOOP_HTTP_CLIENTS[loop] = client
    return client
