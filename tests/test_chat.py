"""Chat with tools: tool schemas, parsing assistant messages, the chat templates and the tiny chat
tokenizer, and the whole path (template -> tokens -> HFEngine -> text -> parse) on the tiny chat
model."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astranb import models
from astranb.chat import (
    CHAT_TEMPLATE,
    THINK_STRIPPING_TEMPLATE,
    ParsedAssistant,
    ToolCallError,
    ToolRequest,
    parse_assistant,
    render_tool_result,
    tool_schema,
)
from astranb.engines import HFEngine
from astranb.types import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return models.tiny_chat().tokenizer()


# -- tool schemas ---------------------------------------------------------------------------------

def plan_trip(
    city: str,
    days: int,
    budget: float,
    stops: list[str],
    prices: dict[str, int],
    units: Literal["metric", "imperial"],
    pets: bool = False,
    note: str | None = None,
) -> str:
    """Plan a trip to a city.

    The plan lists one stop per day.

    Args:
        city: where to go.
        days (int): how long to stay,
            counted in nights.
        budget: most money to spend.
        stops: places to visit.
        units: how distances are shown.
        note: anything else.

    Returns:
        The plan as text.
    """
    return city


def test_tool_schema_of_a_documented_function():
    assert tool_schema(plan_trip) == {
        "type": "function",
        "function": {
            "name": "plan_trip",
            "description": "Plan a trip to a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "where to go."},
                    "days": {"type": "integer",
                             "description": "how long to stay, counted in nights."},
                    "budget": {"type": "number", "description": "most money to spend."},
                    "stops": {"type": "array", "items": {"type": "string"},
                              "description": "places to visit."},
                    "prices": {"type": "object"},
                    "units": {"type": "string", "enum": ["metric", "imperial"],
                              "description": "how distances are shown."},
                    "pets": {"type": "boolean"},
                    "note": {"type": "string", "description": "anything else."},
                },
                "required": ["city", "days", "budget", "stops", "prices", "units"],
            },
        },
    }


def test_tool_schema_without_docstring_and_with_a_nested_list():
    def grid(rows: list[list[int]]):
        return rows

    assert tool_schema(grid)["function"] == {
        "name": "grid", "description": "",
        "parameters": {"type": "object", "required": ["rows"], "properties": {
            "rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}},
    }


def no_annotation(x):
    return x


def star_args(*values: int):
    return values


def star_kwargs(**options: str):
    return options


def a_tuple(pair: tuple[int, int]):
    return pair


def a_union(value: int | str):
    return value


def mixed_literal(mode: Literal["a", 1]):
    return mode


@pytest.mark.parametrize("fn, param, fix", [
    (no_annotation, "'x'", "annotate it"),
    (star_args, "'values'", "list each parameter by name"),
    (star_kwargs, "'options'", "list each parameter by name"),
    (a_tuple, "'pair'", "use str, int, float, bool"),
    (a_union, "'value'", "use str, int, float, bool"),
    (mixed_literal, "'mode'", "values of one type"),
])
def test_tool_schema_errors_name_the_function_the_parameter_and_the_fix(fn, param, fix):
    with pytest.raises(TypeError) as error:
        tool_schema(fn)
    message = str(error.value)
    assert f"tool_schema({fn.__name__})" in message and param in message and fix in message


# -- parsing assistant messages -------------------------------------------------------------------

def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_well_formed_message_with_reasoning_content_and_a_call():
    text = ("<think>\n12 apples times 7 bags.\n</think>\nLet me compute it.\n"
            + call('{"name": "calculator", "arguments": {"expression": "12 * 7"}}'))
    assert parse_assistant(text) == ParsedAssistant(
        content="Let me compute it.", reasoning="12 apples times 7 bags.",
        tool_calls=(ToolRequest("calculator", {"expression": "12 * 7"}, "call_0"),), errors=())


def test_plain_text_has_no_reasoning_and_no_calls():
    assert parse_assistant("  The answer is \\boxed{85}.\n") == ParsedAssistant(
        "The answer is \\boxed{85}.", None, (), ())


def test_several_calls_with_nested_json_arguments_and_string_arguments():
    nested = {"query": "a } b { c", "filters": {"tags": ["x", {"y": [1, 2.5, None]}]},
              "text": "</think> inside a string"}
    text = "\n".join([
        "Two lookups.",
        call(json.dumps({"name": "search", "arguments": nested})),
        call('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'),
        call('{"name": "now", "arguments": {}}'),
    ])
    parsed = parse_assistant(text)
    assert parsed.errors == () and parsed.content == "Two lookups." and parsed.reasoning is None
    assert parsed.tool_calls == (ToolRequest("search", nested, "call_0"),
                                 ToolRequest("calculator", {"expression": "1+1"}, "call_1"),
                                 ToolRequest("now", {}, "call_2"))


@pytest.mark.parametrize("body, expected", [
    ('{"name": "f", "arguments": {"x": 1,}}', "not valid JSON: Expecting property name enclosed "
                                              "in double quotes at line 1 column 36"),
    ('{"name": "f",\n "arguments": {"x": }}', "Expecting value at line 2 column 21"),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "", "arguments": {}}', 'has an empty "name"'),
    ('{"name": 3, "arguments": {}}', 'has a number as its "name"'),
    ('{"name": "f"}', 'the call to f has no "arguments"'),
    ('{"name": "f", "arguments": [1, 2]}', '"arguments" of f must be a JSON object'),
    ('{"name": "f", "arguments": "{x: 1}"}', "a string that is not valid JSON"),
    ('{"name": "f", "arguments": "[1]"}', "not an array"),
    ('{"name": "f", "arguments": {}} and more', "text after the JSON object: 'and more'"),
    ('{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}', "exactly one JSON object"),
    ('["f", {}]', "must be a JSON object, not an array"),
    ("", "block is empty"),
])
def test_malformed_calls_become_errors_a_model_can_read(body, expected):
    text = call(body) + "\n" + call('{"name": "ok", "arguments": {"a": [1]}}')
    parsed = parse_assistant(text)
    assert parsed.tool_calls == (ToolRequest("ok", {"a": [1]}, "call_1"),)
    (error,) = parsed.errors
    assert error.index == 0 and error.raw == call(body)
    assert expected in error.message, error.message
    assert parsed.content == ""


def test_an_unclosed_call_keeps_the_calls_before_it():
    text = "Sure. " + call('{"name": "a", "arguments": {}}') + ' then <tool_call>\n{"name": "b"'
    parsed = parse_assistant(text)
    assert parsed.tool_calls == (ToolRequest("a", {}, "call_0"),)
    assert parsed.errors == (ToolCallError(1, '<tool_call>\n{"name": "b"',
                                           "<tool_call> is never closed; end each call with "
                                           "</tool_call>"),)
    assert parsed.content == "Sure.  then"


def test_an_unclosed_think_is_all_reasoning_and_calls_inside_it_do_not_count():
    text = "<think>\nmaybe " + call('{"name": "a", "arguments": {}}')
    parsed = parse_assistant(text)
    assert parsed.reasoning == "maybe " + call('{"name": "a", "arguments": {}}')
    assert parsed.tool_calls == () and parsed.content == ""
    (error,) = parsed.errors
    assert error.index == -1 and error.raw == text
    assert "end the reasoning with </think>" in error.message


def test_calls_inside_a_closed_think_block_are_reasoning_not_calls():
    parsed = parse_assistant("<think>I could " + call('{"name": "a", "arguments": {}}')
                             + "</think>No tool needed.")
    assert parsed.tool_calls == () and parsed.errors == () and parsed.content == "No tool needed."


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "{", "}", '"',
                             '"name"', '"arguments"', ":", ",", "[", "]", "\\", "\n", " ", "x",
                             '{"name": "f", "arguments": {}}', "null", "1e999", "NaN"])


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS | st.text(max_size=5), max_size=25).map("".join))
def test_parse_assistant_never_raises_and_numbers_every_block(text):
    parsed = parse_assistant(text)
    ids = [int(c.id.removeprefix("call_")) for c in parsed.tool_calls]
    indexes = [e.index for e in parsed.errors if e.index >= 0]
    assert sorted(ids + indexes) == list(range(len(ids) + len(indexes)))
    assert len(ids) + len(indexes) <= text.count("<tool_call>")
    assert parsed.content == parsed.content.strip()


class Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")


@pytest.mark.parametrize("result, shown", [
    ("84", "84"), ("", ""), (84, "84"), (2.5, "2.5"), (None, "null"), (True, "true"),
    ({"total": 84, "items": ["a", "é"]}, '{"total":84,"items":["a","é"]}'),
    ([1, [2]], "[1,[2]]"), (math.nan, "nan"), ({1, 2}, "{1, 2}"), (b"x", "b'x'"),
    (Unprintable(), "<Unprintable object>"),
])
def test_render_tool_result(result, shown):
    assert render_tool_result(result) == shown


# -- the chat templates ---------------------------------------------------------------------------

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: such as "12 * 7".
    """
    return str(expression)


def test_the_template_renders_tools_calls_and_tool_responses(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "12*7 and 3+4?"},
        {"role": "assistant", "content": "Two sums.", "tool_calls": [
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "12 * 7"}}},
            {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}]},
        {"role": "tool", "content": "84"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "84 and 7."},
    ]
    schema = json.dumps(tool_schema(calculator))
    assert tok.apply_chat_template(messages, tools=[tool_schema(calculator)], tokenize=False) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call the functions below. Each is "
        "described by a JSON schema, one per line, inside <tools></tools>:\n<tools>\n"
        f"{schema}\n</tools>\n\nTo call a function, reply with its name and a JSON object of "
        "arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n12*7 and 3+4?<|im_end|>\n"
        "<|im_start|>assistant\nTwo sums.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n84 and 7.<|im_end|>\n"
    )


def test_without_a_system_message_tools_get_their_own_system_block(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   tools=[tool_schema(calculator)], add_generation_prompt=True,
                                   tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")


def test_a_rendered_tool_call_parses_back_to_the_same_call(tok):
    arguments = {"expression": "(1 + 2) * 3", "options": {"exact": True, "digits": [1, 2]}}
    messages = [{"role": "user", "content": "?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"function": {"name": "calculator", "arguments": arguments}}]}]
    text = tok.apply_chat_template(messages, tokenize=False)
    body = text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert parse_assistant(body) == ParsedAssistant(
        "", None, (ToolRequest("calculator", arguments, "call_0"),), ())


CONTENT = st.text(max_size=12) | st.sampled_from(
    ["", "<think>\nhm\n</think>\n\nok", "<tool_call>\n{}\n</tool_call>", "\n", "84", "<|im_end|>"])
CALLS = st.lists(st.fixed_dictionaries({
    "function": st.fixed_dictionaries({
        "name": st.sampled_from(["calculator", "f"]),
        "arguments": st.dictionaries(st.sampled_from(["x", "expression"]),
                                     st.integers() | st.text(max_size=5), max_size=2)})}),
    min_size=1, max_size=2)
MESSAGE = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, CONTENT),
    st.builds(lambda c: {"role": "system", "content": c}, CONTENT),
    st.builds(lambda c: {"role": "assistant", "content": c}, CONTENT),
    st.builds(lambda c, t: {"role": "assistant", "content": c, "tool_calls": t},
              st.none() | CONTENT, CALLS),
    st.builds(lambda c: {"role": "tool", "content": c}, CONTENT),
)


def render(tok, messages, tools, generation_prompt=False, template=None):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                   chat_template=template, tokenize=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=8), st.booleans())
def test_the_chat_template_is_append_only(tok, messages, with_tools):
    tools = [tool_schema(calculator)] if with_tools else None
    for k in range(1, len(messages)):
        shorter, longer = render(tok, messages[:k], tools), render(tok, messages[:k + 1], tools)
        assert longer.startswith(shorter), (k, shorter, longer)
        if messages[k]["role"] == "assistant":
            prompt = render(tok, messages[:k], tools, generation_prompt=True)
            assert longer.startswith(prompt), (k, prompt, longer)


def test_the_think_stripping_template_rewrites_history(tok):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\n4"},
                {"role": "user", "content": "and 3+3?"}]
    before = render(tok, messages[:2], None, template=THINK_STRIPPING_TEMPLATE)
    after = render(tok, messages, None, template=THINK_STRIPPING_TEMPLATE)
    assert "<think>\nsmall sum\n</think>" in before and "<think>" not in after
    assert not after.startswith(before)
    assert "<|im_start|>assistant\n4<|im_end|>\n" in after
    # the same conversation through the append-only template keeps its reasoning
    assert render(tok, messages, None, template=CHAT_TEMPLATE).startswith(
        render(tok, messages[:2], None, template=CHAT_TEMPLATE))


# -- the tiny chat tokenizer ----------------------------------------------------------------------

TRICKY = [
    "", " ", "  two  spaces ", "\n\n\t\r\n", "Hello, world!", "12345678901234567890", "-0.25e-3",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><|endoftext|>", "a<|im_end|>b",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "<think></think>",
    "<|im_start", "im_end|>", "<tool_call<tool_call>>", "日本語のテキスト", "emoji 🙂‍↔️ 👩🏽‍🚀",
    "Ünïcödé ñ ß ø", "\x00\x01\x7f", "\\boxed{85} #### 85 $\\frac{1}{2}$", " 's 't 're",
    "\u200b\u00a0\u2028", "tab\there", "ends with space ",
]


@pytest.mark.parametrize("text", TRICKY)
def test_the_tokenizer_round_trips_tricky_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text() | st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>",
                                              "</tool_response>", "<think>", " 1", "\n"]),
                max_size=10).map("".join))
def test_the_tokenizer_round_trips_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_the_tokenizer_splits_digits_and_keeps_chat_tokens_whole(tok):
    assert tok.clean_up_tokenization_spaces is False
    assert 512 <= len(tok) <= 1024
    assert tok.convert_ids_to_tokens(tok.encode("x=2025")) == ["x", "=", "2", "0", "2", "5"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>", "<|endoftext|>"):
        assert len(tok.encode(token)) == 1, token
    # only the control tokens are special: a parser still sees the tool and think tags
    text = "<think>a</think><tool_call>b</tool_call><|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.removesuffix("<|im_end|>")


def _generator():
    spec = importlib.util.spec_from_file_location("make_tiny_chat",
                                                  ROOT / "scripts" / "make_tiny_chat.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_the_shipped_tokenizer_files_are_what_the_generator_writes(tmp_path):
    generator = _generator()
    written = generator.build(tmp_path)
    assert [p.name for p in written] == ["tokenizer.json", "tokenizer_config.json"]
    for path in written:
        shipped = models.TINY_CHAT_ASSETS / path.name
        assert shipped.read_bytes() == path.read_bytes(), (
            f"{shipped.name} is stale; run .venv/bin/python scripts/make_tiny_chat.py")
    assert sum(p.stat().st_size for p in models.TINY_CHAT_ASSETS.iterdir()) < 300_000
    config = json.loads((models.TINY_CHAT_ASSETS / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


# -- the whole path on the tiny chat model --------------------------------------------------------

def test_chat_with_tools_through_the_engine_and_back(tok):
    spec = models.tiny_chat(hidden_size=64, num_heads=4, initializer_range=0.3)
    messages = [{"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "A bag holds 12 apples. How many are in 7 bags?"}]
    prompt = tok.apply_chat_template(messages, tools=[tool_schema(calculator)],
                                     add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt)
    assert tok.decode(prompt_ids) == prompt
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12,
                              stop_token_ids=(tok.eos_token_id,))
    with HFEngine(spec, max_batch_size=2) as engine:
        gen = engine.generate_many([GenerationRequest(tuple(prompt_ids), sampling)])[0]
    assert len(gen.completion_ids) <= 12 and all(0 <= t < len(tok) for t in gen.completion_ids)
    assert isinstance(parse_assistant(gen.text), ParsedAssistant)  # junk, but it parses

    # a well-formed completion, as ids after the prompt, decodes and parses exactly
    completion = ('<think>\n12 apples in each of 7 bags.\n</think>\n<tool_call>\n'
                  '{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
                  "</tool_call><|im_end|>")
    ids = prompt_ids + tok.encode(completion)
    text = tok.decode(ids[len(prompt_ids):], skip_special_tokens=True)
    assert parse_assistant(text) == ParsedAssistant(
        "", "12 apples in each of 7 bags.",
        (ToolRequest("calculator", {"expression": "12 * 7"}, "call_0"),), ())
    # and the conversation that keeps it verbatim extends those very tokens
    kept = messages + [{"role": "assistant", "content": text},
                       {"role": "tool", "content": render_tool_result(84)}]
    again = tok.apply_chat_template(kept, tools=[tool_schema(calculator)],
                                    add_generation_prompt=True, tokenize=False)
    assert again.startswith(tok.decode(ids, skip_special_tokens=False))
