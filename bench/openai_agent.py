"""The same agent written twice, against `ctx.chat` and against the official `openai` client.

    .venv/bin/python bench/openai_agent.py              # 3 seeds: ~10 min on 2 cores
    .venv/bin/python bench/openai_agent.py --quick      # 1 seed, 20 steps: a smoke run
    .venv/bin/python bench/openai_agent.py --hidden 512 --layers 8   # a wider, deeper tiny_chat

The task is the quickstart's (single-digit sums, 0/1 reward), as a two-turn chat: the user asks
"a+b=", the agent answers, the user asks "Are you sure? Answer again with the digit only.", and
the reward is 1 when the second answer's first digit is (a+b) mod 10. Both agents send the same
messages with the same sampling (max 4 new tokens, temperature 1); one calls
`ctx.chat("agent", messages)`, the other `client.chat.completions.create(model=..., messages=...,
max_tokens=4)` on `ctx.openai_client("agent")`, the episode's OpenAI-compatible endpoint on
loopback, so its calls go through HTTP, the official client and the endpoint's request parsing
and recording. Model: `ab.models.tiny_chat()` (random weights, a chat template), astranb's
defaults (the trainer in a child process), GRPO with entropy 0.05, lr 1e-3, batch 64 x group 8,
max_staleness 2, --steps steps. Configurations interleaved seed by seed.

Reported: episodes/s over the run (episodes played / training wall time), the openai agent's
against the ctx.chat agent's (the target: >= 0.9), the first and last 10% of steps' reward, and
how many turns were tokenized afresh (`retokenized`: 0 when token-in/token-out held).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import astranb as ab

AGAIN = "Are you sure? Answer again with the digit only."


class Sums(ab.Environment):
    """The quickstart's sums as a two-turn chat; `client=True`: through the openai client."""

    roles = ("agent",)
    sampling = ab.SamplingParams(max_new_tokens=4)

    def __init__(self, client: bool):
        self.client = client

    @property
    def name(self) -> str:
        return "sums-openai" if self.client else "sums-chat"

    def samples(self, seed: int = 0):
        import random

        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            yield {"question": f"{a}+{b}=", "answer": str((a + b) % 10)}

    async def episode(self, ctx: Any, sample: Any) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": sample["question"]}]
        if self.client:
            client = ctx.openai_client("agent")
            for _ in range(2):
                answer = await client.chat.completions.create(
                    model="agent", messages=messages, max_tokens=4, temperature=1.0)
                messages.append({"role": "assistant",
                                 "content": answer.choices[0].message.content or ""})
                if len(messages) == 2:
                    messages.append({"role": "user", "content": AGAIN})
        else:
            await ctx.chat("agent", messages)
            messages.append({"role": "user", "content": AGAIN})
            await ctx.chat("agent", messages)
        digits = [c for c in messages[-1]["content"] if c.isdigit()]
        return float(bool(digits) and digits[0] == sample["answer"])


def run(client: bool, steps: int, seed: int, workdir: Path,
        model: dict[str, int] | None = None) -> dict[str, Any]:
    with ab.Session(workdir) as session:
        policy = session.policy("agent", model=ab.models.tiny_chat(**(model or {})), seed=seed,
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3))
        session.wire(Sums(client), agent=policy)
        started = time.monotonic()
        train = session.train(steps=steps, batch_size=64, group_size=8, max_staleness=2,
                              seed=seed)
        train.wait(progress=False)
        wall = time.monotonic() - started
        rows = train.rows
    n = len(rows)
    tail = max(1, n // 10)
    episodes = int(rows[-1]["episodes"]) if rows else 0
    return {"steps": n, "episodes": episodes, "wall": wall,
            "episodes_per_s": episodes / float(rows[-1]["time"]) if rows else 0.0,
            "reward_first10": _mean([r["reward"] for r in rows[:tail]]),
            "reward_last10": _mean([r["reward"] for r in rows[-tail:]]),
            "retokenized": int(sum(r.get("count/retokenized", 0) or 0 for r in rows))}


def _mean(values: list[Any]) -> float:
    values = [float(v) for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=128, help="tiny_chat's width")
    parser.add_argument("--layers", type=int, default=2, help="tiny_chat's depth")
    args = parser.parse_args()
    model = {"hidden_size": args.hidden, "num_layers": args.layers}
    if args.quick:
        args.seeds, args.steps = 1, 20
    results: dict[str, list[dict[str, Any]]] = {"ctx.chat": [], "openai client": []}
    begun = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            order = list(results) if seed % 2 == 0 else list(reversed(results))
            for name in order:
                out = run(name == "openai client", args.steps, seed, Path(tmp) / f"{name}-{seed}",
                          model)
                results[name].append(out)
                print(f"{name} seed {seed}: {out}", flush=True)
    load = os.getloadavg()
    lines = [f"## An agent through the openai client against ctx.chat (bench/openai_agent.py, "
             f"{date.today().isoformat()})", "",
             f"`.venv/bin/python bench/openai_agent.py{' --quick' if args.quick else ''}"
             f" --hidden {args.hidden} --layers {args.layers}` "
             f"({(time.monotonic() - begun) / 60:.0f} min, load average {load[0]:.1f}/"
             f"{load[1]:.1f}/{load[2]:.1f} at the end; 2 cores). {args.steps} steps, batch 64 x "
             f"group 8, tiny_chat({args.hidden}x{args.layers}), two-turn sums.", "",
             "| agent | seed | episodes/s | reward, first 10% | last 10% | retokenized |",
             "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        for seed, r in enumerate(runs):
            lines.append(f"| {name} | {seed} | {r['episodes_per_s']:.1f} | "
                         f"{r['reward_first10']:.2f} | {r['reward_last10']:.2f} | "
                         f"{r['retokenized']} |")
    ratios = [o["episodes_per_s"] / c["episodes_per_s"]
              for c, o in zip(results["ctx.chat"], results["openai client"], strict=True)]
    lines += ["", f"openai client / ctx.chat episodes/s per seed: "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}; "
              "target >= 0.9)."]
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
