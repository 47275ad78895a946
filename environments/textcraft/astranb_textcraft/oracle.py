"""A scripted player that knows the recipes: the optimal policy tests and benchmarks run.

`oracle_reply(world, conversation)` reads one agent's conversation (its first "Task: craft
{...}" and its last "Inventory: {...}") and answers the action that plan says comes next:
craft the first missing step, or finish when the targets are in the inventory. With
`spawn=True`, an agent with several targets that has not spawned yet starts one sub-agent per
target first. `oracle_policy(world)` wraps it as a policy whose engine answers with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .world import World

__all__ = ["oracle_reply", "oracle_policy", "scripted_policy", "ScriptedEngine"]

_TASK = re.compile(r"Task: craft (\{.*?\})\.")
_INVENTORY = re.compile(r"Inventory: (\{.*?\})")


def oracle_reply(world: World, conversation: str, *, spawn: bool = False) -> str:
    tasks = _TASK.findall(conversation)
    if not tasks:
        return "I do not see a task."
    targets = json.loads(tasks[-1])  # the agent's own task (a child's prompt has only its own)
    inventory = json.loads(_INVENTORY.findall(conversation)[-1])
    if spawn and len(targets) > 1 and "sub-agent 0" not in conversation:
        subtasks = [{"targets": {item: n}, "max_steps": 12} for item, n in targets.items()]
        return f'<action type="spawn">{json.dumps({"subtasks": subtasks})}</action>'
    steps, _ = world.plan(targets, have=inventory)
    if not steps:
        return '<action type="finish">{"message": "done"}</action>'
    item, times = steps[0]
    return f'<action type="craft">{json.dumps({"target": item, "count": times})}</action>'


class ScriptedEngine:
    """A rollout engine that answers each prompt with `reply(prompt text)` and EOS, on the tiny
    chat model's tokenizer: a scripted "model" for tests, benchmarks and demonstrations. It keeps
    every prompt it saw (`prompts`) and stamps its tokens with `version`.

    `max_context` stands in for the model's context: a TextCraft conversation with many steps
    outgrows the tiny tokenizer's 1,024 tokens."""

    def __init__(self, reply: Callable[[str], str], *, version: int = 0,
                 max_context: int = 8192) -> None:
        import astranb as ab

        self.reply, self.version, self.max_context = reply, version, max_context
        self.tokenizer = ab.models.tiny_chat().tokenizer()
        self.prompts: list[str] = []

    async def generate(self, request: Any) -> Any:
        import astranb as ab

        tokenizer = self.tokenizer
        prompt = tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        self.prompts.append(prompt)
        ids = (*tokenizer.encode(self.reply(prompt), add_special_tokens=False),
               tokenizer.eos_token_id)
        return ab.Generation(request.prompt_ids, ids, (0.0,) * len(ids),
                             (self.version,) * len(ids), "stop",
                             text=tokenizer.decode(list(ids), skip_special_tokens=True))


def scripted_policy(name: str, reply: Callable[[str], str], *, version: int = 0) -> Any:
    """A policy (never trained) whose engine is a `ScriptedEngine` answering with `reply`."""
    import astranb as ab
    from astranb.weights.publish import StatePublisher

    engine = ScriptedEngine(reply, version=version)
    return ab.Policy(name, ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher(name, engine, None), engine.tokenizer)


def oracle_policy(world: World, *, spawn: bool = False, name: str = "oracle",
                  version: int = 0) -> Any:
    """A policy that plays `oracle_reply` on `world`: each agent's prompt is its own
    conversation, so the player reads that agent's task and inventory."""
    return scripted_policy(name, lambda prompt: oracle_reply(world, prompt, spawn=spawn),
                           version=version)
