"""On-policy distillation from a trained tiny teacher against RL from the same start, on CPU.

    .venv/bin/python bench/distill.py              # teacher, then 3 seeds of each: ~12 min
    .venv/bin/python bench/distill.py --seeds 1    # a smoke run

The task is the quickstart's (single-digit arithmetic, `ab.environments.load("arithmetic")`).

1. The teacher: `ab.models.tiny()` trained with the quickstart's settings (GRPO with
   entropy_coef=0.05, AdamW lr 1e-3, batch 128, groups of 8, max_staleness 2, `--teacher-steps`
   steps), evaluated on 512 held-out episodes, written with `policy.save_pretrained`.
2. Per seed, two students from the same start (`ab.models.tiny(seed=100 + seed)`), one after
   the other, same batch, learning rate and staleness:
   - RL: GRPO on the task's reward (astranb's defaults).
   - distill: `ab.Reference(model=ab.models.local(teacher), distill=1.0)` with
     `GRPO(filter_groups=False)` on the same environment with its reward replaced by 0, so the
     teacher's per-token logprobs are the only signal (on-policy distillation).
   Both evaluate on the task's held-out split every `--eval-every` versions (128 problems) and
   stop when a window reaches the teacher's score, or after `--steps` steps.

Reported: the teacher's score; per run the steps and seconds to it (None: not reached) and the
best window. Prints a markdown section for bench/RESULTS.md; writes results/distill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import astranb as ab

ROOT = Path(__file__).resolve().parents[1]
BATCH, GROUP, LR, STALENESS = 128, 8, 1e-3, 2


def arithmetic(scored: bool = True) -> ab.Environment:
    """The quickstart's task with a held-out "test" split (its samples from seed 10,000 on, as
    `session.evaluate` plays them); `scored=False` replaces every reward by 0, so that a
    teacher is a student's only signal."""
    base = type(ab.environments.load("arithmetic"))

    class Task(base):  # type: ignore[misc, valid-type]
        splits = ("train", "test")

        def split_samples(self, split, seed=0):
            return self.samples(10_000 + seed) if split == "test" else self.samples(seed)

        async def episode(self, ctx, sample):
            reward = await super().episode(ctx, sample)
            return reward if scored else 0.0

    return Task()


def teacher(workdir: Path, steps: int) -> tuple[Path, float, float]:
    """Train and save the teacher; (its folder, its held-out score, training seconds)."""
    with ab.Session(workdir / "teacher-runs") as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=LR))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        started = time.monotonic()
        session.train(steps=steps, batch_size=BATCH, group_size=GROUP,
                      max_staleness=STALENESS).wait(progress=False)
        seconds = time.monotonic() - started
        score = session.evaluate(n=512)["solver"]
        folder = policy.save_pretrained(workdir / "teacher")
    return folder, score, seconds


def student(workdir: Path, kind: str, seed: int, folder: Path, target: float, steps: int,
            every: int) -> dict[str, Any]:
    """One student run, stopped once an evaluation window reaches `target`."""
    with ab.Session(workdir / f"{kind}-{seed}") as session:
        model = ab.models.tiny(seed=100 + seed)
        if kind == "rl":
            policy = session.policy("solver", model=model, optimizer=ab.AdamWConfig(lr=LR))
            env = arithmetic()
        else:
            policy = session.policy(
                "solver", model=model, algorithm=ab.GRPO(filter_groups=False),
                optimizer=ab.AdamWConfig(lr=LR),
                reference=ab.Reference(model=ab.models.local(folder), distill=1.0))
            env = arithmetic(scored=False)
        session.wire(env, solver=policy)
        started = time.monotonic()
        run = session.train(steps=steps, batch_size=BATCH, group_size=GROUP,
                            max_staleness=STALENESS, eval_every=every, eval_n=128,
                            eval_env=arithmetic())
        reached: dict[str, Any] | None = None
        while not run.done and reached is None:
            time.sleep(0.5)
            reached = next((w for w in run.evaluation_rows if w["solver/avg@1"] >= target), None)
        run.stop()
        run.wait(progress=False)
        windows = run.evaluation_rows
        reached = reached or next((w for w in windows if w["solver/avg@1"] >= target), None)
    return {"kind": kind, "seed": seed, "steps": None if reached is None else reached["version"],
            "seconds": None if reached is None else reached["time"],
            "best": max((w["solver/avg@1"] for w in windows), default=float("nan")),
            "wall": time.monotonic() - started}


def report(results: dict[str, Any], load: tuple[float, ...]) -> str:
    lines = [f"## On-policy distillation against RL (bench/distill.py, {date.today()})", "",
             "```", f".venv/bin/python bench/distill.py --seeds {results['seeds']}", "```", "",
             f"2 cores, load average at the start {load[0]:.2f}. Teacher: "
             f"{results['teacher_steps']} quickstart steps in "
             f"{results['teacher_seconds']:.0f} s, held-out score "
             f"{results['target']:.3f} (512 episodes): the target of both students.", "",
             "| student | seed | steps to the teacher's score | seconds | best window |",
             "|---|---:|---:|---:|---:|"]
    for r in results["runs"]:
        steps = "not reached" if r["steps"] is None else str(r["steps"])
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {r['kind']} | {r['seed']} | {steps} | {seconds} | {r['best']:.3f} |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=600, help="most steps of a student")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "distill.json")
    args = parser.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="astranb-distill-") as tmp:
        folder, target, seconds = teacher(Path(tmp), args.teacher_steps)
        print(f"teacher: {target:.3f} after {seconds:.0f} s", flush=True)
        runs = []
        for seed in range(args.seeds):
            for kind in ("rl", "distill"):
                runs.append(student(Path(tmp), kind, seed, folder, target, args.steps,
                                    args.eval_every))
                print(json.dumps(runs[-1]), flush=True)
    results = {"seeds": args.seeds, "teacher_steps": args.teacher_steps,
               "teacher_seconds": seconds, "target": target, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results, load))


if __name__ == "__main__":
    main()
