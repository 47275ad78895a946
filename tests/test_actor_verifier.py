"""The actor_verifier environment: every path's rewards, the prompts each role sees, and which
policy each turn (and each trained row) belongs to. Scripted fakes stand in for the models."""

from __future__ import annotations

import itertools

import anyio
import pytest
from astranb_actor_verifier import (
    ActorVerifier,
    early_late,
    retry_prompt,
    role_rewards,
    verdict,
    verifier_prompt,
)

import astranb as ab
from astranb.dataflow.batcher import build_batch
from astranb.dataflow.buffer import Group
from astranb.weights.publish import StatePublisher

SAMPLE = {"prompt": "3+4=", "answer": 7}


class ScriptedCtx:
    """An episode context that answers each role from a script and records every call."""

    def __init__(self, **script: list[str]):
        self.script = {role: list(texts) for role, texts in script.items()}
        self.calls: list[tuple[str, str, dict]] = []

    async def generate(self, role, prompt, **sampling):
        self.calls.append((role, prompt, sampling))
        return ab.Generation((), (), (), (), "stop", text=self.script[role].pop(0))

    async def tool(self, name, fn, *args):
        return fn(*args)


def play(env, **script):
    ctx = ScriptedCtx(**script)
    rewards = anyio.run(env.episode, ctx, SAMPLE)
    return rewards, ctx.calls


# solver: 1 right first (and kept), 0.5 wrong first and fixed, else 0;
# verifier: 0.5 * judgement of the first answer + 0.5 * solver
@pytest.mark.parametrize(
    "solver, verifier, rewards",
    [
        (["7"], ["y"], {"solver": 1.0, "verifier": 1.0}),           # right, approved
        (["7", "7"], ["n"], {"solver": 1.0, "verifier": 0.5}),      # right, rejected, right again
        (["7", "5"], ["nno"], {"solver": 0.0, "verifier": 0.0}),    # right, rejected, gave in
        (["5"], ["y"], {"solver": 0.0, "verifier": 0.0}),           # wrong, approved: no retry
        (["5", "7"], ["n"], {"solver": 0.5, "verifier": 0.75}),     # wrong, rejected, fixed
        (["5", "6"], ["n+2"], {"solver": 0.0, "verifier": 0.5}),    # wrong, rejected, still wrong
        (["5", "7"], ["x"], {"solver": 0.5, "verifier": 0.25}),     # no verdict: a reject worth 0
        (["7", "7"], [""], {"solver": 1.0, "verifier": 0.5}),       # empty reply: same
    ],
)
def test_rewards_on_every_path(solver, verifier, rewards):
    got, calls = play(ActorVerifier(), solver=solver, verifier=verifier)
    assert got == rewards
    assert [role for role, _, _ in calls] == ["solver", "verifier", "solver"][: 1 + len(solver)]


# -- the reward rule against the lazy fixed point, by playing every problem -------------------

# Every problem of ActorVerifier() (ops "+", max_value 9): a + b = c with c <= 9, 55 of them.
PROBLEMS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10 - a)]


class PolicyCtx:
    """An episode context whose roles answer with functions of their prompt."""

    def __init__(self, **policies):
        self.policies = policies

    async def generate(self, role, prompt, **sampling):
        return ab.Generation((), (), (), (), "stop", text=self.policies[role](prompt))

    async def tool(self, name, fn, *args):
        return fn(*args)


def truth(problem):  # "3+4=" -> 7
    a, b = problem.split("=")[0].split("+")
    return int(a) + int(b)


def lazy_solver(prompt):      # wrong at first, right once it sees a reject ("3+4=5?n\n3+4=")
    problem = prompt.split("\n")[-1]
    return str(truth(problem)) if "?" in prompt else str((truth(problem) + 1) % 10)


def honest_solver(prompt):    # right every time
    return str(truth(prompt.split("\n")[-1]))


def reject_all(prompt):
    return "n"


def checker(prompt):          # "3+4=7?" -> "y", "3+4=5?" -> "n"
    problem, answer = prompt[:-1].split("=")
    return "y" if int(answer) == truth(problem + "=") else "n"


def expected_rewards(env, solver, verifier):
    """Each role's mean reward over every problem, from the environment's own episode()."""
    ctx = PolicyCtx(solver=solver, verifier=verifier)
    rewards = [anyio.run(env.episode, ctx, problem) for problem in PROBLEMS]
    return {role: sum(r[role] for r in rewards) / len(rewards) for role in env.roles}


def test_every_problem_is_in_the_samples():
    seen = {s["prompt"] for s in itertools.islice(ActorVerifier().samples(0), 3000)}
    assert len(PROBLEMS) == 55 and seen == {p["prompt"] for p in PROBLEMS}


def test_the_lazy_fixed_point_earns_less_than_honest_play_for_each_role():
    env = ActorVerifier()
    # (a) solver wrong first / right on the retry, verifier rejects all: every episode is
    # "wrong, rejected, fixed": solver 0.5; verifier 0.5 * 1 (right reject) + 0.5 * 0.5 = 0.75
    lazy = expected_rewards(env, lazy_solver, reject_all)
    # (b) solver right first, verifier checks (approves): solver 1; verifier 0.5 + 0.5 * 1 = 1
    honest = expected_rewards(env, honest_solver, checker)
    assert lazy == {"solver": 0.5, "verifier": 0.75}
    assert honest == {"solver": 1.0, "verifier": 1.0}
    assert all(lazy[role] < honest[role] for role in env.roles)
    # and (a) is no longer a resting point: against a verifier that rejects all, a solver that
    # answers right at once earns 1 ("right, rejected, right again"), twice the lazy one's 0.5;
    # a checking verifier does no worse than rejecting all against the lazy solver
    assert expected_rewards(env, honest_solver, reject_all)["solver"] == 1.0
    assert expected_rewards(env, lazy_solver, checker) == lazy


def test_the_old_rule_could_not_tell_the_lazy_fixed_point_from_honest_play():
    # the old rule is this one with a full reward for a fix and no team share: (a) and (b) tie
    old = ActorVerifier(retry_discount=1.0, team_weight=0.0)
    lazy = expected_rewards(old, lazy_solver, reject_all)
    assert lazy == expected_rewards(old, honest_solver, checker) == {"solver": 1.0,
                                                                      "verifier": 1.0}


def test_answers_are_read_like_arithmetic():
    # "7!" is 7 (a digit, then something else); "71" is not 7
    both, neither = {"solver": 1.0, "verifier": 1.0}, {"solver": 0.0, "verifier": 0.0}
    assert play(ActorVerifier(), solver=["7!"], verifier=["y"])[0] == both
    assert play(ActorVerifier(), solver=["71"], verifier=["y"])[0] == neither
    assert play(ActorVerifier(), solver=["71", "7"], verifier=["n"])[0] == {"solver": 0.5,
                                                                            "verifier": 0.75}


def test_prompts_each_role_sees():
    _, calls = play(ActorVerifier(reason_tokens=3), solver=["5", "7"], verifier=["nbig"])
    assert calls == [("solver", "3+4=", {}),
                     ("verifier", "3+4=5?", {"max_new_tokens": 4}),  # verdict + 3 characters
                     ("solver", "3+4=5?nbig\n3+4=", {})]
    assert verifier_prompt("1+1=", "2") == "1+1=2?"
    assert retry_prompt("1+1=", "3", "n") == "1+1=3?n\n1+1="


def test_verdict_only_at_first_character():
    assert verdict("y") == "y" and verdict("nope") == "n"
    assert verdict(" y") is None and verdict("") is None and verdict("Y") is None


def test_without_retry_first_answer_is_final():
    got, calls = play(ActorVerifier(retry=False), solver=["5"], verifier=["n"])
    assert got == {"solver": 0.0, "verifier": 0.5} and len(calls) == 2


def test_samples_are_small_seeded_sums():
    env = ActorVerifier()
    problems = [s for s, _ in zip(env.samples(seed=5), range(300), strict=False)]
    assert problems[:20] == [s for s, _ in zip(ActorVerifier().samples(seed=5), range(20),
                                               strict=False)]
    for s in problems:
        a, op, b, eq = s["prompt"]
        assert op == "+" and eq == "=" and int(a) + int(b) == s["answer"] <= 9
    small = [s["answer"] for s, _ in zip(ActorVerifier(max_value=3).samples(0), range(50),
                                         strict=False)]
    assert max(small) <= 3


def test_prompts_fit_the_tiny_vocabulary():
    tok = ab.models.tiny().tokenizer()
    text = retry_prompt("3+4=", "5", "n big")
    assert tok.decode(tok.encode(text)) == text
    assert tok.unk_token_id not in tok.encode(text)


def test_bad_arguments():
    with pytest.raises(ValueError, match="reason_tokens"):
        ActorVerifier(reason_tokens=-1)
    with pytest.raises(ValueError, match="ops must be"):
        ActorVerifier(ops="*")
    with pytest.raises(ValueError, match=r"retry_discount must be in \[0, 1\], got 1.5"):
        ActorVerifier(retry_discount=1.5)
    with pytest.raises(ValueError, match="team_weight must be in"):
        ActorVerifier(team_weight=-0.1)


def test_loads_by_name():
    env = ab.environments.load("actor_verifier", max_value=5)
    assert isinstance(env, ActorVerifier) and env.roles == ("solver", "verifier")
    assert "actor_verifier" in ab.environments.available()


# -- through the real EpisodeContext: turns are recorded with their role and policy ----------

class ScriptedEngine:
    """An engine that completes each prompt with the next scripted text (and a version)."""

    def __init__(self, tokenizer, texts, version):
        self.tokenizer, self.texts, self.version = tokenizer, list(texts), version

    async def generate(self, request):
        ids = tuple(self.tokenizer.encode(self.texts.pop(0)))
        return ab.Generation(request.prompt_ids, ids, (-1.0,) * len(ids),
                             (self.version,) * len(ids), "stop", text=self.tokenizer.decode(ids))


def scripted_policy(name, texts, version):
    spec = ab.models.tiny()
    tok = spec.tokenizer()
    engine = ScriptedEngine(tok, texts, version)
    return ab.Policy(name, spec, ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher(name, engine, None), tok)


def test_turns_roles_and_credit_assignment():
    env = ActorVerifier()
    # two episodes of one group: (wrong, rejected, fixed) and (right, approved)
    solver = scripted_policy("alice", ["5", "7", "7"], version=3)
    verifier = scripted_policy("bob", ["n", "y"], version=8)
    trajectories = []
    for i in range(2):
        ctx = ab.EpisodeContext(env, {"solver": solver, "verifier": verifier})
        rewards = env.rewards_for(anyio.run(env.episode, ctx, SAMPLE))
        trajectories.append(ab.Trajectory(SAMPLE, tuple(ctx.turns), rewards, 0, id=f"0.{i}"))
    assert [(t.role, t.policy) for t in trajectories[0].turns] == [
        ("solver", "alice"), ("verifier", "bob"), ("solver", "alice")]
    assert [(t.role, t.policy) for t in trajectories[1].turns] == [
        ("solver", "alice"), ("verifier", "bob")]
    assert trajectories[0].rewards == {"solver": 0.5, "verifier": 0.75}
    assert trajectories[1].rewards == {"solver": 1.0, "verifier": 1.0}
    group = Group(0, tuple(trajectories), 0, frozenset({"alice", "bob"}))
    tok = solver.tokenizer
    alice = build_batch([group], "alice", ab.GRPO(), tok.pad_token_id)
    bob = build_batch([group], "bob", ab.GRPO(), tok.pad_token_id)
    # own turns only: alice sampled "5", "7" and "7", bob "n" and "y" (one token each); a retry
    # whose prompt extends the first turn may share its row, so count sampled tokens, not rows
    assert alice.loss_mask_B_T.sum().item() == 3 and bob.loss_mask_B_T.sum().item() == 2
    assert set(alice.versions_B_T[alice.loss_mask_B_T > 0].tolist()) == {3}
    assert set(bob.versions_B_T[bob.loss_mask_B_T > 0].tolist()) == {8}
    first_prompt = tok.decode(alice.input_ids_B_T[0, :4].tolist())
    assert first_prompt == "3+4=" and tok.decode(bob.input_ids_B_T[0, :6].tolist()) == "3+4=5?"


def test_role_rewards_and_early_late():
    def episode(index, solver_version, verifier_version, rewards):
        turns = ({"role": "solver", "policy": "alice", "versions": [solver_version]},
                 {"role": "verifier", "policy": "bob",
                  "versions": [verifier_version, verifier_version + 1]})
        return ab.Episode(index, 0, SAMPLE, turns, rewards, None, 0)

    failed = ab.Episode(9, 0, SAMPLE, (), {}, "Traceback ...", 0)
    episodes = [episode(0, 0, 0, {"solver": 0.0, "verifier": 1.0}),
                episode(1, 9, 8, {"solver": 1.0, "verifier": 0.0}),
                episode(2, 10, 9, {"solver": 1.0, "verifier": 1.0}), failed]
    table = role_rewards(episodes)
    assert len(table) == 6
    assert table.query("episode == 1 and role == 'verifier'")["version"].item() == 8
    assert set(table.query("role == 'verifier'")["policy"]) == {"bob"}
    split = early_late(table, steps=10)  # first version 0, last versions 9 and 10
    assert split.loc["solver", "early"] == 0.0 and split.loc["solver", "late"] == 1.0
    assert split.loc["verifier", "early"] == 1.0 and split.loc["verifier", "late"] == 1.0
    assert split.loc["solver", "late_episodes"] == 2 and split.loc["verifier", "late_episodes"] == 1
