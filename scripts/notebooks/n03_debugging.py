"""Cells of notebooks/03_debugging.ipynb."""

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "03_debugging"

CELLS = [
    new_markdown_cell(
        "# Debugging episodes: step through, edit, re-score\n\n"
        "A run records the episodes it plays (by default every failed or truncated one and a "
        "sample of the rest): each `generate` turn (prompt, completion tokens, "
        "their logprobs and the weight version that sampled each one), each tool call (the "
        "arithmetic environment checks its answer with `ctx.tool(\"check\", ...)`), and the "
        "rewards. This notebook trains a tiny model on arithmetic for a moment, picks an "
        "episode it got wrong, steps through it, edits the answer, re-scores it, exports it as "
        "a standalone HTML file, and plays a fresh episode in the debugger. Every button of the "
        "debugger is also a method, so all of it works headless too. Run All finishes within 3 "
        "minutes on 2 CPU cores."
    ),
    new_code_cell(
        "# Parameters (papermill can override any of them)\n"
        "steps = 20\n"
        "batch_size = 64\n"
        "group_size = 8\n"
        "max_staleness = 2\n"
        "lr = 1e-3\n"
        'run_dir = "../runs/debugging"\n'
        'results_dir = "../results"',
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        "import os\nimport tempfile\n\n"
        "if os.environ.get(\"ASTRANB_SMOKE\"):"
            "  # the test suite runs this notebook small and fast\n"
        "    steps, batch_size = 2, 16\n"
        "    run_dir = results_dir = tempfile.mkdtemp(prefix=\"astranb-smoke-\")"
    ),
    new_code_cell(
        "import astranb as ab\n\n"
        "session = ab.Session(run_dir)\n"
        "policy = session.policy(\"solver\", model=ab.models.tiny(),\n"
        "                        algorithm=ab.GRPO(entropy_coef=0.05),"
            " optimizer=ab.AdamWConfig(lr=lr))\n"
        'env = ab.environments.load("arithmetic")\n'
        "session.wire(env, solver=policy)\n"
        "run = session.train(steps=steps, batch_size=batch_size, group_size=group_size,\n"
        "                    max_staleness=max_staleness)\n"
        "await run"
    ),
    new_markdown_cell(
        "## A failed episode\n\n"
        "`run.episodes` holds the episodes the run kept: every failed or truncated one and 8 "
        "others a step (`train(record=\"all\")` keeps all of them). Take one the model got "
        "wrong and open it: "
        "`show()` displays the debugger (a widget in JupyterLab, a self-contained HTML viewer in "
        "a saved notebook: use ◀ ▶ or the arrow keys) and returns it. Tokens are shaded by "
        "logprob; hover one for its logprob and weight version."
    ),
    new_code_cell(
        "failed = next(e for e in run.episodes if e.error is None and e.rewards[\"solver\"] == 0)\n"
        "dbg = failed.show()"
    ),
    new_markdown_cell(
        "The same with methods. Each returns the step it lands on; a step prints as text and "
        "carries its fields (`kind`, `prompt`, `completion`, `tokens`, `logprobs`, `versions`, "
        "`tool`, `args`, `result`, `rewards`)."
    ),
    new_code_cell("dbg.goto(0)"),
    new_code_cell(
        "step = dbg.current\n"
        "list(zip(step.tokens, step.logprobs, step.versions))"
    ),
    new_code_cell("dbg.forward()"),
    new_markdown_cell("`run_until` goes forward to the first step a condition holds for:"),
    new_code_cell(
        "dbg.goto(0)\n"
        "dbg.run_until(lambda s: s.kind == \"tool\" and s.result is False)"
    ),
    new_markdown_cell(
        "## Edit and re-score\n\n"
        "`edit(turn, text)` replaces a turn's completion; `rescore()` plays the environment's "
        "own `episode()` again: turns before the edit return what was recorded, the edited turn "
        "returns the new text, and tools are called again, so the reward is whatever the "
        "environment makes of it. It returns a new debugger, opened on the edited turn."
    ),
    new_code_cell(
        "right = str(failed.sample[\"answer\"])\n"
        "fixed = dbg.edit(0, right).rescore()\n"
        "assert fixed.rewards == {\"solver\": 1.0}, fixed.rewards\n"
        "fixed"
    ),
    new_code_cell(
        "almost = dbg.edit(0, right + \"1\").rescore()  # \"71\" is not \"7\": the check says no\n"
        "almost.rewards"
    ),
    new_markdown_cell(
        "## Export\n\n"
        "One HTML file with the data, styles and a few lines of JavaScript inside: it opens in "
        "any browser, without a kernel or a network."
    ),
    new_code_cell(
        "from pathlib import Path\n\n"
        "path = fixed.export_html(Path(results_dir) / \"debugging_episode.html\")\n"
        "print(path, f\"{path.stat().st_size / 1024:.1f} KiB\")"
    ),
    new_markdown_cell(
        "## A fresh episode\n\n"
        "`ab.debug(env, sample, role=policy)` plays one new episode with the current weights. "
        "Its `rescore` samples the turns after an edit afresh from the policy (a recorded "
        "episode replays them instead)."
    ),
    new_code_cell(
        "sample = next(iter(env.samples(seed=123)))\n"
        "fresh = ab.debug(env, sample, solver=policy)\n"
        "print(sample, \"->\", repr(fresh.steps[0].completion), fresh.rewards)\n"
        "fresh"
    ),
    new_code_cell("session.close()"),
]
