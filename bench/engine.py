"""Benchmark: HFEngine (continuous batching) vs transformers `generate()` (static batching).

Both sides decode the same prompts with the same model, the same batch size and the same torch
threads, sampling at temperature 1.0 with no stop tokens; every request has its own
max_new_tokens. `generate()` runs consecutive chunks of `batch` requests, each chunk to the
longest request in it; only each request's own tokens count as useful for both sides.

Scenarios:
  uniform   every request wants the same number of tokens (continuous batching cannot win;
            the target is to lose at most 10% to per-step overhead).
  long-tail 80% short (16 tokens), 20% long (256 tokens), shuffled: static batches idle on the
            finished short rows while the long ones finish (target: >= 1.5x).

The model (tiny Qwen3, hidden 512, 4 layers, ~17M parameters) makes one batch-16 decode step
about 15 ms on a 2-core CPU, of which transformers' Python overhead is ~3.5 ms (at hidden 256 the
Python share is over half the step); the whole run stays well under 3 minutes. Each side runs in a
fresh process, is timed `--repeats` times, and the best run counts, which damps noise from others
(the load average before the run is printed with the table: a busy machine makes both sides
slower and noisier, generate() more so as its runs are longer).

    .venv/bin/python bench/engine.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a script from a checkout

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from astranb import models  # noqa: E402
from astranb.engines import HFEngine  # noqa: E402
from astranb.types import GenerationRequest, SamplingParams  # noqa: E402

MODEL = dict(hidden_size=512, num_layers=4, num_heads=8)
SECTION = "## hf engine vs transformers generate()"


def make_requests(max_new: list[int], vocab: int, seed: int) -> list[GenerationRequest]:
    """One request per entry of max_new, with random prompts of 8-32 tokens."""
    rng = random.Random(seed)
    return [
        GenerationRequest(
            prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=m),
        )
        for m in max_new
    ]


def scenario_lengths(name: str, n: int, seed: int) -> list[int]:
    if name == "uniform":
        return [64] * n
    rng = random.Random(seed)
    lengths = [256 if i < n // 5 else 16 for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def run_engine(engine: HFEngine, requests: list[GenerationRequest]) -> tuple[int, float]:
    """Returns (useful tokens, seconds)."""
    start = time.perf_counter()
    gens = engine.generate_many(requests)
    seconds = time.perf_counter() - start
    assert all(len(g.completion_ids) == r.sampling.max_new_tokens
               for g, r in zip(gens, requests, strict=True))
    return sum(len(g.completion_ids) for g in gens), seconds


def run_generate(model, requests: list[GenerationRequest], batch: int) -> tuple[int, float]:
    """Static batching: consecutive chunks, each run to its longest request."""
    useful, start = 0, time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        longest = max(len(r.prompt_ids) for r in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for j, r in enumerate(chunk):  # left padding, as generate() expects for decoder-only models
            ids[j, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[j, longest - len(r.prompt_ids) :] = 1
        wanted = [r.sampling.max_new_tokens for r in chunk]
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(wanted),
            min_new_tokens=max(wanted),  # no stop tokens on either side
            pad_token_id=0,
            eos_token_id=None,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] - longest == max(wanted)
        useful += sum(wanted)
    return useful, time.perf_counter() - start


def measure(side: str, scenario: str, args) -> dict:
    """Best of `args.repeats` runs of one side on one scenario, after a warm-up run."""
    spec = models.tiny(**MODEL)
    vocab = spec.build().config.vocab_size
    requests = make_requests(scenario_lengths(scenario, args.requests, args.seed), vocab, args.seed)
    warm = make_requests([8] * args.batch, vocab, args.seed + 1)
    runs = []
    if side == "engine":
        with HFEngine(spec, max_batch_size=args.batch, seed=args.seed) as engine:
            run_engine(engine, warm)
            runs = [run_engine(engine, requests) for _ in range(args.repeats)]
    else:
        model = spec.build()
        torch.manual_seed(args.seed)
        run_generate(model, warm, args.batch)
        runs = [run_generate(model, requests, args.batch) for _ in range(args.repeats)]
    return {"tokens": runs[0][0], "seconds": min(seconds for _, seconds in runs)}


def measure_in_subprocess(side: str, scenario: str, args) -> dict:
    """Run `measure` in a fresh interpreter.

    Each side gets a process of its own: torch's OpenMP pools are per calling thread, and an idle
    pool left by the other side (the engine decodes on its own thread) measurably slows the next
    run on a 2-core machine.
    """
    command = [
        sys.executable, __file__, "--measure", side, scenario,
        "--requests", str(args.requests), "--batch", str(args.batch),
        "--seed", str(args.seed), "--repeats", str(args.repeats),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(scenario: str, args) -> dict:
    engine = measure_in_subprocess("engine", scenario, args)
    generate = measure_in_subprocess("generate", scenario, args)
    assert engine["tokens"] == generate["tokens"]
    return {
        "scenario": scenario,
        "tokens": engine["tokens"],
        "engine": engine["tokens"] / engine["seconds"],
        "generate": generate["tokens"] / generate["seconds"],
        "engine_s": engine["seconds"],
        "generate_s": generate["seconds"],
    }


def render(rows: list[dict], args, load_before: tuple[float, ...]) -> str:
    targets = {"uniform": 0.9, "long-tail": 1.5}
    model = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    load = ", ".join(f"{x:.2f}" for x in load_before)
    lines = [
        f"model tiny({model}), {args.requests} requests, batch {args.batch}, temperature 1.0, "
        f"torch threads {torch.get_num_threads()}, best of {args.repeats}, "
        f"load average before the run {load}",
        "",
        "| scenario | useful tokens | engine tok/s | generate() tok/s | ratio | target |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["engine"] / r["generate"]
        target = targets[r["scenario"]]
        mark = "ok" if ratio >= target else "MISSED"
        lines.append(
            f"| {r['scenario']} | {r['tokens']} | {r['engine']:.0f} ({r['engine_s']:.1f}s) "
            f"| {r['generate']:.0f} ({r['generate_s']:.1f}s) | {ratio:.2f}x | >= {target}x {mark} |"
        )
    return "\n".join(lines)


def write_results(table: str, path: Path) -> None:
    """Replace (or append) this benchmark's section of bench/RESULTS.md."""
    body = f"{SECTION}\n\n```\n.venv/bin/python bench/engine.py\n```\n\n{table}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION in text:
        before, _, rest = text.partition(SECTION)
        after = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
        text = before + body + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--measure", nargs=2, metavar=("SIDE", "SCENARIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # internal: one measurement, printed as JSON for the parent process
        print(json.dumps(measure(*args.measure, args)))
        return
    load_before = os.getloadavg()  # other processes' load (ours adds ~2 once running)
    rows = [bench(s, args) for s in ("uniform", "long-tail")]
    table = render(rows, args, load_before)
    print(table)
    if not args.no_write:
        write_results(table, ROOT / "bench" / "RESULTS.md")


if __name__ == "__main__":
    main()
