"""What the step inspector's recording costs: the quickstart's run (arithmetic, tiny model,
batch 128, group 8, max_staleness 2) with recording off (`inspect_every=0`), at its default
(every 10th step) and on every step, the settings interleaved so a busy machine slows them alike.

    .venv/bin/python bench/inspector.py [--steps 100] [--repeats 3]
    .venv/bin/python bench/inspector.py --trainer [--repeats 40]

Prints, per setting: steps/s (median over repeats), the ratio to recording off, the recorded
steps kept and their bytes on disk. With --trainer: the child-process trainer alone on a
quickstart batch (128 rows; recorded by a first short run), a plain step against a recorded one
written to a run folder, alternating: what one recorded step costs, and so what recording every
10th step adds to a step on average. Whole runs on a busy machine vary by more than 3%; the
trainer-only numbers are what bounds the recording's cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import astranb as ab
from astranb.remote.process import ProcessTrainer
from astranb.session.steps import StepStore
from astranb.types import Batch

SETTINGS = (("off", 0), ("every 10th (default)", 10), ("every step", 1))


def train(every: int, steps: int) -> tuple[float, int, int, float]:
    """Steps per second, recorded steps kept, their bytes, and the median step_seconds of the
    recorded steps minus that of the others (within the run: the same machine, the same
    moment; 0 when none or all are recorded)."""
    with ab.Session(Path(tempfile.mkdtemp(prefix="astranb-bench-inspector-"))) as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2,
                            inspect_every=every)
        start = time.monotonic()
        run.wait(progress=False)
        seconds = time.monotonic() - start
        files = [step.path for step in run.steps]
        recorded = [r["step_seconds"] for r in run.rows if every and r["step"] % every == 0]
        others = [r["step_seconds"] for r in run.rows if not every or r["step"] % every]
        extra = (statistics.median(recorded) - statistics.median(others)
                 if recorded and others else 0.0)
        return steps / seconds, len(files), sum(p.stat().st_size for p in files), extra


def quickstart_batch() -> Batch:
    """The batch of a recorded quickstart step (a short run records one)."""
    with ab.Session(Path(tempfile.mkdtemp(prefix="astranb-bench-inspector-"))) as session:
        policy = session.policy("solver", model=ab.models.tiny())
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=1, batch_size=128, group_size=8, inspect_every=1)
        run.wait(progress=False)
        t = run.steps[0].trace.tensors
    # filter_groups left some groups out: its rows, repeated up to the quickstart's 128
    times = -(-128 // t["rewards_B"].shape[0])
    t = {k: torch.cat([v] * times)[:128] for k, v in t.items() if k != "grad_norm_P"}
    return Batch(t["input_ids_B_T"].long(), t["attention_mask_B_T"].long(),
                 t["loss_mask_B_T"].float(), t["old_logp_B_T"], t["advantages_B_T"],
                 t["versions_B_T"].long(), torch.ones(128), t["rewards_B"])


def trainer_cost(repeats: int) -> None:
    """A plain step against a recorded one (and its file written), alternating."""
    batch = quickstart_batch()
    trainer = ProcessTrainer("solver", ab.models.tiny(), ab.GRPO(entropy_coef=0.05),
                             ab.AdamWConfig(lr=1e-3))
    tokenizer = ab.models.tiny().tokenizer()
    store = StepStore(Path(tempfile.mkdtemp(prefix="astranb-bench-inspector-")),
                      {"solver": tokenizer.decode})
    plain, recorded = [], []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            trainer.step(batch)
            middle = time.perf_counter()
            metrics, trace = trainer.step_recorded(batch)
            store.add({"policy": "solver", "step": i, **metrics}, trace)
            recorded.append(time.perf_counter() - middle)
            plain.append(middle - start)
    finally:
        trainer.close()
    a, b = statistics.median(plain), statistics.median(recorded)
    print(f"batch {tuple(batch.input_ids_B_T.shape)}, median of {repeats}: plain step "
          f"{a * 1e3:.1f} ms, recorded and written {b * 1e3:.1f} ms (+{(b - a) * 1e3:.1f} ms); "
          f"every 10th recorded: +{(b - a) / 10 / a:.1%} a step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer", action="store_true")
    args = parser.parse_args()
    if args.trainer:
        trainer_cost(args.repeats)
        return
    results: dict[str, list[tuple[float, int, int, float]]] = {name: [] for name, _ in SETTINGS}
    for _ in range(args.repeats):
        for name, every in SETTINGS:
            results[name].append(train(every, args.steps))
    base = statistics.median(r[0] for r in results["off"])
    print(f"{args.steps} steps, median of {args.repeats}")
    for name, runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        kept, size = runs[-1][1], runs[-1][2]
        extra = statistics.median(r[3] for r in runs)
        within = (f"  recorded steps +{extra * 1e3:.1f} ms (within runs)"
                  if name.startswith("every 10") else "")
        print(f"  {name:<22} {rate:6.2f} steps/s  {rate / base:6.1%} of off  "
              f"{kept:4d} steps kept, {size / 1e6:6.2f} MB  (runs: "
              + ", ".join(f"{r[0]:.2f}" for r in runs) + ")" + within)


if __name__ == "__main__":
    main()
