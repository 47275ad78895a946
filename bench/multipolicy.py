"""Two policies on one workload: astranb's asynchronous run beside a synchronous, verl-style loop.

    .venv/bin/python bench/multipolicy.py               # 100 steps per arm: 3-5 min on 2 cores
    .venv/bin/python bench/multipolicy.py --fixed-work  # same, every step one batch of rollouts
    .venv/bin/python bench/multipolicy.py --quick       # smoke test: 3 steps of batch 16

Workload: the actor_verifier environment (a solver answers a single-digit sum, a verifier says
y/n, a rejected solver retries once), a tiny model per role, GRPO, batch 128 in groups of 8.

- astranb: `session.train(mode="independent", max_staleness=2)`: rollouts keep going while each
  policy trains, each policy steps as soon as its own batch is ready.
- sync (verl-style), written here from astranb's pieces, NOT astranb's scheduler: roll out with
  the current weights until every policy has a full batch of groups it can learn from (the same
  rule as astranb's: groups without reward spread are skipped when the policy filters them),
  then train the solver, then the verifier, one after the other, then publish both. Nothing
  overlaps. (`Session.train(max_staleness=0, mode="barrier")` is not this loop: it still trains
  the two policies concurrently and keeps rollouts of the other policy going.)

Prints seconds per step for each arm and their ratio, the sync loop's rollout / train / publish
split and the ideal overlap bound it implies (what a perfect pipeline would save if rollouts and
training did not share the cores), and each role's own reward: mean over the episodes played by
the first and the last 10% of weight versions, and an evaluation of the final weights.

By default the solver skips groups without reward spread (as in notebook 02), so how many
rollouts a step needs depends on how the solver is doing at that moment, in each arm: the
per-step ratio then mixes scheduling with learning dynamics. `--fixed-work` keeps every group
for both policies, so each step of either arm trains on exactly one batch of rollouts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from astranb_actor_verifier import early_late, role_rewards

import astranb as ab
from astranb.dataflow.batcher import build_batch, has_signal_for, policy_reward  # internals
from astranb.dataflow.buffer import Group  # internal

ROLES = ("solver", "verifier")


# -- the workload ------------------------------------------------------------------------------

def build(directory: Path, args, torch_threads: int | None) -> tuple[ab.Session, ab.Environment]:
    """A session with one tiny policy per role, wired to actor_verifier (as notebook 02)."""
    session = ab.Session(directory, torch_threads=torch_threads)
    algorithms = {
        "solver": ab.GRPO(entropy_coef=0.05, filter_groups=not args.fixed_work),
        # the verifier's groups often all earn the same reward; filtering them starves its steps
        "verifier": ab.GRPO(entropy_coef=0.0, filter_groups=False),
    }
    policies = {role: session.policy(role, model=ab.models.tiny(), algorithm=algorithms[role],
                                     optimizer=ab.AdamWConfig(lr=args.lr)) for role in ROLES}
    env = ab.environments.load("actor_verifier", max_value=args.max_value)
    session.wire(env, **policies)
    return session, env


# -- arm 1: astranb, asynchronous --------------------------------------------------------------

def run_astranb(args) -> dict:
    session, _ = build(Path(tempfile.mkdtemp(prefix="astranb-mp-async-")), args, None)
    with session:
        start = time.monotonic()
        run = session.train(steps=args.steps, batch_size=args.batch_size, group_size=8,
                            max_staleness=args.max_staleness, mode="independent", seed=args.seed)
        run.wait(progress=False)
        seconds = time.monotonic() - start
        table = role_rewards(run.episodes)
        final = session.evaluate(n=args.eval_episodes)
        df = run.metrics
    return {"seconds": seconds, "episodes": len(run.episodes), "table": table, "eval": final,
            "staleness_max": int(df["staleness_max"].max())}


# -- arm 2: synchronous, verl-style ------------------------------------------------------------

@dataclass
class Phases:
    """Seconds the sync loop spent per phase, summed over steps."""

    rollout: float = 0.0
    train: dict[str, float] = field(default_factory=lambda: {r: 0.0 for r in ROLES})
    publish: float = 0.0


def run_sync(args) -> dict:
    threads = os.cpu_count() or 2  # nothing overlaps here, so it may use every core
    session, env = build(Path(tempfile.mkdtemp(prefix="astranb-mp-sync-")), args, threads)
    with session:
        policies = {role: session.policies[role] for role in ROLES}
        phases, rows = Phases(), []
        start = time.monotonic()
        anyio.run(sync_loop, env, policies, args, phases, rows)
        seconds = time.monotonic() - start
        final = session.evaluate(n=args.eval_episodes)
    import pandas as pd

    return {"seconds": seconds, "episodes": len(rows) // len(ROLES), "phases": phases,
            "table": pd.DataFrame(rows), "eval": final, "threads": threads}


async def sync_loop(env, policies: Mapping[str, ab.Policy], args, phases: Phases,
                    rows: list[dict]) -> None:
    """Roll out a batch, train each policy in turn, publish; repeat."""
    samples = iter(env.samples(args.seed))
    groups_per_batch = args.batch_size // 8
    for step in range(args.steps):
        t0 = time.monotonic()
        batches = await fill_batches(env, policies, samples, groups_per_batch, step, rows)
        t1 = time.monotonic()
        for role, policy in policies.items():
            t = time.monotonic()
            batch = build_batch(batches[role], policy.name, policy.algorithm, _pad(policy))
            await policy.train_step(batch)
            phases.train[role] += time.monotonic() - t
        t2 = time.monotonic()
        for policy in policies.values():
            await policy.publish()
        phases.rollout += t1 - t0
        phases.publish += time.monotonic() - t2


async def fill_batches(env, policies, samples: Iterator, groups_per_batch: int, version: int,
                       rows: list[dict]) -> dict[str, list[Group]]:
    """Play rounds of `groups_per_batch` groups until every policy has a full batch."""
    batches: dict[str, list[Group]] = {role: [] for role in policies}
    while any(len(b) < groups_per_batch for b in batches.values()):
        for group in await play_round(env, policies, samples, groups_per_batch, version, rows):
            for role, policy in policies.items():
                if len(batches[role]) < groups_per_batch and useful(group, policy):
                    batches[role].append(group)
    return batches


async def play_round(env, policies, samples: Iterator, groups: int, version: int,
                     rows: list[dict]) -> list[Group]:
    """`groups` samples x 8 episodes, all at once (the engine batches them)."""
    played: list[list[ab.Trajectory]] = [[] for _ in range(groups)]

    async def episode(g: int, sample) -> None:
        ctx = ab.EpisodeContext(env, policies)
        rewards = env.rewards_for(await env.episode(ctx, sample))
        played[g].append(ab.Trajectory(sample, tuple(ctx.turns), rewards, g))
        rows.extend({"role": r, "version": version, "reward": rewards[r]} for r in ROLES)

    async with anyio.create_task_group() as tg:
        for g in range(groups):
            sample = next(samples)
            for _ in range(8):
                tg.start_soon(episode, g, sample)
    return [Group(g, tuple(t), version, frozenset(turn.policy for traj in t for turn in traj.turns))
            for g, t in enumerate(played)]


def useful(group: Group, policy: ab.Policy) -> bool:
    """astranb's rule (Orchestrator._deliver): two scored episodes, and reward spread if the
    policy's algorithm filters groups."""
    scored = sum(policy_reward(t, policy.name) is not None for t in group.trajectories)
    return scored >= 2 and (not policy.algorithm.filter_groups
                            or has_signal_for(group, policy.name))


def _pad(policy: ab.Policy) -> int:
    tok = policy.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


# -- report ------------------------------------------------------------------------------------

def report(args, fast: dict, sync: dict) -> None:
    steps = args.steps
    per_fast, per_sync = fast["seconds"] / steps, sync["seconds"] / steps
    ph = sync["phases"]
    train = sum(ph.train.values())
    print(f"workload: actor_verifier(max_value={args.max_value}), 2 tiny policies, {steps} steps "
          f"of batch {args.batch_size} (groups of 8), lr {args.lr}, {os.cpu_count()} cores, "
          "solver groups "
          f"{'all kept' if args.fixed_work else 'filtered (no reward spread: skipped)'}")
    print(f"{'arm':28} {'s/step':>7} {'episodes':>9} {'solver early->late':>19} "
          f"{'verifier early->late':>21} {'eval solver':>11} {'eval verifier':>13}")
    for name, arm in ((f"astranb async (s={args.max_staleness})", fast),
                      (f"sync verl-style ({sync['threads']} thr)", sync)):
        split = early_late(arm["table"], steps)
        cells = [f"{split.loc[r, 'early']:.3f} -> {split.loc[r, 'late']:.3f}" for r in ROLES]
        print(f"{name:28} {arm['seconds'] / steps:7.3f} {arm['episodes']:9d} {cells[0]:>19} "
              f"{cells[1]:>21} {arm['eval']['solver']:11.3f} {arm['eval']['verifier']:13.3f}")
    print(f"async/sync wall-clock per step: {per_fast / per_sync:.2f}")
    print(f"sync per step: rollout {ph.rollout / steps:.3f} s, train solver "
          f"{ph.train['solver'] / steps:.3f} s + verifier {ph.train['verifier'] / steps:.3f} s, "
          f"publish {ph.publish / steps:.3f} s")
    work = ph.rollout + train + ph.publish
    pipelined = max(ph.rollout, train + ph.publish) / work
    parallel = max(ph.rollout, *ph.train.values(), ph.publish) / work
    print(f"ideal overlap bound (if overlapped work did not share cores): rollout || training "
          f"{pipelined:.2f} of sync time; rollout || solver || verifier {parallel:.2f}")
    print(f"episodes played per step: async {fast['episodes'] / steps:.0f}, sync "
          f"{sync['episodes'] / steps:.0f}; seconds per 1000 episodes: async "
          f"{1000 * fast['seconds'] / fast['episodes']:.2f}, sync "
          f"{1000 * sync['seconds'] / sync['episodes']:.2f}; astranb staleness max "
          f"{fast['staleness_max']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--max-value", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-episodes", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-work", action="store_true",
                        help="no group filtering for either policy: every step trains on exactly "
                             "one batch of rollouts in both arms (isolates the scheduling)")
    parser.add_argument("--quick", action="store_true", help="3 steps of batch 16 (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.eval_episodes = 3, 16, 16
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    fast = run_astranb(args)
    sync = run_sync(args)
    report(args, fast, sync)


if __name__ == "__main__":
    main()
