"""Chat turns inside episodes: token-in/token-out, tool calls, the non-append-only fallback, and
the outcomes (truncation, malformed calls, raising tools) that end or mark only their episode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

import astranb as ab
from astranb import models
from astranb.chat import THINK_STRIPPING_TEMPLATE, encode
from astranb.dataflow.batcher import build_batch, chains
from astranb.dataflow.buffer import Group
from astranb.engines import HFEngine
from astranb.types import Generation, GenerationRequest

SPEC = models.tiny_chat()


@pytest.fixture(scope="module")
def tokenizer():
    return SPEC.tokenizer()


@dataclass
class Handle:
    """What an episode sees of a policy."""

    name: str
    tokenizer: object
    engine: object
    max_context: int | None = None
    version: int = 0


class ScriptedEngine:
    """Answers each request with the next scripted text (tokenized, EOS appended) and keeps the
    prompt ids it was given: what the engine consumed."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.consumed = tokenizer, list(texts), []

    async def generate(self, request: GenerationRequest) -> Generation:
        self.consumed.append(request.prompt_ids)
        text = self.texts.pop(0)
        ids = (*encode(self.tokenizer, text), self.tokenizer.eos_token_id)
        ids = ids[: request.sampling.max_new_tokens]
        return Generation(request.prompt_ids, ids, tuple(-0.25 for _ in ids), (0,) * len(ids),
                          "stop", text)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a * b


CALL = '<tool_call>\n{{"name": "{}", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'


class ToolConversation(ab.Environment):
    """Three turns: add, multiply, answer; the tools' results come back as tool messages."""

    roles = ("agent",)

    def samples(self, seed=0):
        while True:
            yield {"question": "What is (2 + 3) * 4?"}

    async def episode(self, ctx, sample):
        messages = [{"role": "user", "content": sample["question"]}]
        for _ in range(3):
            message = await ctx.chat("agent", messages, tools=[add, mul], max_new_tokens=64)
            if not message.tool_calls and not message.errors:
                return float(message.content.strip() == "20")
            await ctx.run_tools(messages, message, [add, mul])
        return 0.0


def _play(env, engine, tokenizer, **handle):
    policy = Handle("p", tokenizer, engine, **handle)
    return asyncio.run(ab.play_episode(env, {r: policy for r in env.roles}, {"question": "q"}))


def test_three_turn_tool_conversation_keeps_the_sampled_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL.format("add", 2, 3), CALL.format("mul", 5, 4), "20"])
    traj = _play(ToolConversation(), engine, tokenizer)
    assert traj.ok and traj.rewards == {"agent": 1.0} and traj.truncated is None
    assert [c.name for c in traj.tool_calls] == ["add", "mul"]
    assert [c.result for c in traj.tool_calls] == [5, 20]
    # what the engine consumed at each turn is exactly what was recorded
    assert [t.generation.prompt_ids for t in traj.turns] == engine.consumed
    # each prompt is the previous prompt + completion, as sampled, plus the new tokens only
    for before, after in zip(traj.turns, traj.turns[1:], strict=False):
        kept = before.generation.prompt_ids + before.generation.completion_ids
        assert after.generation.prompt_ids[: len(kept)] == kept
        new = tokenizer.decode(list(after.generation.prompt_ids[len(kept):]),
                               skip_special_tokens=False)
        assert "<tool_response>" in new and "<|im_start|>assistant\n" in new
    assert traj.counts == {"retokenized": 0}  # counted on every chat turn
    # trained as one sequence, loss on exactly the sampled tokens
    assert chains(list(traj.turns)) == [list(traj.turns)]
    other = _play(ToolConversation(), ScriptedEngine(
        tokenizer, [CALL.format("add", 2, 3), CALL.format("mul", 5, 4), "21"]), tokenizer)
    batch = build_batch([Group(0, (traj, other), 0)], "p", ab.GRPO(), pad_id=0)
    assert batch.size == 2
    last = traj.turns[-1].generation
    ids = list(last.prompt_ids + last.completion_ids)
    assert batch.input_ids_B_T[0, : len(ids)].tolist() == ids
    spans = [(len(t.generation.prompt_ids), len(t.generation.completion_ids)) for t in traj.turns]
    sampled = {i for start, length in spans for i in range(start, start + length)}
    assert {i for i, m in enumerate(batch.loss_mask_B_T[0].tolist()) if m} == sampled


def test_a_template_that_rewrites_history_falls_back_to_fresh_tokens_and_separate_rows():
    tokenizer = SPEC.tokenizer()
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE

    class Thinking(ab.Environment):
        roles = ("agent",)

        def samples(self, seed=0):
            yield {}

        async def episode(self, ctx, sample):
            messages = [{"role": "user", "content": "first"}]
            await ctx.chat("agent", messages)
            messages.append({"role": "user", "content": "second"})  # past <think> now dropped
            await ctx.chat("agent", messages)
            return 1.0

    engine = ScriptedEngine(tokenizer, ["<think>hm</think>one", "<think>ok</think>two"])
    traj = _play(Thinking(), engine, tokenizer)
    first, second = traj.turns
    kept = first.generation.prompt_ids + first.generation.completion_ids
    assert second.generation.prompt_ids[: len(kept)] != kept
    assert "hm" not in tokenizer.decode(list(second.generation.prompt_ids))
    assert traj.counts == {"retokenized": 1}
    assert chains([first, second]) == [[first], [second]]


def test_malformed_calls_unknown_tools_and_raising_tools_become_tool_messages(tokenizer):
    def explode(a: int) -> int:
        """Always fails.

        Args:
            a: ignored.
        """
        raise RuntimeError("boom")

    seen = []

    class Messy(ab.Environment):
        roles = ("agent",)

        def samples(self, seed=0):
            yield {}

        async def episode(self, ctx, sample):
            messages = [{"role": "user", "content": "go"}]
            message = await ctx.chat("agent", messages, tools=[explode], max_new_tokens=96)
            outcomes = await ctx.run_tools(messages, message, [explode])
            seen.extend(messages[2:])
            return float(len(outcomes))

    text = ('<tool_call>{"name": "explode", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "explode", "arguments": [1]}</tool_call>')
    traj = _play(Messy(), ScriptedEngine(tokenizer, [text]), tokenizer)
    assert traj.ok and traj.rewards == {"agent": 3.0}
    assert traj.counts == {"retokenized": 0, "malformed_tool_calls": 1, "tool_errors": 1}
    contents = [m["content"] for m in seen]
    assert all(m["role"] == "tool" for m in seen) and len(seen) == 3
    assert contents[0].startswith("error: malformed tool call")
    assert "RuntimeError: boom" in contents[1]
    assert "unknown tool 'nope'" in contents[2]
    assert traj.tool_calls[0].error == "RuntimeError: boom"


def test_an_episode_past_the_context_or_budget_ends_truncated_with_its_reward(tokenizer):
    class Long(ab.Environment):
        roles = ("agent",)
        truncated_reward = -0.5

        def samples(self, seed=0):
            yield {}

        async def episode(self, ctx, sample):
            messages = [{"role": "user", "content": "talk"}]
            while True:
                await ctx.chat("agent", messages, max_new_tokens=40)
                messages.append({"role": "user", "content": "more"})

    texts = ["blah " * 8] * 50
    traj = _play(Long(), ScriptedEngine(tokenizer, texts), tokenizer, max_context=160)
    assert traj.ok and traj.truncated.startswith("context")
    assert traj.rewards == {"agent": -0.5} and len(traj.turns) >= 2
    assert all(len(t.generation.prompt_ids) + len(t.generation.completion_ids) <= 160
               for t in traj.turns)  # generation never starts past the context

    env = Long()
    env.max_episode_tokens = 30
    traj = _play(env, ScriptedEngine(tokenizer, texts), tokenizer)
    assert traj.truncated.startswith("budget")
    assert sum(len(t.generation.completion_ids) for t in traj.turns) <= 30


def test_the_chat_path_runs_for_real_on_the_tiny_chat_model(tokenizer):
    """render -> tokenize -> generate -> parse on the real engine, two turns, ids kept."""

    class Real(ab.Environment):
        roles = ("agent",)

        def samples(self, seed=0):
            yield {}

        async def episode(self, ctx, sample):
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            first = await ctx.chat("agent", messages, tools=[add], max_new_tokens=12)
            messages.append({"role": "tool", "name": "add", "content": "5"})
            second = await ctx.chat("agent", messages, tools=[add], max_new_tokens=12)
            return float(bool(first.text) or bool(second.text))

    consumed = []

    async def play():
        with HFEngine(SPEC, max_batch_size=2, seed=1) as engine:
            real_generate = engine.generate

            async def spy(request):
                consumed.append(request.prompt_ids)
                return await real_generate(request)

            engine.generate = spy
            handle = Handle("p", tokenizer, engine)
            return await ab.play_episode(Real(), {"agent": handle}, {})

    traj = asyncio.run(play())
    assert traj.ok, traj.error
    assert [t.generation.prompt_ids for t in traj.turns] == consumed
    first, second = traj.turns
    kept = first.generation.prompt_ids + first.generation.completion_ids
    assert second.generation.prompt_ids[: len(kept)] == kept


@pytest.mark.slow  # a run over rollout services
def test_chat_episodes_on_rollout_services_keep_tokens_versions_and_tool_calls(tmp_path):
    """ctx.chat over the wire: the service rebuilds the tiny chat model from its spec, plays the
    conversation, records the tool calls; trained with versions inside the staleness bound."""
    from .envs import ChatTool
    from .services import in_process_services

    session, apps, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), rollouts=1,
                                           trainer=False)
    with session:
        policy = session.policy("agent", models.tiny_chat(),
                                algorithm=ab.GRPO(filter_groups=False))
        session.wire(ChatTool(), agent=policy)
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
        service_engine = apps["http://r0"].state.service.slots["agent"].engine
        assert service_engine.version == 3
        episodes = [e for e in run.episodes if e.error is None]
        assert episodes
        for episode in episodes:
            first, second = episode.turns
            kept = first["prompt_ids"] + first["completion_ids"]
            assert second["prompt_ids"][: len(kept)] == kept  # tokens kept on the service
            assert "add" in [c["name"] for c in episode.tool_calls]
        assert run.metrics["staleness_max"].max() <= 1
        assert run.accounting["lost"] == 0


def test_the_debugger_shows_chat_turns_tool_calls_and_masks(tokenizer):
    from astranb.session.recorder import Episode

    engine = ScriptedEngine(tokenizer, [CALL.format("add", 2, 3), CALL.format("mul", 5, 4), "20"])
    traj = _play(ToolConversation(), engine, tokenizer)
    episode = Episode.from_trajectory(traj, 0, 0, tokenizers={"p": tokenizer})
    dbg = episode.debugger()
    assert [s.kind for s in dbg.steps] == ["generate", "tool", "generate", "tool", "generate",
                                           "reward"]
    turns = [s for s in dbg.steps if s.kind == "generate"]
    assert [s.extends for s in turns] == [-1, 0, 1]
    assert turns[1].new_prompt.startswith("\n<|im_start|>user\n<tool_response>\n5")
    sizes = [(len(t.generation.prompt_ids), len(t.generation.completion_ids)) for t in traj.turns]
    carried = sum(sizes[0])
    assert turns[1].mask == (f"prompt {sizes[1][0]} tokens = turn 0's {carried} tokens as "
                             f"sampled + {sizes[1][0] - carried} new (loss 0); completion "
                             f"{sizes[1][1]} tokens: loss 1")
    assert [s.tool for s in dbg.steps if s.kind == "tool"] == ["add", "mul"]
    assert "loss mask" in dbg.to_html() and "loss mask" in repr(dbg)


class Rebuilt(ab.Environment):
    """Two turns over a conversation the episode builds anew between them: `messages + [...]`
    (the reply kept as ctx.chat appended it), or from the parsed reply's content."""

    roles = ("agent",)

    def __init__(self, keep_reply: bool):
        self.keep_reply = keep_reply

    def samples(self, seed=0):
        yield {}

    async def episode(self, ctx, sample):
        asked = [{"role": "user", "content": "first"}]
        messages = list(asked)
        reply = await ctx.chat("agent", messages)
        if self.keep_reply:  # a new list, equal in content to what ctx.chat left
            messages = messages + [{"role": "user", "content": "second"}]
        else:  # the assistant message rebuilt from the parsed content
            messages = asked + [{"role": "assistant", "content": reply.content},
                                {"role": "user", "content": "second"}]
        await ctx.chat("agent", messages)
        return 1.0


def test_a_conversation_rebuilt_as_a_new_list_keeps_its_sampled_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, ["<think>hm</think>one", "two"])
    traj = _play(Rebuilt(keep_reply=True), engine, tokenizer)
    first, second = traj.turns
    kept = first.generation.prompt_ids + first.generation.completion_ids
    assert second.generation.prompt_ids[: len(kept)] == kept  # found by content, not by list
    assert traj.counts == {"retokenized": 0}
    assert chains([first, second]) == [[first, second]]


def test_a_conversation_whose_reply_was_rewritten_is_counted_and_warned_about(tokenizer):
    engine = ScriptedEngine(tokenizer, ["<think>hm</think>one", "two"])
    with pytest.warns(RuntimeWarning, match="tokenized afresh.*count/retokenized.*msg.text"):
        traj = _play(Rebuilt(keep_reply=False), engine, tokenizer)
    first, second = traj.turns
    kept = first.generation.prompt_ids + first.generation.completion_ids
    assert second.generation.prompt_ids[: len(kept)] != kept
    assert traj.counts == {"retokenized": 1}
    assert chains([first, second]) == [[first], [second]]


def test_rows_report_the_retokenized_count_as_0_when_nothing_was_retokenized(tokenizer):
    from astranb.dataflow.orchestrator import RolloutCounters

    counters = RolloutCounters()
    traj = _play(ToolConversation(), ScriptedEngine(
        tokenizer, [CALL.format("add", 2, 3), CALL.format("mul", 5, 4), "20"]), tokenizer)
    counters.add(traj, ["p"])
    assert counters.take_episode_facts("p") == {"truncated": 0, "count/retokenized": 0}
