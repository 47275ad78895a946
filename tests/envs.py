"""Small environments for the tests (no dataset, no network)."""

from __future__ import annotations

import random

from astranb import Environment, SamplingParams


class CountA(Environment):
    """Reward = fraction of 'a' in an 8-token completion: varied rewards, long generations."""

    roles = ("solver",)

    def __init__(self, max_new_tokens: int = 8):
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens)

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            yield {"prompt": rng.choice(["ab=", "ba=", "aa=", "bb="])}

    async def episode(self, ctx, sample):
        out = await ctx.generate("solver", sample["prompt"])
        return out.text.count("a") / 8 + 0.01 * len(out.completion_ids)


class Flaky(CountA):
    """Raises in every episode whose sample index is odd-ish: failures mixed with successes."""

    def __init__(self, fail_every: int = 3):
        super().__init__()
        self.fail_every = fail_every
        self.calls = 0

    async def episode(self, ctx, sample):
        self.calls += 1
        if self.calls % self.fail_every == 0:
            raise ValueError("flaky environment: deliberate failure")
        return await super().episode(ctx, sample)


class AlwaysFails(CountA):
    async def episode(self, ctx, sample):
        await ctx.generate("solver", sample["prompt"])
        raise ValueError("broken reward function")


class TwoRoles(CountA):
    roles = ("solver", "verifier")


class SlowCountA(CountA):
    """CountA whose episodes also wait a little: keeps work in flight on rollout services."""

    def __init__(self, max_new_tokens: int = 8, delay: float = 0.1):
        super().__init__(max_new_tokens)
        self.delay = delay

    async def episode(self, ctx, sample):
        import anyio

        await anyio.sleep(self.delay)
        return await super().episode(ctx, sample)


class Duet(Environment):
    """Two roles that both generate: the solver is rewarded for 'a's, the verifier for 'b's.

    Prompts start with the role's own marker, so a test can tell whose turn a batch row is."""

    roles = ("solver", "verifier")
    sampling = SamplingParams(max_new_tokens=4)

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            yield {"topic": rng.choice("ab")}

    async def episode(self, ctx, sample):
        said = await ctx.generate("solver", f"s{sample['topic']}:")
        heard = await ctx.generate("verifier", f"v{said.text[:2]}:")
        return {"solver": said.text.count("a") / 4, "verifier": heard.text.count("b") / 4}


class OnlyB(CountA):
    """CountA with other prompts (tells which environment an episode came from)."""

    def samples(self, seed=0):
        while True:
            yield {"prompt": "zz="}


class ToolBetween(Environment):
    """Two generate turns with tool calls around them: turn 0, an async tool, turn 1 (whose
    prompt carries the tool's answer), a sync check. Reward: 1 when turn 1 starts with the
    sample's answer digit (the check tool's verdict), else 0."""

    roles = ("solver",)
    sampling = SamplingParams(max_new_tokens=3)

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            yield {"prompt": f"{a}+{b}=", "answer": a + b}

    async def episode(self, ctx, sample):
        first = await ctx.generate("solver", sample["prompt"])
        count = await ctx.tool("count_a", count_a, first.text)
        second = await ctx.generate("solver", f"{sample['prompt']}{count}=")
        right = await ctx.tool("check", starts_with, second.text, str(sample["answer"]))
        return 1.0 if right else 0.0


async def count_a(text: str) -> int:
    """An async tool: how many 'a' are in `text`."""
    return text.count("a")


def starts_with(text: str, prefix: str) -> bool:
    return text.startswith(prefix)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


class ChatTool(Environment):
    """Two chat turns around a tool call: the agent may call `add`; the result of `add` comes back
    as a tool message either way; the reward is whether its reply holds the sum ("a" counts a
    little, so an untrained model sees varied rewards)."""

    roles = ("agent",)
    sampling = SamplingParams(max_new_tokens=8)

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            yield {"a": rng.randint(1, 9), "b": rng.randint(1, 9)}

    async def episode(self, ctx, sample):
        a, b = sample["a"], sample["b"]
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
        first = await ctx.chat("agent", messages, tools=[add])
        await ctx.run_tools(messages, first, [add])
        total = await ctx.tool("add", add, a, b)
        messages.append({"role": "tool", "name": "add", "content": str(total)})
        final = await ctx.chat("agent", messages, tools=[add])
        return float(str(total) in final.content) + 0.01 * final.text.count("a")


class SpawnCountA(CountA):
    """CountA where the solver's first generation is followed by two sub-agents (role "helper")
    that generate too: one episode, three conversations, all of them trained."""

    roles = ("solver", "helper")

    async def episode(self, ctx, sample):
        first = await ctx.generate("solver", sample["prompt"])

        async def child(sub, prompt):
            out = await sub.generate("helper", prompt)
            return out.text.count("a") / 8

        helped = await ctx.spawn(child, [sample["prompt"], "a" + sample["prompt"]])
        return first.text.count("a") / 8 + sum(helped) / 2
