"""An AstraFlow-like two-policy run, simulated: astranb async schedules vs a synchronous baseline.

astranb's real dataflow (orchestrator, staleness gate, buffers, barrier, train loops) drives
simulated GPUs on a virtual clock (astranb.sim): an 8B-class solver + verifier on 8 rollout GPUs
and 8 training GPUs, long-tail answers (see `astranb.sim.astraflow_like`). Rows:

  independent / barrier   astranb async (max_staleness, default 6); training "shared" (one
                          trainer service for both policies on all 8 GPUs, taking turns);
                          independent also "split" (4 GPUs per policy, AstraFlow's
                          one-trainer-per-model layout)
  baseline                verl-style sync: roll out a batch, train policy 1 then policy 2 on all
                          8 training GPUs, publish, repeat (the 2.7x claim's reference)
  colocated               the same, as verl colocates it: all 16 GPUs roll out, then all train

Columns: virtual seconds per iteration (every policy one step, after the warm-up), speedup vs
the baseline and vs colocated, the ideal overlap bound max(rollout work / rollout GPUs,
training work / training GPUs) and the fraction of it reached, the time per iteration the
busiest training pool computes (with "split", the verifier's 4 GPUs: it reads the solver's
answer, so it trains ~15% more tokens, and no schedule beats that), the largest staleness
trained, groups dropped as too stale, and the real seconds the simulation took. Targets:
>= 2.7x the baseline and >= 90% of the bound.

    .venv/bin/python bench/multipolicy_sim.py            # ~30 s on 2 shared cores
    .venv/bin/python bench/multipolicy_sim.py --quick    # ~20 s: 9 steps, a smoke test
"""

from __future__ import annotations

import argparse
import time

from astranb import sim

ASYNC = ("independent", "barrier")
TARGET_SPEEDUP, TARGET_FRACTION = 2.7, 0.90


def run(args) -> list[tuple[str, str, sim.ScheduleResult]]:
    knobs = dict(steps=args.steps, warmup=args.warmup, max_staleness=args.max_staleness,
                 seed=args.seed)
    shared = sim.simulate(sim.astraflow_like(
        placement="shared", schedules=(*ASYNC, "baseline", "colocated"), **knobs))
    split = sim.simulate(sim.astraflow_like(placement="split", schedules=("independent",), **knobs))
    rows = [(n, "shared", shared.schedules[n]) for n in ASYNC]
    rows += [("independent", "split", split.schedules["independent"])]
    rows += [(n, "all, in turn", shared.schedules[n]) for n in ("baseline", "colocated")]
    return rows


def table(rows) -> str:
    base = {n: r.seconds_per_iteration for n, _, r in rows if n in ("baseline", "colocated")}
    lines = ["| schedule | training | s/iter | vs baseline | vs colocated | bound s/iter "
             "(rollout, train) | % of bound | busiest trainer s/iter | max stale | dropped | "
             "real s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, placement, r in rows:
        s = r.seconds_per_iteration
        lines.append(
            f"| {name} | {placement} | {s:.1f} | {base['baseline'] / s:.2f}x | "
            f"{base['colocated'] / s:.2f}x | {r.bound_seconds:.1f} ({r.rollout_bound:.1f}, "
            f"{r.train_bound:.1f}) | {100 * r.bound_fraction:.1f}% | {r.busiest_trainer:.1f} | "
            f"{r.staleness_max} | "
            f"{r.dropped_stale} | {r.real_seconds:.1f} |")
    return "\n".join(lines)


def verdicts(rows) -> list[str]:
    base = next(r for n, _, r in rows if n == "baseline").seconds_per_iteration
    out = []
    for name, placement, r in rows:
        if name not in ASYNC:
            continue
        speedup = base / r.seconds_per_iteration
        ok = speedup >= TARGET_SPEEDUP and r.bound_fraction >= TARGET_FRACTION
        out.append(f"{name} ({placement}): {speedup:.2f}x the baseline (target {TARGET_SPEEDUP}x), "
                   f"{100 * r.bound_fraction:.1f}% of the bound (target "
                   f"{100 * TARGET_FRACTION:.0f}%): {'ok' if ok else 'MISSED'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="steps per policy (default 14)")
    parser.add_argument("--warmup", type=int, default=None, help="iterations left out (default 4)")
    parser.add_argument("--max-staleness", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.steps = args.steps or (9 if args.quick else 14)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 4)
    started = time.perf_counter()
    rows = run(args)
    config = sim.astraflow_like()
    print(f"AstraFlow-like solver + verifier: {config.rollout.gpus} rollout GPUs, "
          f"{config.training.gpus} training GPUs, batch {config.batch_size} "
          f"(group {config.group_size}), max_staleness {args.max_staleness}, {args.steps} steps "
          f"({args.warmup} warm-up), seed {args.seed}\n")
    print(table(rows))
    print()
    print("\n".join(verdicts(rows)))
    print(f"\nreal time: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
