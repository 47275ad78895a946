"""LoRA (`ab.LoRA`, PEFT's adapters) against full fine-tuning on the quickstart's task and model.

    .venv/bin/python bench/lora.py              # 3 seeds: ~25 min on 2 cores
    .venv/bin/python bench/lora.py --quick      # 1 seed, 60 steps: a smoke run
    .venv/bin/python bench/lora.py --steps 900 --cap 600 --lora-lrs 3e-3 --norms 3e-3 --no-bytes

LoRA adapts a pretrained model; the quickstart's model starts from random weights, whose frozen
tied head and final norm bound every logit to about +-1.3 (hidden 64, init std 0.02), so
adapters on its linear layers cannot make any answer likely (measured: reward 0.02 after 600
steps from random weights, entropy stuck at 4.07 of 4.09). So each seed first makes a base:
--base-steps of full fine-tuning from random weights (the quickstart's settings), written with
`policy.save_pretrained`; both configurations then start from it.

Two parts, the configurations interleaved seed by seed so the machine's load falls on both:

  A. Learning, astranb's defaults (the trainer in a child process): notebooks/01_quickstart's
     run (arithmetic, batch 128 x group 8, max_staleness 2, GRPO with entropy 0.05) for --steps
     steps from the base, full fine-tuning at the quickstart's lr 1e-3 against LoRA (rank 8,
     alpha 16, every linear layer but the head) at each --lora-lrs (adapters usually want a higher
     rate than full fine-tuning). Reported: the last 10% of steps' reward (the quickstart's
     target: >= 0.6), held-out accuracy after the run (512 samples), steps/s, and the trainer's
     seconds per step (`trainer_seconds`: forward, backward and optimizer in the child).
  B. Bytes per version, a trainer in this process publishing bf16 deltas through the weight store
     (weight_transfer="delta", the path to rollout services): --bytes-steps steps of each
     configuration. Full fine-tuning and LoRA's merged weights are measured from the rows
     (`transfer_bytes` of the delta versions); for LoRA the adapters themselves are also taken
     after every step (bf16, as published) and the delta between consecutive versions encoded
     with the same codec: what would travel if engines merged the adapters themselves.

Prints a markdown section for bench/RESULTS.md.
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

import torch

import astranb as ab
from astranb.weights import codec

LORA = ab.LoRA(rank=8, alpha=16)
LORA_NORMS = ab.LoRA(rank=8, alpha=16, modules_to_save=("norm",))
"""The adapters, and every RMSNorm's weight trained in full beside them (PEFT's modules_to_save):
the norms set the hidden states' scale, which the frozen tied head turns into logits."""


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def make_base(steps: int, workdir: Path, seed: int) -> tuple[Path, float]:
    """Full fine-tuning from random weights for `steps` steps: the folder, its held-out score."""
    with ab.Session(workdir / "run") as session:
        policy = session.policy("solver", model=ab.models.tiny(),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=1e-3), seed=seed)
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2,
                      seed=seed).wait(progress=False)
        score = session.evaluate(n=512)["solver"]
        return policy.save_pretrained(workdir / "base"), score


def learning(base: Path, lora: ab.LoRA | None, lr: float, steps: int, cap: float,
             workdir: Path, seed: int) -> dict[str, Any]:
    """Part A: one quickstart run with the defaults; stopped at `cap` seconds if not done."""
    with ab.Session(workdir) as session:
        policy = session.policy("solver", model=ab.models.local(base),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=lr), seed=seed, lora=lora)
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        started = time.monotonic()
        run = session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2, seed=seed)
        while not run.done and time.monotonic() - started < cap:
            time.sleep(0.5)
        capped = not run.done
        run.stop()
        run.wait(progress=False)
        rows = run.rows
        evaluation = session.evaluate(n=512)["solver"]
    n = len(rows)
    tail = max(1, n // 10)
    wall = float(rows[-1]["time"]) if rows else float("nan")
    rewards = [float(r["reward"]) for r in rows]
    # the quickstart's target: the mean reward over 60 steps reaches 0.6 (None: never)
    reached = next((i + 1 for i in range(59, n) if _mean(rewards[i - 59:i + 1]) >= 0.6), None)
    return {"steps": n, "steps_to_target": reached, "capped": capped, "train_s": wall,
            "steps_per_s": n / wall if n else 0.0,
            "reward_last10": _mean([float(r["reward"]) for r in rows[-tail:]]),
            "final_eval": evaluation,
            "trainer_s": statistics.median(float(r["trainer_seconds"]) for r in rows)
            if rows else float("nan")}


def transfer(base: Path, lora: ab.LoRA | None, lr: float, steps: int, workdir: Path,
             seed: int) -> dict[str, Any]:
    """Part B: bytes per published version, merged (from the rows) and adapter-only."""
    adapters: list[dict[str, torch.Tensor]] = []
    with ab.Session(workdir, trainer="thread") as session:
        policy = session.policy("solver", model=ab.models.local(base),
                                algorithm=ab.GRPO(entropy_coef=0.05),
                                optimizer=ab.AdamWConfig(lr=lr), seed=seed, lora=lora,
                                weight_transfer="delta", full_every=0)
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        trainer: Any = policy.trainer

        def on_event(kind: str, row: Any) -> None:
            # called on the session's loop between steps: the adapters are not being updated
            if kind == "metrics" and lora is not None:
                adapters.append({k: v.to(torch.bfloat16)
                                 for k, v in trainer.adapter_weights().items()})

        if lora is not None:
            adapters.append({k: v.to(torch.bfloat16) for k, v in trainer.adapter_weights().items()})
        run = session.train(steps=steps, batch_size=128, group_size=8, max_staleness=2, seed=seed)
        run.on_event(on_event)
        run.wait(progress=False)
        rows = run.rows
        weights = sum(t.numel() for t in trainer.weights().values())
        adapter_numel = (sum(t.numel() for t in adapters[0].values()) if adapters else 0)
    deltas = [int(r["transfer_bytes"]) for r in rows if r.get("transfer_kind") == "delta"]
    changed = [float(r["changed_fraction"]) for r in rows if r.get("transfer_kind") == "delta"]
    adapter_bytes = [len(codec.encode(a, b)) for a, b in zip(adapters, adapters[1:], strict=False)
                     if any(not torch.equal(a[k], b[k]) for k in a)]
    return {"params": weights, "adapter_params": adapter_numel,
            "full_bytes": weights * 2,
            "delta_bytes": statistics.median(deltas) if deltas else float("nan"),
            "changed": statistics.median(changed) if changed else float("nan"),
            "adapter_full_bytes": adapter_numel * 2,
            "adapter_delta_bytes": statistics.median(adapter_bytes) if adapter_bytes
            else float("nan")}


def _num(value: float, digits: int = 2) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"


def report(args, learn: dict[str, list[dict]], moved: dict[str, list[dict]],
           bases: list[float], load: tuple[float, ...], seconds: float) -> str:
    lines = [f"## LoRA against full fine-tuning ({date.today().isoformat()})", "",
             f"`.venv/bin/python bench/lora.py{' --quick' if args.quick else ''} --seeds "
             f"{args.seeds}` ({seconds / 60:.0f} min, load average "
             f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end; 2 cores). Quickstart "
             f"task and model; a base per seed from {args.base_steps} full fine-tuning steps "
             f"(held-out {', '.join(_num(b) for b in bases)}), then {args.steps} steps from it: "
             f"full fine-tuning at lr {args.full_lr}, LoRA rank {LORA.rank}, alpha "
             f"{LORA.alpha:g}, all linear layers but the head (\"lora + norms\": and every "
             f"RMSNorm's weight in full, modules_to_save=('norm',)).", "",
             "| config | seed | steps | steps to target | reward, last 10% | held-out | steps/s | "
             "trainer s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in learn.items():
        for seed, r in enumerate(runs):
            lines.append(f"| {name} | {seed} | {r['steps']}{' (capped)' * r['capped']} | "
                         f"{r['steps_to_target'] or 'not reached'} | "
                         f"{_num(r['reward_last10'])} | {_num(r['final_eval'])} | "
                         f"{_num(r['steps_per_s'], 1)} | {_num(r['trainer_s'] * 1000, 1)} ms |")
    lines += ["", f"Bytes per version ({args.bytes_steps} steps, a trainer in this process "
              "publishing bf16 deltas, medians over the delta versions):", "",
              "| config | seed | parameters | full snapshot | delta (merged weights) | "
              "changed | adapter parameters | adapter snapshot | adapter delta |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in moved.items():
        for seed, r in enumerate(runs):
            lines.append(f"| {name} | {seed} | {r['params']:,} | {r['full_bytes']:,} | "
                         f"{_num(r['delta_bytes'], 0)} | {_num(r['changed'] * 100, 1)}% | "
                         f"{r['adapter_params']:,} | {r['adapter_full_bytes']:,} | "
                         f"{_num(r['adapter_delta_bytes'], 0)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--cap", type=float, default=240.0, help="wall seconds per run, part A")
    parser.add_argument("--bytes-steps", type=int, default=40)
    parser.add_argument("--full-lr", type=float, default=1e-3)
    parser.add_argument("--lora-lrs", type=lambda s: [float(x) for x in s.split(",") if x],
                        default=[1e-3, 5e-3])
    parser.add_argument("--norms", type=lambda s: [float(x) for x in s.split(",")], default=[],
                        help="lrs of LoRA with the RMSNorms trained too (modules_to_save)")
    parser.add_argument("--no-bytes", action="store_true", help="part A only")
    parser.add_argument("--no-full", action="store_true", help="leave full fine-tuning out")
    parser.add_argument("--quick", action="store_true", help="1 seed, short runs")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.base_steps, args.steps, args.cap, args.bytes_steps = 1, 20, 30, 60.0, 8
    configs: dict[str, tuple[ab.LoRA | None, float]] = {} if args.no_full else {
        f"full, lr {args.full_lr:g}": (None, args.full_lr)}
    configs.update({f"lora, lr {lr:g}": (LORA, lr) for lr in args.lora_lrs})
    configs.update({f"lora + norms, lr {lr:g}": (LORA_NORMS, lr) for lr in args.norms})
    learn: dict[str, list[dict]] = {name: [] for name in configs}
    moved: dict[str, list[dict]] = {name: [] for name in configs}
    bases: list[float] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            base, score = make_base(args.base_steps, Path(tmp) / f"base-{seed}", seed)
            bases.append(score)
            print(f"base seed {seed}: held-out {score:.3f}", flush=True)
            for i, (name, (lora, lr)) in enumerate(configs.items()):
                if (lora is not None or i == 0) and not args.no_bytes:
                    out = transfer(base, lora, lr, args.bytes_steps, Path(tmp) / f"b{i}-{seed}",
                                   seed)
                    moved[name].append(out)
                    print(f"bytes {name} seed {seed}: {out}", flush=True)
                out = learning(base, lora, lr, args.steps, args.cap, Path(tmp) / f"a{i}-{seed}",
                               seed)
                learn[name].append(out)
                print(f"learn {name} seed {seed}: {out}", flush=True)
    print()
    print(report(args, learn, moved, bases, os.getloadavg(), time.monotonic() - started))


if __name__ == "__main__":
    main()
