"""Chat with tools: the chat templates, tool schemas, parsing what an assistant wrote, and a
conversation's tokens.

A chat model sees a conversation as text in its chat template. Tools are announced in the system
part as JSON schemas; the model asks for one by writing a block

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

and reads the answer in a `<tool_response>` block of the next user turn. This module holds the
pure parts of that loop, with no torch or transformers import:

    schema = tool_schema(calculator)          # from the signature, type hints and docstring
    parsed = parse_assistant(completion)      # content, reasoning, tool calls, errors
    text = render_tool_result(calculator(**parsed.tool_calls[0].arguments))

and the token-in/token-out step that chat episodes (environments/conversation.py) and SFT batches
(training/sft.py) share, on any tokenizer with a chat template:

    text = render(tokenizer, messages, schemas_of(tools))   # the template's text
    ids = extend(tokenizer, kept_ids, text) or encode(tokenizer, text)

`CHAT_TEMPLATE` is the Jinja template of `astranb.models.tiny_chat()`. It is append-only: the
rendering of the first k messages is a prefix of the rendering of any longer conversation, so a
multi-turn episode can keep the tokens it sampled instead of re-tokenizing its history.
`THINK_STRIPPING_TEMPLATE` renders the same format but drops `<think>` blocks from past assistant
turns, as Qwen3's template does; it is here to test what happens when history is rewritten.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "THINK_STRIPPING_TEMPLATE",
    "ToolRequest",
    "ToolCallError",
    "ParsedAssistant",
    "tool_schema",
    "parse_assistant",
    "render_tool_result",
    "schemas_of",
    "render",
    "extend",
    "encode",
]

# -- chat templates -------------------------------------------------------------------------------
# Written with `{%-`/`-%}` everywhere and every newline spelled '\n' inside a string, so the output
# is the same whatever whitespace options the Jinja environment uses.

_TOOLS_MACRO = r"""{%- macro tools_section(tools) -%}
{{- '# Tools\n\nYou can call the functions below. Each is described by a JSON schema, '
    'one per line, inside <tools></tools>:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, reply with its name and a JSON object of arguments inside '
    '<tool_call></tool_call> tags:\n<tool_call>\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endmacro -%}
{%- macro call_json(call) -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{{- '{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}
{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
{{- '}' -}}
{%- endmacro -%}
{%- macro text_of(message) -%}
{%- if message['content'] is string -%}{{- message['content'] -}}
{%- elif message['content'] is none or message['content'] is not defined -%}
{%- else -%}
{{- raise_exception('message content must be a string, got ' + (message['content'] | tojson)) -}}
{%- endif -%}
{%- endmacro -%}
"""

_HEAD = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools and (messages and messages[0]['role'] != 'system'
                  or not messages and add_generation_prompt) -%}
{{- '<|im_start|>system\n' + tools_section(tools) + '<|im_end|>\n' -}}
{%- endif -%}
"""

# One message per loop turn. A run of tool messages shares one user block, which the next message
# (or the generation prompt) closes: closing it after the last tool message would make the
# rendering of a shorter conversation stop being a prefix of a longer one.
_LOOP = r"""{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role != 'tool' and not loop.first and messages[loop.index0 - 1]['role'] == 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- if role == 'system' -%}
{{- '<|im_start|>system\n' + text_of(message) -}}
{%- if loop.first and tools -%}{{- '\n\n' + tools_section(tools) -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif role == 'user' -%}
{{- '<|im_start|>user\n' + text_of(message) + '<|im_end|>\n' -}}
{%- elif role == 'assistant' -%}
{%- set content = text_of(message) -%}
@@STRIP@@
{{- '<|im_start|>assistant\n' + content -}}
{%- if message['tool_calls'] is defined and message['tool_calls'] -%}
{%- for call in message['tool_calls'] -%}
{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n' + call_json(call) + '\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' -}}
{%- if message['content'] is string -%}{{- message['content'] -}}
{%- else -%}{{- message['content'] | tojson -}}{%- endif -%}
{{- '\n</tool_response>' -}}
{%- else -%}
{{- raise_exception('unknown message role ' + (role | tojson)
                    + '; use system, user, assistant or tool') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{%- if messages and messages[-1]['role'] == 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen3's rule: reasoning of turns before the last user message is dropped from the history.
_STRIP_PAST_THINKING = r"""{%- if loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}"""

CHAT_TEMPLATE = _TOOLS_MACRO + _HEAD + _LOOP.replace("@@STRIP@@\n", "")
"""The append-only chat template of `astranb.models.tiny_chat()` (Qwen2.5-style format).

Assistant content is rendered verbatim, followed by any structured `tool_calls`. A run of tool
messages shares one user block that the next message or the generation prompt closes, so a
conversation that ends with tool messages renders without the final `<|im_end|>`."""

THINK_STRIPPING_TEMPLATE = _TOOLS_MACRO + _HEAD + _LOOP.replace("@@STRIP@@", _STRIP_PAST_THINKING)
"""`CHAT_TEMPLATE`, except that assistant messages before the last user message lose their
`<think>...</think>` part, like Qwen3's template. Not append-only."""


# -- tool schemas ---------------------------------------------------------------------------------

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SUPPORTED = "str, int, float, bool, list[...], dict, Literal[...] or X | None"


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema (OpenAI function format) a chat template shows the model for `fn`.

    Types come from the annotations, the description from the docstring's first paragraph and
    each parameter's description from its Google-style `Args:` entry. A parameter with a default
    or typed `X | None` is optional.

    Raises:
        TypeError: a parameter has no annotation, is *args/**kwargs, or has a type that JSON
            schema cannot express; the message names the function and the parameter.

    >>> def add(a: int, b: int = 0) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> tool_schema(add)["function"]["parameters"]["required"]
    ['a']
    """
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not isinstance(name, str):
        raise TypeError(f"tool_schema needs a named function, got {fn!r}; pass a def'd function")
    hints = _type_hints(fn, name)
    doc = inspect.getdoc(fn) or ""
    described = _documented_args(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool_schema({name}): parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{where} is *args/**kwargs, which a model cannot be told about; "
                            "list each parameter by name")
        if param.name not in hints:
            raise TypeError(f"{where} has no type annotation; annotate it (for example "
                            f"`{param.name}: str`) so the model knows what to pass")
        hint, optional = _strip_none(hints[param.name])
        schema = _schema_of(hint, where)
        if param.name in described:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if not optional and param.default is param.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _summary(doc),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _type_hints(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as error:  # NameError for an unresolvable string annotation, and kin
        raise TypeError(f"tool_schema({name}): cannot resolve its type annotations ({error}); "
                        "use types defined at module level of the tool's file") from None


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """(the hint without None, whether None was allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = tuple(a for a in typing.get_args(hint) if a is not type(None))
        if len(rest) < len(typing.get_args(hint)):
            return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _schema_of(hint: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is list or origin is list:
        return {"type": "array", **({"items": _schema_of(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {_JSON_TYPES.get(type(value)) for value in args}
        if len(kinds) == 1 and None not in kinds:
            return {"type": kinds.pop(), "enum": list(args)}
        raise TypeError(f"{where}: Literal{list(args)} mixes value types; use values of one "
                        "type (all str, or all int)")
    raise TypeError(f"{where} has type {hint!r}, which has no JSON schema here; use {_SUPPORTED}")


def _summary(doc: str) -> str:
    """The docstring's first paragraph on one line."""
    lines: list[str] = []
    for line in doc.splitlines():
        if not line.strip() or _SECTION.match(line):
            break
        lines.append(line.strip())
    return " ".join(lines)


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _documented_args(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` section (continuation lines joined)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.strip() in ("Args:", "Arguments:", "Parameters:")), None)
    if start is None:
        return {}
    found: dict[str, str] = {}
    indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break  # the next section
        match = _ARG.match(line.strip())
        if depth == indent and match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif current is not None:
            found[current] = f"{found[current]} {line.strip()}".strip()
    return found


# -- parsing an assistant message -----------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolRequest:
    """A well-formed tool call the assistant made."""

    name: str
    """The function it asked for."""
    arguments: dict[str, Any]
    """Its arguments, decoded from JSON."""
    id: str
    """"call_<i>", where i counts the message's `<tool_call>` blocks (malformed ones too)."""


@dataclass(frozen=True)
class ToolCallError:
    """A malformed tool call (or reasoning block), with a message the model can act on."""

    index: int
    """Which `<tool_call>` block of the message (0-based); -1 for an unclosed `<think>`."""
    raw: str
    """The block as written, tags included (for an unclosed block: up to the end of the text)."""
    message: str
    """What is wrong and how to write it instead."""


@dataclass(frozen=True)
class ParsedAssistant:
    """An assistant message split into its parts."""

    content: str
    """The text without the reasoning and tool-call blocks, stripped."""
    reasoning: str | None
    """The text of a leading `<think>...</think>` block, stripped; None without one."""
    tool_calls: tuple[ToolRequest, ...]
    """The well-formed tool calls, in order."""
    errors: tuple[ToolCallError, ...]
    """The malformed ones (and an unclosed `<think>`), in order."""


def parse_assistant(text: str) -> ParsedAssistant:
    """Split an assistant message into content, reasoning, tool calls and errors; never raises.

    >>> parsed = parse_assistant('<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n'
    ...                          '</tool_call>')
    >>> parsed.tool_calls[0].name, parsed.tool_calls[0].arguments, parsed.errors
    ('add', {'a': 1}, ())
    """
    reasoning, rest, think_error = _split_thinking(text)
    calls, errors, content = _split_calls(rest)
    if think_error is not None:
        errors.insert(0, think_error)
    return ParsedAssistant(content, reasoning, tuple(calls), tuple(errors))


def _split_thinking(text: str) -> tuple[str | None, str, ToolCallError | None]:
    """(reasoning, the text after it, an error for an unclosed block)."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text, None
    body = stripped[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        message = (f"{THINK_OPEN} is never closed: end the reasoning with {THINK_CLOSE}, then "
                   "write the answer or the tool calls")
        return body.strip(), "", ToolCallError(-1, stripped, message)
    return body[:end].strip(), body[end + len(THINK_CLOSE):], None


def _split_calls(text: str) -> tuple[list[ToolRequest], list[ToolCallError], str]:
    """(well-formed calls, errors, the text outside every block)."""
    calls: list[ToolRequest] = []
    errors: list[ToolCallError] = []
    outside: list[str] = []
    pos = index = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            errors.append(ToolCallError(index, text[start:], f"{CALL_OPEN} is never closed; "
                                        f"end each call with {CALL_CLOSE}"))
            pos = len(text)
            break
        pos = end + len(CALL_CLOSE)
        read = _read_call(text[start + len(CALL_OPEN):end])
        if isinstance(read, str):
            errors.append(ToolCallError(index, text[start:pos], read))
        else:
            calls.append(ToolRequest(read[0], read[1], f"call_{index}"))
        index += 1
    outside.append(text[pos:])
    return calls, errors, "".join(outside).strip()


_FORMAT = 'write {"name": "<function>", "arguments": {...}}'


def _read_call(body: str) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of one block's body, or why it is malformed."""
    text = body.strip()
    if not text:
        return f"the {CALL_OPEN} block is empty; {_FORMAT} inside it"
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as error:
        return (f"the tool call is not valid JSON: {error.msg} at line {error.lineno} column "
                f"{error.colno} of the block; {_FORMAT}")
    if text[end:].strip():
        return (f"unexpected text after the JSON object: {text[end:].strip()[:40]!r}; put exactly "
                f"one JSON object in each {CALL_OPEN} block")
    if not isinstance(value, dict):
        return f"the tool call must be a JSON object, not {_json_kind(value)}; {_FORMAT}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        got = ("has no" if "name" not in value else "has an empty" if isinstance(name, str)
               else f"has {_json_kind(name)} as its")
        return f'the tool call {got} "name"; give the function name as a non-empty string'
    if "arguments" not in value:
        return (f'the call to {name} has no "arguments"; give them as a JSON object '
                "({} when the function takes none)")
    return _arguments(name, value["arguments"])


def _arguments(name: str, arguments: Any) -> tuple[str, dict[str, Any]] | str:
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return (f'the "arguments" of {name} are a string that is not valid JSON '
                    f"({error.msg} at column {error.colno}); give them as a JSON object")
    if not isinstance(arguments, dict):
        return (f'the "arguments" of {name} must be a JSON object of parameter names to values, '
                f"not {_json_kind(arguments)}")
    return name, arguments


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def render_tool_result(result: Any) -> str:
    """How a tool's return value is shown to the model: a str as is, anything else as compact
    JSON, and its repr() when it is not JSON (never raises).

    >>> render_tool_result({"total": 84}), render_tool_result("84"), render_tool_result(None)
    ('{"total":84}', '84', 'null')
    """
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return repr(result)
    except Exception:  # a broken __repr__ must not end the episode
        return f"<{type(result).__name__} object>"


# -- a conversation's tokens ------------------------------------------------------------------
# A prompt extends the ids kept so far by only the template's new text (see the module doc).
def schemas_of(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas of the tool functions (from their signatures and docstrings)."""
    return [tool_schema(fn) for fn in tools]


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
