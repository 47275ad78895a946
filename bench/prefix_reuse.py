"""Benchmark: multi-turn episodes through the hf engine with prefix reuse on and off, side by side.

The workload is `astranb_search.Search` (the repository's tool-using search environment, as
bench/env_training.py sets it up: 2,000 invented places, BM25 top 2) played by the tiny chat model
with `--turns` turns an episode: each turn is a `ctx.chat` call (token-in/token-out), then either
the retriever's passages (a `<search>` action) or the environment's nudge (anything else, which is
what an untrained model mostly writes) comes back as the next user message, until an `<answer>`
or the last turn. Untrained weights, so no training here: only rollout, which is what reuse
changes. Both engines are built alike (`max_batch_size` 64, sampling seed 0) except
`prefix_cache_bytes` (0: off; None: the default budget, reuse on); `--episodes` episodes are
played `--concurrency` at a time, per measurement, alternating which engine goes first.

Reported per engine (median over `--repeats`): episodes/s, turns/s, tokens prefilled and reused
per episode, and prefix hits / misses; then the ratio of episodes/s (the issue's target: >= 3x).

    .venv/bin/python bench/prefix_reuse.py             # ~3 minutes on 2 cores
    .venv/bin/python bench/prefix_reuse.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import date
from itertools import islice
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from a checkout

import torch  # noqa: E402

import astranb as ab  # noqa: E402
from astranb.engines import HFEngine  # noqa: E402

SECTION = "## Prefix reuse across turns in the hf engine (bench/prefix_reuse.py)"


@dataclass
class Handle:
    """What an episode sees of a policy."""

    name: str
    tokenizer: Any
    engine: HFEngine
    max_context: int | None = None
    version: int = 0


def environment(turns: int, max_new_tokens: int) -> Any:
    from astranb_search import BM25Retriever, Search, facts

    passages, questions = facts(2000, seed=0)
    return Search({"train": questions}, BM25Retriever(passages), k=2, max_turns=turns,
                  sampling={"max_new_tokens": max_new_tokens})


async def play(env: Any, handle: Handle, samples: list[Any], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(sample: Any) -> Any:
        async with gate:
            return await ab.play_episode(env, {"searcher": handle}, sample)

    return list(await asyncio.gather(*(one(s) for s in samples)))


def measure(env: Any, handle: Handle, samples: list[Any], concurrency: int) -> dict[str, float]:
    before = handle.engine.stats()
    started = time.perf_counter()
    trajectories = asyncio.run(play(env, handle, samples, concurrency))
    wall = time.perf_counter() - started
    after = handle.engine.stats()
    failed = [t for t in trajectories if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed; first: {failed[0].error}")
    n, turns = len(trajectories), sum(len(t.turns) for t in trajectories)
    return {"episodes_per_s": n / wall, "turns_per_s": turns / wall, "turns": turns / n,
            "prefill": (after.prefill_tokens - before.prefill_tokens) / n,
            "reused": (after.prefix_reused_tokens - before.prefix_reused_tokens) / n,
            "generated": (after.tokens_generated - before.tokens_generated) / n,
            "hits": after.prefix_hits - before.prefix_hits,
            "misses": after.prefix_misses - before.prefix_misses,
            "prompt": statistics.mean(len(t.turns[-1].generation.prompt_ids)
                                      for t in trajectories)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.repeats = 64, 1
    torch.set_num_threads(2)
    begun = time.monotonic()
    env = environment(args.turns, args.max_new_tokens)
    spec = ab.models.tiny_chat()
    engines = {"reuse off": HFEngine(spec, max_batch_size=64, prefix_cache_bytes=0),
               "reuse on": HFEngine(spec, max_batch_size=64)}
    handles = {name: Handle("searcher", e.tokenizer, e, e.max_context)
               for name, e in engines.items()}
    stream = env.samples(seed=0)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    try:
        for handle in handles.values():  # warm up: first calls, allocations
            measure(env, handle, list(islice(stream, 16)), 16)
        for repeat in range(args.repeats):
            samples = list(islice(stream, args.episodes))  # both engines play the same ones
            order = list(handles) if repeat % 2 == 0 else list(reversed(handles))
            for name in order:
                out = measure(env, handles[name], samples, args.concurrency)
                results[name].append(out)
                print(f"{name} repeat {repeat}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in out.items()), flush=True)
        budget = engines["reuse on"].prefix_cache_bytes
    finally:
        for e in engines.values():
            e.close()
    print()
    print("\n".join(report(args, results, budget, time.monotonic() - begun)))


def report(args: Any, results: dict[str, list[dict[str, float]]], budget: int | None,
           seconds: float) -> list[str]:
    load = os.getloadavg()
    quick = " --quick" if args.quick else ""
    lines = [f"{SECTION[:-1]}, {date.today().isoformat()})", "",
             f"`.venv/bin/python bench/prefix_reuse.py{quick}` ({seconds / 60:.1f} min, load "
             f"average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end; 2 cores). "
             f"astranb_search.Search, tiny_chat (untrained), up to {args.turns} turns an "
             f"episode, {args.max_new_tokens} new tokens a turn, {args.episodes} episodes "
             f"{args.concurrency} at a time per measurement, max_batch_size 64, "
             f"{args.repeats} repeats (medians); reuse on = the default budget "
             f"({(budget or 0) / 2**20:.0f} MiB).", "",
             "| engine | episodes/s | turns/s | turns/episode | last prompt (tokens) | "
             "prefilled tokens/episode | reused tokens/episode | prefix hits / misses |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        hits, misses = sum(r["hits"] for r in runs), sum(r["misses"] for r in runs)
        lines.append(f"| {name} | {med['episodes_per_s']:.1f} | {med['turns_per_s']:.0f} | "
                     f"{med['turns']:.1f} | {med['prompt']:.0f} | {med['prefill']:.0f} | "
                     f"{med['reused']:.0f} | {hits:.0f} / {misses:.0f} |")
    ratios = [on["episodes_per_s"] / off["episodes_per_s"]
              for off, on in zip(results["reuse off"], results["reuse on"], strict=True)]
    lines += ["", f"reuse on / off, episodes/s per repeat: "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median "
              f"{statistics.median(ratios):.2f}; target >= 3)."]
    return lines


if __name__ == "__main__":
    main()
