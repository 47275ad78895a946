"""Benchmark: a 4-turn episode trained as one merged sequence vs one row per call.

A tool-using conversation of 4 assistant turns (each prompt = the previous prompt + completion +
an observation) is collated both ways by `astranb.dataflow.batcher.build_batch` and trained with
`LocalTrainer.step` on the same starting weights, alternating the two so that machine noise hits
both alike. Reported per layout: rows, token positions the trainer runs the model over (padding
included), trained tokens (identical by construction), and the median step time; the loss of the
first step is printed for both (they must agree: same terms, same token mean).

    .venv/bin/python bench/tito.py             # ~1 minute on 2 cores
    .venv/bin/python bench/tito.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from a checkout

import torch  # noqa: E402

import astranb as ab  # noqa: E402
from astranb import models  # noqa: E402
from astranb.dataflow.batcher import build_batch  # noqa: E402
from astranb.dataflow.buffer import Group  # noqa: E402
from astranb.training.local import LocalTrainer  # noqa: E402
from astranb.types import Generation, SamplingParams, Trajectory, Turn  # noqa: E402

SECTION = "## Multi-turn episodes: merged sequences vs per-call rows (bench/tito.py)"


def episode(rng: random.Random, vocab: int, system: int, completion: int, observation: int,
            turns: int) -> Trajectory:
    """A conversation of `turns` assistant turns over random token ids."""
    prompt = tuple(rng.randrange(3, vocab) for _ in range(system))
    made = []
    for t in range(turns):
        if t:
            before = made[-1].generation
            prompt = (before.prompt_ids + before.completion_ids
                      + tuple(rng.randrange(3, vocab) for _ in range(observation)))
        ids = tuple(rng.randrange(3, vocab) for _ in range(completion))
        gen = Generation(prompt, ids, tuple(-1.0 for _ in ids), (0,) * len(ids), "stop")
        made.append(Turn("agent", "p", gen, SamplingParams()))
    return Trajectory({}, tuple(made), {"agent": float(rng.random() < 0.5)}, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    groups, repeats = (2, 3) if args.quick else (8, 9)
    torch.set_num_threads(2)
    rng = random.Random(0)
    spec = models.tiny_chat()
    vocab = len(spec.tokenizer())
    trajs = [episode(rng, vocab, system=96, completion=32, observation=16, turns=4)
             for _ in range(groups * 8)]
    batch_groups = [Group(g, tuple(trajs[8 * g: 8 * g + 8]), 0) for g in range(groups)]
    batches = {merge: build_batch(batch_groups, "p", ab.GRPO(), pad_id=0, merge=merge)
               for merge in (True, False)}
    base = LocalTrainer(spec, ab.GRPO(), micro_batch_size=64)
    state = copy.deepcopy(base.model.state_dict())
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, float] = {}
    for _ in range(repeats):
        for merge in (True, False):
            base.model.load_state_dict(state)
            base.optimizer = torch.optim.AdamW(base.model.parameters(), lr=1e-4)
            start = time.perf_counter()
            metrics = base.step(batches[merge])
            times[merge].append(time.perf_counter() - start)
            losses.setdefault(merge, metrics["loss"])
    print(SECTION)
    print(f"{groups * 8} episodes x 4 turns (system 96, completion 32, observation 16 tokens), "
          f"model {spec.name}, median of {repeats} steps\n")
    print("| layout | rows | positions run | trained tokens | s/step | first loss |")
    print("|---|---|---|---|---|---|")
    for merge, name in ((True, "merged"), (False, "per call")):
        b = batches[merge]
        print(f"| {name} | {b.size} | {b.input_ids_B_T.numel():,} | {b.num_tokens:,} | "
              f"{statistics.median(times[merge]):.3f} | {losses[merge]:.6f} |")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    positions = batches[False].input_ids_B_T.numel() / batches[True].input_ids_B_T.numel()
    print(f"\nper-call / merged: {positions:.2f}x the positions, {ratio:.2f}x the step time")


if __name__ == "__main__":
    main()
