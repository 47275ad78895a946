"""Cells of notebooks/09_research.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "09_research"

CELLS = [
    new_markdown_cell(
        "# Research: your own loss, a step taken apart, the zoo, LoRA and distillation\n\n"
        "astranb is built for changing how an agent learns and seeing what the change did. "
        "This notebook writes a loss in a cell and trains with it, takes one update apart cell "
        "by cell (play, batch, forward/backward, optimizer step, publish), opens a recorded step "
        "in the step inspector, runs three algorithms of the zoo side by side, LoRA against "
        "full fine-tuning, and on-policy distillation from a teacher against RL. All on the "
        "quickstart's task (single-digit sums, 0/1 reward) and its ~135K-parameter model. Run "
        "All finishes within 12 minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 150\n"
        "batch_size = 128\n"
        "group_size = 8\n"
        "lr = 1e-3\n"
        "lora_lr = 5e-3\n"
        "entropy_coef = 0.05\n"
        "eval_episodes = 256\n"
        'run_dir = "../runs/research"\n'
        'results_dir = "../results"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast\n"
        "    steps = 3 if steps == 150 else steps\n"
        "    batch_size = 16 if batch_size == 128 else batch_size\n"
        "    eval_episodes = 16 if eval_episodes == 256 else eval_episodes\n"
        "    smoke_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")\n"
        "    run_dir = smoke_dir if run_dir == \"../runs/research\" else run_dir\n"
        "    results_dir = smoke_dir if results_dir == \"../results\" else results_dir"
    ),
    new_markdown_cell(
        "## 1. A loss of your own\n\n"
        "An algorithm is a frozen dataclass: how advantages are made (`normalize_std`: divide "
        "by the group's std, as GRPO does), whether groups whose rewards all tie are trained "
        "(`filter_groups`), an entropy bonus, and a token `loss`. This one is a policy "
        "gradient whose importance ratio is capped at 2 (no clip below), with a metric of its "
        "own. Defined here, it trains in any trainer: in a child process or on a trainer "
        "service the loss still runs in this kernel, on the trainer's per-token logprobs, and "
        "only its gradient travels back."
    ),
    new_code_cell(
        "import dataclasses\n\n"
        "import torch\n\n"
        "import astranb as ab\n\n\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class CappedPG(ab.Algorithm):\n"
        "    cap: float = 2.0\n"
        "    normalize_std: bool = True\n"
        "    filter_groups: bool = True\n"
        "    entropy_coef: float = entropy_coef\n\n"
        "    @property\n"
        "    def name(self) -> str:\n"
        "        return \"capped_pg\"\n\n"
        "    def loss(self, logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=None):\n"
        "        ratio_B_T = torch.exp(logp_B_T - old_logp_B_T).clamp(max=self.cap)\n"
        "        total = -(ratio_B_T * adv_B_T * mask_B_T).sum()\n"
        "        loss = total / (num_tokens if num_tokens is not None else mask_B_T.sum())\n"
        "        return loss, {\"capped_ratio_max\": float(ratio_B_T.detach().max())}\n\n\n"
        "env = ab.environments.load(\"arithmetic\")\n"
        "session = ab.Session(f\"{run_dir}/manual\", trainer=\"thread\")  # the live model here\n"
        "policy = session.policy(\"solver\", model=ab.models.tiny(), algorithm=CappedPG(),\n"
        "                        optimizer=ab.AdamWConfig(lr=lr))\n"
        "session.wire(env, solver=policy)\n"
        "policy"
    ),
    new_markdown_cell(
        "## 2. One update, cell by cell\n\n"
        "`session.train` is made of these blocks; here they run one at a time. First a few "
        "groups of episodes with the current weights (nothing is recorded or counted):"
    ),
    new_code_cell(
        "groups = session.play(groups=16, group_size=group_size)\n"
        "rewards = [[t.rewards[\"solver\"] for t in g.trajectories] for g in groups]\n"
        "print(\"rewards of the first groups:\", rewards[:3])\n"
        "print(\"groups with a learning signal:\", sum(len(set(r)) > 1 for r in rewards), "
        "\"of\", len(groups))"
    ),
    new_markdown_cell(
        "The batch the trainer gets: one row per episode, right-padded, with the loss mask on "
        "the generated tokens, each token's advantage (the group-normalised reward), the "
        "engine's logprob of it and the weight version that sampled it."
    ),
    new_code_cell(
        "batch = policy.build_batch(groups)\n"
        "print(\"rows x tokens:\", tuple(batch.input_ids_B_T.shape))\n"
        "print(\"trained tokens:\", int(batch.loss_mask_B_T.sum()))\n"
        "trained_B_T = batch.loss_mask_B_T > 0\n"
        "print(\"weight versions:\", batch.versions_B_T[trained_B_T].unique().tolist())\n"
        "print(\"advantages of row 0:\", batch.advantages_B_T[0][trained_B_T[0]].tolist())"
    ),
    new_markdown_cell(
        "The loss and its gradient. The weights do not move yet, and the gradients are there "
        "to look at (a thread trainer: `policy.trainer.model` is the live model)."
    ),
    new_code_cell(
        "out = policy.forward_backward(batch)\n"
        "print({k: round(v, 4) for k, v in out.items()})\n"
        "model = policy.trainer.model\n"
        "norms = {name: float(p.grad.norm()) for name, p in model.named_parameters()\n"
        "         if p.grad is not None}\n"
        "for name, norm in sorted(norms.items(), key=lambda kv: -kv[1])[:5]:\n"
        "    print(f\"{norm:9.4f}  {name}\")"
    ),
    new_code_cell(
        "print(\"version before:\", policy.version)\n"
        "print(policy.optim_step())\n"
        "print(\"trainer at version\", policy.version,\n"
        "      \"- engine still at\", policy.engine.version)\n"
        "policy.publish_weights()\n"
        "print(\"engine now at\", policy.engine.version)"
    ),
    new_markdown_cell(
        "## 3. A run with the same loss, and the step inspector\n\n"
        "The same blocks in the train loop. Step 0 and every 10th step are recorded token by "
        "token (`inspect_every=10`, the default): open one to see what it trained."
    ),
    new_code_cell(
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=2)\n"
        "await run\n"
        "print(run.metrics[[\"step\", \"reward\", \"capped_ratio_max\", \"loss\"]].tail())\n"
        "print(len(run.steps), \"steps recorded\")"
    ),
    new_code_cell("run.steps[-1].show()"),
    new_code_cell(
        "from pathlib import Path\n\n"
        "Path(results_dir).mkdir(parents=True, exist_ok=True)\n"
        "base = policy.save_pretrained(Path(run_dir) / \"base\")  # for LoRA and distillation\n"
        "session.close()\n"
        "# one HTML file that opens without a kernel\n"
        "run.steps[-1].save_html(Path(results_dir) / \"research_step.html\")"
    ),
    new_markdown_cell(
        "## 4. Three algorithms of the zoo, side by side\n\n"
        "GRPO (PPO's clip, group-normalised advantages), Dr. GRPO (no std, a constant "
        "normaliser) and CISPO (clipped importance weights, every token keeps its gradient), "
        "each from the same random start."
    ),
    new_code_cell(
        "def train(name, *, algorithm=None, model=None, lr=lr, lora=None, reference=None,\n"
        "          environment=env):\n"
        "    \"\"\"One run of `steps` steps; its metrics and its held-out reward.\"\"\"\n"
        "    with ab.Session(f\"{run_dir}/{name}\") as s:\n"
        "        p = s.policy(\"solver\", model=model or ab.models.tiny(),\n"
        "                     algorithm=algorithm or ab.GRPO(entropy_coef=entropy_coef),\n"
        "                     optimizer=ab.AdamWConfig(lr=lr), lora=lora, reference=reference)\n"
        "        s.wire(environment, solver=p)\n"
        "        r = s.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=2)\n"
        "        r.wait(progress=False)\n"
        "        return r.metrics, s.evaluate(env, n=eval_episodes)[\"solver\"]\n\n\n"
        "# each with its paper's defaults (no entropy bonus): Dr. GRPO's loss is a token\n"
        "# sum over a constant (3000 x rows): a token-mean entropy bonus would outweigh it\n"
        "zoo = {\"GRPO\": ab.GRPO(), \"Dr. GRPO\": ab.DrGRPO(), \"CISPO\": ab.CISPO()}\n"
        "zoo_runs = {name: train(f\"zoo-{i}\", algorithm=a) for i, (name, a) in "
        "enumerate(zoo.items())}\n"
        "{name: round(score, 3) for name, (_, score) in zoo_runs.items()}"
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n\n\n"
        "def compare(runs, title):\n"
        "    fig, ax = plt.subplots(figsize=(7, 3.5))\n"
        "    for name, (metrics, score) in runs.items():\n"
        "        smooth = metrics[\"reward\"].rolling(10, min_periods=1).mean()\n"
        "        ax.plot(metrics[\"step\"], smooth, label=f\"{name} (held-out {score:.2f})\")\n"
        "    ax.set(xlabel=\"step\", ylabel=\"reward (10-step mean)\", title=title)\n"
        "    ax.legend()\n"
        "    return fig\n\n\n"
        "compare(zoo_runs, \"the zoo from a random start\");"
    ),
    new_markdown_cell(
        "## 5. LoRA against full fine-tuning\n\n"
        "LoRA adapts a pretrained model: from random weights the tiny model's frozen, tied "
        "output head keeps every logit within about ±1.3, so adapters alone cannot make any "
        "answer likely. Both start from the model trained in section 3. Only the adapters "
        "train (PEFT's maths); the engine gets the merged weights. Expect LoRA to lag far "
        "behind here: on a model this small the task lives largely in the token embeddings "
        "and the tied head, which adapters leave frozen (bench/RESULTS.md measures it)."
    ),
    new_code_cell(
        "lora_runs = {\n"
        "    \"full fine-tuning\": train(\"full\", model=ab.models.local(base)),\n"
        "    \"LoRA r=8\": train(\"lora\", model=ab.models.local(base), lr=lora_lr,\n"
        "                      lora=ab.LoRA(rank=8, alpha=16)),\n"
        "}\n"
        "compare(lora_runs, \"from the section 3 model\");"
    ),
    new_markdown_cell(
        "## 6. On-policy distillation against RL\n\n"
        "A student from random weights learns from a teacher (the section 3 model) alone: the "
        "environment's reward is replaced by 0, and each sampled token's advantage is the "
        "teacher's logprob of it minus the student's (the per-token reverse KL). Beside it, RL "
        "on the task's reward from the same start."
    ),
    new_code_cell(
        "class Unscored(type(env)):\n"
        "    \"\"\"The same task with every reward 0: the teacher is the only signal.\"\"\"\n\n"
        "    async def episode(self, ctx, sample):\n"
        "        await super().episode(ctx, sample)\n"
        "        return 0.0\n\n\n"
        "distill_runs = {\n"
        "    \"RL\": train(\"rl\"),\n"
        "    \"distillation\": train(\n"
        "        \"distill\", algorithm=ab.GRPO(filter_groups=False),\n"
        "        reference=ab.Reference(model=ab.models.local(base), distill=1.0),\n"
        "        environment=Unscored()),\n"
        "}\n"
        "compare(distill_runs, \"a student from random weights\");"
    ),
    new_code_cell(
        "import json\n\n"
        "results = {\"zoo\": {n: s for n, (_, s) in zoo_runs.items()},\n"
        "           \"lora\": {n: s for n, (_, s) in lora_runs.items()},\n"
        "           \"distillation\": {n: s for n, (_, s) in distill_runs.items()}}\n"
        "(Path(results_dir) / \"research.json\").write_text(json.dumps(results, indent=1))\n"
        "results"
    ),
]
