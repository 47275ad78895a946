"""Cells of notebooks/01_quickstart.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "01_quickstart"

CELLS = [
    new_markdown_cell(
        "# astranb quickstart: a tiny model learns arithmetic with asynchronous RL\n\n"
        "A ~135K-parameter Qwen3-architecture model, built locally, learns single-digit "
        "arithmetic (`3+4=` → `7`) from a 0/1 reward. Rollouts run up to `max_staleness` weight "
        "versions ahead of the trainer, in the session's background loop: the kernel stays free "
        "while it trains. Run All finishes within 5 minutes on 2 CPU cores. (Near reward 1 "
        "almost every group of 8 answers is all right and is filtered out, as it carries no "
        "learning signal, so each step then needs many more rollouts: steps beyond ~600 get "
        "slow.)"
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 600\n"
        "batch_size = 128\n"
        "group_size = 8\n"
        "max_staleness = 2\n"
        "lr = 1e-3\n"
        "entropy_coef = 0.05\n"
        "eval_episodes = 512\n"
        'run_dir = "../runs/quickstart"\n'
        'results_dir = "../results"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast:\n"
        "    # the full-size defaults shrink, values set with -p (astranb run, sweep) are kept\n"
        "    steps = 3 if steps == 600 else steps\n"
        "    batch_size = 16 if batch_size == 128 else batch_size\n"
        "    eval_episodes = 16 if eval_episodes == 512 else eval_episodes\n"
        "    smoke_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")\n"
        "    run_dir = smoke_dir if run_dir == \"../runs/quickstart\" else run_dir\n"
        "    results_dir = smoke_dir if results_dir == \"../results\" else results_dir"
    ),
    new_code_cell(
        "import astranb as ab\n\n"
        "session = ab.Session(run_dir)\n"
        "policy = session.policy(\n"
        '    "solver",\n'
        "    model=ab.models.tiny(),\n"
        "    algorithm=ab.GRPO(entropy_coef=entropy_coef),\n"
        "    optimizer=ab.AdamWConfig(lr=lr),\n"
        ")\n"
        'env = ab.environments.load("arithmetic")\n'
        "session.wire(env, solver=policy)\n"
        "policy"
    ),
    new_markdown_cell("The untrained model is our random-policy baseline:"),
    new_code_cell(
        "baseline = session.evaluate(n=eval_episodes)\n"
        "print(f\"random-policy baseline reward: {baseline['solver']:.3f}\")"
    ),
    new_markdown_cell(
        "`train` returns at once; training goes on in the background. `run.dashboard()` "
        "shows reward, staleness, weight-delta sizes, throughput, buffer and drops, live in "
        "JupyterLab (with a Stop button) and as a static figure when the notebook runs "
        "headless. `await run` shows progress and re-raises any background error "
        "(use `run.wait()` in a script)."
    ),
    new_code_cell(
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness)\n"
        "run.dashboard()"
    ),
    new_code_cell("await run"),
    new_markdown_cell("## Results"),
    new_code_cell(
        "import json\n"
        "from pathlib import Path\n\n"
        "out = Path(results_dir)\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        'fig = run.plot(out / "quickstart_reward.png")\n'
        "summary = run.summary()\n"
        'summary["baseline"] = baseline["solver"]\n'
        'summary["final_eval"] = session.evaluate(n=eval_episodes)["solver"]\n'
        '(out / "quickstart.json").write_text(json.dumps(summary, indent=1))\n'
        "summary"
    ),
    new_code_cell(
        'run.metrics[["step", "reward", "staleness_max", "buffer_size", "dropped_stale",\n'
        '             "filtered_groups", "loss", "entropy", "transfer_kind", "changed_fraction",\n'
        '             "transfer_ratio"]].tail()'
    ),
    new_markdown_cell(
        "The run keeps every failed or truncated episode and 8 others a step (`run.episodes`, "
        "saved in the run folder's `episodes.jsonl.zst`; `train(record=\"all\")` keeps all of "
        "them); step through the last one:"
    ),
    new_code_cell("run.episodes[-1].show()\nsession.close()"),
]
