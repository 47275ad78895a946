"""Runs whose task gets learned: does the run keep its pace once nearly every group ties?

    .venv/bin/python bench/learned.py                   # each task and configuration once
    .venv/bin/python bench/learned.py --seeds 3 --cap 150   # three seeds: ~25 min on 2 cores
    .venv/bin/python bench/learned.py --only largest --configs defaults

Two tasks, each run in three configurations side by side in one process (`CONFIGS`:
astranb's defaults, the bound with the open-samples sampler, and no bound), seeds and
configurations interleaved so they share the machine's load:

    largest     `LargestDigit`: "max(a,b,c)=" -> the largest of three digits, one token, with
                `ab.models.tiny()`, GRPO(entropy_coef=0.05), AdamW lr 1e-3, batch 128, groups of
                8, max_staleness 2, 300 steps. The tiny model learns it (reward ~0.99 by step
                200), after which nearly every group's rewards tie: dynamic sampling
                (`filter_groups`) drops such groups, and without a bound the rollouts play ever
                more episodes to fill one batch.
    quickstart  notebooks/01_quickstart.ipynb's run (arithmetic, 600 steps, the same settings),
                then its held-out evaluation (512 episodes).

Reported per run: wall seconds of the first and the second half of the steps (largest) or
steps/s over the first half and the last 10% (quickstart), groups dropped by filter_groups,
episodes played, the reward over the last 10% of steps, the largest metrics row in bytes, and
the "learned" events. Prints a markdown section for bench/RESULTS.md and writes
results/learned.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import astranb as ab

ROOT = Path(__file__).resolve().parents[1]


class LargestDigit(ab.Environment):
    """Say the largest of three digits: "max(3,8,1)=" -> "8"; reward 1 for exactly that digit."""

    roles = ("solver",)
    sampling = ab.SamplingParams(max_new_tokens=1)

    def samples(self, seed: int = 0):
        rng = random.Random(seed)
        while True:
            a, b, c = (rng.randrange(10) for _ in range(3))
            yield {"prompt": f"max({a},{b},{c})=", "answer": str(max(a, b, c))}

    async def episode(self, ctx, sample):
        out = await ctx.generate("solver", sample["prompt"])
        return 1.0 if out.text.startswith(sample["answer"]) else 0.0


CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "open sampler": {"sampler": "open"},
    "unbounded": {"max_gen_batches": None},
}
"""`session.train` arguments of each configuration run side by side: astranb's defaults (the
bound, every sample played), the bound with the open-samples sampler, and no bound (dynamic
sampling as it was)."""


def train(env: ab.Environment, steps: int, cap: float, workdir: Path, seed: int,
          kw: dict[str, Any]) -> dict[str, Any]:
    """One run with the README's settings; stopped at `cap` wall seconds if it gets that far."""
    with ab.Session(workdir) as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3), seed=seed)
        session.wire(env, solver=policy)
        started = time.monotonic()
        run = session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2,
                            seed=seed, **kw)
        while not run.done and time.monotonic() - started < cap:
            time.sleep(0.5)
        capped = not run.done
        run.stop()
        run.wait(progress=False)
        wall = time.monotonic() - started
        rows = run.rows
        sizes = [len(line) for line in (run.directory / "metrics.jsonl").read_bytes()
                 .splitlines()]
        events = [e for e in run.events if e["kind"] == "learned"]
        evaluation = session.evaluate(n=512)["solver"]
    return {"rows": rows, "capped": capped, "wall": wall, "row_bytes_max": max(sizes, default=0),
            "learned": events, "final_eval": evaluation}


def _times(rows: list[dict[str, Any]]) -> list[float]:
    return [float(r["time"]) for r in rows]


def _mean(values: list[float]) -> float:
    """The mean of the numbers that are not NaN (a row without episodes has a NaN reward)."""
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def largest(cap: float, workdir: Path, seed: int, kw: dict[str, Any]) -> dict[str, Any]:
    out = train(LargestDigit(), 300, cap, workdir, seed, kw)
    rows, t = out["rows"], _times(out["rows"])
    half = len(rows) // 2
    first = t[half - 1] if half else float("nan")
    return {"steps": len(rows), "capped": out["capped"], "first_half_s": first,
            "second_half_s": t[-1] - first if rows else float("nan"),
            "filtered_groups": rows[-1]["filtered_groups"] if rows else 0,
            "episodes": rows[-1]["episodes"] if rows else 0,
            "reward_last10": _mean([r["reward"] for r in rows[-max(1, len(rows) // 10):]]),
            "final_eval": out["final_eval"], "row_bytes_max": out["row_bytes_max"],
            "learned_at_step": [e.get("step") for e in out["learned"]]}


def quickstart(cap: float, workdir: Path, seed: int, kw: dict[str, Any]) -> dict[str, Any]:
    env = ab.environments.load("arithmetic")
    out = train(env, 600, cap, workdir, seed, kw)
    rows, t = out["rows"], _times(out["rows"])
    n = len(rows)
    half, tail = n // 2, max(1, n // 10)
    first_rate = half / t[half - 1] if half else float("nan")
    last_rate = tail / (t[-1] - t[n - tail - 1]) if n > tail else float("nan")
    return {"steps": n, "capped": out["capped"], "train_s": t[-1] if t else float("nan"),
            "steps_per_s_first_half": first_rate, "steps_per_s_last10": last_rate,
            "ratio": last_rate / first_rate,
            "filtered_groups": rows[-1]["filtered_groups"] if rows else 0,
            "reward_last10": _mean([r["reward"] for r in rows[-tail:]]),
            "final_eval": out["final_eval"], "row_bytes_max": out["row_bytes_max"],
            "learned_at_step": [e.get("step") for e in out["learned"]]}


def report(results: dict[str, dict[str, list[dict[str, Any]]]], seeds: int, cap: float,
           load: tuple[float, ...]) -> str:
    """A markdown section: per task, a row per configuration and seed."""
    lines = [f"## Runs whose task gets learned (bench/learned.py, {date.today()})", "",
             "```", f".venv/bin/python bench/learned.py --seeds {seeds} --cap {cap:g}", "```",
             "", f"2 cores, load average at the start {load[0]:.2f}. Configurations: "
             + "; ".join(f"{name}: {kw or 'astranb defaults'}" for name, kw in CONFIGS.items())
             + ".", ""]
    common = [("filtered", lambda r: f"{r['filtered_groups']:,}"),
              ("reward, last 10%", lambda r: f"{r['reward_last10']:.3f}"),
              ("held-out eval (512)", lambda r: f"{r['final_eval']:.3f}"),
              ("largest row, bytes", lambda r: f"{r['row_bytes_max']:,}"),
              ("learned at step", lambda r: ", ".join(map(str, r["learned_at_step"])) or "-")]
    columns = {
        "largest": [("steps", lambda r: f"{r['steps']}{' (capped)' * r['capped']}"),
                    ("s, first half", lambda r: f"{r['first_half_s']:.1f}"),
                    ("s, second half", lambda r: f"{r['second_half_s']:.1f}"),
                    ("all / first half",
                     lambda r: f"{1 + r['second_half_s'] / r['first_half_s']:.2f}"),
                    ("episodes", lambda r: f"{r['episodes']:,}"), *common],
        "quickstart": [("steps", lambda r: f"{r['steps']}{' (capped)' * r['capped']}"),
                       ("training s", lambda r: f"{r['train_s']:.1f}"),
                       ("steps/s, first half", lambda r: f"{r['steps_per_s_first_half']:.2f}"),
                       ("steps/s, last 10%", lambda r: f"{r['steps_per_s_last10']:.2f}"),
                       ("last 10% / first half", lambda r: f"{r['ratio']:.2f}"), *common],
    }
    titles = {"largest": "largest digit, 300 steps", "quickstart": "quickstart, 600 steps"}
    for task, cols in columns.items():
        runs = [(config, seed, r) for config, tasks in results.items()
                for seed, r in enumerate(tasks.get(task, []))]
        if not runs:
            continue
        lines += [f"| {titles[task]} | seed | " + " | ".join(c for c, _ in cols) + " |",
                  "|---|---:|" + "---:|" * len(cols)]
        lines += [f"| {config} | {seed} | " + " | ".join(f(r) for _, f in cols) + " |"
                  for config, seed, r in runs]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("largest", "quickstart"), default=None)
    parser.add_argument("--configs", type=lambda v: v.split(","), default=list(CONFIGS),
                        help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--cap", type=float, default=300.0, help="wall seconds per run at most")
    parser.add_argument("--seeds", type=int, default=1, help="runs of each, seeds 0, 1, ...")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "learned.json")
    args = parser.parse_args()
    if unknown := set(args.configs) - set(CONFIGS):
        parser.error(f"unknown configuration(s) {sorted(unknown)}; pick from {list(CONFIGS)}")
    load = os.getloadavg()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="astranb-learned-") as tmp:
        for name, bench in (("largest", largest), ("quickstart", quickstart)):
            if args.only not in (None, name):
                continue
            for seed in range(args.seeds):  # configurations interleaved: the same load
                for config in args.configs:
                    out = bench(args.cap, Path(tmp) / f"{name}-{seed}-{config}", seed,
                                CONFIGS[config])
                    results.setdefault(config, {}).setdefault(name, []).append(out)
                    print(name, config, seed, json.dumps(out), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results, args.seeds, args.cap, load))


if __name__ == "__main__":
    main()
