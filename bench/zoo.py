"""The algorithm zoo on bench/vs_trl.py's digit and sum tasks: steps and seconds to 0.5 and 0.9.

    .venv/bin/python bench/zoo.py                 # 8 algorithms x 2 tasks x 3 seeds: <= 50 min
    .venv/bin/python bench/zoo.py --quick         # smoke run: 1 seed, 5 s caps, ~3 min
    .venv/bin/python bench/zoo.py --algorithms GRPO,GSPO --tasks digit --seeds 2 --cap 30

Each algorithm runs with its paper's defaults, as `astranb` exports it (`ab.GRPO()`,
`ab.M2PO()`, `ab.DrGRPO()`, `ab.DAPO()`, `ab.GSPO()`, `ab.CISPO()`, `ab.RLOO()`,
`ab.ReinforcePP()`), on what vs_trl.py runs astranb with: its tasks, its random-init Qwen3 per
seed, 16 prompts x 8 samples per step, AdamW at lr 3e-4, engine batch 256, max_staleness 2 (its
default astranb configuration), Session defaults (the trainer in a child process). Tasks, model,
runner and measures are vs_trl.py's own (`Task`, `write_model`, `run_astranb`, `window_mean`,
`summarize`), imported, not copied.

A run stops when the mean reward of its last 1,280 episodes reaches 0.9, or at the wall-clock cap
(45 s digit, 65 s sum; `--cap`). Seeds are interleaved: every algorithm runs seed 0 before any
runs seed 1, and the algorithms' order rotates by one each seed, so the machine's load falls on
all alike. An algorithm that fails is reported with its traceback, and the rest go on. Prints
a progress line per run, a markdown section for bench/RESULTS.md, and writes results/zoo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import UTC, date, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_trl  # noqa: E402  (bench/vs_trl.py: the tasks, the model, the runner, the measures)

ALGORITHMS = ("GRPO", "M2PO", "DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP")
"""Names of `astranb`'s algorithm configs, each built with its defaults."""
CAPS = {"digit": 45.0, "sum": 65.0}
"""Wall-clock cap of one run, seconds, per task."""
QUICK_CAP = 5.0
STALENESS = 2
"""vs_trl.py's default astranb configuration ("astranb s=2")."""
TARGETS = vs_trl.TARGETS


def algorithm(name: str):
    import astranb as ab

    return getattr(ab, name)()


def one(task_name: str, name: str, seed: int, model_dir: Path, cap: float,
        workdir: Path) -> dict:
    """One run; its summary, or its error with the traceback."""
    task = vs_trl.TASKS[task_name]
    started = time.monotonic()
    try:
        rows = vs_trl.run_astranb(task, STALENESS, seed, model_dir, cap, workdir,
                                  algorithm=algorithm(name))
    except Exception as error:  # noqa: BLE001 - one failed run is reported, the rest go on
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(),
                "load": os.getloadavg()[0], "wall": time.monotonic() - started}
    summary = vs_trl.summarize(rows)
    return {**summary, "cap": cap, "load": os.getloadavg()[0],
            "wall": time.monotonic() - started,
            "episodes_per_step": summary["episodes_per_s"] / (summary["steps_per_s"] or 1)}


def progress(task: str, name: str, seed: int, r: dict) -> str:
    head = f"{task} seed {seed} {name}:"
    if "error" in r:
        return f"{head} FAILED ({r['error']})"
    reached = []
    for t in TARGETS:
        to = r[f"to_{t}"]
        reached.append(f"{t} {to['seconds']:.1f} s / {to['steps']} steps" if to
                       else f"{t} not reached")
    return (f"{head} {'; '.join(reached)}; {r['steps']} steps, {r['steps_per_s']:.2f} steps/s, "
            f"{r['episodes_per_step']:.0f} episodes/step, final {_num(r['final'], 3)} "
            f"(run {r['wall']:.0f} s, load average {r['load']:.1f})")


def bench(args) -> dict[str, dict[str, list[dict]]]:
    """results[task][algorithm] = [run per seed]."""
    results: dict[str, dict[str, list[dict]]] = {t: {a: [] for a in args.algorithms}
                                                  for t in args.tasks}
    with tempfile.TemporaryDirectory(prefix="astranb-zoo-") as tmp:
        for task in args.tasks:
            cap = args.cap or (QUICK_CAP if args.quick else CAPS[task])
            for seed in range(args.seeds):
                model_dir = Path(tmp) / f"model-{seed}"
                if not model_dir.exists():
                    vs_trl.write_model(model_dir, seed)
                k = seed % len(args.algorithms)
                for name in args.algorithms[k:] + args.algorithms[:k]:
                    r = one(task, name, seed, model_dir, cap,
                            Path(tempfile.mkdtemp(dir=tmp, prefix=f"{task}-{name}-{seed}-")))
                    results[task][name].append({"seed": seed, **r})
                    print(progress(task, name, seed, r), file=sys.stderr, flush=True)
                    if "traceback" in r:
                        print(r["traceback"], file=sys.stderr, flush=True)
    return results


# -- the report -----------------------------------------------------------------------------------

def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _to(r: dict, t: float, field: str) -> float | None:
    to = r.get(f"to_{t}")
    return to[field] if to else None


def task_table(task: str, by_algorithm: dict[str, list[dict]]) -> list[str]:
    spec = vs_trl.TASKS[task]
    about = ("(a+b) mod 10, reward for the first token" if spec.modulo
             else "a+b (0..18), reward for exactly its digits then eos")
    caps = sorted({r["cap"] for runs in by_algorithm.values() for r in runs if "cap" in r})
    lo, hi = TARGETS
    lines = [f"### {task}: {about}; {spec.max_new_tokens} new tokens at most, cap "
             f"{', '.join(f'{c:g}' for c in caps) or '-'} s", "",
             f"| algorithm | s to {lo} per seed | median | steps to {lo} per seed | median "
             f"| s to {hi} per seed | median | steps to {hi} per seed | median | reached {hi} "
             "| steps/s | episodes/step | final reward per seed | median |",
             "|---|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for name, runs in by_algorithm.items():
        ok = [r for r in runs if "error" not in r]
        failed = [r for r in runs if "error" in r]
        if not ok:
            why = failed[0]["error"].replace("|", "\\|")[:200] if failed else "not run"
            lines.append(f"| {name} | failed: {why} |" + " |" * 12)
            continue
        cells = [name]
        for t in TARGETS:
            for field, digits in (("seconds", 1), ("steps", 0)):
                values = [_to(r, t, field) for r in ok]
                cells += [", ".join(_num(v, digits) for v in values),
                          _num(vs_trl.median_or_none(values), digits)]
        finals = [r["final"] for r in ok]
        cells += [f"{sum(_to(r, hi, 'steps') is not None for r in ok)}/{len(ok)}"
                  + (f" ({len(failed)} failed)" if failed else ""),
                  f"{statistics.median(r['steps_per_s'] for r in ok):.2f}",
                  f"{statistics.median(r['episodes_per_step'] for r in ok):.0f}",
                  ", ".join(_num(v, 3) for v in finals),
                  _num(vs_trl.median_or_none(finals), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def report(results: dict, args, load: tuple, seconds: float) -> str:
    import torch
    import transformers

    import astranb as ab

    command = " ".join([".venv/bin/python bench/zoo.py", *sys.argv[1:]])
    runs = [r for by in results.values() for rs in by.values() for r in rs]
    loads = sorted(r["load"] for r in runs) or [0.0]
    now = datetime.now(UTC).strftime("%H:%M UTC")
    lines = [f"## Algorithm zoo on the digit and sum tasks (bench/zoo.py, {date.today()})", "",
             "```", command, "```", "",
             f"astranb {ab.__version__} (transformers {transformers.__version__}, torch "
             f"{torch.__version__}), finished {now}. {os.cpu_count()} CPU cores shared with other "
             f"work: load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} before the "
             f"benchmark, {loads[0]:.1f} to {loads[-1]:.1f} (median "
             f"{statistics.median(loads):.1f}) at the ends of runs. Whole benchmark "
             f"{seconds / 60:.1f} min, {len(runs)} runs.", "",
             f"vs_trl.py's setup (its tasks and random-init Qwen3 per seed; {vs_trl.GROUPS} "
             f"prompts x {vs_trl.GROUP_SIZE} samples per step, temperature 1, AdamW lr "
             f"{vs_trl.LR:g}, engine batch {vs_trl.ENGINE_BATCH}, max_staleness {STALENESS}, "
             f"Session defaults), each algorithm with its defaults. Reward: mean of the last "
             f"{vs_trl.WINDOW} episodes; a run stops when that reaches {TARGETS[-1]}, or at its "
             "cap; seconds count from the start of training. Medians over seeds; a seed that "
             "missed a target counts as slower than any that reached it (— when the median "
             "missed it). episodes/step: more than 128 where the algorithm drops groups whose "
             "rewards tie (`filter_groups`).", "",
             "The configs, as run:", ""]
    lines += [f"- `{algorithm(name)!r}`" for name in args.algorithms]
    lines.append("")
    for task, by in results.items():
        lines += task_table(task, by)
    failures = [(task, name, r) for task, by in results.items() for name, rs in by.items()
                for r in rs if "error" in r]
    for task, name, r in failures:
        lines += [f"{name} failed on {task}, seed {r['seed']}:", "", "```",
                  r["traceback"].rstrip(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 seed, {QUICK_CAP:g} s caps")
    parser.add_argument("--algorithms", type=lambda s: s.split(","), default=list(ALGORITHMS),
                        help="comma-separated, of " + ", ".join(ALGORITHMS))
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(CAPS),
                        help="comma-separated, of " + ", ".join(CAPS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0, 1, ... per algorithm")
    parser.add_argument("--cap", type=float, default=None,
                        help="wall-clock cap per run, s (default: " + ", ".join(
                            f"{t} {c:g}" for t, c in CAPS.items()) + ")")
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "zoo.json")
    args = parser.parse_args()
    if unknown := set(args.algorithms) - set(ALGORITHMS):
        parser.error(f"unknown algorithm(s) {sorted(unknown)}; pick from {', '.join(ALGORITHMS)}")
    if unknown := set(args.tasks) - set(CAPS):
        parser.error(f"unknown task(s) {sorted(unknown)}; pick from {', '.join(CAPS)}")
    args.seeds = 1 if args.quick else args.seeds
    from transformers.utils import logging

    logging.disable_progress_bar()
    load, started = os.getloadavg(), time.monotonic()
    results = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results, args, load, time.monotonic() - started))


if __name__ == "__main__":
    main()
