"""Executed notebooks: the quickstart runs end to end as the test suite runs every notebook
(ASTRANB_SMOKE), its dashboard's saved figures hold the last step and the file stays small; a
failing background task fails its notebook under nbmake.

The quickstart executes once for this module (nbmake skips it when this module is collected too,
see the root conftest.py): with the live dashboard (ASTRANB_DISPLAY=widgets), plus one cell added
after the `train` cell that shows the same run's static dashboard (`run.dashboard(mode="static")`),
so both saved forms come from that one execution."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "01_quickstart.ipynb"
SMOKE_STEPS = 3  # the quickstart's smoke cell turns its default 600 steps into 3
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
STATIC_CELL = 'run.dashboard(mode="static")  # added by the test: the same run, saved static'

pytestmark = pytest.mark.slow  # every test here executes a notebook


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """The quickstart executed once with papermill, smoke sized (its own defaults, shrunk by its
    ASTRANB_SMOKE cell), live dashboard plus a static one of the same run.
    Returns (executed notebook path, executed notebook, metrics rows)."""
    import papermill

    folder = tmp_path_factory.mktemp("quickstart")
    nb = nbformat.read(QUICKSTART, as_version=4)
    [train] = [i for i, c in enumerate(nb.cells) if "session.train(" in c.source]
    nb.cells.insert(train + 1, new_code_cell(STATIC_CELL))
    source, out = folder / "quickstart.ipynb", folder / "executed.ipynb"
    nbformat.write(nb, source)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASTRANB_SMOKE", "1")  # as the test suite runs every notebook
        patch.setenv("ASTRANB_DISPLAY", "widgets")
        papermill.execute_notebook(  # the smoke cell keeps run_dir and results_dir set here
            str(source), str(out), cwd=str(ROOT / "notebooks"), progress_bar=False,
            parameters={"run_dir": str(folder / "run"), "results_dir": str(folder)},
        )
    [metrics] = (folder / "run").rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == SMOKE_STEPS
    return out, json.loads(out.read_text()), rows


def reward_trace(data: list[dict]) -> dict:
    return next(t for t in data if t.get("xaxis") == "x" and t.get("name") == "solver")


def expected_rewards(rows):
    def missing(reward) -> bool:
        return reward is None or (isinstance(reward, float) and math.isnan(reward))

    return [None if missing(r["reward"]) else r["reward"] for r in rows]


def test_the_quickstart_runs_end_to_end_and_writes_its_results(quickstart):
    path, nb, rows = quickstart
    errors = [o for cell in nb["cells"] for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    summary = json.loads((path.parent / "quickstart.json").read_text())
    assert summary["baseline"] is not None and summary["final_eval"] is not None
    assert (path.parent / "quickstart_reward.png").stat().st_size > 0


def test_headless_quickstart_saves_static_figures_with_the_last_step(quickstart):
    _, nb, rows = quickstart
    figures = [o for cell in nb["cells"] for o in cell.get("outputs", [])
               if PLOTLY in o.get("data", {})]
    assert len(figures) == 1, "the static dashboard output should turn into one static figure"
    data = figures[0]["data"]
    status = f"finished · {SMOKE_STEPS}/{SMOKE_STEPS} steps · solver v{SMOKE_STEPS}"
    assert data["image/png"] and status in "".join(data["text/plain"])
    reward = reward_trace(data[PLOTLY]["data"])
    assert reward["x"] == [r["step"] for r in rows] == list(range(SMOKE_STEPS))
    assert reward["y"] == pytest.approx(expected_rewards(rows), nan_ok=True)


def test_quickstart_with_live_dashboard_is_small_and_saves_the_last_step(quickstart):
    path, nb, rows = quickstart
    size = path.stat().st_size
    assert size < 10 * 2**20, f"executed quickstart is {size / 2**20:.1f} MB"
    states = nb["metadata"]["widgets"][WIDGET_STATE]["state"]
    figures = [s["state"] for s in states.values() if "_widget_data" in s["state"]]
    assert len(figures) == 1, "one FigureWidget per dashboard"
    reward = reward_trace(figures[0]["_widget_data"])
    assert list(reward["x"]) == list(range(SMOKE_STEPS))
    assert reward["y"] == pytest.approx(expected_rewards(rows), nan_ok=True)


FAILING = '''
import astranb as ab

class Broken(ab.Environment):
    roles = ("solver",)

    def samples(self, seed=0):
        while True:
            yield {"prompt": "1+1="}

    async def episode(self, ctx, sample):
        await ctx.generate("solver", sample["prompt"], max_new_tokens=2)
        raise RuntimeError("this environment always fails")

session = ab.Session(".")
policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
session.wire(Broken(), solver=policy)
run = session.train(steps=2, batch_size=4, group_size=2, max_staleness=1)
'''


@pytest.mark.parametrize("ending", ["await run", "run.wait()"])
def test_a_failing_background_task_fails_its_notebook_under_nbmake(tmp_path, ending):
    nb = new_notebook(cells=[new_code_cell(FAILING), new_code_cell(ending)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / "failing.ipynb"
    nbformat.write(nb, path)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
         "--rootdir", str(tmp_path), str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "EpisodesKeepFailing" in result.stdout or "always fails" in result.stdout
