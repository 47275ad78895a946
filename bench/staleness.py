"""Staleness that M2PO is meant to survive: GRPO and M2PO at max_staleness 0, 4 and 16 on CPU.

    .venv/bin/python bench/staleness.py              # 3 seeds x 6 runs: ~40 min on 2 cores
    .venv/bin/python bench/staleness.py --quick      # smoke run: 1 seed, 30 s caps, ~4 min
    .venv/bin/python bench/staleness.py --only m2po  # one algorithm (or m2po:16, or 16)
    .venv/bin/python bench/staleness.py --seeds 1 --cap 300

The task and model are bench/vs_trl.py's, imported from it: the 'digit' task ("a+b=" -> (a+b) mod
10, reward 1 when the first generated token is that digit), a random-init Qwen3 (hidden 128, 2
layers) over a 16-token character tokenizer, written once per seed and shared by every run of
that seed; 16 prompts x 8 samples per step, temperature 1, AdamW at a constant lr 3e-4, gradient
norm clipped at 1, no KL, token-mean loss.

Runs per seed, one after the other (algorithms interleaved, so load on the shared cores spreads
over all of them): `ab.GRPO()` (PPO's clipped surrogate, clip 0.2) and `ab.M2PO()` (no clip; the
tokens with the largest (log r)^2 are dropped until the batch's mean is within 0.04, the paper's
default), each at max_staleness 0, 4 and 16 (`--staleness`). Both with their defaults: groups
without reward spread are not trained on. A run stops when the mean reward of its last 1,280
episodes reaches 0.9, at the wall-clock cap (`--cap`, 240 s) or at the step cap (`--steps-cap`).
Runs that reach 0.9 took 80-125 s (360-420 steps) in a trial, so the whole benchmark is about
40 min, and at most about 75 min if every run hits the cap.

What it measures: steps and seconds to reward 0.9, the final reward, and the staleness that was
real: for every trained group, trainer version minus the version of its oldest token, averaged
per step (`staleness_mean` of run.metrics) and then over the run's steps; its maximum; and the
first step at which the bound was reached. On a CPU the trainer is the slow side, so rollouts run
ahead until the staleness gate stops them and the buffer holds (bound + 1) batches; at bound 16
that takes some 40 steps to build up, and after it trained groups are 15-16 versions old (a
little less near 0.9, where most groups are filtered and rollouts barely keep up). The
reward is of episodes as they finish, played with the newest weights (rollouts wait in the buffer,
not in the engine), so a stale run's reward curve is the current policy's, not a lagged one.
Also reported: the share of trained tokens M2PO dropped (m2po_masked_frac) or GRPO clipped
(clip_frac), mean over steps.

The M2PO paper (Zheng et al., 2025) claims stable training at staleness up to 256; the closing
lines check the claim's small version here: M2PO at staleness 16 within 1.25x the steps of
staleness 0, beside GRPO's ratio. Prints progress to stderr and a markdown section for
bench/RESULTS.md to stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_trl import (  # noqa: E402  (the task, model and measuring rules of bench/vs_trl.py)
    BATCH,
    GROUP_SIZE,
    GROUPS,
    LR,
    TARGETS,
    TASKS,
    WINDOW,
    Task,
    arithmetic_env,
    finished,
    median_or_none,
    summarize,
    window_mean,
    write_model,
)

ALGORITHMS = ("grpo", "m2po")
STALENESS = (0, 4, 16)
LOW, TARGET = TARGETS
CAP, QUICK_CAP = 240.0, 30.0
"""Default wall-clock cap of one run, seconds (vs_trl's digit cap is 180 s; stale runs may need
more steps, so more time)."""
STEPS_CAP = 1500
LOAD_SECONDS = 8.0
"""About what a run costs besides training (model load, engine and trainer start), for the
estimate."""
RATIO_BOUND = 1.25
"""The acceptance bound: M2PO's steps to 0.9 at the highest staleness over those at 0."""


def make_algorithm(name: str):
    import astranb as ab

    return {"grpo": ab.GRPO, "m2po": ab.M2PO}[name]()


# -- one run --------------------------------------------------------------------------------------

def run_one(task: Task, algorithm: str, staleness: int, seed: int, model_dir: Path, cap: float,
            steps_cap: int, workdir: Path, label: str, every: float, *, config=None,
            lr: float = LR, max_batch_size: int = BATCH, prefill: bool = False) -> list[dict]:
    """One astranb run, stopped by `finished` or the step cap; its raw metrics rows (dicts).

    config: the algorithm object (default: `make_algorithm(algorithm)`); lr: AdamW's;
    max_batch_size: the engine's; prefill: hold the first train step until the staleness gate
    is full (see `PrefillHold`), so that the bound is reached `staleness` steps in rather than
    after the rollouts have slowly built a lead. The first row then says `prefill_s`, the
    hold's seconds.
    """
    import astranb as ab

    with ab.Session(workdir) as session:
        policy = session.policy("solver", model=ab.models.local(model_dir),
                                algorithm=config or make_algorithm(algorithm),
                                optimizer=ab.AdamWConfig(lr=lr), max_batch_size=max_batch_size,
                                seed=seed)
        session.wire(arithmetic_env(task), solver=policy)
        hold = (PrefillHold(policy.trainer, min_episodes=(staleness + 1) * BATCH)
                if prefill and staleness else None)
        started = last_print = time.monotonic()
        run = session.train(steps=steps_cap, batch_size=BATCH, group_size=GROUP_SIZE,
                            max_staleness=staleness, seed=seed)
        if hold is not None:
            run.on_event(hold.on_event)
        try:
            while not run.done:
                time.sleep(0.5)
                raw = run.rows
                rows = reward_rows(raw)
                if finished(rows, cap) or time.monotonic() - started > cap + 60:
                    run.stop()
                if raw and time.monotonic() - last_print >= every:
                    last_print = time.monotonic()
                    last = raw[-1]
                    print(f"  {label}: step {len(raw)}, {last['time']:.0f} s, reward "
                          f"{_num(window_mean(rows), 3)} (last {WINDOW} episodes), staleness "
                          f"{last['staleness_mean']:.1f} (max {last['staleness_max']})",
                          file=sys.stderr, flush=True)
        finally:
            if hold is not None:
                hold.release()  # a run stopped during the hold must not wait out its timeout
        run.wait(progress=False)  # re-raises a failure (a stopped run is not one)
        rows = run.rows
        if hold is not None and rows:
            rows[0] = {**rows[0], "prefill_s": hold.seconds}
        return rows


class PrefillHold:
    """Holds a trainer's first step until the rollouts have filled the staleness gate.

    On a CPU the trainer is the slow side by only some 20%, so rollouts build their lead over
    the trainer slowly: at bound 256 a run trains ~1,300 steps before a group is 256 versions old.
    Held, the first step waits while the engine plays with the initial weights until the gate
    admits no more groups (at least `min_episodes` finished, the gate's capacity, and then none
    for `quiet` seconds; a pause of the engine under load alone does not release it), as in the
    M2PO paper's setting, where the first `bound` steps train on the initial model's rollouts.
    After the hold
    the step at version k trains groups k versions old until k reaches the bound.

    Replaces the trainer's `step` on that one object; nothing else changes.
    """

    def __init__(self, trainer, min_episodes: int = 0, quiet: float = 1.5,
                 timeout: float = 120.0) -> None:
        import threading

        self._step, self._quiet, self._timeout = trainer.step, quiet, timeout
        self._min_episodes = max(min_episodes, 1)
        self._released = threading.Event()
        self._last_episode = time.monotonic()
        self.episodes, self.seconds = 0, 0.0
        trainer.step = self._held_step

    def on_event(self, kind: str, payload) -> None:
        """Run observer: counts finished episodes."""
        if kind == "episode":
            self.episodes += 1
            self._last_episode = time.monotonic()

    def release(self) -> None:
        self._released.set()

    def _held_step(self, batch):
        if not self._released.is_set():
            started = time.monotonic()
            while not self._released.wait(0.25):
                now = time.monotonic()
                quiet = (self.episodes >= self._min_episodes
                         and now - self._last_episode >= self._quiet)
                if quiet or now - started >= self._timeout:
                    break
            self._released.set()
            self.seconds = time.monotonic() - started
        return self._step(batch)


def reward_rows(raw: list[dict]) -> list[dict]:
    """vs_trl's row format: time, reward of the episodes since the previous step, their count."""
    return [{"time": float(r["time"]), "reward": float(r["reward"]) if r["episodes_since_step"]
             else 0.0, "count": int(r["episodes_since_step"])} for r in raw]


def measure(raw: list[dict], staleness: int) -> dict:
    """summarize() plus the measured staleness and the dropped or clipped token share."""
    result = summarize(reward_rows(raw))
    means = [float(r["staleness_mean"]) for r in raw]
    at_bound = next((i + 1 for i, r in enumerate(raw) if r["staleness_max"] >= staleness), None)
    cut = [c for c in map(cut_share, raw) if c is not None]
    return {**result, "staleness_mean": statistics.fmean(means) if means else None,
            "staleness_max": max((int(r["staleness_max"]) for r in raw), default=None),
            "at_bound": at_bound if staleness else 1,
            "cut": statistics.fmean(cut) if cut else None}


CUT_KEYS = ("m2po_masked_frac", "clip_frac", "cispo_clip_frac")
"""Metrics that say what share of a step's trained tokens the algorithm cut: M2PO's dropped
tokens, the clipped objectives' tokens whose clip held (GRPO, DAPO; GSPO's whole sequences), and
CISPO's tokens whose weight was capped (CISPO keeps their gradient, with the weight held)."""


def cut_share(row: dict) -> float | None:
    """The share of a step's trained tokens its algorithm cut (None: the row says none)."""
    values = [float(row[k]) for k in CUT_KEYS if k in row and row[k] == row[k]]
    return max(values) if values else None


# -- the benchmark --------------------------------------------------------------------------------

def configs(args) -> list[tuple[str, int]]:
    """(algorithm, staleness) pairs in run order, filtered by --only."""
    chosen = []
    for staleness in args.staleness:
        for algorithm in ALGORITHMS:
            if _selected(args.only, algorithm, staleness):
                chosen.append((algorithm, staleness))
    return chosen


def _selected(only: list[str] | None, algorithm: str, staleness: int) -> bool:
    if not only:
        return True
    for item in only:
        name, _, level = item.partition(":")
        if name.isdigit() and not level:
            name, level = "", name
        if name in ("", algorithm) and level in ("", str(staleness)):
            return True
    return False


def bench(args, chosen: list[tuple[str, int]]) -> dict[tuple[str, int], list[dict]]:
    """Every (seed, algorithm, staleness) run; results[(algorithm, staleness)] = [runs]."""
    task = TASKS["digit"]
    results: dict[tuple[str, int], list[dict]] = {c: [] for c in chosen}
    every = 10.0 if args.quick else 30.0
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        for seed in range(args.seeds):
            model_dir = write_model(Path(tmp) / f"model-{seed}", seed)
            for algorithm, staleness in chosen:
                label = f"seed {seed} {algorithm} s={staleness}"
                workdir = Path(tempfile.mkdtemp(dir=tmp))
                try:
                    raw = run_one(task, algorithm, staleness, seed, model_dir, args.cap,
                                  args.steps_cap, workdir, label, every)
                    result = {**measure(raw, staleness), "load": os.getloadavg()[0]}
                except Exception as error:  # noqa: BLE001 - one failed run is reported
                    result = {"error": f"{type(error).__name__}: {error}"}
                results[(algorithm, staleness)].append(result)
                print(f"{label}: {_progress(result, staleness)}", file=sys.stderr, flush=True)
    return results


def _progress(result: dict, staleness: int) -> str:
    if "error" in result:
        return f"failed ({result['error']})"
    to = result[f"to_{TARGET}"]
    where = f"{to['seconds']:.1f} s, {to['steps']} steps" if to else "not reached"
    text = (f"{TARGET} {where}; {result['steps']} steps in {result['seconds']:.0f} s "
            f"({result['steps_per_s']:.2f}/s), final {_num(result['final'], 3)}; staleness mean "
            f"{_num(result['staleness_mean'], 1)} max {result['staleness_max']} (bound from step "
            f"{result['at_bound'] or '—'}); tokens cut {_pct(result['cut'])} (load average "
            f"{result['load']:.1f})")
    if _far_below(result, staleness):
        text += f"; NOTE: measured staleness is far below the bound {staleness}"
    return text


def _far_below(result: dict, staleness: int) -> bool:
    mean = result.get("staleness_mean")
    return staleness > 0 and mean is not None and mean < 0.75 * staleness


# -- the report -----------------------------------------------------------------------------------

def report(results: dict, args, load: tuple, seconds: float) -> str:
    """The markdown section for bench/RESULTS.md."""
    import torch
    import transformers

    import astranb as ab

    command = " ".join(["python bench/staleness.py", *sys.argv[1:]])
    runs = [r for rs in results.values() for r in rs if "load" in r]
    loads = sorted(r["load"] for r in runs) or [0.0]
    lines = [
        f"## Staleness: GRPO and M2PO at max_staleness {', '.join(map(str, args.staleness))} "
        f"(bench/staleness.py, {date.today()})", "", "```", command, "```", "",
        f"astranb {ab.__version__} (transformers {transformers.__version__}, torch "
        f"{torch.__version__}; Session defaults). {os.cpu_count()} CPU cores shared with other "
        f"work: load average {load[0]:.2f} before, {loads[0]:.1f} to {loads[-1]:.1f} at the ends "
        f"of runs. {args.seeds} seed(s); whole benchmark {seconds / 60:.1f} min.",
        "",
        f"bench/vs_trl.py's digit task and model ((a+b) mod 10, reward for the first token; "
        f"random-init Qwen3 hidden 128, 16-token character tokenizer), {GROUPS} prompts x "
        f"{GROUP_SIZE} samples a step, AdamW lr {LR:g}. GRPO: clip 0.2; M2PO: threshold 0.04 on "
        f"the mean (log r)^2, no clip; both drop groups without reward spread. Reward: mean of "
        f"the last {WINDOW} episodes; a run stops at {TARGET}, at {args.cap:g} s or at "
        f"{args.steps_cap} steps. Medians over seeds; a seed that missed {TARGET} counts as "
        f"slower than any that reached it (— when the median missed it). Staleness, measured: "
        f"trainer version minus the version of a trained group's oldest token, mean over the "
        f"run's steps and max; 'bound from step': the first step that trained a group at the "
        f"bound (the buffer fills up over the first steps). Tokens cut: the share of trained "
        f"tokens M2PO dropped or GRPO's clip held, mean over steps.",
        "",
        f"| algorithm | staleness | s to {TARGET} | steps to {TARGET} | reached {TARGET} | "
        f"steps to {TARGET} per seed | steps to {LOW} | final reward | staleness mean / max | "
        f"bound from step | tokens cut | steps/s | episodes/step |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    medians = {}
    for (algorithm, staleness), rs in results.items():
        ok = [r for r in rs if "error" not in r]
        name = algorithm.upper()
        if not ok:
            lines.append(f"| {name} | {staleness} | failed: {rs[0]['error'] if rs else '-'} |"
                         + " |" * 10)
            continue
        medians[(algorithm, staleness)] = m = _medians(ok)
        per_seed = ", ".join(_num(r[f"to_{TARGET}"] and r[f"to_{TARGET}"]["steps"], 0)
                             for r in ok)
        lines.append(
            f"| {name} | {staleness} | {_num(m['seconds'])} | {_num(m['steps'], 0)} | "
            f"{m['reached']}/{len(ok)} | {per_seed} | {_num(m['low'], 0)} | "
            f"{_num(m['final'], 3)} | {_num(m['staleness_mean'], 1)} / {m['staleness_max']} | "
            f"{_num(m['at_bound'], 0)} | {_pct(m['cut'])} | {m['steps_per_s']:.2f} | "
            f"{m['per_step']:.0f} |")
    return "\n".join(lines + [""] + closing(results, medians, args.staleness))


def _medians(runs: list[dict]) -> dict:
    to = [r[f"to_{TARGET}"] for r in runs]
    known = lambda key: [r[key] for r in runs if r[key] is not None]  # noqa: E731
    return {"seconds": median_or_none([t and t["seconds"] for t in to]),
            "steps": median_or_none([t and t["steps"] for t in to]),
            "reached": sum(t is not None for t in to),
            "low": median_or_none([r[f"to_{LOW}"] and r[f"to_{LOW}"]["steps"] for r in runs]),
            "final": median_or_none([r["final"] for r in runs]),
            "staleness_mean": statistics.median(known("staleness_mean") or [math.nan]),
            "staleness_max": max(known("staleness_max"), default="—"),
            "at_bound": median_or_none([r["at_bound"] for r in runs]),
            "cut": statistics.median(known("cut")) if known("cut") else None,
            "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
            "per_step": statistics.median(r["episodes_per_s"] / (r["steps_per_s"] or 1)
                                          for r in runs)}


def closing(results: dict, medians: dict, levels: list[int]) -> list[str]:
    """Steps-to-0.9 ratios against staleness 0, the acceptance line, and staleness warnings."""
    lines = []
    base, top = 0, max(levels)
    for algorithm in ALGORITHMS:
        zero = medians.get((algorithm, base))
        for level in levels:
            m = medians.get((algorithm, level))
            if level == base or m is None or zero is None:
                continue
            lines.append(f"- {algorithm.upper()} s={level} / s={base}: steps to {TARGET} "
                         f"{_ratio(m['steps'], zero['steps'])}, seconds "
                         f"{_ratio(m['seconds'], zero['seconds'])}")
    m2po, zero = medians.get(("m2po", top)), medians.get(("m2po", base))
    if m2po is not None and zero is not None and top != base:
        if m2po["steps"] is not None and zero["steps"] is not None:
            ratio = m2po["steps"] / zero["steps"]
            verdict = "holds" if ratio <= RATIO_BOUND else "does NOT hold"
            lines.append(f"- Acceptance (M2PO at staleness {top} within {RATIO_BOUND}x the steps "
                         f"of staleness {base}): {verdict}, {ratio:.2f}x "
                         f"({m2po['steps']:.0f} vs {zero['steps']:.0f} steps, medians).")
        else:
            missed = [f"s={s}" for s, m in ((top, m2po), (base, zero)) if m["steps"] is None]
            lines.append(f"- Acceptance (M2PO at staleness {top} within {RATIO_BOUND}x the steps "
                         f"of staleness {base}): not decided: the median run at "
                         f"{' and '.join(missed)} did not reach {TARGET} within the cap.")
    else:
        lines.append(f"- Acceptance: not checked (needs M2PO at staleness {base} and {top}).")
    for (algorithm, level), rs in results.items():
        low = [r for r in rs if "error" not in r and _far_below(r, level)]
        if low:
            lines.append(f"- Note: {algorithm.upper()} s={level}: measured mean staleness "
                         f"{', '.join(_num(r['staleness_mean'], 1) for r in low)} is far below "
                         f"the bound (short runs spend most of their steps filling the buffer).")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    if a is None:
        return "— (not reached)"
    return "—" if not b else f"{a / b:.2f}x"


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or value != value else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 seed, {QUICK_CAP:g} s caps")
    parser.add_argument("--cap", type=float, default=None,
                        help=f"wall-clock cap per run, s (default {CAP:g}; --quick {QUICK_CAP:g})")
    parser.add_argument("--steps-cap", type=int, default=STEPS_CAP, help="step cap per run")
    parser.add_argument("--staleness", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(STALENESS), help="comma-separated max_staleness values")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="comma-separated subset: grpo, m2po, 16, m2po:16, ...")
    args = parser.parse_args()
    if args.quick:
        args.seeds = 1
    args.cap = args.cap or (QUICK_CAP if args.quick else CAP)
    chosen = configs(args)
    if not chosen:
        parser.error(f"--only {','.join(args.only)} selects nothing; pick from "
                     f"{', '.join(ALGORITHMS)}, staleness {args.staleness}, or algorithm:staleness")
    from transformers.utils import logging

    logging.disable_progress_bar()
    count = len(chosen) * args.seeds
    print(f"{count} runs ({args.seeds} seed(s) x {len(chosen)}: "
          f"{', '.join(f'{a} s={s}' for a, s in chosen)}), each capped at {args.cap:g} s and "
          f"{args.steps_cap} steps: at most ~{count * (args.cap + LOAD_SECONDS) / 60:.0f} min, "
          f"less where runs reach {TARGET} early", file=sys.stderr, flush=True)
    load, started = os.getloadavg(), time.monotonic()
    results = bench(args, chosen)
    print(report(results, args, load, time.monotonic() - started))


if __name__ == "__main__":
    main()
