"""Cells of notebooks/02_multi_agent.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "02_multi_agent"

CELLS = [
    new_markdown_cell(
        "# Two policies, two roles: a solver and a verifier learn together\n\n"
        "Each role gets its own tiny model. In an episode of `actor_verifier` the **solver** "
        "answers a sum (`3+1=` → `4`), the **verifier** reads the answer and replies `y` "
        "(approve) or `n` (reject), and a rejected solver tries once more with the reply in "
        "its prompt (`3+1=5?n\\n3+1=`). The solver earns 1 for a right first answer and 0.5 "
        "for one right only on the retry; the verifier earns half for a verdict that matches "
        "the truth of the first answer and half the solver's reward, so rejecting everything "
        "does not pay. Each policy trains "
        "only on its own turns, with its own role's reward; both train at once, each stepping "
        "as soon as its own batch is ready (`mode=\"independent\"`). Run All finishes within 5 "
        "minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 100\n"
        "batch_size = 128\n"
        "group_size = 8\n"
        "max_staleness = 2\n"
        'mode = "independent"\n'
        "lr = 3e-3\n"
        "max_value = 5  # problems a+b with a result of at most 5\n"
        "eval_episodes = 512\n"
        'run_dir = "../runs/multi_agent"\n'
        'results_dir = "../results"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast\n"
        "    steps, batch_size, eval_episodes = 3, 16, 16\n"
        "    run_dir = results_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")"
    ),
    new_markdown_cell(
        "Two policies with their own settings. The verifier soon gives the same verdict in "
        "every episode of a group, so its rewards are often all equal: filtering such groups "
        "(GRPO's default) would starve its steps, and an entropy bonus acting on them alone "
        "pushes it back to noise. So it keeps every group and has no bonus."
    ),
    new_code_cell(
        "import astranb as ab\n\n"
        "session = ab.Session(run_dir)\n"
        "solver = session.policy(\"solver\", model=ab.models.tiny(),\n"
        "                        algorithm=ab.GRPO(entropy_coef=0.05),"
            " optimizer=ab.AdamWConfig(lr=lr))\n"
        "verifier = session.policy(\"verifier\", model=ab.models.tiny(),\n"
        "                          algorithm=ab.GRPO(filter_groups=False),"
            " optimizer=ab.AdamWConfig(lr=lr))\n"
        'env = ab.environments.load("actor_verifier", max_value=max_value)\n'
        "session.wire(env, solver=solver, verifier=verifier)\n"
        "session.wiring"
    ),
    new_markdown_cell("The untrained models are the baseline, one reward per role:"),
    new_code_cell(
        "baseline = session.evaluate(n=eval_episodes)\n"
        "baseline"
    ),
    new_code_cell(
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness, mode=mode,\n"
        "                    record=\"all\")  # keep every episode: the per-version tables"
        " read them all\n"
        "run.dashboard()"
    ),
    new_code_cell("await run"),
    new_markdown_cell(
        "## Results\n\n"
        "Each role's own reward, read from the recorded episodes by the weight version that "
        "played it (left), and each policy's `batch_reward` from `run.metrics`: its own role's "
        "reward in the batch it trained on, after the solver's groups without reward spread "
        "were filtered out (right). The metrics' `reward` column averages both roles."
    ),
    new_code_cell(
        "import json\n"
        "from pathlib import Path\n\n"
        "import matplotlib.pyplot as plt\n"
        "import pandas as pd\n"
        "from astranb_actor_verifier import early_late, role_rewards\n\n"
        "table = role_rewards(run.episodes)  # one row per (episode, role)\n"
        "fig, (ax_own, ax_batch) = plt.subplots(1, 2, figsize=(10, 3.5))\n"
        'for role, part in table.groupby("role"):\n'
        '    by_version = part.groupby("version")["reward"].mean()\n'
        "    ax_own.plot(by_version.index, by_version.values, label=role)\n"
        'for name, part in run.metrics.groupby("policy"):\n'
        '    ax_batch.plot(part["step"], part["batch_reward"], label=name)\n'
        'ax_own.set(xlabel="weight version", ylabel="own-role episode reward",'
            ' ylim=(-0.02, 1.02))\n'
        'ax_batch.set(xlabel="step", ylabel="batch_reward (run.metrics)", ylim=(-0.02, 1.02))\n'
        "for ax in (ax_own, ax_batch):\n"
        "    ax.grid(alpha=0.3)\n"
        "    ax.legend()\n"
        "fig.tight_layout()\n"
        "out = Path(results_dir)\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        'fig.savefig(out / "multi_agent_reward.png", dpi=100)'
    ),
    new_markdown_cell(
        "Own-role reward over the first and the last 10% of weight versions, and an "
        "evaluation of the untrained and the trained weights:"
    ),
    new_code_cell(
        "final = session.evaluate(n=eval_episodes)\n"
        "split = early_late(table, steps)\n"
        'split["eval_before"] = pd.Series(baseline)\n'
        'split["eval_after"] = pd.Series(final)\n'
        'summary = {"steps": steps, "seconds": float(run.metrics["time"].max()),\n'
        '           "episodes": len(run.episodes), **split.T.to_dict()}\n'
        '(out / "multi_agent.json").write_text(json.dumps(summary, indent=1))\n'
        "split"
    ),
    new_code_cell(
        'run.metrics.groupby("policy").tail(2)[["policy", "step", "batch_reward",'
            ' "staleness_max",\n'
        '                                       "filtered_groups", "wait_seconds", "step_seconds"]]'
    ),
    new_markdown_cell("An episode in which the verifier rejected and the solver tried again:"),
    new_code_cell(
        "retried = [e for e in run.episodes if len(e.turns) == 3]\n"
        "(retried or run.episodes)[-1].show()\n"
        "session.close()"
    ),
]
