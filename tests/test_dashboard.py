"""The run dashboard: panel data from hand-made rows, the throttle, live and headless forms."""

from __future__ import annotations

import base64
import math
import threading
import time
import warnings

import pytest

import astranb as ab
from astranb.notebook.dashboard import (
    HELDOUT_PANEL,
    LEAGUE_PANELS,
    PANELS,
    StaticDashboard,
    TextDashboard,
    Throttle,
    figure,
    open_dashboard,
    status_line,
    to_png,
)
from tests.envs import CountA
from tests.waiting import wait_until


def row(policy, step, **extra):
    base = {"policy": policy, "step": step, "version": step + 1, "time": 1.0 + step,
            "reward": 0.5, "staleness_mean": 0.5, "staleness_max": 1, "staleness_counts": [1, 1],
            "buffer_size": 2, "live_groups": 3, "dropped_stale": 0, "filtered_groups": 0,
            "failed_episodes": 0, "episodes": 16 * (step + 1), "rollout_tokens": 100 * (step + 1),
            "transfer_bytes": 2_000_000, "changed_fraction": 0.25}
    return {**base, **extra}


def traces(spec, panel):
    suffix = spec["layout"]["meta"]["panels"].index(panel) + 1 if "layout" in spec else (
        [key for key, _, _ in (*PANELS, HELDOUT_PANEL)].index(panel) + 1)
    axis = "x" if suffix == 1 else f"x{suffix}"
    return {t["name"]: t for t in spec["data"] if t["xaxis"] == axis}


def test_figure_panels_hold_the_rows_numbers():
    rows = [row("a", 0, reward=0.25), row("b", 0, reward=float("nan")),
            row("a", 1, reward=0.75, staleness_counts=[0, 2, 2], staleness_max=2,
                transfer_bytes=500_000, changed_fraction=0.1, time=3.0)]
    spec = figure(rows, ["a", "b"], max_staleness=2)
    reward = traces(spec, "reward")
    assert reward["a"]["x"] == [0, 1] and reward["a"]["y"] == [0.25, 0.75]
    assert reward["b"]["y"] == [None]  # NaN (no finished episode) is not JSON: a gap
    stale = traces(spec, "staleness")
    assert stale["bound"]["y"] == [2, 2] and stale["bound"]["x"] == [0, 1]
    assert stale["a max"]["y"] == [1, 2]
    dist = traces(spec, "staleness_dist")
    # policy a trained 1+0 groups at staleness 0, 1+2 at 1, 2 at 2: 6 groups in all
    assert dist["a"]["x"] == [0, 1, 2]
    assert dist["a"]["y"] == pytest.approx([1 / 6, 3 / 6, 2 / 6])
    assert traces(spec, "transfer")["a"]["y"] == [2.0, 0.5]
    assert traces(spec, "transfer")["a"]["x"] == [1, 2]
    assert traces(spec, "sparsity")["a"]["y"] == pytest.approx([25.0, 10.0])
    # throughput over time-ordered rows: (a0 t=1, b0 t=1 -> dt 0 skipped), then a1 at t=3:
    # window back to the first row: tokens (200-100)/2, episodes (32-16)/2
    rate = traces(spec, "throughput")
    assert rate["tokens/s"]["x"] == [3.0]
    assert rate["tokens/s"]["y"] == [50.0] and rate["episodes/s"]["y"] == [8.0]
    assert traces(spec, "buffer")["a live"]["y"] == [3, 3]


def test_figure_structure_is_stable_before_and_after_data():
    empty = figure([], ["a", "b"], max_staleness=1)
    full = figure([row("a", 0), row("b", 0), row("a", 1)], ["a", "b"], max_staleness=1)
    assert [t["name"] for t in empty["data"]] == [t["name"] for t in full["data"]]
    axes = {"x"} | {f"x{i}" for i in range(2, len(PANELS) + 1)}
    assert {t["xaxis"] for t in full["data"]} == axes
    assert all(t["x"] == [] for t in empty["data"] if t["name"] not in ("bound", "a", "b"))


def test_truncated_episodes_add_up_on_the_drops_panel():
    rows = [row("a", 0, truncated=2), row("a", 1), row("a", 2, truncated=3)]
    drops = traces(figure(rows, ["a"], max_staleness=1), "drops")
    # rows count truncated episodes since the last step; the panel draws the running total
    assert drops["a truncated episodes"]["y"] == [2, 2, 5]
    assert drops["a truncated episodes"]["line"]["dash"] == "dashdot"


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_heldout_panel_draws_each_windows_scores_against_its_version():
    windows = [{"version": 0, "solver/avg@4": 0.25, "solver/pass@4": 0.5},
               {"version": 3, "solver/avg@4": 0.5, "solver/pass@4": float("nan")}]
    spec = figure([row("a", 0), row("a", 1)], ["a"], 1, evaluations=windows,
                  eval_roles=["solver"], eval_k=4)
    held = traces(spec, "heldout")
    assert held["solver avg@4"]["x"] == [0, 3] and held["solver avg@4"]["y"] == [0.25, 0.5]
    assert held["solver pass@4"]["y"] == [0.5, None]  # NaN (nothing scored) is a gap
    assert held["solver pass@4"]["line"]["dash"] == "dash"
    assert spec["layout"]["meta"]["panels"][-1] == "heldout"
    assert spec["layout"]["xaxis9"]["title"]["text"] == "version"
    before = figure([], ["a"], 1, evaluations=[], eval_roles=["solver"], eval_k=4)
    assert [t["name"] for t in before["data"]] == [t["name"] for t in spec["data"]]
    assert "heldout" not in figure([], ["a"], 1)["layout"]["meta"]["panels"]  # no evaluation
    assert to_png(spec)[:8] == b"\x89PNG\r\n\x1a\n"
    line = status_line("running", [row("a", 0)], ["a"], 2, evaluation={**windows[0], "version": 3})
    assert line.endswith("held-out v3: solver/avg@4 0.25, solver/pass@4 0.50")


def test_league_panels_draw_each_policy_s_win_rate_and_elo_from_its_own_rows():
    # alice's rows: 2 wins 1 loss, then 1 draw, then nothing new; bob's: 1 win 2 losses.
    # A row also counts the other policy's results of the same games (the counts' names are
    # shared): the panels read only each policy's own names from its own rows.
    rows = [row("alice", 0, **{"count/win/alice": 2, "count/loss/alice": 1,
                               "count/elo_milli/alice": 16000, "count/win/bob": 1}),
            row("bob", 0, **{"count/win/bob": 1, "count/loss/bob": 2,
                             "count/elo_milli/bob": -16000, "count/win/alice": 2}),
            row("alice", 1, **{"count/draw/alice": 1, "count/elo_milli/alice": -1500}),
            row("alice", 2, **{"count/win/alice": 0, "count/elo_milli/alice": 0})]
    spec = figure(rows, ["alice", "bob"], 1)
    assert spec["layout"]["meta"]["panels"][-2:] == ["win_rate", "elo"]
    assert spec["layout"]["xaxis10"]["title"]["text"] == "step"
    won = traces(spec, "win_rate")
    assert won["alice win rate"]["x"] == [0, 1, 2]
    assert won["alice win rate"]["y"] == pytest.approx([2 / 3, 2 / 4, 2 / 4])
    assert won["alice draw rate"]["y"] == pytest.approx([0, 1 / 4, 1 / 4])
    assert won["alice draw rate"]["line"]["dash"] == "dot"
    assert won["bob win rate"]["y"] == pytest.approx([1 / 3])
    elo = traces(spec, "elo")
    assert elo["alice Elo"]["y"] == pytest.approx([1016.0, 1014.5, 1014.5])
    assert elo["bob Elo"]["x"] == [0] and elo["bob Elo"]["y"] == pytest.approx([984.0])
    # the held-out panel keeps its place before them
    both = figure(rows, ["alice"], 1, evaluations=[], eval_roles=["r"], eval_k=1)
    assert both["layout"]["meta"]["panels"][-3:] == ["heldout", *(k for k, _, _ in LEAGUE_PANELS)]
    assert to_png(spec)[:8] == b"\x89PNG\r\n\x1a\n"


def test_league_panels_wait_for_a_policy_s_own_game_counts():
    assert "win_rate" not in figure([row("a", 0)], ["a"], 1)["layout"]["meta"]["panels"]
    # b's row names a's results (a policy of the same run that has played none yet): no panel
    other = [row("a", 0), row("b", 0, **{"count/win/a": 0})]
    assert "win_rate" not in figure(other, ["a", "b"], 1)["layout"]["meta"]["panels"]
    # a's first game counted, a zero: the panels are there, b's lines empty, a's win rate a gap
    # before its first game
    first = [row("a", 0, **{"count/loss/a": 0}), row("a", 1, **{"count/loss/a": 1})]
    spec = figure(first, ["a", "b"], 1)
    won = traces(spec, "win_rate")
    assert won["a win rate"]["y"] == [None, 0.0] and won["b win rate"]["x"] == []
    assert traces(spec, "elo")["a Elo"]["y"] == [1000.0, 1000.0]


def test_long_runs_are_thinned_to_a_bounded_size_keeping_the_last_step():
    rows = [row("a", step, reward=step / 5000, time=1.0 + step * 0.1,
                rollout_tokens=100 * (step + 1)) for step in range(5000)]
    spec = figure(rows, ["a"], max_staleness=2, max_points=500)
    assert max(len(t["x"]) for t in spec["data"]) <= 501
    reward = traces(spec, "reward")["a"]
    assert reward["x"][:3] == [0, 10, 20] and reward["x"][-1] == 4999
    assert reward["y"][-1] == pytest.approx(4999 / 5000)
    assert traces(spec, "throughput")["tokens/s"]["y"][-1] == pytest.approx(1000.0)
    short = figure(rows[:400], ["a"], max_staleness=2, max_points=500)
    assert traces(short, "reward")["a"]["x"] == list(range(400))  # nothing dropped when short


def test_status_line_names_state_versions_and_error():
    rows = [row("a", 0), row("a", 1, reward=0.875, time=12.4)]
    line = status_line("running", rows, ["a", "b"], steps=5)
    assert line.startswith("running · 2/10 steps · a v2, b v0 · 12 s · reward 0.88")
    assert "staleness max 1" in line and "32 episodes" in line
    failed = status_line("failed", rows, ["a"], 5, RuntimeError("boom"))
    assert failed.endswith("error: RuntimeError: boom")


def test_a_resumed_run_shows_where_it_was_resumed_on_the_reward_panel():
    rows = [row("a", s, reward=0.1 * s) for s in range(6)]
    none = traces(figure(rows, ["a"], 1), "reward")["resumed"]
    assert none["x"] == [] and none["y"] == []
    marks = traces(figure(rows, ["a"], 1, resumed=[2, 4]), "reward")["resumed"]
    assert marks["x"] == [2, 2, None, 4, 4, None]
    assert marks["y"] == pytest.approx([0.0, 0.5, None, 0.0, 0.5, None])
    assert to_png(figure(rows, ["a"], 1, resumed=[2]))[:4] == b"\x89PNG"


def test_png_is_drawn_from_the_spec():
    data = to_png(figure([row("a", 0), row("a", 1)], ["a"], 2, "title"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_throttle_bounds_renders_while_pokes_stream_fast():
    renders, errors = [], []
    throttle = Throttle(lambda: renders.append(time.monotonic()), 0.1, errors.append)
    start = time.monotonic()
    pokes = 0
    while (last_poke := time.monotonic()) - start < 1.0:
        throttle.poke()
        pokes += 1
    wait_until(lambda: renders[-1] >= last_poke, 5, "the last pokes to be drawn")
    throttle.close()
    assert pokes > 1000
    assert 3 <= len(renders) <= 1.3 / 0.1 + 2
    gaps = [b - a for a, b in zip(renders, renders[1:], strict=False)]
    assert min(gaps) >= 0.1 * 0.9
    assert renders[-1] > start + 0.9  # the final state was drawn after the stream ended
    assert not errors and not throttle.alive


def test_throttle_error_goes_to_on_error_and_never_to_the_poker():
    errors = []

    def render():
        raise ValueError("bad panel")

    throttle = Throttle(render, 0.01, errors.append)
    throttle.poke()
    wait_until(lambda: errors, 5, "the render error to reach on_error")
    throttle.poke()  # no exception here, even though the thread is gone
    throttle.close()
    assert len(errors) == 1 and "bad panel" in str(errors[0]) and throttle.renders == 0


def test_display_mode_override(monkeypatch):
    from astranb.notebook.display import display_mode

    monkeypatch.setenv("ASTRANB_DISPLAY", "static")
    assert display_mode() == "static"
    monkeypatch.setenv("ASTRANB_DISPLAY", "Widgets")
    assert display_mode() == "widgets"
    monkeypatch.setenv("ASTRANB_DISPLAY", "fancy")
    with pytest.raises(ValueError, match="ASTRANB_DISPLAY='fancy'.*widgets, static, none"):
        display_mode()
    monkeypatch.delenv("ASTRANB_DISPLAY")
    assert display_mode() == "none"  # no kernel here


# -- with real runs ------------------------------------------------------------------------------
def make_session(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(CountA(), solver=policy)
    return session


@pytest.mark.slow  # a 30-step training run
def test_live_dashboard_throttles_and_ends_with_the_last_step(tmp_path):
    session = make_session(tmp_path)
    with session:
        run = session.train(steps=30, batch_size=8, group_size=4, max_staleness=2)
        dash = run.dashboard(mode="widgets", interval=0.5)
        started = time.monotonic()
        run.wait(progress=False)
        elapsed = time.monotonic() - started
    rows = run.metrics
    assert len(rows) == 30
    # 30 metrics events; at most one redraw per 0.5 s (+ the first and the final one)
    assert 1 <= dash.redraws <= elapsed / 0.5 + 2
    reward = traces(dash.fig.to_plotly_json(), "reward")["solver"]
    assert reward["x"][-1] == 29 and len(reward["x"]) == 30
    saved = traces({"data": dash.fig._widget_data}, "reward")["solver"]  # what a notebook saves
    assert list(saved["x"]) == list(range(30))
    assert "finished · 30/30 steps · solver v30" in dash.status_html.value
    assert dash.stop_button.disabled


def test_stop_button_stops_the_run(tmp_path):
    session = make_session(tmp_path)
    with session:
        run = session.train(steps=10_000, batch_size=8, group_size=4, max_staleness=2)
        dash = run.dashboard(mode="widgets", interval=0.2)
        wait_until(lambda: len(run.metrics) >= 2, 60, "two steps")
        dash.stop_button.click()
        run.wait(progress=False, timeout=60)
    assert run.status == "stopped" and len(run.metrics) < 10_000
    assert "stopped" in dash.status_html.value


def test_a_failing_dashboard_never_stops_training(tmp_path, monkeypatch):
    from astranb.notebook.widgets.dashboard import LiveDashboard

    def broken(self):
        raise RuntimeError("plot exploded")

    monkeypatch.setattr(LiveDashboard, "_redraw", broken)
    session = make_session(tmp_path)
    with session:
        run = session.train(steps=6, batch_size=8, group_size=4, max_staleness=1)
        dash = run.dashboard(mode="widgets", interval=0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # finish() must not even warn: the error is shown
            run.wait(progress=False)
    assert run.status == "finished" and len(run.metrics) == 6
    assert isinstance(dash.error, RuntimeError)
    assert "dashboard stopped updating (training goes on)" in dash.status_html.value
    assert "plot exploded" in dash.status_html.value


def test_a_view_that_raises_on_finish_is_reported_not_raised(tmp_path):
    session = make_session(tmp_path)

    class Broken(TextDashboard):
        def finish(self):
            raise OSError("disk full")

    with session:
        run = session.train(steps=2, batch_size=8, group_size=4, max_staleness=1)
        run._views.append(Broken(run))
        with pytest.warns(RuntimeWarning, match="Broken failed.*disk full.*run goes on"):
            run.wait(progress=False)
    assert run.status == "finished"


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_static_and_text_dashboards(tmp_path, capsys):
    session = make_session(tmp_path)
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        assert type(open_dashboard(run, "none", 0.5)) is TextDashboard
        static = run.dashboard(mode="static")
        text = run.dashboard(mode="none")
        assert isinstance(static, StaticDashboard) and isinstance(text, TextDashboard)
        run.wait(progress=False)
    out = capsys.readouterr().out
    assert "dashboard: finished · 3/3 steps · solver v3" in out  # printed outside a kernel
    bundle = static.bundle()
    assert base64.b64decode(bundle["image/png"])[:4] == b"\x89PNG"
    reward = traces(bundle["application/vnd.plotly.v1+json"], "reward")["solver"]
    assert reward["x"] == [0, 1, 2]
    assert reward["y"] == [None if math.isnan(v) else v for v in run.metrics["reward"]]
    with pytest.raises(ValueError, match="mode='fancy'"):
        run.dashboard(mode="fancy")


class Match(CountA):
    """CountA scored as a game: a win when most of the completion is 'a', else a loss, and
    +-16 Elo points; counted the way TextArena's games count them."""

    async def episode(self, ctx, sample):
        reward = await super().episode(ctx, sample)
        policy = ctx.wiring["solver"].name
        won = reward >= 0.5
        ctx.count(f"{'win' if won else 'loss'}/{policy}")
        ctx.count(f"elo_milli/{policy}", 16000 if won else -16000)
        return reward


def test_live_dashboard_adds_the_league_panels_with_the_first_game(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
    session.wire(Match(), solver=policy)
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1)
        dash = run.dashboard(mode="widgets", interval=0.05)
        run.wait(progress=False)
    shown = dash.fig.to_plotly_json()
    assert list(shown["layout"]["meta"]["panels"][-2:]) == ["win_rate", "elo"]
    # rows before the first counted game have no such column
    wins = sum(r.get("count/win/solver", 0) for r in run.rows)
    games = wins + sum(r.get("count/loss/solver", 0) for r in run.rows)
    assert 0 < games <= run.rows[-1]["episodes"]
    won = traces(shown, "win_rate")["solver win rate"]
    assert list(won["x"]) == [0, 1, 2] and won["y"][-1] == pytest.approx(wins / games)
    elo = traces(shown, "elo")["solver Elo"]
    assert elo["y"][-1] == pytest.approx(1000 + 16 * (wins - (games - wins)))
    saved = traces({"data": dash.fig._widget_data, "layout": dash.fig._widget_layout}, "elo")
    assert list(saved["solver Elo"]["y"]) == list(elo["y"])  # what a notebook saves
    assert dash.fig.layout.title.text == ""


class HeldOutCountA(CountA):
    """CountA with a two-problem test split."""

    splits = ("train", "test")

    def split_samples(self, split, seed=0):
        return iter([{"prompt": "ab="}, {"prompt": "ba="}])


def test_live_dashboard_draws_the_heldout_windows(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
    session.wire(HeldOutCountA(), solver=policy)
    with session:
        run = session.train(steps=2, batch_size=8, group_size=4, eval_every=1, eval_n=2)
        dash = run.dashboard(mode="widgets", interval=0.05)
        run.wait(progress=False)
    held = traces(dash.fig.to_plotly_json(), "heldout")
    assert list(held["solver avg@1"]["x"]) == [0, 1, 2] == list(run.evaluations["version"])
    assert list(held["solver pass@1"]["y"]) == list(run.evaluations["solver/pass@1"])
    assert "held-out v2: solver/avg@1" in dash.status_html.value


def test_dashboard_updates_come_from_one_thread_only(tmp_path):
    """Redraws run on the dashboard's own thread, never on the training loop's thread."""
    from astranb.notebook.widgets.dashboard import LiveDashboard

    seen = set()
    original = LiveDashboard._redraw

    def spy(self):
        seen.add(threading.current_thread().name)
        original(self)

    session = make_session(tmp_path)
    LiveDashboard._redraw = spy
    try:
        with session:
            run = session.train(steps=4, batch_size=8, group_size=4, max_staleness=1)
            run.dashboard(mode="widgets", interval=0.05)
            run.wait(progress=False)
    finally:
        LiveDashboard._redraw = original
    assert seen <= {"astranb-dashboard", threading.main_thread().name} and seen
