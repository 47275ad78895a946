"""An OpenAI-compatible endpoint per episode: an agent's own client calls become recorded turns.

`ctx.openai_client(role)` (or `ctx.openai_base_url(role)` for code that builds its own client)
opens a binding of this episode's role on the process's endpoint server: a small HTTP app on
127.0.0.1, its port picked by the OS, started on first use in a thread of its own. Every binding
has a random token in its base URL (`http://127.0.0.1:<port>/episodes/<token>/v1`); a request
with no live token is refused (401), one from or addressed to anything but loopback too (403).
`ctx.openai_client` reaches the same app without the socket: its HTTP client (one per event
loop) calls the app in the episode's loop through httpx's ASGITransport as client 127.0.0.1.
When the episode ends its bindings close: later calls get 410 at once, calls in flight are
cancelled and answered 410.

A `chat.completions.create` call runs on the episode's own event loop through the machinery of
`ctx.chat`: rendered with the policy's chat template, sampled by `ctx.generate` (a turn recorded
with its ids, logprobs and versions), tool calls parsed with `astranb.chat.parse_assistant` into
the answer's `tool_calls`. The tokens stay as sampled across calls: when a request's messages
start with an earlier request's messages followed by the assistant message it returned (the
agent loop of every OpenAI client), that prefix is the earlier prompt and completion, token for
token, and only the new messages are tokenized. A request that changed an earlier assistant
message is tokenized afresh and counted as `count/retokenized`.

The engine answers whole completions, so a streamed answer (`stream=True`) arrives as OpenAI's
chunks once the completion is sampled. Calls must come from an async client on the episode's
loop (or another thread): a synchronous client on the episode's loop blocks the loop that would
sample for it, so such a call is answered 503 after `BLOCKED_AFTER` seconds rather than hang.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..chat import encode, parse_assistant
from ..errors import EpisodeTruncated
from ..loopback import is_loopback
from ..types import Generation, ToolCall, Turn
from .conversation import completion_text
from .openai_api import (
    BadRequest,
    ChatRequest,
    Sampled,
    TextRequest,
    canonical,
    chunked,
    error_body,
    read_chat_request,
    read_text_request,
    template_message,
    text_chunks,
    tool_call_json,
)

if TYPE_CHECKING:
    from .base import EpisodeContext

__all__ = ["Binding", "Endpoints", "endpoints", "create_app", "REWRITTEN"]

REWRITTEN = (
    "an OpenAI-endpoint request changed an assistant message the endpoint had returned (its "
    "content or tool calls differ): the prompt was tokenized afresh and the sampled tokens are "
    "lost for training (counted as count/retokenized). Send the returned message back as it came "
    "(messages.append(response.choices[0].message))")
"""The warning (shown once) when an agent rewrote a returned assistant message."""

BLOCKED_AFTER = 30.0
"""Seconds a call waits for the episode's loop to take it up before a 503 (`BLOCKED`)."""
BLOCKED = (
    "the episode's event loop did not take this call up: something blocks it, most likely a "
    "synchronous client (openai.OpenAI) called inside the async episode; use "
    "ctx.openai_client(role), an AsyncOpenAI, and await its calls")
MAX_BODY = 16 << 20
_KEEP = 16  # conversations remembered per binding, as in conversation.py
_ENDED = 4096  # closed tokens remembered, so their late calls hear 410 rather than 401


class _Ended(Exception):
    """The binding's episode has ended."""


@dataclass(frozen=True)
class _Kept:
    keys: tuple[tuple[Any, ...], ...]
    """The canonical messages of a request followed by the message it returned."""
    rendered: list[dict[str, Any]]
    """The same conversation as the template saw it (the reply as sampled text)."""


class Binding:
    """One role of one episode, reachable at `base_url`."""

    def __init__(self, ctx: EpisodeContext, role: str, base: str):
        self.ctx, self.role = ctx, role
        self.token = secrets.token_urlsafe(24)
        self.base_url = f"{base}/episodes/{self.token}/v1"
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._kept: list[_Kept] = []
        self._active: set[asyncio.Task[Any]] = set()
        self._calls: dict[str, tuple[str, Any]] = {}  # returned call id -> (name, arguments)

    async def call(self, request: ChatRequest | TextRequest) -> dict[str, Any]:
        """Answer `request` on the episode's loop (from the server's thread).

        Raises:
            BadRequest: 503 when the episode's loop does not take the call up within
                `BLOCKED_AFTER` seconds (blocked, say by a synchronous client on it).
        """
        started = threading.Event()
        work = self._run(request, started)
        try:
            future = asyncio.run_coroutine_threadsafe(work, self.loop)
        except RuntimeError:  # the episode's loop is gone
            work.close()
            raise _Ended from None
        answer = asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait({answer}, timeout=BLOCKED_AFTER)
            if not done and not started.is_set():
                answer.cancel()
                raise BadRequest(BLOCKED, status=503, code="episode_loop_blocked")
            return await answer
        except asyncio.CancelledError:
            if self.closed:
                raise _Ended from None
            raise

    def close(self) -> None:
        """End the binding (on the episode's loop): calls in flight are cancelled."""
        self.closed = True
        for task in list(self._active):
            task.cancel()

    async def _run(self, request: ChatRequest | TextRequest,
                   started: threading.Event) -> dict[str, Any]:
        started.set()
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        try:
            if self.closed:
                raise _Ended
            return await self._complete(request)
        finally:
            self._active.discard(task)

    async def _complete(self, request: ChatRequest | TextRequest) -> dict[str, Any]:
        if isinstance(request, TextRequest):
            return await self._complete_text(request)
        rendered, start = self._rendered(request.messages)
        self._record_results(request.messages[start:])
        schemas = list(request.tools)
        prompt_ids = self.ctx._chat_prompt(self.role, rendered, schemas, REWRITTEN)
        turns = await self._generate(prompt_ids, request)
        choices = [self._choice(request, rendered, schemas, i, position, turn)
                   for i, (position, turn) in enumerate(turns)]
        return {"id": f"chatcmpl-{self.token[:8]}-{turns[0][0]}", "object": "chat.completion",
                "created": int(time.time()), "model": request.model or self.role,
                "choices": choices, "usage": _usage(turns)}

    async def _complete_text(self, request: TextRequest) -> dict[str, Any]:
        """A (legacy) completion: the prompt as given, no template, no conversation."""
        tokenizer = self.ctx.tokenizer(self.role)
        turns = await self._generate(request.prompt, request)
        choices = []
        for i, (_, turn) in enumerate(turns):
            generation, ids = turn.generation, _returned_ids(turn)
            logprobs = None
            if request.logprobs:
                entries = _logprobs(tokenizer, generation, len(ids))
                offsets = [0]
                for entry in entries[:-1]:
                    offsets.append(offsets[-1] + len(entry["token"]))
                logprobs = {"tokens": [e["token"] for e in entries],
                            "token_logprobs": [e["logprob"] for e in entries],
                            "top_logprobs": None, "text_offset": offsets[:len(entries)]}
            choices.append({"index": i, "finish_reason": generation.finish_reason,
                            "text": str(tokenizer.decode(list(ids), skip_special_tokens=False)),
                            "logprobs": logprobs})
        return {"id": f"cmpl-{self.token[:8]}-{turns[0][0]}", "object": "text_completion",
                "created": int(time.time()), "model": request.model or self.role,
                "choices": choices, "usage": _usage(turns)}

    async def _generate(self, prompt: str | tuple[int, ...], request: Sampled
                        ) -> list[tuple[int, Turn]]:
        """`request.n` turns from `prompt` (the request's sampling and stop tokens), each with
        its position in `ctx.turns` (other agents of the episode may sample meanwhile)."""
        ctx = self.ctx
        sampling = dict(request.sampling)
        stops = _stop_ids(ctx.tokenizer(self.role), request.stop)
        if stops:
            sampling["stop_token_ids"] = (*ctx.env.sampling.stop_token_ids, *stops)
        tasks = [asyncio.ensure_future(ctx.generate(self.role, prompt, **sampling))
                 for _ in range(request.n)]
        try:
            try:
                generations = await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # no choice samples on for a call that failed (no-op else)
                    task.cancel()
        except EpisodeTruncated as cut:
            ctx._truncate(cut)
            raise BadRequest(f"the episode is truncated: {cut.reason}",
                             code="context_length_exceeded") from None
        return [_recorded(ctx.turns, generation) for generation in generations]

    def _rendered(self, messages: tuple[Mapping[str, Any], ...]
                  ) -> tuple[list[dict[str, Any]], int]:
        """The template's messages: the longest remembered conversation these messages extend,
        as it was sampled, then the new messages (from the returned index on)."""
        keys = tuple(canonical(m) for m in messages)
        best = max((k for k in self._kept if keys[:len(k.keys)] == k.keys),
                   key=lambda k: len(k.keys), default=None)
        start = 0 if best is None else len(best.keys)
        head = [] if best is None else copy.deepcopy(best.rendered)
        return head + [template_message(m) for m in messages[start:]], start

    def _record_results(self, new: tuple[Mapping[str, Any], ...]) -> None:
        """Record the agent's answers to tool calls this endpoint returned as the episode's tool
        calls (`ctx.tool_calls`: the debugger shows them between the turns), once each."""
        for message in new:
            call = self._calls.pop(str(message.get("tool_call_id")), None)
            if message.get("role") == "tool" and call is not None:
                arguments = call[1] if isinstance(call[1], dict) else {"arguments": call[1]}
                self.ctx.tool_calls.append(ToolCall(call[0], arguments,
                                                    template_message(message)["content"],
                                                    None, len(self.ctx.turns)))

    def _choice(self, request: ChatRequest, rendered: list[dict[str, Any]],
                schemas: list[Any], index: int, position: int, turn: Turn) -> dict[str, Any]:
        tokenizer, generation = self.ctx.tokenizer(self.role), turn.generation
        sampled = completion_text(tokenizer, generation)
        conversation = rendered + [{"role": "assistant", "content": sampled}]
        self.ctx._conversations.keep(conversation, schemas, generation)
        ids = _returned_ids(turn)
        text = str(tokenizer.decode(list(ids), skip_special_tokens=False))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if request.parse_tools:
            parsed = parse_assistant(text)
            if parsed.errors:
                self.ctx.count("malformed_tool_calls", len(parsed.errors))
            calls = [tool_call_json(c.name, c.arguments, f"call_{position}_{k}")
                     for k, c in enumerate(parsed.tool_calls)]
            self._calls.update((j["id"], (c.name, c.arguments))
                               for j, c in zip(calls, parsed.tool_calls, strict=True))
            message["content"] = parsed.content or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
            if parsed.reasoning is not None:
                message["reasoning_content"] = parsed.reasoning
        keys = tuple(canonical(m) for m in (*request.messages, message))
        self._kept.append(_Kept(keys, conversation))
        del self._kept[:-_KEEP]
        finish = ("length" if generation.finish_reason == "length"
                  else "tool_calls" if message.get("tool_calls") else "stop")
        logprobs = ({"content": _logprobs(tokenizer, generation, len(ids)), "refusal": None}
                    if request.logprobs else None)
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": logprobs}


def _stop_ids(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    ids = []
    for stop in stops:
        tokens = encode(tokenizer, stop)
        if len(tokens) != 1:
            raise BadRequest(f"stop {stop!r} is {len(tokens)} tokens of this policy's tokenizer; "
                             "the engine stops on single tokens only", "stop")
        ids.append(tokens[0])
    return tuple(ids)


def _recorded(turns: list[Turn], generation: Generation) -> tuple[int, Turn]:
    """The turn `generation` was recorded as, and its position."""
    for position in range(len(turns) - 1, -1, -1):
        if turns[position].generation is generation:
            return position, turns[position]
    raise LookupError("a generation the endpoint sampled is not among the episode's turns")


def _returned_ids(turn: Turn) -> tuple[int, ...]:
    """The completion without the token that stopped it (as OpenAI returns text)."""
    ids = turn.generation.completion_ids
    if (turn.generation.finish_reason == "stop" and ids
            and ids[-1] in turn.sampling.stop_token_ids):
        return ids[:-1]
    return ids


def _logprobs(tokenizer: Any, generation: Generation, count: int) -> list[dict[str, Any]]:
    out = []
    for token_id, logprob in zip(generation.completion_ids[:count], generation.logprobs,
                                 strict=False):
        token = str(tokenizer.decode([token_id], skip_special_tokens=False))
        out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": []})
    return out


def _usage(turns: list[tuple[int, Turn]]) -> dict[str, int]:
    prompt = len(turns[0][1].generation.prompt_ids)
    completion = sum(len(turn.generation.completion_ids) for _, turn in turns)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class Endpoints:
    """The process's endpoint server and its live bindings (token -> binding)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Binding] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._base: str | None = None

    def open(self, ctx: EpisodeContext, role: str) -> Binding:
        """A binding of `role` of the episode `ctx`, serving from now until `close`."""
        binding = Binding(ctx, role, self.start())
        with self._lock:
            self._live[binding.token] = binding
        return binding

    def close(self, binding: Binding) -> None:
        binding.close()
        with self._lock:
            self._live.pop(binding.token, None)
            self._ended[binding.token] = None
            while len(self._ended) > _ENDED:
                self._ended.popitem(last=False)

    def find(self, token: str) -> Binding:
        """The live binding of `token`; `_Ended` or a 401 `BadRequest` otherwise."""
        with self._lock:
            binding = self._live.get(token)
            ended = token in self._ended
        if binding is not None:
            return binding
        if ended:
            raise _Ended
        raise BadRequest("no live episode has this token; use the base URL "
                         "ctx.openai_base_url(role) gave inside the episode", status=401,
                         code="invalid_api_key")

    def start(self) -> str:
        """The server's base URL, started on first use."""
        with self._lock:
            if self._base is None:
                self._base = _start_server(self)
            return self._base


def _start_server(endpoints: Endpoints) -> str:
    import uvicorn  # the server stack loads only when an episode asks for an endpoint

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the OS picks the port: two runs never collide
    # accepted sockets inherit it: without, every answer waited ~40 ms on the delayed ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(128)
    config = uvicorn.Config(create_app(endpoints), log_level="warning", lifespan="off",
                            access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),),
                              name="astranb-openai-endpoint", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenAI endpoint server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def create_app(endpoints: Endpoints) -> Any:
    """The endpoint server as an ASGI app (served by `_start_server`; tested in-process)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def refused(error: BadRequest) -> Response:
        return JSONResponse(error_body(str(error), error.param, error.code),
                            status_code=error.status)

    def ended() -> Response:
        return JSONResponse(error_body("the episode this endpoint belonged to has ended; "
                                       "an endpoint lives as long as its episode",
                                       code="episode_ended"), status_code=410)

    def binding_of(request: Request) -> Binding:
        client = request.client.host if request.client else ""
        host = request.headers.get("host", "").rsplit(":", 1)[0].strip("[]")
        if not (is_loopback(client) and is_loopback(host)):
            raise BadRequest("the endpoint serves loopback only (client and Host)", status=403)
        return endpoints.find(request.path_params.get("token", ""))

    async def serve(request: Request, read: Any, chunks: Any) -> Response:
        try:
            binding = binding_of(request)
            checked = read(await _json(request))
            answer = await binding.call(checked)
        except BadRequest as error:
            return refused(error)
        except _Ended:
            return ended()
        except Exception as error:  # the engine's or the template's: the agent sees it
            return JSONResponse(error_body(f"{type(error).__name__}: {error}",
                                           kind="server_error"), status_code=500)
        if checked.stream:
            return StreamingResponse(_events(answer, chunks(answer), checked.include_usage),
                                     media_type="text/event-stream")
        return JSONResponse(answer)

    async def chat(request: Request) -> Response:
        return await serve(request, read_chat_request, chunked)

    async def text(request: Request) -> Response:
        return await serve(request, read_text_request, text_chunks)

    async def models(request: Request) -> Response:
        try:
            binding = binding_of(request)
        except BadRequest as error:
            return refused(error)
        except _Ended:
            return ended()
        name = binding.ctx.wiring[binding.role].name
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "astranb"}]})

    async def other(request: Request) -> Response:
        try:
            binding_of(request)
        except BadRequest as error:
            return refused(error)
        except _Ended:
            return ended()
        if request.url.path.endswith("/completions"):
            return refused(BadRequest("completions take POST", status=405))
        return refused(BadRequest(f"no endpoint {request.url.path}; this one serves "
                                  "POST .../v1/chat/completions, POST .../v1/completions "
                                  "and GET .../v1/models",
                                  status=404))

    prefix = "/episodes/{token}/v1"
    return Starlette(routes=[
        Route(prefix + "/chat/completions", chat, methods=["POST"]),
        Route(prefix + "/completions", text, methods=["POST"]),
        Route(prefix + "/models", models, methods=["GET"]),
        Route(prefix + "/{rest:path}", other, methods=["GET", "POST"]),
        Route("/{rest:path}", other, methods=["GET", "POST"]),
    ])


async def _json(request: Any) -> Any:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        raise BadRequest(f"request body larger than {MAX_BODY} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY:
            raise BadRequest(f"request body larger than {MAX_BODY} bytes", status=413)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON: {error}") from None


async def _events(answer: Mapping[str, Any], chunks: Any, include_usage: bool
                  ) -> AsyncIterator[str]:
    """Server-sent events of OpenAI's chunk format, ended by [DONE]."""
    for chunk in chunks:
        if include_usage:
            chunk = {**chunk, "usage": None}
        yield f"data: {json.dumps(chunk)}\n\n"
    if include_usage:
        last = {"id": answer["id"], "object": chunks[0]["object"] if chunks else answer["object"],
                "created": answer["created"], "model": answer["model"], "choices": [],
                "usage": answer["usage"]}
        yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


endpoints = Endpoints()
"""The process's endpoint server (started by the first binding)."""
