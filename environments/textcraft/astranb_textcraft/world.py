"""A crafting world generated from a seed: items, recipes as a DAG, base materials, tasks.

    world = World.generate(seed=0)
    task = world.task(rng, targets=2)           # {"targets": {"copper_gear": 2, ...}, ...}
    inventory = Inventory(task["inventory"])
    world.craft(inventory, "copper_gear", 1)    # -> None, or why it cannot

Items come in tiers: tier 0 are base materials (a task's starting inventory holds them), an item
of tier t is crafted from 1-3 ingredients of lower tiers, at least one of tier t-1, so the
recipes form a DAG whose depth is the number of tiers. A recipe makes `makes` units of its item
from the listed ingredient counts. The names are the project's own, built from word lists.

A task asks for target items and counts, gives exactly the base materials its plan consumes
(plus `spare` extra units of some) and a step budget: the plan's craft actions plus slack.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Recipe", "World", "Inventory"]

_MATERIALS = ("oak", "birch", "iron", "copper", "tin", "clay", "flint", "reed", "wool", "amber",
              "slate", "moss")
_FORMS = ("plank", "rod", "plate", "gear", "rope", "brick", "ring", "hinge", "panel", "spindle",
          "lantern", "crate", "frame", "wheel", "blade", "bucket")


@dataclass(frozen=True)
class Recipe:
    item: str
    makes: int
    ingredients: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        needs = ", ".join(f"{n} {name}" for name, n in self.ingredients)
        return f"{self.makes} {self.item} <- {needs}"


class Inventory(dict):
    """Item -> count (a dict, shared by reference between an agent and its sub-agents)."""

    def has(self, needs: Mapping[str, int]) -> bool:
        return all(self.get(item, 0) >= n for item, n in needs.items())

    def view(self) -> dict[str, int]:
        return {item: n for item, n in sorted(self.items()) if n > 0}


@dataclass
class World:
    recipes: dict[str, Recipe]
    base: tuple[str, ...]
    tiers: dict[str, int] = field(default_factory=dict)

    # -- generation -------------------------------------------------------------------------------
    @classmethod
    def generate(cls, seed: int = 0, base_items: int = 8, per_tier: int = 10,
                 tiers: int = 3) -> World:
        rng = random.Random(seed)
        names = [f"{m}_{f}" for m in _MATERIALS for f in _FORMS]
        rng.shuffle(names)
        base = tuple(f"raw_{m}" for m in rng.sample(_MATERIALS, base_items))
        tier_of = dict.fromkeys(base, 0)
        by_tier: list[list[str]] = [list(base)]
        recipes: dict[str, Recipe] = {}
        for t in range(1, tiers + 1):
            layer = []
            for _ in range(per_tier):
                item = names.pop()
                lower = [i for tier in by_tier for i in tier]
                parts = {rng.choice(by_tier[t - 1]): rng.randint(1, 3)}
                for _ in range(rng.randint(0, 2)):
                    parts.setdefault(rng.choice(lower), rng.randint(1, 2))
                recipes[item] = Recipe(item, rng.randint(1, 2), tuple(sorted(parts.items())))
                tier_of[item] = t
                layer.append(item)
            by_tier.append(layer)
        return cls(recipes, base, tier_of)

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, targets: Mapping[str, int], have: Mapping[str, int] | None = None
             ) -> tuple[list[tuple[str, int]], dict[str, int]]:
        """(craft actions in a valid order as (item, times), base units consumed) to reach
        `targets` from `have` (default: nothing but unlimited base materials)."""
        stock = dict(have or {})
        steps: list[tuple[str, int]] = []
        used: dict[str, int] = {}

        def need(item: str, n: int) -> None:
            short = n - stock.get(item, 0)
            if short <= 0:
                stock[item] = stock.get(item, 0) - n
                return
            if item not in self.recipes:  # base: taken from the supply
                used[item] = used.get(item, 0) + short
                stock[item] = stock.get(item, 0) + short - n
                return
            recipe = self.recipes[item]
            times = math.ceil(short / recipe.makes)
            for ingredient, k in recipe.ingredients:
                need(ingredient, k * times)
            steps.append((item, times))
            stock[item] = stock.get(item, 0) + times * recipe.makes - n

        for item, n in targets.items():
            need(item, n)
        return steps, used

    def task(self, rng: random.Random, targets: int = 1, spare: int = 1,
             slack: int = 4) -> dict[str, Any]:
        """A task: `targets` distinct crafted items (tier >= 2 first), the base materials its
        plan uses plus up to `spare` extra units of each, and a step budget."""
        crafted = sorted(self.recipes)
        high = [i for i in crafted if self.tiers[i] >= 2] or crafted
        chosen = rng.sample(high, min(targets, len(high)))
        wanted = {item: rng.randint(1, 2) for item in chosen}
        steps, used = self.plan(wanted)
        inventory = {item: n + rng.randint(0, spare) for item, n in used.items()}
        return {"targets": wanted, "inventory": inventory,
                "max_steps": len(steps) + len(wanted) + slack}

    # -- acting -----------------------------------------------------------------------------------
    def craft(self, inventory: Inventory, item: str, times: int = 1) -> str | None:
        """Craft `item` `times` times from the inventory; None, or why it cannot."""
        recipe = self.recipes.get(item)
        if recipe is None:
            return (f"{item} is a base material; it cannot be crafted" if item in self.base
                    else f"there is no item called {item}")
        if not isinstance(times, int) or times < 1 or times > 100:
            return "count must be a whole number from 1 to 100"
        needs = {name: n * times for name, n in recipe.ingredients}
        if not inventory.has(needs):
            missing = {name: n - inventory.get(name, 0) for name, n in needs.items()
                       if inventory.get(name, 0) < n}
            return f"not enough ingredients: missing {missing}"
        for name, n in needs.items():
            inventory[name] -= n
        inventory[item] = inventory.get(item, 0) + recipe.makes * times
        return None

    def info(self, items: list[str]) -> dict[str, str]:
        """What each named item is: its recipe, or that it is a base material."""
        out = {}
        for item in items[:10]:
            if item in self.recipes:
                out[item] = self.recipes[item].describe()
            elif item in self.base:
                out[item] = "base material (not craftable)"
            else:
                out[item] = "unknown item"
        return out
