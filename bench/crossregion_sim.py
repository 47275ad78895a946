"""Cross-region rollout and autoscaling at AstraFlow's scale, on the cost-model simulator.

astranb's real dataflow (gate, buffer, TrainLoop, Recorder) drives simulated rollout pools in
regions on a virtual clock (astranb.sim.regions, crossregion): weights travel over links with
the real codec's delta sizes, pools sample only from weights that have arrived, and the
scheduler routes each episode to a pool.

A. AstraFlow's cross-region setting (`sim.astraflow_crossregion`): Qwen3-14B, three rollout
   pools at 100/60/30 % throughput (10, 6 and 3 GPUs), the first beside the trainer, two behind
   4 Gbit/s links with a 300 ms round trip; 8,192 episodes a step (512 problems x 16, as DAPO
   trains), max_staleness 3, 12 steps of which the first 4 are left out (the pipeline filling),
   a full snapshot every 10 versions (the weight store's default). The step is long (~6 min)
   because a version costs every GPU ~1 s of loading plus a re-prefill of its ~128 in-flight
   sequences (~15-20 s): shorter steps would spend a tenth of the pools on updates. The 2x2:
   weights relayed (one pull per region) or pulled directly by every GPU, episodes routed by
   measured throughput and weight lag or round-robin. Target: throughput-aware + relays
   >= 0.9x the ideal (the pools' summed capacity at full batches).

B. Autoscaling on a curriculum (`sim.varying_demand`): one pool beside the trainer, answers
   short for 8 versions (median 400 tokens), long for 8 (2,400), short for 8; static pools of
   several sizes against an autoscaled one (2-10 GPUs, 2 min start-up, a look every minute).
   The comparison is at equal time to target: the static GPU-hours needed to finish as soon as
   the autoscaled run did, read off the static runs (linear between the two that bracket it).

    .venv/bin/python bench/crossregion_sim.py            # ~5 min on 2 idle cores (2 cases at once)
    .venv/bin/python bench/crossregion_sim.py --quick    # ~2 min: smaller runs, a smoke test only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGET_FRACTION = 0.9
ASTRAFLOW_SAVING = 1 - 312 / 358  # Qwen3-14B, autoscaled vs static GPU-hours

CROSS = [("relay", "throughput"), ("direct", "throughput"), ("relay", "round_robin"),
         ("direct", "round_robin")]
STATIC = (6, 7, 8, 10)
AUTOSCALE = {"min_gpus": 2, "max_gpus": 10, "start": 8}


# -- one case, in a child process ------------------------------------------------------------------

def run_case(case: dict) -> dict:
    from astranb import sim

    if case["kind"] == "cross":
        quick = {"batch_size": 2048, "group_size": 16, "steps": 8, "warmup": 3} \
            if case["quick"] else {}
        r = sim.simulate_regions(sim.astraflow_crossregion(case["sync"], case["routing"],
                                                           **quick))
        west = r.syncs["west"]
        return {**r.summary(), "work_share": r.work_share, "capacity_share": r.capacity_share,
                "remote_gb": (r.link_bytes["west"] + r.link_bytes["east"]) / 1e9,
                "west_sync_mean": west["mean_seconds"], "west_sync_max": west["max_seconds"],
                "fulls": west["fulls"], "steps": r.config.steps, "warmup": r.config.warmup,
                "batch_size": r.config.batch_size,
                "delta_mb": r.config.weights.delta_bytes / 1e6,
                "full_gb": r.config.weights.full_bytes / 1e9,
                "per_change": r.config.weights.per_change}
    quick = {"steps": 12, "schedule": None} if case["quick"] else {}
    if quick:
        short, long = sim.Lengths(400, 0.5, 8192), sim.Lengths(2400, 0.5, 8192)
        quick["schedule"] = sim.LengthSchedule.phases((0, short), (4, long), (8, short))
    rule = None
    gpus = case["gpus"]
    if case["kind"] == "auto":
        rule = sim.Autoscale(min_gpus=AUTOSCALE["min_gpus"], max_gpus=AUTOSCALE["max_gpus"])
        gpus = AUTOSCALE["start"]
    r = sim.simulate_regions(sim.varying_demand(gpus, autoscale=rule, **quick))
    serving = [s.gpus for s in r.scaling]
    return {**r.summary(), "gpus": gpus, "scalings": len(r.scaling),
            "gpus_min": min(serving, default=gpus), "gpus_max": max(serving, default=gpus),
            "accounting": r.accounting}


def run_all(cases: list[dict], jobs: int) -> list[dict]:
    """Each case in a child process (JSON on stdout), `jobs` at a time."""
    def child(case: dict) -> dict:
        done = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)],
                              capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
        if done.returncode:
            raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
        return {**case, **json.loads(done.stdout.strip().splitlines()[-1])}

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(child, cases))


# -- tables ----------------------------------------------------------------------------------------

def cross_table(rows: list[dict]) -> str:
    lines = ["| weights | routing | s/step | episodes/s (ideal) | of ideal | work share "
             "home/west/east | remote link GB | west sync s (mean, max) | dropped | real s |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        share = "/".join(f"{100 * r['work_share'][p]:.0f}" for p in ("home", "west", "east"))
        lines.append(
            f"| {r['sync']} | {r['routing']} | {r['seconds_per_step']:.0f} | "
            f"{r['episodes_per_second']:.1f} ({r['ideal_episodes_per_second']:.1f}) | "
            f"{r['fraction']:.3f} | {share} % | {r['remote_gb']:.0f} | "
            f"{r['west_sync_mean']:.1f}, {r['west_sync_max']:.0f} | {r['dropped_stale']} | "
            f"{r['real_seconds']:.0f} |")
    return "\n".join(lines)


def auto_table(rows: list[dict]) -> str:
    lines = ["| rollout capacity | time to target s | rollout GPU-h | training GPU-h | total "
             "GPU-h | dropped | lost |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        what = (f"autoscaled ({r['gpus_min']}-{r['gpus_max']} GPUs, {r['scalings']} changes)"
                if r["kind"] == "auto" else f"static {r['gpus']} GPUs")
        lines.append(f"| {what} | {r['time_to_target']:.0f} | {r['rollout_gpu_hours']:.2f} | "
                     f"{r['training_gpu_hours']:.2f} | "
                     f"{r['rollout_gpu_hours'] + r['training_gpu_hours']:.2f} | "
                     f"{r['dropped_stale']} | {r['lost']} |")
    return "\n".join(lines)


def static_at(statics: list[dict], seconds: float) -> tuple[float, float, float] | None:
    """(GPUs, rollout GPU-h, training GPU-h) a static pool needs to finish in `seconds`: linear
    between the two static runs that bracket it (None when none is that fast, or all are)."""
    runs = sorted(statics, key=lambda r: r["gpus"])
    for slow, fast in zip(runs, runs[1:], strict=False):
        if fast["time_to_target"] <= seconds <= slow["time_to_target"]:
            f = (slow["time_to_target"] - seconds) / (slow["time_to_target"]
                                                      - fast["time_to_target"])
            gpus, rollout, training = (slow[k] + f * (fast[k] - slow[k])
                                       for k in ("gpus", "rollout_gpu_hours",
                                                 "training_gpu_hours"))
            return gpus, rollout, training
    return None


def verdicts(cross: list[dict], auto: list[dict]) -> list[str]:
    out = []
    by = {(r["sync"], r["routing"]): r for r in cross}
    best, naive = by[("relay", "throughput")], by[("direct", "round_robin")]
    ok = best["fraction"] >= TARGET_FRACTION
    out.append(f"A. throughput-aware + relays: {best['fraction']:.3f} of the ideal (target "
               f">= {TARGET_FRACTION}): {'ok' if ok else 'MISSED'}; round-robin + direct "
               f"pulls: {naive['fraction']:.3f}")
    scaled = next(r for r in auto if r["kind"] == "auto")
    statics = [r for r in auto if r["kind"] == "static"]
    match = static_at(statics, scaled["time_to_target"])
    if match is None:
        out.append("B. no two static runs bracket the autoscaled time to target: widen STATIC")
        return out
    gpus, rollout_h, training_h = match
    saved = 1 - scaled["rollout_gpu_hours"] / rollout_h
    total = 1 - (scaled["rollout_gpu_hours"] + scaled["training_gpu_hours"]) \
        / (rollout_h + training_h)
    out.append(f"B. to finish in {scaled['time_to_target']:.0f} s a static pool needs "
               f"{gpus:.1f} GPUs: {rollout_h:.2f} rollout GPU-h; autoscaled "
               f"{scaled['rollout_gpu_hours']:.2f}: {100 * saved:.1f}% fewer rollout GPU-h, "
               f"{100 * total:.1f}% of all GPU-h with training (AstraFlow: "
               f"{100 * ASTRAFLOW_SAVING:.0f}%): {'ok' if saved > 0 else 'MISSED'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # a child: one case, JSON out
        print(json.dumps(run_case(json.loads(args.case))))
        return
    started = time.perf_counter()
    cases = [{"kind": "cross", "sync": s, "routing": r, "quick": args.quick} for s, r in CROSS]
    cases += [{"kind": "auto", "gpus": None, "quick": args.quick}]
    cases += [{"kind": "static", "gpus": g, "quick": args.quick} for g in STATIC]
    results = run_all(cases, args.jobs)
    cross = [r for r in results if r["kind"] == "cross"]
    auto = [r for r in results if r["kind"] != "cross"]
    c = cross[0]
    print(f"A. Cross-region: Qwen3-14B ({c['full_gb']:.1f} GB full, {c['delta_mb']:.0f} MB a "
          f"delta at 1% changed, {c['per_change']:.2f} B per change from the codec), pools "
          f"10/6/3 GPUs (home, west, east), batch {c['batch_size']}, {c['steps']} steps "
          f"({c['warmup']} warm-up)\n")
    print(cross_table(cross))
    print("\nB. Autoscaling on a curriculum (short, long, short answers)\n")
    print(auto_table(sorted(auto, key=lambda r: (r["kind"] != "auto", r["gpus"] or 0))))
    print()
    print("\n".join(verdicts(cross, auto)))
    print(f"\nreal time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
