"""Recursive TextCraft for LLM agents: crafting from a recipe DAG, with spawned sub-agents.

    from astranb_textcraft import TextCraft

    env = TextCraft(seed=0, spawn=True)                      # roles: crafter
    env = TextCraft(seed=0, child_role="helper")             # sub-agents train as "helper"
    session.wire(env, crafter=policy)

The world (items, recipes as a DAG, base materials, tasks) is generated locally from a seed
(`World.generate`). Actions follow AstraFlow's TextCraft protocol,
<action type="get_info|view_inventory|craft|spawn|finish">{json}</action>; spawn starts
sub-agents through `ctx.spawn`, each with its own conversation, targets and step budget, on the
same inventory. Reward: the share of the targets in the final inventory (1.0 when all are).
"""

from __future__ import annotations

from .env import ActionError, TextCraft, read_action, score
from .oracle import ScriptedEngine, oracle_policy, oracle_reply, scripted_policy
from .world import Inventory, Recipe, World

__all__ = ["TextCraft", "World", "Recipe", "Inventory", "ActionError", "read_action", "score",
           "oracle_reply", "oracle_policy", "scripted_policy", "ScriptedEngine"]
