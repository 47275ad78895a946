"""A scripted player that knows the recipes: the optimal policy tests and benchmarks run.

`oracle_reply(world, conversation)` reads one agent's conversation (its first "Task: craft
{...}" and its last "Inventory: {...}") and answers the action that plan says comes next:
craft the first missing step, or finish when the targets are in the inventory. With
`spawn=True`, an agent with several targets that has not spawned yet starts one sub-agent per
target first.
"""

from __future__ import annotations

import json
import re

from .world import World

__all__ = ["oracle_reply"]

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
