"""Supervised warm start: which tokens carry loss, the same tokens ctx.chat would build, and a
real policy.sft that lowers the loss and publishes its weights."""

from __future__ import annotations

import asyncio

import pytest

import astranb as ab
from astranb import models
from astranb.chat import THINK_STRIPPING_TEMPLATE
from astranb.training.sft import sft_rows

SPEC = models.tiny_chat(hidden_size=64)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


CONVERSATION = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant",
     "content": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "The answer is \\boxed{5}."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return SPEC.tokenizer()


def test_loss_falls_on_the_assistant_tokens_and_their_end_of_turn_only(tokenizer):
    [(ids, mask)] = sft_rows(tokenizer, {"messages": CONVERSATION, "tools": [add]})
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    eos = tokenizer.eos_token_id
    assert trained.count(eos) == 2  # each assistant turn ends with its end-of-turn token
    first, second = tokenizer.decode(trained, skip_special_tokens=False).split(
        tokenizer.eos_token)[:2]
    assert first == CONVERSATION[2]["content"]
    assert second == CONVERSATION[4]["content"]
    # the tokens are the rendered conversation's: nothing between the turns is trained
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[ab.chat.tool_schema(add)],
                                         tokenize=False)
    assert text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    context = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m],
                               skip_special_tokens=False)
    assert "<tool_response>" in context and "What is 2 + 3?" in context


def test_demonstrations_are_tokenized_as_ctx_chat_builds_prompts(tokenizer):
    """The prompt of the second turn in an episode equals the demonstration's tokens up there."""
    from .test_chat_episodes import Handle, ScriptedEngine

    class Replay(ab.Environment):
        roles = ("agent",)

        def samples(self, seed=0):
            yield {}

        async def episode(self, ctx, sample):
            messages = CONVERSATION[:2]
            message = await ctx.chat("agent", messages, tools=[add], max_new_tokens=64)
            await ctx.run_tools(messages, message, [add])
            await ctx.chat("agent", messages, tools=[add], max_new_tokens=64)
            return 1.0

    texts = [CONVERSATION[2]["content"], CONVERSATION[4]["content"]]
    engine = ScriptedEngine(tokenizer, texts)
    traj = asyncio.run(ab.play_episode(Replay(), {"agent": Handle("p", tokenizer, engine)}, {}))
    last = traj.turns[-1].generation
    [(ids, _)] = sft_rows(tokenizer, {"messages": CONVERSATION, "tools": [add]})
    assert list(last.prompt_ids + last.completion_ids) == ids


def test_a_template_that_rewrites_history_gives_one_row_per_assistant_turn():
    tokenizer = SPEC.tokenizer()
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    talk = [{"role": "user", "content": "one"},
            {"role": "assistant", "content": "<think>hm</think>first"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "second"}]
    rows = sft_rows(tokenizer, talk)
    assert len(rows) == 2
    assert "hm" not in tokenizer.decode(rows[1][0])


def test_bad_demonstrations_get_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="no assistant message"):
        sft_rows(tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="needs 'messages'"):
        sft_rows(tokenizer, {"conversation": []})


@pytest.mark.slow  # 12 SFT steps end to end
def test_policy_sft_lowers_the_loss_and_publishes(tmp_path):
    with ab.Session(tmp_path) as session:
        policy = session.policy("p", SPEC, optimizer=ab.AdamWConfig(lr=1e-3))
        history = policy.sft([{"messages": CONVERSATION, "tools": [add]}] * 4, steps=12,
                             batch_size=4, lr=5e-3, progress=False)
        assert history[-1]["loss"] < 0.5 * history[0]["loss"]
        assert policy.version == 12
        assert policy.engine.version == 12
        assert policy.trainer.optimizer.param_groups[0]["lr"] == 1e-3  # RL keeps its own
        with pytest.raises(ValueError, match="positive integer"):
            policy.sft([CONVERSATION], steps=0)
