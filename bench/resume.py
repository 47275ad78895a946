"""An interrupted run against an uninterrupted one: does resuming after SIGKILL change where
training ends up?

Each pair trains the quickstart's setting (tiny model, arithmetic, batch 128, groups of 8,
max_staleness 2, lr 1e-3, entropy 0.05) for `--steps` steps with `checkpoint_every`:

    uninterrupted  one process, start to end
    interrupted    one process killed with SIGKILL at a random step, then
                   `ab.Session.resume(folder)` in a new process, to the same end

and reports the mean reward of the last 10% of steps and the held-out reward (512 episodes of
the final weights) of both, the step killed at and the checkpoint resumed from, per seed.

    .venv/bin/python bench/resume.py --steps 200 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SETUP = """\
import json, sys
import astranb as ab
folder, steps, seed, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
"""

TRAIN = SETUP + """\
session = ab.Session(folder)
policy = session.policy("solver", model=ab.models.tiny(), seed=seed,
                        algorithm=ab.GRPO(entropy_coef=0.05), optimizer=ab.AdamWConfig(lr=1e-3))
session.wire(ab.environments.load("arithmetic"), solver=policy)
run = session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2, seed=seed,
                    checkpoint_every=every)
run.wait(progress=False)
"""

RESUME = SETUP + """\
run = ab.Session.resume(folder)
run.wait(progress=False)
session = run.session
"""

REPORT = """\
summary = run.summary()
print(json.dumps({"reward_last_10pct": summary["reward_last_10pct"],
                  "heldout": session.evaluate(n=512)["solver"],
                  "seconds": summary["seconds"]}))
"""


def rows(folder: Path) -> int:
    path = folder / "run-000" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_script(script: str, folder: Path, steps: int, seed: int, every: int) -> dict:
    out = subprocess.run([sys.executable, "-c", script, str(folder), str(steps), str(seed),
                          str(every)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def interrupted(folder: Path, steps: int, seed: int, every: int, kill_at: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(folder), str(steps), str(seed),
                             str(every)])
    while rows(folder) < kill_at:
        if proc.poll() is not None:
            raise RuntimeError(f"training ended before step {kill_at} ({proc.returncode})")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = rows(folder)
    started = time.perf_counter()
    result = run_script(RESUME + REPORT, folder, steps, seed, every)
    events = [json.loads(line) for line in
              (folder / "run-000" / "events.jsonl").read_text().splitlines()]
    resumed = next(e for e in events if e["kind"] == "resumed")
    return {**result, "killed_after_rows": killed, "resumed_from": resumed["step"],
            "resume_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/resume.json"))
    args = parser.parse_args()
    results = []
    for seed in range(args.seeds):
        kill_at = random.Random(seed).randint(args.steps // 4, 3 * args.steps // 4)
        with tempfile.TemporaryDirectory() as tmp:
            whole = run_script(TRAIN + REPORT, Path(tmp) / "a", args.steps, seed, args.every)
            cut = interrupted(Path(tmp) / "b", args.steps, seed, args.every, kill_at)
        results.append({"seed": seed, "uninterrupted": whole, "interrupted": cut})
        print(textwrap.dedent(f"""\
            seed {seed}: uninterrupted reward(last 10%) {whole['reward_last_10pct']:.3f},
              held-out {whole['heldout']:.3f}; killed after {cut['killed_after_rows']} steps,
              resumed from step {cut['resumed_from']}: reward(last 10%)
              {cut['reward_last_10pct']:.3f}, held-out {cut['heldout']:.3f}"""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "every": args.every,
                                    "runs": results}, indent=1))


if __name__ == "__main__":
    main()
