"""astranb beside TRL's GRPOTrainer on CPU: same task, model, tokenizer, batch and learning rate.

    .venv/bin/python bench/vs_trl.py              # 3 seeds, both tasks: ~30 min on 2 cores
    .venv/bin/python bench/vs_trl.py --quick      # smoke run: 1 seed, 30 s caps, ~4 min
    .venv/bin/python bench/vs_trl.py --skip-trl   # the astranb half only

The first run also creates TRL's virtual environment (below): a few minutes more.

Model: a random-init Qwen3 (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, FFN 256, tied
embeddings) over a 16-token character tokenizer ("0123456789+= " plus pad, eos, unk), written once
per seed with save_pretrained; astranb reads it with `ab.models.local(dir)`, TRL with
`from_pretrained(dir)`. Batch: 16 prompts x 8 samples per step, temperature 1, AdamW at a constant
lr 3e-4, GRPO clipped at 0.2, no KL, token-mean loss, gradient norm clipped at 1.

Tasks:
    digit  "a+b=" -> (a+b) mod 10; reward 1 when the first generated token is that digit
           (2 new tokens at most; a random policy scores about 1/16).
    sum    "a+b=" -> a+b (0..18); reward 1 for exactly the answer's digits followed by eos
           (3 new tokens at most, so a completion is 1 to 3 tokens long).

Runs per task and seed, one after the other: astranb with max_staleness=2 and with
max_staleness=0 (GRPO defaults: groups without reward spread are not trained on), and TRL's
GRPOTrainer. Each run stops when the mean reward of its last 1,280 episodes reaches 0.9, or at the
wall-clock cap (180 s for digit, 120 s for sum; `--cap`). Times count from the start of training,
models already loaded.

Threads: astranb's Session (defaults) trains in a child process with one torch thread and
samples in an engine thread with one, on 2 cores; the TRL process gets one torch thread as well
(`--trl-threads`; 0 keeps torch's default, all cores). With two, TRL's steps were ~30% faster
while the machine was quiet, but at times when other processes kept the cores busy they stalled,
up to 30x slower.

TRL is not a dependency of the project, so it runs in its own virtual environment,
bench/.venv-trl, which this script creates on first use; the project's .venv stays as `make setup`
made it. The TRL venv gets the project's torch, transformers and tokenizers versions, so both tools
run the same model code. Each TRL run is a subprocess that prints one JSON line per step. If TRL
cannot be installed the script says why and still runs the astranb half. Prints a markdown section
for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_REQUIREMENTS = HERE / "trl-requirements.txt"
TORCH_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
VOCAB = (PAD, EOS, UNK, *"0123456789+= ")
GROUPS, GROUP_SIZE, LR = 16, 8, 3e-4
BATCH = GROUPS * GROUP_SIZE
ENGINE_BATCH = 2 * BATCH
"""Most sequences astranb's engine decodes at once (`max_batch_size`). Not the training batch:
with the group filter a step plays ~200 episodes, and while the trainer works on one batch the
engine already plays the next; a wider decode batch spends its per-step Python once for more of
them (TRL generates each step's 128 completions in one `generate` call)."""
TARGETS = (0.5, 0.9)
WINDOW = 1280
"""Episodes the reward is averaged over (10 steps of TRL's 128)."""
MARKER = "vs_trl-json "
"""Prefix of the TRL worker's JSON lines (TRL and transformers print to stdout too)."""


# -- the tasks ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """One arithmetic task, scored on token ids so both tools score exactly alike."""

    name: str
    """Short name, used on the command line."""
    max_new_tokens: int
    """Completion budget."""
    modulo: bool
    """True: the answer is (a+b) mod 10 and only the first token counts; False: the whole sum,
    then eos."""
    cap: float
    """Default wall-clock cap of one run, seconds."""

    def sample(self, rng: random.Random) -> dict[str, str]:
        a, b = rng.randrange(10), rng.randrange(10)
        return {"prompt": f"{a}+{b}=", "answer": str((a + b) % 10 if self.modulo else a + b)}

    def reward(self, completion_ids: Sequence[int], answer: str) -> float:
        wanted = [VOCAB.index(c) for c in answer]
        if self.modulo:
            return float(list(completion_ids[:1]) == wanted)
        return float(list(completion_ids) == [*wanted, VOCAB.index(EOS)])


TASKS = {"digit": Task("digit", 2, True, 180.0), "sum": Task("sum", 3, False, 120.0)}


def write_model(directory: Path, seed: int) -> Path:
    """Save the random-init Qwen3 and the character tokenizer into `directory`."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # characters
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS,
                                        unk_token=UNK)
    config = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
        max_position_embeddings=64, pad_token_id=VOCAB.index(PAD),
        eos_token_id=VOCAB.index(EOS), bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# -- measuring ------------------------------------------------------------------------------------
# A run is a list of rows, one per train step: {"time": s since training began, "reward": mean
# reward of the episodes that finished since the previous step, "count": how many}.

def window_mean(rows: Sequence[dict]) -> float | None:
    """Mean reward of the last WINDOW episodes (None before there are that many). The oldest row
    in the window counts with only the episodes it contributes."""
    need, total = WINDOW, 0.0
    for row in reversed(rows):
        take = min(row["count"], need)
        total += row["reward"] * take if take else 0.0
        need -= take
        if need == 0:
            return total / WINDOW
    return None


def finished(rows: Sequence[dict], cap: float) -> bool:
    """The stop rule both tools follow: the top target reached, or the cap."""
    return bool(rows) and (rows[-1]["time"] >= cap or (window_mean(rows) or 0.0) >= TARGETS[-1])


def summarize(rows: Sequence[dict]) -> dict:
    """Throughput, final reward, and seconds and steps to each target (None: not reached)."""
    if not rows:
        return {"steps": 0, "seconds": 0.0, "steps_per_s": 0.0, "episodes_per_s": 0.0,
                "final": None, "first": None, **{f"to_{t}": None for t in TARGETS}}
    seconds, episodes = max(rows[-1]["time"], 1e-9), sum(r["count"] for r in rows)
    reached: dict[str, dict | None] = {f"to_{t}": None for t in TARGETS}
    for i in range(len(rows)):
        mean = window_mean(rows[:i + 1])
        for t in TARGETS:
            if mean is not None and mean >= t and reached[f"to_{t}"] is None:
                reached[f"to_{t}"] = {"seconds": rows[i]["time"], "steps": i + 1}
    return {"steps": len(rows), "seconds": seconds, "steps_per_s": len(rows) / seconds,
            "episodes_per_s": episodes / seconds, "final": window_mean(rows),
            "first": rows[0]["reward"], **reached}


# -- the astranb half -----------------------------------------------------------------------------

def arithmetic_env(task: Task):
    """The task as an astranb environment: all a user writes for it."""
    import astranb as ab

    class Arithmetic(ab.Environment):
        roles = ("solver",)
        sampling = ab.SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens)

        def samples(self, seed=0):
            rng = random.Random(seed)
            while True:
                yield task.sample(rng)

        async def episode(self, ctx, sample):
            out = await ctx.generate("solver", sample["prompt"])
            return task.reward(out.completion_ids, sample["answer"])

    return Arithmetic()


def run_astranb(task: Task, staleness: int, seed: int, model_dir: Path, cap: float,
                workdir: Path, algorithm=None) -> list[dict]:
    """One astranb run, stopped by `finished`; its rows. `algorithm`: GRPO's defaults unless
    given (bench/zoo.py passes the zoo's configs).

    The stop rule is checked on each metrics row as it is recorded (`run.on_event`), as TRL's
    side checks it in a step callback: polling `run.metrics` from this thread would build a
    DataFrame of every row twice a second, on the same GIL as the engine and the event loop."""
    import threading

    import astranb as ab

    with ab.Session(workdir) as session:
        policy = session.policy("solver", model=ab.models.local(model_dir),
                                algorithm=algorithm or ab.GRPO(),
                                optimizer=ab.AdamWConfig(lr=LR), max_batch_size=ENGINE_BATCH,
                                seed=seed)
        session.wire(arithmetic_env(task), solver=policy)
        rows: list[dict] = []
        reached = threading.Event()

        def on_row(kind: str, row) -> None:
            if kind == "metrics":
                count = int(row.get("episodes_since_step") or 0)
                rows.append({"time": float(row["time"]), "count": count,
                             "reward": float(row["reward"]) if count else 0.0})
                if finished(rows, cap):
                    reached.set()

        started = time.monotonic()
        run = session.train(steps=1_000_000, batch_size=BATCH, group_size=GROUP_SIZE,
                            max_staleness=staleness, seed=seed)
        run.on_event(on_row)
        while not run.done and not reached.wait(0.5):
            if time.monotonic() - started > cap + 60:
                break
        run.stop()
        run.wait(progress=False)
        return _astranb_rows(run.metrics)


def _astranb_rows(df) -> list[dict]:
    if df.empty:
        return []
    return [{"time": float(t), "reward": float(r) if n else 0.0, "count": int(n)}
            for t, r, n in zip(df["time"], df["reward"], df["episodes_since_step"],
                               strict=True)]


# -- the TRL half ---------------------------------------------------------------------------------

def ensure_trl_venv(venv: Path) -> tuple[Path | None, str]:
    """The TRL venv's python, creating the venv on first use; (None, why) when that fails."""
    import tokenizers
    import torch
    import transformers

    python = venv / "bin" / "python"
    pins = [f"transformers=={transformers.__version__}", f"tokenizers=={tokenizers.__version__}"]
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    wanted = "\n".join([TRL_REQUIREMENTS.read_text(), torch_pin, *pins])
    marker = venv / ".installed"
    if marker.is_file() and marker.read_text() == wanted and python.is_file():
        return python, ""
    print(f"note: creating {venv.name} (TRL's own virtual environment, one time, a few minutes):"
          f" {torch_pin} (CPU), {', '.join(pins)}, and {TRL_REQUIREMENTS.name}", file=sys.stderr)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    try:
        _call([sys.executable, "-m", "venv", "--clear", str(venv)])
        try:  # the CPU build, as the Makefile installs it; else the plain requirement
            _call([*pip, "--timeout", "15", "--retries", "0", "--index-url", TORCH_INDEX,
                   torch_pin])
        except RuntimeError:
            print(f"note: {TORCH_INDEX} is not reachable; installing {torch_pin} from the "
                  "default index", file=sys.stderr)
            _call([*pip, torch_pin])
        try:
            _call([*pip, "-r", str(TRL_REQUIREMENTS), *pins])
        except RuntimeError as error:
            print(f"note: TRL does not install beside {', '.join(pins)} ({error}); letting pip "
                  "choose (the model code of the two tools may then differ)", file=sys.stderr)
            _call([*pip, "-r", str(TRL_REQUIREMENTS)])
        _call([str(python), "-c", "import trl"])
    except (RuntimeError, OSError) as error:
        return None, f"could not set up {venv.name}: {error}"
    marker.write_text(wanted)
    return python, ""


def _call(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        errors = [line[:300] for line in lines if line.startswith("ERROR")] or lines[-3:]
        raise RuntimeError(f"`{' '.join(command[2:5])} ...` failed: " + " / ".join(errors))


def run_trl(python: Path, task: Task, seed: int, model_dir: Path, cap: float, workdir: Path,
            threads: int | None) -> tuple[list[dict], dict]:
    """One TRL run in the TRL venv; its rows and the worker's versions. Raises on failure."""
    config = {"task": task.name, "seed": seed, "model": str(model_dir), "cap": cap,
              "output": str(workdir), "threads": threads}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": ""}
    log = workdir / "trl.log"
    rows: list[dict] = []
    meta: dict = {}
    with open(log, "w") as stderr:
        worker = subprocess.Popen([str(python), __file__, "--trl-worker", json.dumps(config)],
                                  stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        assert worker.stdout is not None
        for line in worker.stdout:
            if line.startswith(MARKER):
                record = json.loads(line[len(MARKER):])
                meta.update(record.get("meta", {}))
                rows.extend([record["row"]] if "row" in record else [])
        worker.wait()
    if worker.returncode:
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"TRL worker exited with {worker.returncode}: " + " / ".join(tail))
    return rows, meta


def trl_worker(config: dict) -> None:
    """Train with TRL's GRPOTrainer (runs inside the TRL venv) and print a JSON line per step."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    task, cap = TASKS[config["task"]], float(config["cap"])
    if config.get("threads"):
        torch.set_num_threads(config["threads"])
    emit = lambda record: print(MARKER + json.dumps(record), flush=True)  # noqa: E731
    emit({"meta": {"trl": trl.__version__, "transformers": transformers.__version__,
                   "torch": torch.__version__, "threads": torch.get_num_threads()}})
    rng = random.Random(config["seed"])
    data = Dataset.from_list([task.sample(rng) for _ in range(20_000)])
    tokenizer = AutoTokenizer.from_pretrained(config["model"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(config["model"], local_files_only=True,
                                                 dtype=torch.float32)
    rewards: list[float] = []

    def correct(prompts, completions, completion_ids, answer, **_):
        scores = [task.reward(ids, a) for ids, a in zip(completion_ids, answer, strict=True)]
        rewards.extend(scores)
        return scores

    class Meter(TrainerCallback):
        """Times each step from the start of training, records its reward, applies the cap."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.rows = time.perf_counter(), []

        def on_step_end(self, args, state, control, **kwargs):
            row = {"time": time.perf_counter() - self.started,
                   "reward": sum(rewards) / max(len(rewards), 1), "count": len(rewards)}
            rewards.clear()
            self.rows.append(row)
            emit({"row": row})
            control.should_training_stop = finished(self.rows, cap)

    args = trl.GRPOConfig(
        output_dir=config["output"], per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
        max_completion_length=task.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", max_steps=1_000_000, seed=config["seed"],
        use_cpu=True, bf16=False, activation_checkpointing=False, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Meter()])
    trainer.train()


# -- the benchmark --------------------------------------------------------------------------------

CONFIGS = ("astranb s=2", "astranb s=0", "TRL")


def bench(args, trl_python: Path | None, trl_why: str) -> dict:
    """Every (task, seed, config) run, one after the other; results[task][config] = [runs]."""
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for name in args.tasks:
            task, results[name] = TASKS[name], {c: [] for c in CONFIGS}
            cap = args.cap or (30.0 if args.quick else task.cap)
            for seed in range(args.seeds):
                model_dir = write_model(Path(tmp) / f"model-{seed}", seed)
                for config in CONFIGS:
                    workdir = Path(tempfile.mkdtemp(dir=tmp))
                    result = _one(config, task, seed, model_dir, cap, workdir, trl_python,
                                  trl_why, args.trl_threads)
                    results[name][config].append(result)
                    print(f"{name} seed {seed} {config}: {_progress(result)}", file=sys.stderr)
    return results


def _one(config: str, task: Task, seed: int, model_dir: Path, cap: float, workdir: Path,
         trl_python: Path | None, trl_why: str, trl_threads: int | None) -> dict:
    try:
        if config == "TRL":
            if trl_python is None:
                return {"error": trl_why}
            rows, versions = run_trl(trl_python, task, seed, model_dir, cap, workdir,
                                     trl_threads)
        else:
            staleness = int(config.rsplit("=", 1)[1])
            rows, versions = run_astranb(task, staleness, seed, model_dir, cap, workdir), {}
    except Exception as error:  # noqa: BLE001 - one failed run is reported, the rest go on
        return {"error": f"{type(error).__name__}: {error}"}
    return {**summarize(rows), **versions, "cap": cap, "load": os.getloadavg()[0]}


def _progress(result: dict) -> str:
    if "error" in result:
        return f"failed ({result['error']})"
    to = result[f"to_{TARGETS[-1]}"]
    where = f"{to['seconds']:.1f} s, {to['steps']} steps" if to else "not reached"
    return (f"{TARGETS[-1]} {where}; {result['steps_per_s']:.2f} steps/s, "
            f"{result['episodes_per_s']:.0f} episodes/s, final {result['final'] or 0:.3f} "
            f"(load average {result['load']:.1f})")


# -- the report -----------------------------------------------------------------------------------

def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median with None counted as 'later than every number' (None when the median is)."""
    ranked = sorted(math.inf if v is None else v for v in values)
    if not ranked:
        return None
    m = statistics.median(ranked)
    return None if math.isinf(m) else m


def report(results: dict, load: tuple, seconds: float) -> str:
    """The markdown section for bench/RESULTS.md."""
    command = " ".join(["python bench/vs_trl.py", *sys.argv[1:]])
    lines = [f"## astranb vs TRL's GRPOTrainer on CPU (bench/vs_trl.py, {date.today()})", "",
             "```", command, "```", ""]
    lines += _setup_text(results, load, seconds)
    for name, by_config in results.items():
        lines += _task_table(TASKS[name], by_config)
    return "\n".join(lines)


def _setup_text(results: dict, load: tuple, seconds: float) -> list[str]:
    import torch
    import transformers

    import astranb as ab

    runs = [r for task in results.values() for c in task.values() for r in c if "load" in r]
    meta = next((r for r in runs if "trl" in r), None)
    trl = (f"TRL {meta['trl']} in its own venv (transformers {meta['transformers']}, torch "
           f"{meta['torch']}; torch threads {meta['threads']})" if meta else "TRL not run")
    loads = sorted(r["load"] for r in runs) or [0.0]
    return [
        f"astranb {ab.__version__} (transformers {transformers.__version__}, torch "
        f"{torch.__version__}; Session defaults: the trainer in a child process "
        f"(trainer='process'), the engine in a thread of the notebook's process "
        f"(max_batch_size={ENGINE_BATCH}), "
        f"{max(1, (os.cpu_count() or 2) // 2)} torch thread(s) each); {trl}. "
        f"{os.cpu_count()} CPU cores shared with other work: load average {load[0]:.2f} "
        f"before the benchmark, {loads[0]:.1f} to {loads[-1]:.1f} at the ends of runs. Whole "
        f"benchmark {seconds / 60:.1f} min.",
        "",
        f"One random-init Qwen3 per seed (hidden 128, 2 layers, 4 heads / 2 KV heads, FFN 256, "
        f"tied embeddings; 16-token character tokenizer), the same files for both tools. Per step "
        f"{GROUPS} prompts x {GROUP_SIZE} samples, temperature 1; AdamW at lr {LR:g} constant, "
        f"clip 0.2, no KL, token-mean loss, grad norm clipped at 1. Reward: mean of the last "
        f"{WINDOW} episodes; a run stops when that reaches {TARGETS[-1]}, or at its cap. Seconds "
        f"count from the start of training. Medians over seeds; a seed that missed a target "
        f"counts as slower than any that reached it (— when the median missed it). astranb "
        f"s=N: max_staleness=N, GRPO defaults (groups without reward spread are not trained on, "
        f"so a step may play more than {BATCH} episodes). untrained: reward of the first step's "
        f"episodes.",
        "",
    ]


def _task_table(task: Task, by_config: dict[str, list[dict]]) -> list[str]:
    caps = sorted({r["cap"] for runs in by_config.values() for r in runs if "cap" in r})
    about = ("(a+b) mod 10, reward for the first token" if task.modulo
             else "a+b (0..18), reward for exactly its digits then eos")
    lines = [f"### {task.name}: {about}; {task.max_new_tokens} new tokens at most, cap "
             f"{', '.join(f'{c:g}' for c in caps)} s", "",
             f"| run | s to {TARGETS[0]} | steps | s to {TARGETS[1]} | steps | reached "
             f"{TARGETS[1]} | s to {TARGETS[1]} per seed | steps/s | episodes/s | episodes/step "
             "| final reward | untrained |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    medians = {}
    for config, runs in by_config.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {config} | not run: {runs[0]['error'] if runs else '-'} |"
                         + " |" * 10)
            continue
        medians[config] = m = _medians(ok)
        high = f"to_{TARGETS[1]}"
        per_seed = ", ".join(_num(r[high] and r[high]["seconds"]) for r in ok)
        lines.append(
            f"| {config} | {_num(m['s0'])} | {_num(m['n0'], 0)} | {_num(m['s1'])} | "
            f"{_num(m['n1'], 0)} | {m['reached']}/{len(ok)} | {per_seed} | "
            f"{m['steps_per_s']:.2f} | {m['episodes_per_s']:.0f} | {m['per_step']:.0f} | "
            f"{_num(m['final'], 3)} | {_num(m['first'], 3)} |")
    return lines + [""] + _ratios(medians) + [""]


def _medians(runs: list[dict]) -> dict:
    low, high = (f"to_{t}" for t in TARGETS)
    pick = lambda key, field: [r[key] and r[key][field] for r in runs]  # noqa: E731
    return {"s0": median_or_none(pick(low, "seconds")), "n0": median_or_none(pick(low, "steps")),
            "s1": median_or_none(pick(high, "seconds")),
            "n1": median_or_none(pick(high, "steps")),
            "reached": sum(r[high] is not None for r in runs),
            "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
            "episodes_per_s": statistics.median(r["episodes_per_s"] for r in runs),
            "per_step": statistics.median(r["episodes_per_s"] / (r["steps_per_s"] or 1)
                                          for r in runs),
            "final": median_or_none([r["final"] for r in runs]),
            "first": median_or_none([r["first"] for r in runs])}


def _ratios(medians: dict) -> list[str]:
    trl = medians.get("TRL")
    if trl is None:
        return ["No TRL figures, so no ratios."]
    ratio = lambda a, b: "—" if a is None or not b else f"{a / b:.2f}"  # noqa: E731
    return [f"- {config} / TRL: time to {TARGETS[1]} {ratio(m['s1'], trl['s1'])}, to "
            f"{TARGETS[0]} {ratio(m['s0'], trl['s0'])}; episodes/s "
            f"{ratio(m['episodes_per_s'], trl['episodes_per_s'])}"
            for config, m in medians.items() if config != "TRL"]


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 30 s caps")
    parser.add_argument("--cap", type=float, default=None, help="wall-clock cap per run, s")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS),
                        help="comma-separated, of " + ", ".join(TASKS))
    parser.add_argument("--skip-trl", action="store_true", help="run the astranb half only")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch threads of the TRL process (0: torch's default)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # inside the TRL venv
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    if unknown := set(args.tasks) - set(TASKS):
        parser.error(f"unknown task(s) {sorted(unknown)}; pick from {', '.join(TASKS)}")
    args.seeds = 1 if args.quick else args.seeds
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per model load would bury the progress lines
    load, started = os.getloadavg(), time.monotonic()
    python, why = (None, "--skip-trl") if args.skip_trl else ensure_trl_venv(TRL_VENV)
    if python is None:
        print(f"note: TRL is not run ({why}); running the astranb half only", file=sys.stderr)
    results = bench(args, python, why)
    print(report(results, load, time.monotonic() - started))


if __name__ == "__main__":
    main()
