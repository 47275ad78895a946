"""Two reasoning-gym tasks learned by the quickstart's tiny model: held-out avg@1 before and after.

    .venv/bin/python bench/reasoning_gym_learning.py   # 2 tasks x 3 seeds, 3 min each
    .venv/bin/python bench/reasoning_gym_learning.py --minutes 1 --seeds 1   # a smoke run

Tasks (reasoning-gym 0.1.25, the `reasoning-gym` extra), both with reasoning-gym's own scorer:
- basic_arithmetic: two one-digit terms, + or -, no parentheses ("Calculate 5 - 7.", "-2");
- letter_counting: how many times a letter occurs in three to six words ("3").
Each trains on `--size` generated entries (600); the held-out split is reasoning-gym's entries from
another seed with every question that also occurs in training left out (the adapter's "test").

Model: `ab.models.tiny()` (~100K parameters, random init, a character tokenizer: a plain model,
so the prompt is the question followed by "Answer: " and the answer is the first line).
Warm start (the format, not the task): 40 supervised steps (`policy.sft`) on training questions
each paired with the gold answer of another, randomly drawn entry, so the model learns to answer
with one short line in the task's answer vocabulary and stop, while the pairing carries nothing
about which answer is right. Then RL with astranb's defaults (GRPO, the trainer in a child
process) for `--minutes` of wall time, batch 128 x group 8, 4 new tokens at most; held-out
avg@1 (temperature 1) on every test question before RL and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import astranb as ab

TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                         "operators": ("+", "-"), "allow_parentheses": False},
    "letter_counting": {"min_words": 3, "max_words": 6},
}
WARM_STEPS = 40


def run(task: str, seed: int, minutes: float, size: int, workdir: Path) -> dict[str, Any]:
    env = ab.environments.load("reasoning_gym", task=task, size=size, seed=seed, test_size=300,
                               config=TASKS[task], sampling={"max_new_tokens": 4})
    entries = [s for s, _ in zip(env.samples(seed), range(size), strict=False)]  # one epoch
    rng = random.Random(seed)
    golds = [str(e["answer"]) for e in entries]
    demos = [(str(env.prompt(e, False)), rng.choice(golds)) for e in entries]
    with ab.Session(workdir) as session:
        policy = session.policy("solver", ab.models.tiny(seed=seed))
        session.wire(env, solver=policy)
        policy.sft(demos, steps=WARM_STEPS, batch_size=64, lr=3e-3, seed=seed, progress=False)
        before = session.evaluate(env, split="test", n=300)["solver"]
        started = time.monotonic()
        train = session.train(steps=100_000, batch_size=128, group_size=8, max_staleness=2,
                              seed=seed)
        while not train.done and time.monotonic() - started < minutes * 60:
            time.sleep(1.0)
        train.stop()
        train.wait(progress=False)
        wall = time.monotonic() - started
        rows = train.rows
        after = session.evaluate(env, split="test", n=300)["solver"]
    env.close()
    tail = max(1, len(rows) // 10)
    return {"before": before.avg_at_k, "after": after.avg_at_k, "problems": before.n,
            "steps": len(rows), "wall": wall,
            "episodes_per_s": float(rows[-1]["episodes"]) / float(rows[-1]["time"])
            if rows else 0.0,
            "reward_last10": statistics.fmean(float(r["reward"]) for r in rows[-tail:]
                                              if r["reward"] == r["reward"]) if rows else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--size", type=int, default=600)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    args = parser.parse_args()
    begun = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in args.tasks}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for task in args.tasks:
                out = run(task, seed, args.minutes, args.size, Path(tmp) / f"{task}-{seed}")
                results[task].append(out)
                print(f"{task} seed {seed}: {out}", flush=True)
    load = os.getloadavg()
    command = "`.venv/bin/python bench/reasoning_gym_learning.py"
    command += "".join(f" --{k} {v}" for k, v in (("seeds", args.seeds),
                                                  ("minutes", args.minutes)))
    lines = [f"## reasoning-gym tasks learned on CPU (bench/reasoning_gym_learning.py, "
             f"{date.today().isoformat()})", "",
             f"{command}` ({(time.monotonic() - begun) / 60:.0f} min, load average "
             f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end; 2 cores). tiny() model, "
             f"{WARM_STEPS} supervised format steps (random gold answers), then "
             f"{args.minutes:g} min of RL with the defaults, batch 128 x group 8.", "",
             "| task | seed | held-out problems | avg@1 before | after | gain | RL steps | "
             "episodes/s |", "|---|---|---|---|---|---|---|---|"]
    for task, runs in results.items():
        for seed, r in enumerate(runs):
            lines.append(f"| {task} | {seed} | {r['problems']} | {r['before']:.3f} | "
                         f"{r['after']:.3f} | {r['after'] - r['before']:+.3f} | {r['steps']} | "
                         f"{r['episodes_per_s']:.0f} |")
    for task, runs in results.items():
        gains = [r["after"] - r["before"] for r in runs]
        lines.append("")
        lines.append(f"{task}: median gain {statistics.median(gains):+.3f} (target +0.2); "
                     f"{sum(g >= 0.2 for g in gains)} of {len(gains)} seeds reach it.")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
