"""The M2PO paper's staleness sweep, small: GRPO, M2PO, GSPO, CISPO and DAPO at 0, 16, 64 and 256.

    .venv/bin/python bench/staleness_sweep.py             # 24 runs, ~40 min on 2 cores
    .venv/bin/python bench/staleness_sweep.py --quick     # smoke: levels 0 and 16, 10 s caps
    .venv/bin/python bench/staleness_sweep.py --algorithms GRPO,M2PO --levels 0,256

The paper (Zheng et al., 2025, arXiv 2510.01161) trains on rollouts up to 256 model updates old
and finds that clipped objectives (GRPO) degrade as the staleness grows while M2PO, which masks
only the tokens with the largest (log r)^2 until the batch's mean is within 0.04 and clips
nothing, stays close to on-policy. This is that sweep on bench/staleness.py's runs (imported:
`run_one`, `measure`, `cut_share`; the model, task and measuring rules are bench/vs_trl.py's).

The task: vs_trl.py's digit task ("a+b=" -> (a+b) mod 10, reward for the first generated token),
random-init Qwen3 (hidden 128, 2 layers), 16 prompts x 8 samples a step, AdamW lr 3e-4, engine
batch 256. Why this task: its versions drift apart. Every trained token is a decision the reward
hangs on (no long stretches of near-certain tokens as in an LLM's reasoning, which dilute the
mean (log r)^2 there), and on-policy the whole climb from reward 0.06 to 0.9 takes ~250 steps, so
at staleness 64 the trained rollouts come from a policy a quarter of the learning curve behind,
and at 256 from one a whole curve behind: the log ratio of a learned answer between the policy
and the rollouts' is of the order log(0.9 / 0.1) = 2.2, (log r)^2 ~ 5, a hundred times the
paper's bound. (The sum task learns over some 4x as many steps: the sweep would not fit the
time.) A higher lr would make versions drift further per step, but at 3e-3 the runs collapse
even on-policy, and 3e-4 is the rate at which the earlier benchmarks learn.

Reaching the bound: the rollouts here are only ~20% faster than the trainer, so without help the
lead over the trainer grows by ~0.2 versions a step and staleness 256 is never reached (a trial:
mean 34 over 505 steps). Every run with a bound > 0 therefore holds its first train step until
the staleness gate is full (bench/staleness.py's `PrefillHold`): the first `bound` steps train on
the initial weights' rollouts, as in the paper, and from then on on rollouts `bound` versions old
for as long as the engine keeps the buffer full. The table reports the staleness that was real.

Every algorithm with its defaults (`ab.GRPO()`, `ab.M2PO()`, ...). A run stops when the reward of
its last 1,280 episodes reaches 0.9, at the step cap (700 by default: 444 steps past the bound at
256) or the wall-clock cap. Seed 0 for all; seeds 1.. (`--extra-seeds`) for GRPO and M2PO at 0
and 256. `--algorithms ...,M2PO-v` adds M2PO measuring and masking only the sign-violating tokens
(`only_violating=True`, the trust-region tokens of the paper's later version). Reported per run:
steps to 0.5 and 0.9, final reward, staleness mean and max, and per step the share of trained
tokens each algorithm cut (M2PO: masked; GRPO, DAPO: clip held; GSPO: sequences clipped; CISPO:
weights capped, gradient kept) and the k3 KL estimate between the policy and the rollouts' (a
drift measure), both as means over the steps at the bound. Writes
every step's numbers to results/staleness_sweep.json and prints a markdown section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import staleness  # noqa: E402  (bench/staleness.py: one run, its measures)
import vs_trl  # noqa: E402  (bench/vs_trl.py: the task, the model, the constants)

ALGORITHMS = ("GRPO", "M2PO", "GSPO", "CISPO", "DAPO")
"""Names of `astranb`'s algorithm configs, each built with its defaults."""
LEVELS = (0, 16, 64, 256)
SEEDED = (("GRPO", 0), ("M2PO", 0), ("GRPO", 256), ("M2PO", 256))
"""The (algorithm, level) pairs that run on the extra seeds too."""
STEPS_CAP, CAP, QUICK_CAP = 700, 190.0, 10.0
AT_BOUND = 0.9
"""A step is 'at the bound' when its mean staleness is at least this share of the bound."""


VARIANTS = {"M2PO-v": {"only_violating": True}}
"""Named variants: "M2PO-v" is M2PO measuring and masking only the sign-violating tokens,
(A > 0, r > 1) or (A < 0, r < 1), the trust-region tokens of the paper's later version."""


def algorithm(name: str):
    import astranb as ab

    base, _, _ = name.partition("-")
    return getattr(ab, base)(**VARIANTS.get(name, {}))


def plan(args) -> list[tuple[int, int, str]]:
    """(seed, level, algorithm) in run order: seed 0 over every pair, levels outermost and the
    algorithms' order rotated per level so load falls on all alike; then the extra seeds."""
    order = []
    for i, level in enumerate(args.levels):
        names = args.algorithms[i % len(args.algorithms):] + args.algorithms[
            :i % len(args.algorithms)]
        order += [(0, level, name) for name in names]
    for seed in range(1, 1 + args.extra_seeds):
        order += [(seed, level, name) for name, level in SEEDED
                  if name in args.algorithms and level in args.levels]
    return order


def at_bound_stats(raw: list[dict], level: int) -> dict:
    """Means over the steps at the bound (all steps at level 0) of the cut share and the KL."""
    steps = [r for r in raw if float(r["staleness_mean"]) >= AT_BOUND * level]
    cut = [c for c in map(staleness.cut_share, steps) if c is not None]
    kl = [float(r["approx_kl"]) for r in steps if r.get("approx_kl") == r.get("approx_kl")
          and "approx_kl" in r]
    return {"bound_steps": len(steps),
            "cut_at_bound": statistics.fmean(cut) if cut else None,
            "cut_max": max(cut) if cut else None,
            "kl_at_bound": statistics.fmean(kl) if kl else None}


def series(raw: list[dict]) -> list[dict]:
    """Per step: staleness, cut share, KL, reward of the episodes since the previous step."""
    return [{"time": round(float(r["time"]), 2), "staleness": float(r["staleness_mean"]),
             "cut": staleness.cut_share(r),
             "approx_kl": float(r["approx_kl"]) if "approx_kl" in r else None,
             "reward": float(r["reward"]) if r["episodes_since_step"] else None} for r in raw]


def one(args, seed: int, level: int, name: str, model_dir: Path, tmp: str) -> dict:
    label = f"seed {seed} {name} s={level}"
    started = time.monotonic()
    try:
        raw = staleness.run_one(vs_trl.TASKS["digit"], name.lower(), level, seed, model_dir,
                                args.cap, args.steps_cap, Path(tempfile.mkdtemp(dir=tmp)),
                                label, 10.0 if args.quick else 30.0, config=algorithm(name),
                                lr=vs_trl.LR, max_batch_size=vs_trl.ENGINE_BATCH, prefill=True)
    except Exception as error:  # noqa: BLE001 - one failed run is reported, the rest go on
        return {"seed": seed, "error": f"{type(error).__name__}: {error}"}
    result = {"seed": seed, **staleness.measure(raw, level), **at_bound_stats(raw, level),
              "prefill_s": raw[0].get("prefill_s", 0.0) if raw else 0.0,
              "load": os.getloadavg()[0], "wall": time.monotonic() - started,
              "series": series(raw)}
    print(f"{label}: {progress(result)}", file=sys.stderr, flush=True)
    return result


def progress(r: dict) -> str:
    reached = [f"{t}: {to['steps']} steps" if (to := r[f"to_{t}"]) else f"{t}: not reached"
               for t in vs_trl.TARGETS]
    return (f"{', '.join(reached)}; {r['steps']} steps in {r['seconds']:.0f} s (prefill "
            f"{r['prefill_s']:.0f} s), final {staleness._num(r['final'], 3)}; staleness mean "
            f"{staleness._num(r['staleness_mean'], 1)} max {r['staleness_max']}, "
            f"{r['bound_steps']} steps at the bound; cut {staleness._pct(r['cut_at_bound'])} "
            f"there (max {staleness._pct(r['cut_max'])}), KL {_sci(r['kl_at_bound'])} "
            f"(load {r['load']:.1f}, run {r['wall']:.0f} s)")


def bench(args) -> dict[tuple[str, int], list[dict]]:
    results: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="staleness-sweep-") as tmp:
        models: dict[int, Path] = {}
        for seed, level, name in plan(args):
            if seed not in models:
                models[seed] = vs_trl.write_model(Path(tmp) / f"model-{seed}", seed)
            r = one(args, seed, level, name, models[seed], tmp)
            if "error" in r:
                print(f"seed {seed} {name} s={level}: FAILED ({r['error']})", file=sys.stderr,
                      flush=True)
            results.setdefault((name, level), []).append(r)
    return results


# -- the report -----------------------------------------------------------------------------------

def _sci(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def _row(name: str, level: int, ok: list[dict]) -> str:
    """One table row: per-seed values, comma-separated."""
    lo, hi = vs_trl.TARGETS

    def join(cell) -> str:
        return ", ".join(cell(r) for r in ok)

    return (f"| {name} | {level} | {len(ok)} | {join(lambda r: _steps(r, lo))} | "
            f"{join(lambda r: _steps(r, hi))} | "
            f"{join(lambda r: staleness._num(r['final'], 3))} | "
            f"{join(lambda r: str(r['steps']))} | "
            f"{join(lambda r: staleness._num(r['staleness_mean'], 0))} / "
            f"{max(r['staleness_max'] or 0 for r in ok)} | "
            f"{join(lambda r: str(r['bound_steps']))} | "
            f"{join(lambda r: staleness._pct(r['cut_at_bound']))} "
            f"({staleness._pct(max((r['cut_max'] or 0) for r in ok))}) | "
            f"{join(lambda r: _sci(r['kl_at_bound']))} | {join(_prefill)} |")


def _prefill(r: dict) -> str:
    return f"{r['prefill_s']:.0f}"


def _steps(r: dict, target: float) -> str:
    to = r[f"to_{target}"]
    return str(to["steps"]) if to else "—"


def table(results: dict, args) -> list[str]:
    lo, hi = vs_trl.TARGETS
    lines = [f"| algorithm | staleness bound | seeds | steps to {lo} | steps to {hi} | final "
             "reward | steps run | staleness mean / max | steps at the bound | tokens cut per "
             "step at the bound (max) | KL at the bound | prefill s |",
             "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in args.algorithms:
        for level in args.levels:
            runs = results.get((name, level), [])
            ok = [r for r in runs if "error" not in r]
            if not ok:
                why = runs[0]["error"].replace("|", "\\|")[:120] if runs else "not run"
                lines.append(f"| {name} | {level} | failed: {why} |" + " |" * 9)
                continue
            lines.append(_row(name, level, ok))
    return lines


def report(results: dict, args, load: tuple, seconds: float) -> str:
    import torch
    import transformers

    import astranb as ab

    command = " ".join([".venv/bin/python bench/staleness_sweep.py", *sys.argv[1:]])
    runs = [r for rs in results.values() for r in rs if "load" in r]
    loads = sorted(r["load"] for r in runs) or [0.0]
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Staleness sweep 0-256 over the zoo (bench/staleness_sweep.py, {now[:10]})", "",
             "```", command, "```", "",
             f"astranb {ab.__version__} (transformers {transformers.__version__}, torch "
             f"{torch.__version__}), finished {now}. {os.cpu_count()} CPU cores shared with other "
             f"work: load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} before, "
             f"{loads[0]:.1f} to {loads[-1]:.1f} (median {statistics.median(loads):.1f}) at the "
             f"ends of runs. Whole sweep {seconds / 60:.1f} min, {len(runs)} runs.", "",
             f"Digit task, lr {vs_trl.LR:g}, {vs_trl.GROUPS} x {vs_trl.GROUP_SIZE} a step, engine "
             f"batch {vs_trl.ENGINE_BATCH}; first step held until the staleness gate is full; a "
             f"run stops at reward {vs_trl.TARGETS[-1]}, {args.steps_cap} steps or {args.cap:g} "
             f"s. Per-seed values, seed 0 first. 'At the bound': steps whose mean staleness is "
             f">= {AT_BOUND:g} x the bound (every step at 0). Tokens cut: M2PO masked, GRPO/DAPO "
             "clip held, GSPO sequences clipped, CISPO weight capped (gradient kept). KL: k3 "
             "estimate between the policy and the rollouts' policy, mean over those steps.", "",
             "The configs, as run:", ""]
    lines += [f"- `{algorithm(name)!r}`" for name in args.algorithms]
    return "\n".join([*lines, "", *table(results, args), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: levels 0 and 16, {QUICK_CAP:g} s caps, no extra seed")
    parser.add_argument("--algorithms", type=lambda s: s.split(","), default=list(ALGORITHMS),
                        help="comma-separated astranb algorithm names, or " + ", ".join(VARIANTS))
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(LEVELS), help="comma-separated max_staleness values")
    parser.add_argument("--extra-seeds", type=int, default=1,
                        help="seeds after 0 for GRPO and M2PO at 0 and 256")
    parser.add_argument("--cap", type=float, default=None,
                        help=f"wall-clock cap per run, s (default {CAP:g})")
    parser.add_argument("--steps-cap", type=int, default=STEPS_CAP)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results"
                        / "staleness_sweep.json")
    args = parser.parse_args()
    import astranb as ab

    if unknown := [n for n in args.algorithms if not hasattr(ab, n) and n not in VARIANTS]:
        parser.error(f"unknown algorithm(s) {unknown}; astranb has "
                     f"{', '.join(ALGORITHMS)}, DrGRPO, RLOO, ReinforcePP; variants: "
                     f"{', '.join(VARIANTS)}")
    if args.quick:
        args.levels, args.extra_seeds = [0, 16], 0
    args.cap = args.cap or (QUICK_CAP if args.quick else CAP)
    from transformers.utils import logging

    logging.disable_progress_bar()
    print(f"{len(plan(args))} runs, each at most {args.steps_cap} steps or {args.cap:g} s",
          file=sys.stderr, flush=True)
    load, started = os.getloadavg(), time.monotonic()
    results = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({f"{n} s={lv}": rs for (n, lv), rs in results.items()},
                                   indent=1))
    print(report(results, args, load, time.monotonic() - started))


if __name__ == "__main__":
    main()
