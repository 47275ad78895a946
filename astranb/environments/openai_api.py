"""The OpenAI chat-completions API as plain data: what a request may ask, and the answers' shape.

The per-episode endpoint (`openai_endpoint.py`) serves this; nothing here does I/O. A request
body is checked whole before anything is sampled: every parameter astranb cannot honour exactly
is refused with the parameter's name (`BadRequest.param`), never silently ignored, so an agent
written for the OpenAI API learns of a difference at its first call.

Messages are read in two forms. `canonical` is what the agent's side can see of a message (role,
content text, tool calls as name and arguments, tool_call_id): two messages that are equal here
are the same message to the agent, whatever optional fields its client added or dropped.
`template_message` is what the chat template renders: assistant tool calls structured, content
always a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BadRequest", "Sampled", "ChatRequest", "TextRequest", "read_chat_request",
           "read_text_request", "canonical", "template_message", "error_body", "tool_call_json",
           "chunked", "text_chunks", "CHAT", "TEXT", "MAX_N"]

MAX_N = 16
"""Most choices one request may ask for (`n`)."""

_COMMON = ("model", "max_tokens", "temperature", "top_p", "stop", "n", "stream",
           "stream_options")
CHAT = frozenset((*_COMMON, "messages", "tools", "tool_choice", "parallel_tool_calls",
                  "max_completion_tokens", "logprobs", "top_logprobs"))
"""The parameters `chat.completions.create` may send."""
TEXT = frozenset((*_COMMON, "prompt", "logprobs"))
"""The parameters `completions.create` may send."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


class BadRequest(ValueError):
    """A request the endpoint refuses; `status` is the HTTP code, `param` the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class Sampled:
    """What every request asks of sampling and of the answer's form."""

    n: int
    """Choices to sample, each a turn of its own."""
    stream: bool
    """Answer as server-sent events."""
    include_usage: bool
    """Streamed: end with a chunk carrying `usage` (stream_options.include_usage)."""
    logprobs: bool
    """Return each returned token's logprob."""
    stop: tuple[str, ...]
    """Stop strings (each must be one token of the policy's tokenizer)."""
    sampling: Mapping[str, Any]
    """SamplingParams overrides: temperature, top_p, max_new_tokens."""
    model: str
    """The `model` the client named (echoed back; the role decides the policy)."""


@dataclass(frozen=True)
class ChatRequest(Sampled):
    """A checked chat-completions request."""

    messages: tuple[Mapping[str, Any], ...] = ()
    """The conversation as sent."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """Function schemas (OpenAI's format, which the chat template takes as is)."""
    parse_tools: bool = False
    """Whether tool calls are read from the completion (tools given, tool_choice "auto")."""


@dataclass(frozen=True)
class TextRequest(Sampled):
    """A checked (legacy) completions request."""

    prompt: str | tuple[int, ...] = ""
    """Text (tokenized as `ctx.generate` does) or token ids, sampled from as they are."""


def read_chat_request(body: Any) -> ChatRequest:
    """Check a decoded chat-completions body.

    Raises:
        BadRequest: naming the first parameter that is missing, malformed or unsupported.
    """
    given = _given(body, CHAT)
    messages = _messages(given.get("messages"))
    tools = _tools(given.get("tools", []))
    choice = given.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice {choice!r} is not supported: the engine cannot force a "
                         "call; use 'auto' or 'none'", "tool_choice")
    if not _bool(given, "parallel_tool_calls", True):
        raise BadRequest("parallel_tool_calls=false is not supported: the engine cannot keep "
                         "the model to one call; leave it out", "parallel_tool_calls")
    return ChatRequest(**_sampled(given, _bool(given, "logprobs", False)),
                       messages=tuple(messages), tools=tuple(tools),
                       parse_tools=bool(tools) and choice == "auto")


def read_text_request(body: Any) -> TextRequest:
    """Check a decoded completions body (`prompt`: a string, token ids, or a list of one)."""
    given = _given(body, TEXT)
    prompt = given.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string or an array of token ids (one "
                         "prompt per request)", "prompt")
    logprobs = _int(given, "logprobs", 0, 0, 5) if "logprobs" in given else None
    if logprobs:
        raise BadRequest("logprobs > 0 asks for the most likely alternatives, which the engine "
                         "does not report; logprobs=0 gives the sampled tokens' own", "logprobs")
    return TextRequest(**_sampled(given, logprobs == 0), prompt=prompt)


def _given(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """The body's parameters that are not null (null means "the default"), all known."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {_kind(body)}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unsupported parameter {unknown[0]!r}: this endpoint serves "
                         f"{sorted(known)} and refuses the rest rather than ignore them",
                         unknown[0], code="unsupported_parameter")
    return {k: v for k, v in body.items() if v is not None}


def _sampled(given: Mapping[str, Any], logprobs: bool) -> dict[str, Any]:
    stream = _bool(given, "stream", False)
    options = given.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("stream_options may hold only include_usage (a boolean)",
                         "stream_options")
    if _int(given, "top_logprobs", 0, 0, 20):
        raise BadRequest("top_logprobs > 0 is not supported: the engine reports the sampled "
                         "token's logprob only (logprobs=true gives it)", "top_logprobs")
    return {"n": _int(given, "n", 1, 1, MAX_N), "stream": stream,
            "include_usage": stream and _bool(options, "include_usage", False),
            "logprobs": logprobs, "stop": _stop(given.get("stop", [])),
            "sampling": _sampling(given), "model": str(given.get("model", ""))}


def _messages(value: Any) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty array of message objects", "messages")
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object, not {_kind(message)}", where)
        if message.get("role") not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {sorted(_ROLES)}, got "
                             f"{message.get('role')!r}", f"{where}.role")
        _text(message.get("content"), f"{where}.content")
        for j, call in enumerate(message.get("tool_calls") or []):
            _call(call, f"{where}.tool_calls[{j}]")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null, or an array of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string, null or an array of text parts, not "
                     f"{_kind(content)}", where)


def _call(call: Any, where: str) -> tuple[str, Any]:
    """(name, arguments) of an assistant message's tool call."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                         "'arguments': ...}}}", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as written: the model's own malformed call, echoed back
    return function["name"], arguments


def _tools(value: Any) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest("tools must be an array of function tools", "tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': "
                             "..., 'parameters': {...}}}}", f"tools[{i}]")
    return value


def _sampling(given: Mapping[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise BadRequest("give max_tokens or max_completion_tokens, not both",
                         "max_completion_tokens")
    for name in ("max_tokens", "max_completion_tokens"):
        if name in given:
            sampling["max_new_tokens"] = _int(given, name, 0, 1, None)
    if "temperature" in given:
        sampling["temperature"] = _number(given, "temperature", 0.0, 2.0, closed=True)
    if "top_p" in given:
        sampling["top_p"] = _number(given, "top_p", 0.0, 1.0, closed=False)
    return sampling


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or an array of them", "stop")
    if len(stops) > 4:
        raise BadRequest(f"stop holds {len(stops)} strings; at most 4", "stop")
    return tuple(stops)


def _bool(given: Mapping[str, Any], name: str, default: bool) -> bool:
    value = given.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, not {_kind(value)}", name)
    return value


def _int(given: Mapping[str, Any], name: str, default: int, low: int, high: int | None) -> int:
    value = given.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, not {_kind(value)}", name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be {bound}, got {value}", name)
    return value


def _number(given: Mapping[str, Any], name: str, low: float, high: float, closed: bool) -> float:
    value = given[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, not {_kind(value)}", name)
    inside = low <= value <= high if closed else low < value <= high
    if not inside:
        bounds = f"[{low}, {high}]" if closed else f"({low}, {high}]"
        raise BadRequest(f"{name} must be in {bounds}, got {value}", name)
    return float(value)


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the agent can see of a message: equal here means the same message to it."""
    calls = tuple((name, json.dumps(arguments, sort_keys=True)) for name, arguments in (
        _call(call, "tool_calls") for call in message.get("tool_calls") or []))
    return (_ROLES[message["role"]], _text(message.get("content"), "content"), calls,
            message.get("tool_call_id"))


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as the chat template renders it."""
    role = _ROLES[message["role"]]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), "content")}
    calls = [_call(call, "tool_calls") for call in message.get("tool_calls") or []]
    if role == "assistant" and calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in calls]
    if role == "tool" and isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape (the official client reads `message`, `param` and `code`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def tool_call_json(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    """A returned tool call in OpenAI's shape (arguments as a JSON string)."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def chunked(body: Mapping[str, Any]) -> Sequence[dict[str, Any]]:
    """A chat.completion answer as the chunks that stream it (chat.completion.chunk): per
    choice the role, the content (with its logprobs), the tool calls and the finish reason."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}
    chunks = []
    for choice in body["choices"]:
        message, i = choice["message"], choice["index"]

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
                  index: int = i) -> dict[str, Any]:
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]}

        chunks.append(chunk({"role": "assistant", "content": ""}))
        if message["content"]:
            chunks.append(chunk({"content": message["content"]}, logprobs=choice["logprobs"]))
        if message.get("tool_calls"):
            chunks.append(chunk({"tool_calls": [{"index": k, **call} for k, call in
                                                enumerate(message["tool_calls"])]}))
        chunks.append(chunk({}, finish=choice["finish_reason"]))
    return chunks


def text_chunks(body: Mapping[str, Any]) -> Sequence[dict[str, Any]]:
    """A text_completion answer as the chunks that stream it: per choice its text, then its
    finish reason."""
    head = {"id": body["id"], "object": "text_completion", "created": body["created"],
            "model": body["model"]}
    chunks = []
    for choice in body["choices"]:
        chunks.append({**head, "choices": [{**choice, "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": choice["index"], "text": "",
                                            "logprobs": None,
                                            "finish_reason": choice["finish_reason"]}]})
    return chunks
