"""Cells of notebooks/06_agents.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "06_agents"

CELLS = [
    new_markdown_cell(
        "# A tool-using math agent: warm start, RL, held-out avg@k and pass@k\n\n"
        "A chat model solves math problems in a multi-turn conversation: it may call a "
        "`calculator` tool (`<tool_call>{json}</tool_call>`), reads the result as a tool "
        "message, and answers with `\\boxed{}`; math-verify checks the answer. Conversations "
        "keep the tokens the model sampled (token-in/token-out) and train as one masked "
        "sequence. A short supervised warm start on format demonstrations comes first (the "
        "\"cold start\" of real recipes), then asynchronous GRPO, with evaluation windows on "
        "held-out problems running alongside training.\n\n"
        "The recipe follows the machine: where CUDA is available the GPU recipe, Qwen3-0.6B on "
        "GSM8K; elsewhere (a laptop, Binder, CI) the CPU recipe, which Run All finishes "
        "within 10 minutes on 2 CPU cores: the project's tiny chat model on generated "
        "additions (`What is 37 + 48?`), too hard to do in its head and easy with the "
        "calculator, warm-started on demonstrations of which only half use the tool. What RL "
        "has to learn is to call it. The recipe cell prints the one it chose; set `recipe` "
        "(or `papermill -p recipe cpu`) to choose yourself."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        'recipe = None  # None: "gpu" where CUDA is available, else "cpu"\n'
        '#               "gpu": Qwen3-0.6B on GSM8K; "cpu": the tiny chat model, generated sums\n'
        "# None: the recipe's value\n"
        "model = None      # a Hugging Face name or directory, or \"tiny-chat\"\n"
        "dataset = None    # a Hugging Face dataset with config \"main\", or \"generated\"\n"
        "device = None\n"
        "steps = None\n"
        "batch_size = None\n"
        "group_size = 8\n"
        "filter_groups = True  # drop groups whose rewards are all equal (no signal)\n"
        "max_staleness = 2\n"
        "lr = None\n"
        "sft_steps = None\n"
        "sft_lr = None\n"
        "tool_share = 0.5  # generated data: share of demonstrations that call the tool\n"
        "max_new_tokens = None\n"
        "max_turns = None\n"
        "eval_every = None\n"
        "eval_n = None\n"
        "eval_k = None\n"
        'run_dir = "../runs/agents"\n'
        'results_dir = "../results"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "import torch\n\n"
        "RECIPES = {\n"
        "    \"gpu\": dict(model=\"Qwen/Qwen3-0.6B\", dataset=\"openai/gsm8k\", device=\"cuda\",\n"
        "                steps=200, batch_size=64, lr=1e-6, sft_steps=50, sft_lr=1e-5,\n"
        "                max_new_tokens=1024, max_turns=4, eval_every=20, eval_n=256, eval_k=4),\n"
        "    \"cpu\": dict(model=\"tiny-chat\", dataset=\"generated\", device=\"cpu\",\n"
        "                steps=40, batch_size=32, lr=5e-4, sft_steps=300, sft_lr=5e-3,\n"
        "                max_new_tokens=40, max_turns=2, eval_every=10, eval_n=100, eval_k=1),\n"
        "}\n"
        "if recipe is None:  # follow the machine\n"
        "    recipe = \"gpu\" if torch.cuda.is_available() else \"cpu\"\n"
        "    why = \"CUDA is available\" if recipe == \"gpu\" else \"CUDA is not available\"\n"
        "else:\n"
        "    why = \"chosen by the recipe parameter\"\n"
        "if recipe not in RECIPES:\n"
        "    raise ValueError(f\"recipe must be one of {sorted(RECIPES)}, got {recipe!r}\")\n"
        "print(f\"recipe {recipe!r} ({why})\")\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):  # the test suite runs it small and fast\n"
        "    recipe, steps, batch_size, sft_steps = \"cpu\", 2, 16, 2\n"
        "    eval_every, eval_n, eval_k = 1, 8, 2\n"
        "    filter_groups = False  # an untrained model earns 0 everywhere: train anyway\n"
        "    run_dir = results_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")\n"
        "given = dict(model=model, dataset=dataset, device=device, steps=steps,\n"
        "             batch_size=batch_size, lr=lr, sft_steps=sft_steps, sft_lr=sft_lr,\n"
        "             max_new_tokens=max_new_tokens, max_turns=max_turns, eval_every=eval_every,\n"
        "             eval_n=eval_n, eval_k=eval_k)\n"
        "settings = {**RECIPES[recipe], **{k: v for k, v in given.items() if v is not None}}\n"
        "globals().update(settings)\n"
        "settings"
    ),
    new_markdown_cell(
        "## Data, model, environment\n\n"
        "`Math(..., mode=\"tools\")` plays up to `max_turns` assistant turns: each tool call "
        "runs through `ctx.run_tools` (recorded, shown in the debugger) and comes back as a "
        "tool message; the first reply without a tool call is the answer."
    ),
    new_code_cell(
        "import time\n\n"
        "import astranb as ab\n"
        "from astranb_math import Math\n"
        "from astranb_math.synthetic import demonstrations, gsm8k_demonstrations, sum_problems\n\n"
        'SYSTEM = "Use the calculator, then answer as \\\\boxed{}."\n'
        "started = time.perf_counter()\n"
        'if dataset == "generated":\n'
        "    data = {\"train\": sum_problems(4000, seed=0), \"test\": sum_problems(500, seed=1)}\n"
        "    demos = demonstrations(data[\"train\"][:2000], SYSTEM, tool_share=tool_share)\n"
        "else:\n"
        "    from datasets import load_dataset\n\n"
        "    data = load_dataset(dataset, \"main\")\n"
        "    demos = gsm8k_demonstrations(data[\"train\"].select(range(1000)), SYSTEM)\n\n"
        "spec = ab.models.tiny_chat() if model == \"tiny-chat\" else ab.models.hf(model)\n"
        "session = ab.Session(run_dir, device=device)\n"
        "policy = session.policy(\"solver\", spec,\n"
        "                        algorithm=ab.GRPO(filter_groups=filter_groups),\n"
        "                        optimizer=ab.AdamWConfig(lr=lr))\n"
        "env = Math(data, mode=\"tools\", system_prompt=SYSTEM, max_turns=max_turns,\n"
        "           sampling={\"max_new_tokens\": max_new_tokens})\n"
        "session.wire(env, solver=policy)\n"
        "demos[0][\"messages\"]"
    ),
    new_markdown_cell("Held-out problems before any training:"),
    new_code_cell(
        "before = session.evaluate(env, split=\"test\", n=eval_n, k=eval_k)[\"solver\"]\n"
        "before"
    ),
    new_markdown_cell(
        "## Warm start\n\n"
        "`policy.sft` trains on the demonstrations with the loss on the assistant's tokens only "
        "(tool results and prompts are context), tokenized exactly as `ctx.chat` builds prompts."
    ),
    new_code_cell(
        "sft_started = time.perf_counter()\n"
        "history = policy.sft(demos, steps=sft_steps, batch_size=16, lr=sft_lr)\n"
        "sft_seconds = time.perf_counter() - sft_started\n"
        "warm = session.evaluate(env, split=\"test\", n=eval_n, k=eval_k)[\"solver\"]\n"
        "warm"
    ),
    new_markdown_cell(
        "## RL\n\n"
        "`eval_every` plays an evaluation window on the held-out split every so many versions, "
        "alongside training; its episodes never reach the trainer."
    ),
    new_code_cell(
        "rl_started = time.perf_counter()\n"
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness, eval_every=eval_every, eval_n=eval_n,\n"
        "                    eval_k=eval_k)\n"
        "run.dashboard()"
    ),
    new_code_cell("await run\nrl_seconds = time.perf_counter() - rl_started"),
    new_markdown_cell("## Results"),
    new_code_cell(
        "import json\n"
        "from pathlib import Path\n\n"
        "after = session.evaluate(env, split=\"test\", n=eval_n, k=eval_k)[\"solver\"]\n"
        "summary = {\"model\": spec.name, \"dataset\": dataset, \"k\": eval_k, \"n\": eval_n,\n"
        "           \"before\": before.avg_at_k, \"after_warm_start\": warm.avg_at_k,\n"
        "           \"after_rl\": after.avg_at_k, \"pass_after_rl\": after.pass_at_k,\n"
        "           \"rl_rise\": after.avg_at_k - warm.avg_at_k, \"sft_seconds\": sft_seconds,\n"
        "           \"rl_seconds\": rl_seconds, \"seconds\": time.perf_counter() - started,\n"
        "           \"windows\": run.evaluation_rows}\n"
        "out = Path(results_dir)\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / \"06_agents.json\").write_text(json.dumps(summary, indent=1, default=str))\n"
        "import matplotlib\n\n"
        "matplotlib.use(\"Agg\")\n"
        "import matplotlib.pyplot as plt\n\n"
        "curve = run.evaluations\n"
        "fig, ax = plt.subplots(figsize=(5, 3))\n"
        "for name, style in ((\"avg\", \"-\"), (\"pass\", \"--\")):\n"
        "    ax.plot(curve[\"version\"], curve[f\"solver/{name}@{eval_k}\"], style, marker=\"o\",\n"
        "            label=f\"{name}@{eval_k}\")\n"
        "ax.set(xlabel=\"weight version (warm start, then RL)\", ylabel=\"held-out\",\n"
        "       ylim=(0, 1))\n"
        "ax.legend()\n"
        "fig.tight_layout()\n"
        "fig.savefig(out / \"06_agents_curve.png\", dpi=100)\n"
        "curve"
    ),
    new_code_cell(
        "print(f\"held-out avg@{eval_k}: {before.avg_at_k:.3f} untrained, \"\n"
        "      f\"{warm.avg_at_k:.3f} after the warm start, {after.avg_at_k:.3f} after RL \"\n"
        "      f\"(pass@{eval_k} {after.pass_at_k:.3f})\")\n"
        "steps_only = run.metrics[run.metrics[\"kind\"] == \"step\"]\n"
        "shown = (\"step\", \"reward\", \"truncated\", \"staleness_max\")\n"
        "steps_only[[c for c in steps_only if c in shown or c.startswith(\"count/\")]].tail()"
    ),
    new_markdown_cell(
        "Step through one episode: the chat turns, the tool call between them, the loss mask "
        "(the tool result is context, not trained), and the reward."
    ),
    new_code_cell("run.episodes[-1].show()"),
    new_code_cell("env.close()\nsession.close()"),
]
