"""The OpenAI-compatible endpoint of an episode, driven by the official `openai` client: what it
refuses (no token, not loopback, unsupported parameters, malformed bodies, calls after the
episode), then what it does (recorded turns whose ids are what the engine consumed, tool calls,
streaming, tokens kept across calls, retokenization counted)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

import astranb as ab
from astranb.environments.openai_endpoint import create_app, endpoints
from astranb.types import Generation

from .test_chat_episodes import CALL, SPEC, Handle, ScriptedEngine


@pytest.fixture(scope="module")
def tokenizer():
    return SPEC.tokenizer()


class Agent(ab.Environment):
    """Runs `body(ctx)` as the episode: the test's own agent code."""

    roles = ("agent",)

    def __init__(self, body):
        self.body = body

    def samples(self, seed=0):
        yield {}

    async def episode(self, ctx, sample):
        return await self.body(ctx)


def _play(body, engine, tokenizer, **handle):
    policy = Handle("p", tokenizer, engine, **handle)
    return asyncio.run(ab.play_episode(Agent(body), {"agent": policy}, {}))


USER = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {**ADD["function"], "name": "mul",
                                        "description": "Multiply two integers."}}


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


# -- what it refuses ---------------------------------------------------------------------------
def test_requests_without_the_episodes_token_get_401(tokenizer):
    seen = {}

    async def body(ctx):
        url = ctx.openai_base_url("agent")
        root = url.split("/episodes/")[0]
        async with httpx.AsyncClient() as http:
            chat = {"model": "m", "messages": USER}
            seen["bare"] = await http.post(f"{root}/v1/chat/completions", json=chat)
            seen["wrong"] = await http.post(f"{root}/episodes/not-a-token/v1/chat/completions",
                                            json=chat)
        wrong = openai.AsyncOpenAI(base_url=f"{root}/episodes/x{url[-5:]}/v1", api_key="k",
                                   max_retries=0)
        try:
            await wrong.chat.completions.create(model="m", messages=USER)
        except openai.AuthenticationError as error:
            seen["client"] = error
        finally:
            await wrong.close()
        return 1.0

    engine = ScriptedEngine(tokenizer, [])
    traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    assert seen["bare"].status_code == 401 and seen["wrong"].status_code == 401
    assert "no live episode has this token" in _error(seen["wrong"])["message"]
    assert seen["client"].status_code == 401
    assert engine.consumed == [] and traj.turns == ()  # nothing was sampled


def test_anything_not_on_loopback_is_refused():
    async def probe():
        app = create_app(endpoints)
        transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 4444))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            far = await http.post("/episodes/t/v1/chat/completions", json={})
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4444))
        async with httpx.AsyncClient(transport=transport, base_url="http://evil.example") as h:
            rebound = await h.post("/episodes/t/v1/chat/completions", json={})
        return far, rebound

    far, rebound = asyncio.run(probe())
    assert far.status_code == 403 and "loopback" in _error(far)["message"]
    assert rebound.status_code == 403  # a Host that is not loopback (DNS rebinding)
    assert endpoints.start().startswith("http://127.0.0.1:")  # listens on loopback


@pytest.mark.parametrize(("options", "param"), [
    ({"seed": 3}, "seed"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"tool_choice": "required", "tools": [ADD]}, "tool_choice"),
    ({"stop": ["never ever"]}, "stop"),
    ({"n": 0}, "n"),
    ({"parallel_tool_calls": False, "tools": [ADD]}, "parallel_tool_calls"),
    ({"temperature": 3.0}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_an_unsupported_or_invalid_parameter_is_a_400_naming_it(tokenizer, options, param):
    seen = {}

    async def body(ctx):
        client = ctx.openai_client("agent")
        try:
            await client.chat.completions.create(model="m", messages=USER, **options)
        except openai.BadRequestError as error:
            seen["error"] = error
        return 1.0

    engine = ScriptedEngine(tokenizer, ["never used"])
    traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    error = seen["error"]
    assert error.status_code == 400 and error.body["param"] == param
    assert param in error.message
    assert engine.consumed == []


def test_malformed_bodies_get_4xx_with_a_message(tokenizer):
    seen = {}

    async def body(ctx):
        url = ctx.openai_base_url("agent") + "/chat/completions"
        async with httpx.AsyncClient() as http:
            seen["json"] = await http.post(url, content=b'{"model": "m", "messages": [')
            seen["bytes"] = await http.post(url, content=b"\xff\xfe\x00")
            seen["array"] = await http.post(url, json=[1, 2])
            seen["no messages"] = await http.post(url, json={"model": "m"})
            seen["role"] = await http.post(url, json={"messages": [{"role": "robot"}]})
            seen["content"] = await http.post(url, json={"messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
            seen["tools"] = await http.post(url, json={"messages": USER, "tools": [{"x": 1}]})
            seen["stream"] = await http.post(url, json={"messages": USER, "stream": "yes"})
            seen["get"] = await http.get(url)
            seen["path"] = await http.post(url.replace("chat/completions", "embeddings"),
                                           json={})
        return 1.0

    engine = ScriptedEngine(tokenizer, [])
    traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    for name in ("json", "bytes", "array", "no messages", "role", "content", "tools", "stream"):
        assert seen[name].status_code == 400, name
    assert "not valid JSON" in _error(seen["json"])["message"]
    assert "JSON object" in _error(seen["array"])["message"]
    assert _error(seen["no messages"])["param"] == "messages"
    assert _error(seen["role"])["param"] == "messages[0].role"
    assert _error(seen["content"])["param"] == "messages[0].content"
    assert _error(seen["tools"])["param"] == "tools[0]"
    assert _error(seen["stream"])["param"] == "stream"
    assert seen["get"].status_code == 405
    assert seen["path"].status_code == 404 and "chat/completions" in _error(seen["path"])["message"]
    assert engine.consumed == []


def test_a_client_that_calls_after_its_episode_ended_gets_an_error_at_once(tokenizer):
    kept = {}

    async def body(ctx):
        kept["url"] = ctx.openai_base_url("agent")
        kept["client"] = ctx.openai_client("agent")
        await kept["client"].chat.completions.create(model="m", messages=USER)
        return 1.0

    traj = _play(body, ScriptedEngine(tokenizer, ["hi"]), tokenizer)
    assert traj.ok, traj.error and len(traj.turns) == 1

    async def late():
        fresh = openai.AsyncOpenAI(base_url=kept["url"], api_key="k", max_retries=0)
        errors = []
        try:
            for client in (fresh, kept["client"]):
                try:
                    await client.chat.completions.create(model="m", messages=USER)
                except (openai.OpenAIError, RuntimeError) as error:
                    errors.append(error)
        finally:
            await fresh.close()
        return errors

    start = time.monotonic()
    errors = asyncio.run(asyncio.wait_for(late(), 10))
    assert time.monotonic() - start < 5
    gone, closed = errors
    assert isinstance(gone, openai.APIStatusError) and gone.status_code == 410
    assert "has ended" in gone.message
    assert closed is not None  # the episode's own client was closed with it


def test_a_call_in_flight_when_the_episode_ends_is_answered_410(tokenizer):
    class Hanging:
        async def generate(self, request):
            await asyncio.Event().wait()

    answered = {}

    async def body(ctx):
        url = ctx.openai_base_url("agent") + "/chat/completions"

        async def call():
            async with httpx.AsyncClient() as http:
                answered["late"] = await http.post(url, json={"messages": USER})

        answered["task"] = asyncio.get_running_loop().create_task(call())
        await asyncio.sleep(0.5)  # the request reaches the engine, which never answers
        return 1.0

    async def main():
        traj = await ab.play_episode(Agent(body), {"agent": Handle("p", tokenizer, Hanging())}, {})
        await asyncio.wait_for(answered["task"], 5)
        return traj

    traj = asyncio.run(main())
    assert traj.ok, traj.error
    assert answered["late"].status_code == 410


# -- what it does ------------------------------------------------------------------------------
async def _tool_loop(client, tools=(ADD, MUL), **options):
    """A plain OpenAI agent loop: call, run the tools it asked for, send the results back."""
    messages = list(USER)
    answers = []
    for _ in range(3):
        answer = await client.chat.completions.create(model="m", messages=messages,
                                                      tools=list(tools), max_tokens=64, **options)
        answers.append(answer)
        message = answer.choices[0].message
        messages.append(message)  # the message object as it came back
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            result = args["a"] + args["b"] if call.function.name == "add" else args["a"] * args["b"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        if not message.tool_calls:
            break
    return answers


def test_a_three_turn_tool_conversation_keeps_the_sampled_tokens(tokenizer):
    answers = []

    async def body(ctx):
        answers.extend(await _tool_loop(ctx.openai_client("agent"), logprobs=True))
        return float(answers[-1].choices[0].message.content == "20")

    engine = ScriptedEngine(tokenizer, [CALL.format("add", 2, 3), CALL.format("mul", 5, 4), "20"])
    traj = _play(body, engine, tokenizer)
    assert traj.ok and traj.rewards == {"agent": 1.0}, traj.error
    first, second, third = (a.choices[0] for a in answers)
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in
            first.message.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert second.message.tool_calls[0].function.name == "mul"
    assert third.finish_reason == "stop" and third.message.tool_calls is None
    assert first.message.tool_calls[0].id != second.message.tool_calls[0].id
    # what the engine consumed at each turn is exactly what was recorded
    assert [t.generation.prompt_ids for t in traj.turns] == engine.consumed
    assert len(traj.turns) == 3
    for before, after in zip(traj.turns, traj.turns[1:], strict=False):
        kept = before.generation.prompt_ids + before.generation.completion_ids
        assert after.generation.prompt_ids[: len(kept)] == kept
        new = tokenizer.decode(list(after.generation.prompt_ids[len(kept):]),
                               skip_special_tokens=False)
        assert "<tool_response>" in new
    assert traj.counts == {"retokenized": 0}
    # the agent's tool results, recorded between the turns as the episode's tool calls
    assert [(c.name, dict(c.args), c.result, c.position) for c in traj.tool_calls] == [
        ("add", {"a": 2, "b": 3}, "5", 1), ("mul", {"a": 5, "b": 4}, "20", 2)]
    from astranb.session.recorder import Episode

    steps = Episode.from_trajectory(traj, 0, 0, tokenizers={"p": tokenizer}).debugger().steps
    assert [s.kind for s in steps] == ["generate", "tool", "generate", "tool", "generate",
                                       "reward"]
    # logprobs in OpenAI's shape: the sampled tokens' own, stop token left out
    last = traj.turns[-1].generation
    entries = third.logprobs.content
    assert [e.logprob for e in entries] == list(last.logprobs[:-1])
    assert "".join(e.token for e in entries) == "20"
    assert answers[0].usage.prompt_tokens == len(traj.turns[0].generation.prompt_ids)


def test_the_official_client_drives_the_tiny_chat_model_for_three_turns(tokenizer):
    """The real engine: three calls, each answer sent back with a tool result or a user turn;
    the recorded ids are what the engine consumed, and each prompt extends the last."""
    from astranb.engines import HFEngine

    consumed = []

    async def body(ctx):
        client = ctx.openai_client("agent")
        messages = list(USER)
        for turn in range(3):
            answer = await client.chat.completions.create(
                model="m", messages=messages, tools=[ADD], max_tokens=12, temperature=1.0)
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            calls = message.tool_calls or []
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
            if not calls:
                messages.append({"role": "user", "content": f"go on ({turn})"})
        return 1.0

    async def play():
        with HFEngine(SPEC, max_batch_size=2, seed=1) as engine:
            real_generate = engine.generate

            async def spy(request):
                consumed.append(request.prompt_ids)
                return await real_generate(request)

            engine.generate = spy
            return await ab.play_episode(Agent(body), {"agent": Handle("p", tokenizer, engine)},
                                         {})

    traj = asyncio.run(play())
    assert traj.ok, traj.error
    assert [t.generation.prompt_ids for t in traj.turns] == consumed and len(consumed) == 3
    for before, after in zip(traj.turns, traj.turns[1:], strict=False):
        kept = before.generation.prompt_ids + before.generation.completion_ids
        assert after.generation.prompt_ids[: len(kept)] == kept
    assert traj.counts == {"retokenized": 0}
    assert all(len(t.generation.versions) == len(t.generation.completion_ids) for t in traj.turns)


def test_streaming_returns_what_the_plain_call_returns(tokenizer):
    texts = [CALL.format("add", 2, 3), "the sum is 5"]

    async def body(ctx, stream):
        client = ctx.openai_client("agent")
        messages = list(USER)
        out = []
        for _ in texts:
            if not stream:
                answer = await client.chat.completions.create(model="m", messages=messages,
                                                              tools=[ADD], max_tokens=64)
                message = answer.choices[0].message.model_dump(exclude_none=True)
                out.append((message, answer.choices[0].finish_reason, answer.usage.total_tokens))
            else:
                events = await client.chat.completions.create(
                    model="m", messages=messages, tools=[ADD], max_tokens=64, stream=True,
                    stream_options={"include_usage": True})
                content, calls, finish, usage = "", {}, None, None
                async for chunk in events:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        for call in choice.delta.tool_calls or []:
                            calls.setdefault(call.index, call.model_dump(exclude_none=True))
                        finish = choice.finish_reason or finish
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                             for c in calls.values()]
                message = {k: v for k, v in message.items() if v is not None}
                out.append((message, finish, usage.total_tokens))
            messages.append(message)
            messages.append({"role": "tool", "tool_call_id": "call_0_0", "content": "5"})
        return out

    results = {}
    for stream in (False, True):
        async def run(ctx, stream=stream):
            results[stream] = await body(ctx, stream)
            return 1.0

        traj = _play(run, ScriptedEngine(tokenizer, list(texts)), tokenizer)
        assert traj.ok, traj.error
        assert traj.counts == {"retokenized": 0}  # the streamed message extends as well
    assert results[True] == results[False]
    assert results[True][0][1] == "tool_calls" and results[True][1][0]["content"] == "the sum is 5"


def test_messages_that_do_not_extend_are_tokenized_afresh_and_counted(tokenizer):
    async def body(ctx):
        client = ctx.openai_client("agent")
        messages = list(USER)
        answer = await client.chat.completions.create(model="m", messages=messages)
        text = answer.choices[0].message.content
        messages.append({"role": "assistant", "content": text + " (edited)"})
        messages.append({"role": "user", "content": "and then?"})
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0

    engine = ScriptedEngine(tokenizer, ["first", "second"])
    with pytest.warns(RuntimeWarning, match="OpenAI-endpoint request changed an assistant"):
        traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    first, second = traj.turns
    kept = first.generation.prompt_ids + first.generation.completion_ids
    assert second.generation.prompt_ids[: len(kept)] != kept
    assert "(edited)" in tokenizer.decode(list(second.generation.prompt_ids))
    assert traj.counts == {"retokenized": 1}
    assert [t.generation.prompt_ids for t in traj.turns] == engine.consumed


def test_n_choices_stop_strings_and_the_context_limit(tokenizer):
    seen = {}

    async def body(ctx):
        client = ctx.openai_client("agent")
        seen["n"] = await client.chat.completions.create(model="m", messages=USER, n=2)
        # the agent goes on from the second choice: its tokens are the ones kept
        picked = [*USER, seen["n"].choices[1].message, {"role": "user", "content": "more"}]
        seen["on"] = await client.chat.completions.create(model="m", messages=picked)
        seen["stop"] = await client.chat.completions.create(model="m", messages=USER,
                                                            stop=".")
        try:
            await client.chat.completions.create(model="m", messages=USER * 40)
        except openai.BadRequestError as error:
            seen["long"] = error
        return 1.0

    engine = ScriptedEngine(tokenizer, ["one", "two", "three", "a. b"])
    traj = _play(body, engine, tokenizer, max_context=200)
    assert [c.message.content for c in seen["n"].choices] == ["one", "two"]
    assert len(traj.turns) == 4  # each choice a turn of its own, then two more calls
    second = traj.turns[1].generation
    kept = second.prompt_ids + second.completion_ids
    assert traj.turns[2].generation.prompt_ids[: len(kept)] == kept
    assert traj.counts["retokenized"] == 0
    # the scripted engine does not stop on "." (it ignores stop ids); a real one ends there
    assert traj.turns[3].sampling.stop_token_ids[-2:] == (22, tokenizer.eos_token_id)
    assert seen["long"].code == "context_length_exceeded"
    assert traj.truncated is not None and traj.truncated.startswith("context")


def test_stop_ends_the_returned_text_before_the_stop_token(tokenizer):
    class Stops(ScriptedEngine):
        async def generate(self, request):
            generation = await super().generate(request)
            ids = generation.completion_ids
            cut = next(i for i, t in enumerate(ids) if t in request.sampling.stop_token_ids)
            return Generation(generation.prompt_ids, ids[: cut + 1], generation.logprobs[: cut + 1],
                              generation.versions[: cut + 1], "stop")

    seen = {}

    async def body(ctx):
        client = ctx.openai_client("agent")
        seen["answer"] = await client.chat.completions.create(model="m", messages=USER, stop=".")
        return 1.0

    traj = _play(body, Stops(tokenizer, ["a. b"]), tokenizer)
    assert traj.ok, traj.error
    assert seen["answer"].choices[0].message.content == "a"
    assert tokenizer.decode(list(traj.turns[0].generation.completion_ids)) == "a."


class OpenAIToolAgent(ab.Environment):
    """ChatTool's episode written against the OpenAI client: a call, the tool's result sent
    back, a second call; the reward is whether the reply holds the sum."""

    roles = ("agent",)
    sampling = ab.SamplingParams(max_new_tokens=8)

    def samples(self, seed=0):
        a = 1
        while True:
            a = a % 9 + 1
            yield {"a": a, "b": 10 - a}

    async def episode(self, ctx, sample):
        client = ctx.openai_client("agent")
        messages = [{"role": "user", "content": f"What is {sample['a']} + {sample['b']}?"}]
        first = await client.chat.completions.create(model="agent", messages=messages,
                                                     tools=[ADD])
        messages.append(first.choices[0].message)
        messages.append({"role": "tool", "tool_call_id": "call_0_0", "content": "10"})
        final = await client.chat.completions.create(model="agent", messages=messages,
                                                     tools=[ADD])
        text = final.choices[0].message.content or ""
        return float("10" in text) + 0.01 * text.count("a")


def test_a_session_trains_an_agent_written_against_the_openai_client(tmp_path):
    """On the Session's own loop: every episode's two calls are two turns whose tokens chain,
    and the policy trains on them."""
    with ab.Session(tmp_path, trainer="thread") as session:
        policy = session.policy("agent", ab.models.tiny_chat(),
                                algorithm=ab.GRPO(filter_groups=False))
        session.wire(OpenAIToolAgent(), agent=policy)
        run = session.train(steps=2, batch_size=4, group_size=2, max_staleness=1)
        run.wait(progress=False)
        episodes = [e for e in run.episodes if e.error is None]
        assert episodes and len(episodes) == len(run.episodes)
        for episode in episodes:
            first, second = episode.turns
            kept = first["prompt_ids"] + first["completion_ids"]
            assert second["prompt_ids"][: len(kept)] == kept
        assert run.metrics["count/retokenized"].sum() == 0
        assert len(run.metrics) == 2


@pytest.mark.slow  # a run over a rollout service
def test_the_agent_trains_the_same_on_a_rollout_service(tmp_path):
    """The episode plays on the service, so its endpoint lives in the service's process."""
    from astranb.services import rollout_app

    from .services import Switchable

    app = rollout_app.create_app(rollout_app.RolloutConfig(
        engine="hf", environments={"OpenAIToolAgent": f"{__name__}:OpenAIToolAgent"}))
    transport = Switchable(app)
    session = ab.Session(tmp_path, rollout=["http://r0"], transport=lambda url: transport)
    session.context.stack.enter_context(
        session.context.loop().wrap_async_context_manager(app.state.service.running()))
    with session:
        policy = session.policy("agent", ab.models.tiny_chat(),
                                algorithm=ab.GRPO(filter_groups=False))
        session.wire(OpenAIToolAgent(), agent=policy)
        run = session.train(steps=2, batch_size=4, group_size=2, max_staleness=1)
        run.wait(progress=False)
        episodes = [e for e in run.episodes if e.error is None]
        assert episodes and len(episodes) == len(run.episodes)
        for episode in episodes:
            first, second = episode.turns
            kept = first["prompt_ids"] + first["completion_ids"]
            assert second["prompt_ids"][: len(kept)] == kept
        assert app.state.service.slots["agent"].engine.version == 2


def test_an_engine_that_fails_is_a_500_with_its_message(tokenizer):
    class Broken:
        async def generate(self, request):
            raise RuntimeError("the decode thread died")

    seen = {}

    async def body(ctx):
        try:
            await ctx.openai_client("agent").chat.completions.create(model="m", messages=USER)
        except openai.InternalServerError as error:
            seen["error"] = error
        return 1.0

    traj = _play(body, Broken(), tokenizer)
    assert traj.ok, traj.error
    assert "RuntimeError: the decode thread died" in seen["error"].message


def test_text_completions_take_text_or_token_ids_and_stream_the_same(tokenizer):
    seen = {}
    ids = list(tokenizer.encode("2 + 3 ="))

    async def body(ctx):
        client = ctx.openai_client("agent")
        seen["text"] = await client.completions.create(model="m", prompt="2 + 3 =", logprobs=0)
        seen["ids"] = await client.completions.create(model="m", prompt=ids, max_tokens=4)
        events = await client.completions.create(model="m", prompt=ids, stream=True)
        seen["streamed"] = "".join([c.choices[0].text async for c in events if c.choices])
        for options, name in (({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"),
                              ({"prompt": ["a", "b"]}, "prompt")):
            try:
                await client.completions.create(**{"model": "m", "prompt": "x", **options})
            except openai.BadRequestError as error:
                seen[name] = error
        return 1.0

    engine = ScriptedEngine(tokenizer, [" 5", " 5", " 5"])
    traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    text = seen["text"].choices[0]
    assert text.text == " 5" and text.finish_reason == "stop"
    assert text.logprobs.token_logprobs == list(traj.turns[0].generation.logprobs[:-1])
    assert "".join(text.logprobs.tokens) == " 5"
    assert traj.turns[1].generation.prompt_ids == tuple(ids)  # token ids in, as they are
    assert traj.turns[0].generation.prompt_ids == tuple(ids)  # text: tokenized as ctx.generate
    assert seen["streamed"] == seen["ids"].choices[0].text == " 5"
    assert [t.generation.prompt_ids for t in traj.turns] == engine.consumed
    for name in ("echo", "logprobs", "prompt"):
        assert seen[name].body["param"] == name


def test_a_sub_agents_client_records_its_turns_as_the_sub_agents(tokenizer):
    async def child(ctx, question):
        client = ctx.openai_client("agent")
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}])
        return answer.choices[0].message.content

    seen = {}

    async def body(ctx):
        seen["children"] = await ctx.spawn(child, ["a?", "b?"])
        return 1.0

    traj = _play(body, ScriptedEngine(tokenizer, ["x", "y"]), tokenizer)
    assert traj.ok, traj.error
    assert sorted(seen["children"]) == ["x", "y"]
    assert sorted(t.agent for t in traj.turns) == ["0", "1"]


def test_a_synchronous_client_on_the_episodes_loop_gets_a_503_not_a_hang(tokenizer, monkeypatch):
    from astranb.environments import openai_endpoint

    monkeypatch.setattr(openai_endpoint, "BLOCKED_AFTER", 0.5)
    seen = {}

    async def body(ctx):
        client = openai.OpenAI(base_url=ctx.openai_base_url("agent"), api_key="k",
                               max_retries=0)
        try:
            client.chat.completions.create(model="m", messages=USER)  # blocks the loop
        except openai.APIStatusError as error:
            seen["error"] = error
        finally:
            client.close()
        return 1.0

    start = time.monotonic()
    engine = ScriptedEngine(tokenizer, ["never"])
    traj = _play(body, engine, tokenizer)
    assert traj.ok, traj.error
    assert time.monotonic() - start < 10
    assert seen["error"].status_code == 503 and "synchronous client" in seen["error"].message
    assert engine.consumed == [] and traj.turns == ()  # the call never ran, later either


def test_streaming_on_the_real_engine_returns_the_plain_answer(tokenizer):
    from astranb.engines import HFEngine

    seen = {}

    async def body(ctx):
        client = ctx.openai_client("agent")
        options = {"model": "m", "messages": USER, "max_tokens": 10, "temperature": 0.0,
                   "logprobs": True}
        plain = await client.chat.completions.create(**options)
        events = await client.chat.completions.create(**options, stream=True)
        chunks = [c async for c in events]
        seen["plain"] = plain.choices[0]
        seen["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks)
        seen["logprobs"] = [e.logprob for c in chunks if c.choices[0].logprobs
                            for e in c.choices[0].logprobs.content]
        return 1.0

    async def play():
        with HFEngine(SPEC, max_batch_size=2, seed=1) as engine:
            return await ab.play_episode(Agent(body), {"agent": Handle("p", tokenizer, engine)},
                                         {})

    traj = asyncio.run(play())
    assert traj.ok, traj.error
    plain = seen["plain"]
    assert plain.message.content and seen["streamed"] == plain.message.content
    # the second call reuses the first one's kept prompt keys/values (the engine's prefix
    # reuse): the same tokens, logprobs equal within float tolerance
    assert seen["logprobs"] == pytest.approx([e.logprob for e in plain.logprobs.content],
                                             abs=1e-4)
    assert traj.turns[0].generation.completion_ids == traj.turns[1].generation.completion_ids


def test_answers_do_not_wait_on_delayed_acks(tokenizer):
    """Without TCP_NODELAY on the server's sockets every answer took ~40 ms on loopback."""
    took = []

    async def body(ctx):
        url = ctx.openai_base_url("agent") + "/models"
        async with httpx.AsyncClient() as http:
            for _ in range(15):
                start = time.perf_counter()
                answer = await http.get(url)
                took.append(time.perf_counter() - start)
        return float(answer.json()["data"][0]["id"] == "p")

    traj = _play(body, ScriptedEngine(tokenizer, []), tokenizer)
    assert traj.ok and traj.rewards == {"agent": 1.0}, traj.error
    assert sorted(took)[len(took) // 2] < 0.035


def test_a_new_client_per_episode_does_not_probe_the_platform_again(tokenizer, monkeypatch):
    """ctx.openai_client hands each episode's new client the platform probed once, so no
    episode pays the SDK's thread hop for it; the requests still carry the SDK's headers."""
    import openai._base_client as sdk

    from astranb.environments import base

    probes = []
    real = sdk.get_platform

    def counted():
        probes.append(1)
        return real()

    monkeypatch.setattr(sdk, "get_platform", counted)
    monkeypatch.setattr(base, "_PLATFORM", [])
    seen = []

    async def body(ctx):
        client = ctx.openai_client("agent")
        assert client._platform is not None  # before its first request
        answer = await client.chat.completions.with_raw_response.create(model="m",
                                                                         messages=USER)
        seen.append(answer.http_request.headers.get("x-stainless-os"))
        return 1.0

    for _ in range(3):
        traj = _play(body, ScriptedEngine(tokenizer, ["four"]), tokenizer)
        assert traj.ok, traj.error
    assert len(probes) == 1
    assert seen == [str(real())] * 3
