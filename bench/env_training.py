"""Training on the agent environments with the tiny chat model on CPU: held-out avg@1 before
any training, after a short warm start, and along and after RL.

    agentbench  `astranb_agentbench.AgentBench` against the protocol-following stand-in
             controller (`astranb_agentbench.fake`, over HTTP in-process): guess a number from
             1 to 10 in 5 guesses, told "higher" or "lower" after each. Half the warm start's
             conversations guess at random (they win ~4 in 10), half halve the range (they
             always win): RL has to learn which to follow. Held out: sample indices 100-199
             (training plays 0-99).
    code     `astranb_code.Code` on generated one-line functions ("Write a Python function
             times_37(x) that returns x multiplied by 37."), scored by running 4 asserts in the
             sandbox. The held-out split is 20% of the (kind, constant) pairs, never seen in
             training: the model has to read the name and the constant off the prompt.
    search   `astranb_search.Search` over an invented world of 2,000 places (BM25, top 2). The
             held-out questions ask about places no demonstration or training question names:
             the model has to search the place it is asked about and copy the answer out of the
             passage the retriever returns.

Each run: evaluate (n questions, k = 1), `policy.sft` on demonstrations, evaluate, asynchronous
GRPO with evaluation windows every `--eval-every` versions, evaluate. The whole run, evaluations
included, is timed; the issue's target is a held-out avg@1 rise >= 0.2 within 10 minutes on 2
cores. Writes results/env_training_<env>.json and a curve (.png).

    .venv/bin/python bench/env_training.py --env code
    .venv/bin/python bench/env_training.py --env search
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import astranb as ab

ROOT = Path(__file__).resolve().parents[1]

# per environment: warm start, RL and evaluation settings that fit 10 minutes on 2 cores
RECIPES: dict[str, dict[str, Any]] = {
    "agentbench": dict(sft_steps=60, sft_lr=5e-3, steps=60, batch_size=32, lr=5e-4, eval_n=100,
                       eval_every=10, max_new_tokens=8),
    "code": dict(sft_steps=150, sft_lr=5e-3, steps=100, batch_size=32, lr=5e-4, eval_n=100,
                 eval_every=10, max_new_tokens=40),
    "search": dict(sft_steps=200, sft_lr=5e-3, steps=40, batch_size=32, lr=5e-4, eval_n=100,
                   eval_every=10, max_new_tokens=24),
}


# -- the environments ----------------------------------------------------------------------------

def code_setup(settings: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    from astranb_code import Code, Limits, synthetic_tasks

    system = "Write the function in a ```python block."
    tasks = synthetic_tasks(4000, seed=0, constants=range(2, 100))
    pairs = sorted({t["entry_point"] for t in tasks})
    held_out = set(random.Random(1).sample(pairs, len(pairs) // 5))
    train = [t for t in tasks if t["entry_point"] not in held_out]
    test = [t for t in synthetic_tasks(4000, seed=1, constants=range(2, 100))
            if t["entry_point"] in held_out]
    env = Code({"train": train, "test": test}, system_prompt=system,
               limits=Limits(cpu_seconds=2, wall_seconds=5),
               sampling={"max_new_tokens": settings["max_new_tokens"]})
    demos = [{"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": t["prompt"]},
        {"role": "assistant", "content": f"```python\n{t['solution']}\n```"}]}
        for t in train[:2000]]
    return env, demos


def search_setup(settings: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    from astranb_search import BM25Retriever, Search, facts
    from astranb_search.synthetic import demonstrations

    system = "Search the place with <search>, then reply <answer>."
    passages, questions = facts(2000, seed=0)
    retriever = BM25Retriever(passages)
    train, test = questions[:1600], questions[1600:]
    env = Search({"train": train, "test": test}, retriever, k=2, max_turns=2,
                 system_prompt=system, sampling={"max_new_tokens": settings["max_new_tokens"]})
    demos = demonstrations(train[:800], retriever, system, k=2)
    return env, demos


def agentbench_setup(settings: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    import httpx
    from astranb_agentbench import AgentBench
    from astranb_agentbench.fake import TASK, FakeController, demonstrations

    fake = FakeController(samples=200)
    env = AgentBench(TASK, controller="http://fake/api", indices=range(100),
                     test_indices=range(100, 200), max_turns=5,
                     sampling={"max_new_tokens": settings["max_new_tokens"]},
                     transport=httpx.ASGITransport(fake.app))
    return env, (demonstrations(500, seed=0, strategy="random")
                 + demonstrations(500, seed=1, strategy="bisect"))


SETUPS = {"agentbench": agentbench_setup, "code": code_setup, "search": search_setup}


# -- one run -------------------------------------------------------------------------------------

def run(name: str, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    env, demos = SETUPS[name](settings)
    session = ab.Session(tempfile.mkdtemp(prefix=f"astranb-{name}-"))
    policy = session.policy("agent", ab.models.tiny_chat(),
                            algorithm=ab.GRPO(filter_groups=True),
                            optimizer=ab.AdamWConfig(lr=settings["lr"]))
    role = env.roles[0]
    session.wire(env, **{role: policy})
    n = settings["eval_n"]

    def evaluate() -> float:
        return float(session.evaluate(env, split="test", n=n, k=1)[role].avg_at_k)

    before = evaluate()
    sft_started = time.perf_counter()
    policy.sft(demos, steps=settings["sft_steps"], batch_size=16, lr=settings["sft_lr"])
    sft_seconds = time.perf_counter() - sft_started
    warm = evaluate()
    print(f"{name}: held-out avg@1 {before:.2f} untrained, {warm:.2f} after the warm start "
          f"({sft_seconds:.0f} s)", flush=True)
    rl_started = time.perf_counter()
    training = session.train(steps=settings["steps"], batch_size=settings["batch_size"],
                             group_size=8, max_staleness=2, eval_every=settings["eval_every"],
                             eval_n=n, eval_k=1)
    training.wait(progress=False)
    rl_seconds = time.perf_counter() - rl_started
    after = evaluate()
    seconds = time.perf_counter() - started
    windows = [{"version": int(row["version"]), "avg@1": float(row[f"{role}/avg@1"])}
               for row in training.evaluation_rows]
    rewards = training.metrics[training.metrics["kind"] == "step"]["reward"].tolist()
    close = getattr(env, "close", None)
    if close is not None:
        close()
    session.close()
    result = {"env": name, "settings": settings, "before": before, "after_warm_start": warm,
              "after_rl": after, "rise": after - before, "rl_rise": after - warm,
              "windows": windows, "train_reward_first": rewards[:5],
              "train_reward_last": rewards[-5:], "sft_seconds": sft_seconds,
              "rl_seconds": rl_seconds, "seconds": seconds}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"env_training_{name}.json").write_text(json.dumps(result, indent=1))
    _plot(result, settings["sft_steps"], out / f"env_training_{name}.png")
    print(f"{name}: held-out avg@1 {before:.2f} -> {warm:.2f} (warm start) -> {after:.2f} "
          f"(RL); windows {[(w['version'], round(w['avg@1'], 2)) for w in windows]}; "
          f"{seconds:.0f} s in all (warm start {sft_seconds:.0f} s, RL {rl_seconds:.0f} s)",
          flush=True)
    return result


def _plot(result: dict[str, Any], sft_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = [0, sft_steps, *[w["version"] for w in result["windows"]]]
    values = [result["before"], result["after_warm_start"],
              *[w["avg@1"] for w in result["windows"]]]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(versions, values, marker="o")
    ax.axvline(sft_steps, color="grey", linestyle=":", label="warm start | RL")
    ax.set(xlabel="weight version", ylabel="held-out avg@1", ylim=(0, 1),
           title=f"{result['env']}: {result['seconds']:.0f} s on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=sorted(SETUPS), action="append",
                        help="environment to train (repeat for several; default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    for key in RECIPES["code"]:
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(RECIPES["code"][key]))
    args = parser.parse_args()
    for name in args.env or sorted(SETUPS):
        given = {k: getattr(args, k) for k in RECIPES[name] if getattr(args, k) is not None}
        run(name, {**RECIPES[name], **given}, args.out)


if __name__ == "__main__":
    main()
