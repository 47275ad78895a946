"""`TextCraft`: craft target items from a recipe DAG, alone or with spawned sub-agents."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from astranb import Environment, SamplingParams
from astranb.environments.base import SpawnRefused

from .world import Inventory, World

__all__ = ["TextCraft", "read_action", "ActionError", "score"]

ACTIONS = ("get_info", "view_inventory", "craft", "spawn", "finish")
_ACTION = re.compile(r'<action\s+type\s*=\s*"([a-z_]+)"\s*>(.*?)</action>', re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)

SYSTEM_PROMPT = (
    "You craft items from recipes. Reply with exactly one action:\n"
    '<action type="get_info">{"items": ["item", ...]}</action> shows recipes\n'
    '<action type="view_inventory">{}</action>\n'
    '<action type="craft">{"target": "item", "count": 1}</action> runs a recipe count times\n'
    '<action type="finish">{"message": "..."}</action> when the targets are in the inventory')
SPAWN_LINE = (
    '\n<action type="spawn">{"subtasks": [{"targets": {"item": 1}, "max_steps": 5}]}</action> '
    "starts sub-agents that craft parts of the task from the same inventory; you see how each "
    "one finished")


class ActionError(ValueError):
    """A reply that is not one well-formed action (the model is told, the step is spent)."""


def read_action(reply: str) -> tuple[str, dict[str, Any]]:
    """(type, arguments) of the last <action type="...">{json}</action> of a reply."""
    found = _ACTION.findall(_THINK.sub("", reply))
    if not found:
        raise ActionError('no action; reply with <action type="...">{...}</action>')
    kind, body = found[-1]
    if kind not in ACTIONS:
        raise ActionError(f"unknown action type {kind!r}; the types are {list(ACTIONS)}")
    body = body.strip() or "{}"
    try:
        arguments = json.loads(body)
    except ValueError as error:
        raise ActionError(f"the arguments of {kind} are not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise ActionError(f"the arguments of {kind} must be a JSON object")
    return kind, arguments


def score(inventory: Mapping[str, int], targets: Mapping[str, int]) -> float:
    """The share of the targets the inventory holds: the mean over target items of
    min(1, have / wanted); 1.0 when every target is met."""
    if not targets:
        return 0.0
    return sum(min(1.0, inventory.get(item, 0) / n) for item, n in targets.items()) / len(targets)


class TextCraft(Environment):
    """Recursive crafting (AstraFlow's TextCraft recipe) in a world generated from a seed.

    An agent gets target items, a step budget and an inventory of base materials, and acts one
    action per turn (see SYSTEM_PROMPT): read recipes, look at the inventory, craft, finish;
    with `spawn=True` it may also start sub-agents on parts of the task (`ctx.spawn`). A
    sub-agent has its own conversation, targets and step budget (at most what its parent has
    left), shares its parent's inventory, may spawn in turn (up to `max_spawn_depth`), and ends
    with its own finish message, which its parent reads, with whether its targets are met.

    Reward: `score(final inventory, targets)`, 1.0 when every target is in the inventory, for
    every role (the episode's agent and its sub-agents play as a team). Counted:
    `malformed_action` (the agent is told what was wrong; the step is spent), `out_of_steps`,
    `spawn_refused`, `crafts_failed`.

    Args:
        seed: the world's seed (items and recipes).
        spawn: allow the spawn action.
        child_role: the role sub-agents generate as (wire another policy to it to train them
            apart); None: they use "crafter".
        targets: target items per task (1-3).
        test_tasks: tasks of the held-out "test" split.
        tiers, per_tier, base_items: the world's shape (World.generate).
        sampling: SamplingParams or a dict of its fields (default max_new_tokens=96).
    """

    max_spawn_depth = 2
    max_spawn_children = 4

    def __init__(self, *, seed: int = 0, spawn: bool = True, child_role: str | None = None,
                 targets: int = 2, test_tasks: int = 100, tiers: int = 3, per_tier: int = 10,
                 base_items: int = 8, spare: int = 1,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None, max_agent_turns: int | None = 200):
        if not 1 <= targets <= 3:
            raise ValueError(f"targets must be 1 to 3, got {targets}")
        self.world = World.generate(seed, base_items=base_items, per_tier=per_tier, tiers=tiers)
        self.seed, self.allow_spawn, self.targets, self.spare = seed, spawn, targets, spare
        self.child_role = child_role or "crafter"
        self.roles = ("crafter",) if child_role in (None, "crafter") else ("crafter", child_role)
        self.splits = ("train", "test")
        self.test_tasks = test_tasks
        self.sampling = SamplingParams.of(sampling, max_new_tokens=96)
        self.max_episode_tokens = max_episode_tokens
        self.max_agent_turns = max_agent_turns
        self.system_prompt = SYSTEM_PROMPT + (SPAWN_LINE if spawn else "")

    # -- tasks ------------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.split_samples("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Train: endless tasks from `seed`. Test: `test_tasks` fixed tasks (their own seed,
        the same for every run of this world)."""
        if split == "test":
            rng = random.Random(f"test-{self.seed}")
            for i in range(self.test_tasks):
                yield {**self.world.task(rng, self.targets, self.spare), "_index": i}
            return
        rng = random.Random(f"train-{self.seed}-{seed}")
        while True:
            yield self.world.task(rng, self.targets, self.spare)

    # -- an episode -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> dict[str, float]:
        inventory = Inventory(sample["inventory"])
        targets = dict(sample["targets"])
        await self.agent(ctx, {"targets": targets, "max_steps": int(sample["max_steps"]),
                               "inventory": inventory})
        reward = score(inventory, targets)
        return {role: reward for role in self.roles}

    async def agent(self, ctx: Any, job: Mapping[str, Any]) -> dict[str, Any]:
        """One agent (the episode's or a sub-agent) working on `job`: its targets, step budget
        and the shared inventory. Returns {"message", "finished", "met"}."""
        role = "crafter" if ctx.depth == 0 else self.child_role
        inventory: Inventory = job["inventory"]
        targets = job["targets"]
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": (
                        f"Task: craft {json.dumps(targets)}. You have {job['max_steps']} steps."
                        f"\nInventory: {json.dumps(inventory.view())}")}]
        for step in range(job["max_steps"]):
            reply = await ctx.chat(role, messages)
            left = job["max_steps"] - step - 1
            try:
                kind, arguments = read_action(reply.content)
                if kind == "finish":
                    return {"message": str(arguments.get("message", ""))[:500],
                            "finished": True, "met": score(inventory, targets) == 1.0}
                observation = await self._act(ctx, kind, arguments, inventory, left)
            except ActionError as error:
                ctx.count("malformed_action")
                observation = f"invalid action: {error}"
            messages.append({"role": "user", "content": (
                f"{observation}\nInventory: {json.dumps(inventory.view())}")})
        ctx.count("out_of_steps")
        return {"message": None, "finished": False, "met": score(inventory, targets) == 1.0}

    async def _act(self, ctx: Any, kind: str, arguments: Mapping[str, Any],
                   inventory: Inventory, left: int) -> str:
        if kind == "get_info":
            items = arguments.get("items")
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ActionError('get_info takes {"items": ["name", ...]}')
            return "Recipes: " + json.dumps(self.world.info(items))
        if kind == "view_inventory":
            return "Inventory viewed."
        if kind == "craft":
            target, count = arguments.get("target"), arguments.get("count", 1)
            if not isinstance(target, str) or not isinstance(count, int):
                raise ActionError('craft takes {"target": "name", "count": n}')
            problem = self.world.craft(inventory, target, count)
            if problem is not None:
                ctx.count("crafts_failed")
                return f"craft failed: {problem}"
            return f"Crafted {target} x{count}."
        # spawn
        if not self.allow_spawn:
            raise ActionError("spawn is not available in this task")
        subtasks = _subtasks(arguments, left)
        try:
            outcomes = await ctx.spawn(self.agent, [
                {"targets": sub["targets"], "max_steps": sub["max_steps"],
                 "inventory": inventory} for sub in subtasks])
        except SpawnRefused as refused:
            return f"spawn refused: {refused}"
        lines = []
        for i, (sub, outcome) in enumerate(zip(subtasks, outcomes, strict=True)):
            how = (f"finished: {outcome['message']!r}" if outcome["finished"]
                   else "ran out of steps")
            met = "met" if outcome["met"] else "not met"
            lines.append(f"sub-agent {i} ({json.dumps(sub['targets'])}) {how}; targets {met}")
        return "\n".join(lines)


def _subtasks(arguments: Mapping[str, Any], left: int) -> list[dict[str, Any]]:
    subtasks = arguments.get("subtasks")
    if not isinstance(subtasks, list) or not subtasks:
        raise ActionError('spawn takes {"subtasks": [{"targets": {...}, "max_steps": n}, ...]}')
    out = []
    for sub in subtasks:
        if not isinstance(sub, dict) or not isinstance(sub.get("targets"), dict):
            raise ActionError("each subtask needs targets: {item: count}")
        targets = sub["targets"]
        if not targets or not all(isinstance(k, str) and isinstance(v, int) and v > 0
                                  for k, v in targets.items()):
            raise ActionError("subtask targets map item names to positive counts")
        steps = sub.get("max_steps", left)
        if not isinstance(steps, int) or steps < 1:
            raise ActionError("a subtask's max_steps must be a positive whole number")
        out.append({"targets": targets, "max_steps": min(steps, max(left, 1))})
    return out
