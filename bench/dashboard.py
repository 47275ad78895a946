"""What watching costs: the same short quickstart-task run with no dashboard, with the live
dashboard at its default redraw interval (0.5 s), and with a 10x faster one (0.05 s), one after
the other in this process (the live widget is built and redrawn; no browser is attached).

    .venv/bin/python bench/dashboard.py [--steps 60] [--batch-size 64] [--repeats 2]

Prints, per setting: seconds per step (median over repeats), redraws, redraws per second, the
size of one redraw's figure JSON, and the ratio to the run without a dashboard.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import astranb as ab

SETTINGS = (("none", None), ("live 0.5 s", 0.5), ("live 0.05 s", 0.05))


def train(interval: float | None, args) -> tuple[float, int, int]:
    """Seconds per step, redraws, bytes of the last figure (0 without a dashboard)."""
    with ab.Session(Path(tempfile.mkdtemp(prefix="astranb-bench-dash-"))) as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=args.steps, batch_size=args.batch_size, group_size=8,
                            max_staleness=2)
        dash = run.dashboard(mode="widgets", interval=interval) if interval else None
        start = time.monotonic()
        run.wait(progress=False)
        seconds = time.monotonic() - start
        if dash is None:
            return seconds / args.steps, 0, 0
        size = len(json.dumps(dash.fig.to_plotly_json()["data"]))
        return seconds / args.steps, dash.redraws, size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name, _ in SETTINGS}
    for _ in range(args.repeats):  # interleaved, so drift on shared cores hits every setting
        for name, interval in SETTINGS:
            results[name].append(train(interval, args))
    base = statistics.median(r[0] for r in results["none"])
    print(f"{args.steps} steps, batch {args.batch_size}, {args.repeats} repeats (median)")
    print(f"{'setting':12} {'s/step':>7} {'vs none':>7} {'redraws':>7} {'redraws/s':>9} "
          f"{'figure KB':>9}")
    for name, rows in results.items():
        per_step = statistics.median(r[0] for r in rows)
        redraws = statistics.median(r[1] for r in rows)
        rate = redraws / (per_step * args.steps)
        print(f"{name:12} {per_step:7.3f} {per_step / base:7.2f} {redraws:7.0f} {rate:9.2f} "
              f"{statistics.median(r[2] for r in rows) / 1024:9.1f}")


if __name__ == "__main__":
    main()
