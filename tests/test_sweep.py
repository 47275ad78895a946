"""Sweeps, run.json, `ab.runs` and `ab.compare`.

- run.json: written when a run starts ("running") and completed when it ends (finished,
  stopped, failed), by a real Session on a tiny model.
- `ab.runs`: one row per run folder, "interrupted" for a run whose process died, "unknown" for
  folders without run.json; `ab.compare`: one line per run on each axis.
- `astranb sweep`: the grid, upfront argument checks, a failing point beside good ones, and
  --resume, on a small notebook built here; then the issue's acceptance on the quickstart
  (ASTRANB_SMOKE, as the test suite sets it): 4 executed notebooks, 4 HTML files, one table,
  and a point with an invalid value recorded with its error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

import astranb as ab
from astranb.cli import main
from astranb.session.folder import status_of
from astranb.session.history import find_run_folders
from astranb.session.report import summarize
from astranb.sweep import axes_of, plan, point_name
from tests.envs import CountA
from tests.test_cli_run import html_text, write_notebook
from tests.waiting import wait_until

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "01_quickstart.ipynb"


def make_session(tmp_path, **policy_kwargs):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32, **policy_kwargs)
    session.wire(CountA(), solver=policy)
    return session, policy


def run_json(run) -> dict:
    return json.loads((run.directory / "run.json").read_text())


def slow_steps(policy, seconds: float):
    step = policy.trainer.step

    def slow(batch):
        time.sleep(seconds)
        return step(batch)

    policy.trainer.step = slow


# -- run.json ----------------------------------------------------------------------------------
def test_run_json_says_running_then_finished_with_settings_and_summary(tmp_path):
    session, policy = make_session(tmp_path, optimizer=ab.AdamWConfig(lr=3e-3))
    slow_steps(policy, 0.1)
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        started = run_json(run)
        run.wait(progress=False)
        ended = run_json(run)  # complete once wait() returns: written inside the run's task
    assert started["status"] == "running" and "ended" not in started
    assert started["run"] == "run-000" and started["pid"] == os.getpid()
    assert started["host"] == socket.gethostname()
    assert started["config"] == {"steps": 3, "batch_size": 8, "group_size": 4,
                                 "max_staleness": 1, "order": "edf", "seed": 0,
                                 "mode": "independent", "stall_seconds": 120.0,
                                 "max_gen_batches": 4, "stop_when_learned": False,
                                 "sampler": "stream", "inspect_every": 10}
    [solver] = started["policies"]
    assert solver["name"] == "solver" and solver["lr"] == 3e-3
    assert solver["algorithm"]["kind"] == "grpo" and started["environments"] == ["CountA"]
    assert ended["status"] == "finished" and "error" not in ended
    assert ended["started"] == started["started"] <= ended["ended"]
    assert 0 < ended["wall_s"] < 120
    summary = run.summary()
    assert {k: ended["summary"][k] for k in summary} == pytest.approx(summary)
    assert ended["summary"]["reward_last"] == pytest.approx(run.metrics["reward"].iloc[-1])


def test_run_json_of_a_failed_run_has_the_error_line(tmp_path):
    session, policy = make_session(tmp_path)

    def explode(batch):
        raise RuntimeError("trainer exploded\nsecond line of the message")

    policy.trainer.step = explode
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4)
        with pytest.raises(RuntimeError, match="trainer exploded"):
            run.wait(progress=False)
    info = run_json(run)
    assert info["status"] == "failed"
    assert info["error"] == "RuntimeError: trainer exploded"
    assert info["summary"] == {"steps": 0}


def test_run_json_of_a_stopped_run(tmp_path):
    session, _ = make_session(tmp_path)
    with session:
        run = session.train(steps=10_000, batch_size=8, group_size=4)
        wait_until(lambda: len(run.rows) >= 2, 60, "two steps")
        run.stop()
        run.wait(timeout=30, progress=False)
    info = run_json(run)
    assert info["status"] == "stopped" and "error" not in info
    assert info["summary"]["steps"] >= 2


# -- ab.runs and ab.compare --------------------------------------------------------------------
def fake_run(folder: Path, *, info: dict | None, rewards=(0.1, 0.2, 0.3), staleness=(0, 1, 2)):
    """A run folder written by hand: metrics rows and, if given, a run.json."""
    folder.mkdir(parents=True)
    rows = [{"policy": "solver", "step": i, "reward": r, "staleness_max": s, "time": 1.0 + i,
             "episodes": 8 * (i + 1)} for i, (r, s) in enumerate(zip(rewards, staleness,
                                                                      strict=True))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "episodes.jsonl").write_text("this is not JSON: ab.runs must never read it\n")
    if info is not None:
        (folder / "run.json").write_text(json.dumps(info))
    return folder


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def start_info(lr: float, **extra) -> dict:
    return {"run": "run-000", "config": {"steps": 3, "batch_size": 8, "group_size": 4,
                                         "max_staleness": 1, "order": "edf", "seed": 0,
                                         "mode": "independent"},
            "policies": [{"name": "solver", "lr": lr}], "status": "running",
            "started": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **extra}


def test_runs_lists_every_run_with_its_status_and_final_numbers(tmp_path):
    fake_run(tmp_path / "a" / "run-000", info=start_info(1e-3, pid=dead_pid()))
    fake_run(tmp_path / "a" / "run-001", info=start_info(2e-3))  # this process: alive
    fake_run(tmp_path / "b" / "run-000", info=start_info(3e-3, host="another-host",
                                                         pid=dead_pid()))
    fake_run(tmp_path / "old" / "run-000", info=None, rewards=(0.0, 0.5, 1.0))
    finished = start_info(4e-3, status="finished", wall_s=12.5,
                          summary={"steps": 3, "reward_last_10pct": 0.75, "reward_last": 0.75})
    fake_run(tmp_path / "nested" / "deeper" / "run-000", info=finished, rewards=(0.0, 0.0, 0.0))

    table = ab.runs(tmp_path).set_index("path")
    assert len(table) == 5
    status = {str(Path(p).relative_to(tmp_path)): s for p, s in table["status"].items()}
    assert status == {"a/run-000": "interrupted", "a/run-001": "running",
                      "b/run-000": "running",  # another host: cannot be checked
                      "old/run-000": "unknown", "nested/deeper/run-000": "finished"}
    row = table.loc[str(tmp_path / "nested" / "deeper" / "run-000")]
    assert row["lr"] == 4e-3 and row["steps"] == 3 and row["wall_s"] == 12.5
    assert row["reward_last_10pct"] == 0.75  # from run.json, not from the rows
    assert row["run"] == "run-000" and row["session"] == str(tmp_path / "nested" / "deeper")
    old = table.loc[str(tmp_path / "old" / "run-000")]  # no run.json: the rows' numbers
    assert old["steps_done"] == 3 and old["reward_last"] == 1.0 and pd.isna(old["lr"])
    interrupted = table.loc[str(tmp_path / "a" / "run-000")]
    assert interrupted["reward_last"] == pytest.approx(0.3)  # a run without its end: the rows


def test_interrupted_only_for_a_dead_process_on_this_host():
    here = socket.gethostname()
    assert status_of({"status": "running", "pid": dead_pid(), "host": here}) == "interrupted"
    assert status_of({"status": "running", "pid": os.getpid(), "host": here}) == "running"
    assert status_of({"status": "running", "pid": dead_pid(), "host": "elsewhere"}) == "running"
    assert status_of({"status": "failed", "pid": dead_pid(), "host": here}) == "failed"


def test_summarize_matches_the_rows():
    rows = [{"policy": p, "step": i, "reward": 0.1 * i, "staleness_max": i % 3, "time": i,
             "episodes": 10 * i} for i in range(20) for p in ("a", "b")]
    summary = summarize(rows, [], steps=20)
    assert summary["steps"] == 20 and summary["staleness_max"] == 2
    assert summary["reward_last_10pct"] == pytest.approx((1.8 + 1.9) / 2)
    assert summary["reward_last"] == pytest.approx(1.9)
    assert summarize([]) == {"steps": 0}


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_compare_draws_one_line_per_run_on_each_axis(tmp_path):
    a = fake_run(tmp_path / "lr1" / "run-000", info=start_info(1e-3, status="finished"))
    b = fake_run(tmp_path / "lr3" / "run-000", info=start_info(3e-3, status="finished"),
                 rewards=(0.3, 0.6, 0.9), staleness=(0, 0, 1))
    fig = ab.compare(a, str(b), path=tmp_path / "compare.png")
    try:
        reward, staleness = fig.axes
        assert len(reward.get_lines()) == len(staleness.get_lines()) == 2
        assert list(reward.get_lines()[1].get_ydata()) == [0.3, 0.6, 0.9]
        assert list(staleness.get_lines()[1].get_ydata()) == [0, 0, 1]
        labels = [t.get_text() for t in reward.get_legend().get_texts()]
        assert labels == ["lr=0.001", "lr=0.003"]  # what differs between them
        assert (tmp_path / "compare.png").stat().st_size > 1000
    finally:
        plt.close(fig)
    table = ab.runs(tmp_path)
    fig = ab.compare(table)  # the whole table, and single rows
    fig2 = ab.compare(*(row for _, row in table.iterrows()))
    try:
        assert len(fig.axes[0].get_lines()) == len(fig2.axes[1].get_lines()) == 2
    finally:
        plt.close(fig)
        plt.close(fig2)
    with pytest.raises(TypeError, match="Runs, run folders or rows"):
        ab.compare(42)
    with pytest.raises(ValueError, match="at least one run"):
        ab.compare()


def test_compare_takes_a_live_run(tmp_path):
    session, _ = make_session(tmp_path)
    with session:
        run = session.train(steps=2, batch_size=8, group_size=4).wait(progress=False)
        fig = ab.compare(run)
    try:
        assert [len(ax.get_lines()) for ax in fig.axes] == [1, 1]
        assert list(fig.axes[0].get_lines()[0].get_xdata()) == [0, 1]
    finally:
        plt.close(fig)


# -- astranb sweep on a small notebook ---------------------------------------------------------
def test_the_grid_is_the_full_product_with_names_from_the_values():
    points = plan(axes_of([["steps", "20", "40"], ["lr", "1e-3", "3e-3"]]))
    assert [p.name for p in points] == ["steps=20_lr=1e-3", "steps=20_lr=3e-3",
                                        "steps=40_lr=1e-3", "steps=40_lr=3e-3"]
    assert points[1].values == {"steps": 20, "lr": 0.003} and points[1].texts["lr"] == "3e-3"
    assert point_name({"path": "a/b c"}) == "path=a-b-c"
    same = plan(axes_of([["x", "a/b", "a:b"]]))  # unsafe characters make the names collide
    assert [p.name for p in same] == ["x=a-b", "x=a-b-2"]
    long = point_name({"x": "v" * 300})
    assert len(long) == 100 and long != point_name({"x": "v" * 299})
    with pytest.raises(ValueError, match="has no values"):
        axes_of([["lr"]])
    with pytest.raises(ValueError, match="given twice"):
        axes_of([["lr", "1"], ["lr", "2"]])
    with pytest.raises(ValueError, match="more than once"):
        axes_of([["lr", "1", "1"]])


def small_notebook(tmp_path: Path) -> Path:
    """A notebook with run_dir/results_dir parameters that writes a result, counts its
    executions in `counter` and raises for x < 0."""
    return write_notebook(
        tmp_path / "small.ipynb",
        "import json, pathlib\n"
        "with open(counter, 'a') as f:\n"
        "    f.write(f'{x}\\n')\n"
        "if x < 0:\n"
        "    raise ValueError(f'x must be >= 0, got {x}\\nmore detail')\n"
        "out = pathlib.Path(results_dir)\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'result.json').write_text(json.dumps({'y': x * 2, 'x': x, 'word': word}))\n"
        "print('run_dir', run_dir)",
        parameters="x = 1\nword = 'a'\ncounter = 'count.txt'\nrun_dir = 'runs'\n"
                   "results_dir = 'results'",
    )


@pytest.mark.slow  # kernels
@pytest.mark.timeout(300)
def test_a_failing_point_is_recorded_the_others_finish_and_resume_reruns_only_it(
        tmp_path, capsys):
    nb, out, counter = small_notebook(tmp_path), tmp_path / "sweep", tmp_path / "count.txt"
    args = ["sweep", str(nb), "-p", "x", "1", "-2", "3", "-p", "word", "hi",
            "-p", "counter", str(counter), "-o", str(out), "--jobs", "2"]
    assert main(args) == 1  # one point failed
    printed = capsys.readouterr().out
    assert printed.count(" start ") == 3 and "FAILED  2/3 x=-2 " in printed
    assert "x must be >= 0, got -2" in printed
    table = pd.read_csv(out / "sweep.csv")
    assert table["x"].tolist() == [1, -2, 3] and table["status"].tolist() == ["ok", "failed",
                                                                             "ok"]
    assert table["y"].tolist()[::2] == [2, 6] and pd.isna(table["y"][1])
    failed = table.iloc[1]
    assert failed["error"] == "ValueError: x must be >= 0, got -2"  # the first line
    assert "import json, pathlib" in failed["failed_cell"]
    assert (table["wall_s"] > 0).all()
    assert pd.read_parquet(out / "sweep.parquet")["status"].tolist() == table["status"].tolist()
    for point in table["point"]:  # both files for every point, the failed one too
        assert (out / f"{point}.ipynb").is_file() and (out / f"{point}.html").is_file()
    assert "x must be >= 0, got -2" in html_text(out / "x=-2.html")
    assert sorted(counter.read_text().split()) == ["-2", "1", "3"]
    ok_notebook = out / f"{table['point'][0]}.ipynb"
    mtime = ok_notebook.stat().st_mtime_ns

    assert main(args) == 2  # the folder holds a sweep: resume it or pick another
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 1
    printed = capsys.readouterr().out
    assert printed.count(" skip ") == 2 and printed.count(" start ") == 1
    assert sorted(counter.read_text().split()) == ["-2", "-2", "1", "3"]  # only it ran again
    assert ok_notebook.stat().st_mtime_ns == mtime
    assert len(pd.read_csv(out / "sweep.csv")) == 3


def test_unknown_parameters_and_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    nb = small_notebook(tmp_path)
    out = tmp_path / "out"
    assert main(["sweep", str(nb), "-p", "y", "1", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no parameter(s) y" in err and "x, word, counter, run_dir, results_dir" in err
    assert main(["sweep", str(nb), "-p", "run_dir", "a", "b", "-o", str(out)]) == 2
    assert "own run_dir and results_dir" in capsys.readouterr().err
    assert main(["sweep", str(nb), "-p", "x", "1", "--resume"]) == 2
    assert "--resume needs -o" in capsys.readouterr().err
    assert main(["sweep", str(nb), "-p", "x", "1", "--jobs", "0", "-o", str(out)]) == 2
    assert "--jobs 0" in capsys.readouterr().err
    assert main(["sweep", str(nb), "-o", str(out)]) == 2
    assert "at least one -p" in capsys.readouterr().err
    assert not out.exists()


# -- the acceptance: the quickstart --------------------------------------------------------------
@pytest.fixture(scope="module")
def quickstart_sweep(tmp_path_factory):
    """`astranb sweep notebooks/01_quickstart.ipynb -p steps 4 8 -p lr 1e-3 3e-3` (smoke
    sized: ASTRANB_SMOKE is set for the test suite), in a child process as a user runs it."""
    assert os.environ.get("ASTRANB_SMOKE")
    out = tmp_path_factory.mktemp("quickstart") / "sweep"
    command = [sys.executable, "-m", "astranb.cli", "sweep", str(QUICKSTART),
               "-p", "steps", "4", "8", "-p", "lr", "1e-3", "3e-3", "-o", str(out),
               "--jobs", "2"]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=560, cwd=ROOT)
    return out, command, done, time.monotonic() - began


@pytest.mark.slow  # four quickstart executions
@pytest.mark.timeout(600)
def test_quickstart_sweep_writes_four_notebooks_four_html_files_and_one_table(quickstart_sweep):
    out, _, done, _ = quickstart_sweep
    assert done.returncode == 0, done.stdout + done.stderr
    names = ["steps=4_lr=1e-3", "steps=4_lr=3e-3", "steps=8_lr=1e-3", "steps=8_lr=3e-3"]
    assert sorted(p.stem for p in out.glob("*.ipynb")) == names
    assert sorted(p.stem for p in out.glob("*.html")) == names
    assert "random-policy baseline reward" in html_text(out / f"{names[0]}.html")
    table = pd.read_parquet(out / "sweep.parquet")
    assert len(table) == 4 and len(pd.read_csv(out / "sweep.csv")) == 4
    assert table["point"].tolist() == names
    assert table["steps"].tolist() == [4, 4, 8, 8]
    assert table["lr"].tolist() == [1e-3, 3e-3, 1e-3, 3e-3]
    assert (table["status"] == "ok").all() and (table["run_status"] == "finished").all()
    assert table["steps_done"].tolist() == [4, 4, 8, 8]  # the smoke cell kept them
    for column in ("reward_last_10pct", "reward_last", "staleness_max", "baseline",
                   "final_eval", "wall_s"):
        assert table[column].notna().all(), column
    assert "4 of 4 points ok" in done.stdout
    for name in names:  # one line when each point starts and one when it ends
        assert f"start   {names.index(name) + 1}/4 {name}" in done.stdout
        assert f"ok      {names.index(name) + 1}/4 {name}" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_runs_and_compare_on_the_quickstart_sweep(quickstart_sweep):
    out, _, done, _ = quickstart_sweep
    assert done.returncode == 0, done.stdout + done.stderr
    table = ab.runs(out).sort_values(["steps", "lr"])
    assert len(table) == 4 and (table["status"] == "finished").all()
    assert table["steps"].tolist() == [4, 4, 8, 8] and table["batch_size"].eq(16).all()
    assert table["lr"].tolist() == [1e-3, 3e-3, 1e-3, 3e-3]
    assert table["param/lr"].tolist() == table["lr"].tolist()  # the sweep point's parameters
    assert table["steps_done"].tolist() == table["steps"].tolist()
    assert len(set(table["session"])) == 4  # no two points share a run folder
    fig = ab.compare(table)
    try:
        reward, staleness = fig.axes
        assert len(reward.get_lines()) == len(staleness.get_lines()) == 4
        assert sorted(len(line.get_xdata()) for line in reward.get_lines()) == [4, 4, 8, 8]
        labels = [t.get_text() for t in reward.get_legend().get_texts()]
        assert labels == ["lr=0.001 steps=4", "lr=0.003 steps=4", "lr=0.001 steps=8",
                          "lr=0.003 steps=8"]
    finally:
        plt.close(fig)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resuming_the_finished_quickstart_sweep_runs_nothing_again(quickstart_sweep):
    out, command, done, _ = quickstart_sweep
    assert done.returncode == 0, done.stdout + done.stderr
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.ipynb")}
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count(" skip ") == 4 and " start " not in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.ipynb")} == mtimes
    assert len(find_run_folders(out)) == 4


@pytest.mark.slow  # two quickstart executions
@pytest.mark.timeout(600)
def test_quickstart_sweep_with_an_invalid_value_records_the_error_and_goes_on(tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "astranb.cli", "sweep", str(QUICKSTART), "-p", "lr", "3e-3", "-1",
         "-p", "steps", "5", "-o", str(out), "--jobs", "2"],
        capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr  # a point failed
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["ok", "failed"]
    assert table["steps_done"][0] == 5 and pd.isna(table["steps_done"][1])
    error = table["error"][1]
    assert error.startswith("ValueError: AdamWConfig lr must be a positive number, got -1")
    assert "import astranb as ab" in table["failed_cell"][1]
    assert (out / "lr=-1.ipynb").is_file() and (out / "lr=-1.html").is_file()
    assert "AdamWConfig lr must be a positive number" in done.stdout
    assert "1 of 2 points ok" in done.stdout
