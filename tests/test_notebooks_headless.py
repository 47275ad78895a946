"""Executed notebooks: the dashboard's saved figures hold the last step, the file stays small, and
a failing background task fails its notebook under nbmake."""

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
SMALL = {"steps": 4, "batch_size": 16, "eval_episodes": 16}
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

pytestmark = pytest.mark.slow  # every test here executes a notebook


def execute_quickstart(tmp_path: Path, monkeypatch, display: str) -> tuple[dict, list[dict]]:
    """Run the quickstart with papermill, small; returns (executed notebook, metrics rows)."""
    import papermill

    monkeypatch.delenv("ASTRANB_SMOKE", raising=False)  # its smoke cell would pick its own dirs
    monkeypatch.setenv("ASTRANB_DISPLAY", display)
    out = tmp_path / "executed.ipynb"
    papermill.execute_notebook(
        str(QUICKSTART), str(out), cwd=str(ROOT / "notebooks"), progress_bar=False,
        parameters={**SMALL, "run_dir": str(tmp_path / "run"), "results_dir": str(tmp_path)},
    )
    [metrics] = (tmp_path / "run").rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == SMALL["steps"]
    return json.loads(out.read_text()), rows


def reward_trace(data: list[dict]) -> dict:
    return next(t for t in data if t.get("xaxis") == "x" and t.get("name") == "solver")


def expected_rewards(rows):
    def missing(reward) -> bool:
        return reward is None or (isinstance(reward, float) and math.isnan(reward))

    return [None if missing(r["reward"]) else r["reward"] for r in rows]


def test_headless_quickstart_saves_static_figures_with_the_last_step(tmp_path, monkeypatch):
    nb, rows = execute_quickstart(tmp_path, monkeypatch, "static")
    figures = [o for cell in nb["cells"] for o in cell.get("outputs", [])
               if PLOTLY in o.get("data", {})]
    assert len(figures) == 1, "the dashboard output should turn into one static figure"
    data = figures[0]["data"]
    assert data["image/png"] and "finished · 4/4 steps · solver v4" in "".join(data["text/plain"])
    reward = reward_trace(data[PLOTLY]["data"])
    assert reward["x"] == [r["step"] for r in rows] == [0, 1, 2, 3]
    assert reward["y"] == pytest.approx(expected_rewards(rows), nan_ok=True)


def test_quickstart_with_live_dashboard_is_small_and_saves_the_last_step(tmp_path, monkeypatch):
    nb, rows = execute_quickstart(tmp_path, monkeypatch, "widgets")
    size = (tmp_path / "executed.ipynb").stat().st_size
    assert size < 10 * 2**20, f"executed quickstart is {size / 2**20:.1f} MB"
    states = nb["metadata"]["widgets"][WIDGET_STATE]["state"]
    figures = [s["state"] for s in states.values() if "_widget_data" in s["state"]]
    assert len(figures) == 1, "one FigureWidget per dashboard"
    reward = reward_trace(figures[0]["_widget_data"])
    assert list(reward["x"]) == [0, 1, 2, 3]
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
