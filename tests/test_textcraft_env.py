"""TextCraft and ctx.spawn: the generated world, actions and rewards against hand-made cases, a
scripted optimal player (with and without sub-agents), a random player, the spawn budgets, and
sub-agents' turns reaching the right policy's batch."""

from __future__ import annotations

import json
import random

import anyio
import pytest
from astranb_textcraft import (
    ActionError,
    Inventory,
    TextCraft,
    World,
    oracle_policy,
    read_action,
    score,
    scripted_policy,
)

import astranb as ab
from astranb.dataflow.batcher import build_batch
from astranb.dataflow.buffer import Group
from astranb.remote.serialize import trajectory_from_wire, trajectory_to_wire
from astranb.session.recorder import Episode
from tests.test_math_env import TOKENIZER


def policy(name, reply):
    """A scripted "model" answering each prompt with `reply(prompt text)`."""
    return scripted_policy(name, reply, version=3)


def oracle(env, name="p", spawn=False):
    return oracle_policy(env.world, spawn=spawn, name=name, version=3)


def play(env, sample, **wiring):
    return anyio.run(ab.play_episode, env, wiring, sample)


# -- the world ------------------------------------------------------------------------------------

def test_the_world_is_a_dag_generated_from_its_seed():
    world = World.generate(seed=5)
    assert World.generate(seed=5).recipes == world.recipes
    assert World.generate(seed=6).recipes != world.recipes
    for item, recipe in world.recipes.items():
        tiers = [world.tiers[name] for name, _ in recipe.ingredients]
        assert max(tiers) == world.tiers[item] - 1 and all(t < world.tiers[item] for t in tiers)


def test_every_generated_task_is_solvable_within_its_budget():
    world = World.generate(seed=1)
    rng = random.Random(0)
    for _ in range(50):
        task = world.task(rng, targets=2)
        inventory = Inventory(task["inventory"])
        steps, _ = world.plan(task["targets"], have=inventory)
        assert len(steps) + 1 <= task["max_steps"]
        for item, times in steps:
            assert world.craft(inventory, item, times) is None
        assert score(inventory, task["targets"]) == 1.0


def test_craft_says_why_it_cannot():
    world = World.generate(seed=1)
    item = next(iter(world.recipes))
    empty = Inventory()
    assert "not enough ingredients: missing" in world.craft(empty, item)
    assert world.craft(empty, "unobtainium") == "there is no item called unobtainium"
    assert "base material" in world.craft(empty, world.base[0])
    assert "whole number" in world.craft(empty, item, 0)
    assert empty == {}


@pytest.mark.parametrize("inventory, targets, expected", [
    ({"a": 2, "b": 1}, {"a": 2, "b": 1}, 1.0),     # right
    ({}, {"a": 2}, 0.0),                           # wrong
    ({"a": 1, "b": 5}, {"a": 2, "b": 1}, 0.75),    # partial: (1/2 + 1) / 2
    ({"a": 9}, {"a": 2}, 1.0),                     # more than asked
])
def test_score(inventory, targets, expected):
    assert score(inventory, targets) == expected


@pytest.mark.parametrize("reply, expected", [
    ('<action type="craft">{"target": "x", "count": 2}</action>',
     ("craft", {"target": "x", "count": 2})),
    ('<action type="view_inventory"></action>', ("view_inventory", {})),
    ('<think><action type="finish">{}</action></think><action type="get_info">'
     '{"items": ["x"]}</action>', ("get_info", {"items": ["x"]})),
])
def test_read_action(reply, expected):
    assert read_action(reply) == expected


@pytest.mark.parametrize("reply, error", [
    ("craft x", "no action"),
    ('<action type="dig">{}</action>', "unknown action type 'dig'"),
    ('<action type="craft">{target: x}</action>', "not JSON"),
    ('<action type="craft">[1]</action>', "must be a JSON object"),
])
def test_malformed_actions(reply, error):
    with pytest.raises(ActionError, match=error):
        read_action(reply)


# -- playing --------------------------------------------------------------------------------------

def test_the_scripted_optimal_player_solves_tasks_alone():
    env = TextCraft(seed=2, spawn=False, targets=2)
    tasks = [t for t, _ in zip(env.samples(seed=0), range(8), strict=False)]
    for task in tasks:
        trajectory = play(env, task, crafter=oracle(env))
        assert trajectory.rewards == {"crafter": 1.0}, trajectory.truncated
        assert trajectory.counts == {"retokenized": 0}
        assert all(t.agent == "" for t in trajectory.turns)


def test_the_scripted_player_solves_tasks_with_sub_agents_credited_to_their_role():
    env = TextCraft(seed=2, spawn=True, targets=2, spare=3, child_role="helper")
    assert env.roles == ("crafter", "helper")
    task = next(iter(env.samples(seed=0)))
    lead, helper = oracle(env, "lead", spawn=True), oracle(env, "helper", spawn=True)
    trajectory = play(env, task, crafter=lead, helper=helper)
    assert trajectory.rewards == {"crafter": 1.0, "helper": 1.0}, trajectory.error
    agents = {t.agent for t in trajectory.turns}
    assert agents == {"", "0", "1"}
    assert {t.role for t in trajectory.turns if t.agent} == {"helper"}
    assert {t.policy for t in trajectory.turns if t.agent} == {"helper"}
    assert {t.policy for t in trajectory.turns if not t.agent} == {"lead"}
    last = lead.engine.prompts[-1]
    assert "sub-agent 0" in last and "finished: 'done'" in last
    # each sub-agent's conversation holds its own task only
    child_tasks = [p for p in helper.engine.prompts if p.count("Task: craft") == 1]
    assert len(child_tasks) == len(helper.engine.prompts)
    # the helper policy's batch is built from the sub-agents' turns: one row per conversation
    group = Group(0, (trajectory,), 3, frozenset({"lead", "helper"}))
    helper_batch = build_batch([group], "helper", ab.GRPO(), TOKENIZER.pad_token_id or 0)
    lead_batch = build_batch([group], "lead", ab.GRPO(), TOKENIZER.pad_token_id or 0)
    assert helper_batch.input_ids_B_T.shape[0] == 2 and lead_batch.input_ids_B_T.shape[0] == 1
    assert set(helper_batch.versions_B_T[helper_batch.loss_mask_B_T > 0].tolist()) == {3}
    # the record and the debugger show the tree: who made each turn, at what depth
    episode = Episode.from_trajectory(trajectory, tokenizers={"lead": TOKENIZER,
                                                              "helper": TOKENIZER})
    assert "sub-agent 0: helper -> helper" in episode.render()
    assert Episode.from_json(episode.to_json()).turns == episode.turns
    html = episode.debugger().to_html()
    assert "sub-agent 1 (depth 1)" in html
    # rollout services send the tree over the wire
    back = trajectory_from_wire(json.loads(json.dumps(trajectory_to_wire(trajectory))))
    assert [t.agent for t in back.turns] == [t.agent for t in trajectory.turns]


def test_a_random_player_scores_near_zero():
    env = TextCraft(seed=3, spawn=False, targets=2)
    rng = random.Random(0)
    items = sorted(env.world.recipes)

    def random_action(prompt):
        kind = rng.choice(["craft", "craft", "view_inventory", "finish"])
        if kind == "craft":
            return f'<action type="craft">{{"target": "{rng.choice(items)}", "count": 1}}</action>'
        return f'<action type="{kind}">{{}}</action>'

    rewards = [play(env, task, crafter=policy("r", random_action)).rewards["crafter"]
               for task, _ in zip(env.samples(seed=1), range(20), strict=False)]
    assert sum(rewards) / len(rewards) < 0.15


def test_bad_actions_are_outcomes_not_crashes():
    env = TextCraft(seed=2, spawn=False, targets=1)
    task = next(iter(env.samples()))
    replies = iter(["no idea", '<action type="dig">{}</action>',
                    '<action type="craft">{"target": "nothing", "count": 1}</action>',
                    '<action type="spawn">{"subtasks": []}</action>'])
    trajectory = play(env, {**task, "max_steps": 4},
                      crafter=policy("p", lambda prompt: next(replies)))
    assert trajectory.error is None and trajectory.rewards == {"crafter": 0.0}
    assert trajectory.counts == {"retokenized": 0, "malformed_action": 3, "crafts_failed": 1,
                                 "out_of_steps": 1}


def test_spawn_past_the_depth_budget_is_refused_and_counted():
    env = TextCraft(seed=2, spawn=True, targets=1)  # max_spawn_depth 2
    task = next(iter(env.samples()))
    target = next(iter(task["targets"]))
    always_spawn = (f'<action type="spawn">{{"subtasks": [{{"targets": {{"{target}": 1}}, '
                    f'"max_steps": 5}}]}}</action>')
    p = policy("p", lambda prompt: always_spawn if "spawn refused" not in prompt
               else '<action type="finish">{}</action>')
    trajectory = play(env, {**task, "max_steps": 6}, crafter=p)
    assert trajectory.error is None
    assert trajectory.counts["spawn_refused"] >= 1
    assert max(t.agent.count(".") + 1 for t in trajectory.turns if t.agent) == 2  # depth 2
    assert any("past max_spawn_depth=2" in prompt for prompt in p.engine.prompts)


def test_the_turn_budget_covers_the_whole_tree():
    env = TextCraft(seed=2, spawn=True, targets=2, max_agent_turns=3)
    task = next(iter(env.samples()))
    trajectory = play(env, task, crafter=oracle(env, spawn=True))
    assert trajectory.truncated is not None and "max_agent_turns=3" in trajectory.truncated
    assert len(trajectory.turns) == 3


def test_loads_by_name_with_a_held_out_split():
    env = ab.environments.load("textcraft", seed=4, test_tasks=5)
    tests = list(env.split_samples("test"))
    assert len(tests) == 5 and tests == list(env.split_samples("test"))
