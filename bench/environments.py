"""Benchmark: the agent environments' own costs, apart from any model.

    sandbox   programs run per second by `astranb_code.Sandbox` with 16 concurrent trivial
              programs (one assert each) through a pool of `--concurrency` slots, beside the
              cost of starting a bare `python -c pass` the same way (the floor: one interpreter
              start per program)
    bm25      queries per second of `astranb_search.BM25Retriever` on a generated 100k-passage
              corpus (one thread, one query at a time, as episodes ask them; target >= 1,000)
    textcraft episodes per second of `astranb_textcraft.TextCraft` played by the scripted
              optimal player (`oracle_reply`, with sub-agents), 16 episodes at a time, through
              the real EpisodeContext: the environment's and the context's own cost per episode

    .venv/bin/python bench/environments.py
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

import anyio


def bench_sandbox(jobs: int, concurrency: int) -> dict[str, float]:
    from astranb_code import Limits, Sandbox

    sandbox = Sandbox(Limits(wall_seconds=20), concurrency=concurrency)
    program, tests = "def f(x):\n    return x + 1", ["assert f(1) == 2"]

    async def run_all() -> list:
        results: list = [None] * jobs

        async def one(i: int) -> None:
            results[i] = await sandbox.run(program, tests)

        async with anyio.create_task_group() as tg:
            for i in range(jobs):
                tg.start_soon(one, i)
        return results

    anyio.run(run_all)  # warm the page cache
    started = time.perf_counter()
    results = anyio.run(run_all)
    seconds = time.perf_counter() - started
    assert all(r.passed == 1 for r in results), [r.error for r in results]
    started = time.perf_counter()
    for _ in range(jobs):
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
    bare = time.perf_counter() - started
    return {"programs_per_s": jobs / seconds, "bare_starts_per_s_serial": jobs / bare,
            "isolation": results[0].isolation}


def bench_bm25(passages: int, queries: int) -> dict[str, float]:
    from astranb_search import BM25Retriever, facts

    corpus, questions = facts(passages, seed=0)
    started = time.perf_counter()
    retriever = BM25Retriever(corpus)
    index_seconds = time.perf_counter() - started
    rng = random.Random(0)
    asked = [rng.choice(questions) for _ in range(queries)]
    retriever.search_many([asked[0]["question"]], 5)
    started = time.perf_counter()
    hits = 0
    for question in asked:
        found = retriever.search_many([question["question"]], 5)[0]
        hits += any(p.title == question["place"] for p in found)
    seconds = time.perf_counter() - started
    return {"passages": passages, "index_seconds": index_seconds,
            "queries_per_s": queries / seconds, "recall_at_5": hits / queries}


def bench_textcraft(episodes: int) -> dict[str, float]:
    from astranb_textcraft import TextCraft, oracle_policy

    import astranb as ab

    env = TextCraft(seed=0, spawn=True, targets=2, spare=3)
    player = oracle_policy(env.world, spawn=True)
    tasks = [t for t, _ in zip(env.samples(seed=0), range(episodes), strict=False)]

    async def play_all() -> list:
        out: list = [None] * len(tasks)
        limiter = anyio.CapacityLimiter(16)

        async def one(i: int) -> None:
            async with limiter:
                out[i] = await ab.play_episode(env, {"crafter": player}, tasks[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(tasks)):
                tg.start_soon(one, i)
        return out

    started = time.perf_counter()
    played = anyio.run(play_all)
    seconds = time.perf_counter() - started
    turns = sum(len(t.turns) for t in played)
    return {"episodes_per_s": len(played) / seconds, "turns_per_episode": turns / len(played),
            "mean_reward": sum(t.rewards["crafter"] for t in played) / len(played)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--episodes", type=int, default=200)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    sandbox = bench_sandbox(args.jobs, args.concurrency)
    print(f"sandbox: {args.jobs} programs, {args.concurrency} at a time: "
          f"{sandbox['programs_per_s']:.1f} programs/s (bare `python -I -c pass`, one after "
          f"another: {sandbox['bare_starts_per_s_serial']:.1f}/s); isolation "
          f"{sandbox['isolation']}")
    craft = bench_textcraft(args.episodes)
    print(f"textcraft: {craft['episodes_per_s']:.1f} episodes/s with the scripted player "
          f"({craft['turns_per_episode']:.1f} turns an episode across its sub-agents, mean "
          f"reward {craft['mean_reward']:.2f})")
    bm25 = bench_bm25(args.passages, args.queries)
    print(f"bm25: {bm25['passages']} passages indexed in {bm25['index_seconds']:.1f} s; "
          f"{bm25['queries_per_s']:.0f} queries/s on one thread (target >= 1,000); "
          f"recall@5 {bm25['recall_at_5']:.3f}")


if __name__ == "__main__":
    main()
