"""Reward against wall-clock on the quickstart task: asynchronous (max_staleness=4) beside
synchronous (max_staleness=0), same seed, same steps, run one after the other in this process.

    .venv/bin/python bench/async_vs_sync.py [--steps 400] [--batch-size 128]

Prints, per mode: seconds per step, time to reach reward 0.3 / 0.5 / 0.6, final reward (mean over
the last 10% of steps), and the async/sync time ratios. Also writes bench/async_vs_sync.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import astranb as ab

HERE = Path(__file__).resolve().parent
THRESHOLDS = (0.3, 0.5, 0.6)


def train(mode: str, staleness: int, args) -> object:
    with ab.Session(Path(tempfile.mkdtemp(prefix=f"astranb-{mode}-"))) as session:
        policy = session.policy(
            "solver", model=ab.models.tiny(), algorithm=ab.GRPO(entropy_coef=0.05),
            optimizer=ab.AdamWConfig(lr=1e-3),
        )
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=args.steps, batch_size=args.batch_size, group_size=8,
                            max_staleness=staleness, seed=args.seed)
        run.wait(progress=False)
        return run.metrics


def time_to(df, threshold: float, window: int = 10) -> float:
    smooth = df["reward"].rolling(window, min_periods=window).mean()
    hit = df[smooth >= threshold]
    return float(hit["time"].iloc[0]) if len(hit) else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {mode: train(mode, s, args) for mode, s in (("async", 4), ("sync", 0))}

    tail = max(1, args.steps // 10)
    print(f"{'mode':6} {'s/step':>7} " + " ".join(f"{'t@' + str(t):>7}" for t in THRESHOLDS)
          + f" {'final':>6} {'stale max':>9}")
    for mode, df in results.items():
        times = " ".join(f"{time_to(df, t):7.1f}" for t in THRESHOLDS)
        per_step = df["time"].iloc[-1] / len(df)
        print(f"{mode:6} {per_step:7.3f} {times} {df['reward'].tail(tail).mean():6.3f}"
              f" {int(df['staleness_max'].max()):9d}")
    a, s = results["async"], results["sync"]
    print("async/sync wall-clock ratio for the whole run:",
          f"{a['time'].iloc[-1] / s['time'].iloc[-1]:.2f}")
    for t in THRESHOLDS:
        print(f"async/sync time to reward {t}: {time_to(a, t) / time_to(s, t):.2f}")
    _plot(results)


def _plot(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, df in results.items():
        ax.plot(df["time"], df["reward"].rolling(10, min_periods=1).mean(), label=mode)
    ax.set(xlabel="wall-clock seconds", ylabel="episode reward (10-step mean)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "async_vs_sync.png", dpi=100)


if __name__ == "__main__":
    main()
