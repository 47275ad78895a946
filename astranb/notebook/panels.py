"""The dashboard's panels and what every dashboard form is built on.

The panels are plain plotly-JSON dicts built from a run's metrics rows (`figure`, `status_line`;
`to_png` draws them with matplotlib, lazily), so the live widget, the static figure and the tests
read the same numbers. `View` is the panels of one run and what the waiting cell calls on a
dashboard (`tick`, `finish`); `Throttle` bounds how often the live form redraws.

The forms themselves sit above this module: `astranb.notebook.dashboard` (static, text, and the
choice among forms) and `astranb.notebook.widgets.dashboard` (the live widget). Both import it;
it imports neither, nor plotly, nor ipywidgets.
"""

from __future__ import annotations

import io
import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..session.run import Run

__all__ = ["PANELS", "HELDOUT_PANEL", "LEAGUE_PANELS", "OUTCOMES", "figure", "status_line",
           "to_png", "Throttle", "View"]

PANELS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward (own role), tied groups dotted, x: taught nothing", "step"),
    ("staleness", "staleness (mean, max dotted)", "step"),
    ("staleness_dist", "staleness of trained groups", "versions behind"),
    ("transfer", "weights sent (MB)", "version"),
    ("sparsity", "weights changed (%)", "version"),
    ("throughput", "tokens/s, episodes/s dashed", "seconds"),
    ("buffer", "buffered groups, live dotted", "step"),
    ("drops", "drops: stale, filtered, failed, truncated", "step"),
)
"""(key, title, x axis label) of each panel, in grid order (2 rows x 4 columns)."""

HELDOUT_PANEL = ("heldout", "held-out avg@k / pass@k per version", "version")
"""The panel after the others when the run evaluates (`train(eval_every=...)`)."""

LEAGUE_PANELS: tuple[tuple[str, str, str], ...] = (
    ("win_rate", "win rate per policy (games so far), draws dotted", "step"),
    ("elo", "Elo per policy", "step"),
)
"""The panels after those when the rows count games won and lost (`count/win/<policy>`, ...)."""

OUTCOMES = ("win", "draw", "loss")
"""Game results an environment counts per policy: an episode that a policy played counts
`count/<result>/<policy>` once per role of it, and `count/elo_milli/<policy>` its Elo change in
thousandths of a point (TextArena's games do). The rows name them; nothing here imports the
environment that writes them."""
ELO_START = 1000.0
"""The Elo rating a policy starts from."""

COLUMNS = 4
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_RATE_WINDOW = 4
"""Throughput is measured over this many metrics rows (single rows are too noisy)."""


# -- panels -------------------------------------------------------------------------------------
def figure(rows: Sequence[Mapping[str, Any]], policies: Sequence[str], max_staleness: int,
           title: str = "", max_points: int = 500, *,
           evaluations: Sequence[Mapping[str, Any]] | None = None,
           eval_roles: Sequence[str] = (), eval_k: int = 1,
           resumed: Sequence[int] = ()) -> dict[str, Any]:
    """Every panel as one plotly figure dict (`{"data": [...], "layout": {...}}`).

    The traces are the same, in the same order, for any number of rows (empty lists before the
    first step), so a live view can update them in place; only the league panels come later,
    with the first row that counts a game's result (a live view rebuilds then).

    Args:
        rows: the run's metrics rows (one per policy and step).
        policies: policy names, in legend order.
        max_staleness: the run's bound, drawn on the staleness panels.
        title: figure title (the status line).
        max_points: longer series are thinned to every k-th point plus the last, so a redraw of
            a long run stays small (run.metrics keeps every row).
        evaluations: the run's held-out evaluation windows (`run.evaluation_rows`); not None
            adds the held-out panel: avg@k (solid) and pass@k (dashed) of each of `eval_roles`
            against the version each window began at.
        eval_roles: the evaluated environment's roles; eval_k: its plays per problem.
        resumed: steps at which the run was resumed after an interruption (`Session.resume`):
            a dotted vertical line each on the reward panel (the steps before it were trained
            by the process that died).

    Rows that count game results (`OUTCOMES`: `count/win/<policy>`, `count/draw/<policy>`,
    `count/loss/<policy>` and `count/elo_milli/<policy>`, as TextArena's games write them) add
    the league panels (`LEAGUE_PANELS`): each policy's win rate over the games it played up to
    each of its steps (draws dotted) and its Elo rating then (`ELO_START` plus its Elo changes),
    from its own rows only (another policy's rows count the same games again).
    """
    traces: list[dict[str, Any]] = []
    league = _plays_games(rows, policies)
    panels = PANELS if evaluations is None else (*PANELS, HELDOUT_PANEL)
    if league:
        panels = (*panels, *LEAGUE_PANELS)

    def add(panel: str, name: str, x, y, policy: str | None = None, dash: str = "solid",
            kind: str = "scatter", legend: bool = False, color: str | None = None) -> None:
        axis = _axis_suffix(panel, panels)
        if color is None:
            color = (COLORS[policies.index(policy) % len(COLORS)] if policy in policies
                     else "#7f7f7f")
        x, y = _thin(list(x), list(y), max_points)
        trace = {"type": kind, "name": name, "x": x, "y": y,
                 "xaxis": f"x{axis}", "yaxis": f"y{axis}", "showlegend": legend,
                 "legendgroup": policy or name, "marker": {"color": color}}
        if kind == "markers":  # points on a line: scatter without the line
            trace.update(type="scatter", mode="markers",
                         marker={"color": color, "symbol": "x", "size": 8})
        elif kind == "scatter":
            trace.update(mode="lines", line={"color": color, "dash": dash, "width": 1.5})
        traces.append(trace)

    mine = {p: [r for r in rows if r.get("policy") == p] for p in policies}
    for p in policies:
        steps = [r["step"] for r in mine[p]]
        add("reward", p, steps, _col(mine[p], "reward"), p, legend=True)
        # the share of the policy's groups since its last step whose rewards all tied
        add("reward", f"{p} tied", steps, _col(mine[p], "tied_fraction"), p, dash="dot")
        # steps that silently taught nothing (the rows' flags: dataflow.loop.silent_flags);
        # the live dashboard opens the recorded step nearest a clicked point (run.steps.at)
        flagged = [r for r in mine[p] if r.get("flags")]
        add("reward", f"{p} taught nothing", [r["step"] for r in flagged],
            _col(flagged, "reward"), p, kind="markers")
        add("staleness", f"{p} mean", steps, _col(mine[p], "staleness_mean"), p)
        add("staleness", f"{p} max", steps, _col(mine[p], "staleness_max"), p, dash="dot")
    rewards = [r for r in _col(rows, "reward") if isinstance(r, (int, float)) and r == r]
    low, high = (min(rewards, default=0.0), max(rewards, default=1.0))
    marks_x: list[Any] = []
    marks_y: list[Any] = []
    for step in resumed:
        marks_x += [step, step, None]
        marks_y += [low, high, None]
    add("reward", "resumed", marks_x, marks_y, dash="dot", color="#444444")
    last_step = max((r["step"] for r in rows), default=0)
    add("staleness", "bound", [0, last_step], [max_staleness, max_staleness], dash="dash")

    depth = max([max_staleness] + [len(r.get("staleness_counts") or ()) - 1 for r in rows])
    for p in policies:
        counts = [0] * (depth + 1)
        for r in mine[p]:
            for s, n in enumerate(r.get("staleness_counts") or ()):
                counts[s] += n
        total = sum(counts)
        add("staleness_dist", p, range(depth + 1), [n / total if total else 0 for n in counts],
            p, kind="bar")

    for p in policies:
        sent = [r for r in mine[p] if isinstance(r.get("transfer_bytes"), (int, float))]
        add("transfer", p, [r["version"] for r in sent], [r["transfer_bytes"] / 1e6 for r in sent],
            p, kind="bar")
        changed = [r for r in mine[p] if isinstance(r.get("changed_fraction"), (int, float))]
        add("sparsity", p, [r["version"] for r in changed],
            [100 * r["changed_fraction"] for r in changed], p)

    times, tokens, episodes = _rates(rows)
    add("throughput", "tokens/s", times, tokens)
    add("throughput", "episodes/s", times, episodes, dash="dash")

    for p in policies:
        steps = [r["step"] for r in mine[p]]
        add("buffer", f"{p} buffered", steps, _col(mine[p], "buffer_size"), p)
        add("buffer", f"{p} live", steps, _col(mine[p], "live_groups"), p, dash="dot")
        add("drops", f"{p} dropped stale", steps, _col(mine[p], "dropped_stale"), p)
        add("drops", f"{p} filtered", steps, _col(mine[p], "filtered_groups"), p, dash="dot")
        add("drops", f"{p} failed episodes", steps, _col(mine[p], "failed_episodes"), p,
            dash="dash")
        # rows count truncated episodes since the last step; drawn as a running total like
        # the other lines of the panel
        add("drops", f"{p} truncated episodes", steps,
            list(itertools.accumulate(r.get("truncated") or 0 for r in mine[p])), p,
            dash="dashdot")

    if evaluations is not None:
        versions = [e["version"] for e in evaluations]
        for i, role in enumerate(eval_roles):
            color = COLORS[(len(policies) + i) % len(COLORS)]
            for what, dash in (("avg", "solid"), ("pass", "dash")):
                key = f"{role}/{what}@{eval_k}"
                add("heldout", f"{role} {what}@{eval_k}", versions, _col(evaluations, key),
                    dash=dash, color=color, legend=what == "avg")

    if league:
        for p in policies:
            steps, won, drawn, elo = _league_series(mine[p], p)
            add("win_rate", f"{p} win rate", steps, won, p)
            add("win_rate", f"{p} draw rate", steps, drawn, p, dash="dot")
            add("elo", f"{p} Elo", steps, elo, p)
    return {"data": traces, "layout": _layout(title, panels)}


def status_line(state: str, rows: Sequence[Mapping[str, Any]], policies: Sequence[str],
                steps: int, error: BaseException | None = None,
                evaluation: Mapping[str, Any] | None = None, stalled: str | None = None,
                learned: Sequence[str] = ()) -> str:
    """One line: state, steps, each policy's version, time, last reward, worst staleness, the
    last held-out evaluation window's scores when there is one, why the run is stalled
    when it is (`run.stalled`), and the policies whose task is learned (`run.learned`)."""
    done = len(rows)
    parts = [state, f"{done}/{steps * len(policies)} steps"]
    last = {r["policy"]: r for r in rows}
    versions = ", ".join(f"{p} v{last[p]['version']}" if p in last else f"{p} v0" for p in policies)
    parts.append(versions)
    if rows:
        parts.append(f"{max(r['time'] for r in rows):.0f} s")
        rewards = [last[p]["reward"] for p in policies if p in last]
        rewards = [f"{x:.2f}" for x in rewards if isinstance(x, float) and not math.isnan(x)]
        if rewards:
            parts.append("reward " + "/".join(rewards))
        parts.append(f"staleness max {max(r['staleness_max'] for r in rows)}")
        parts.append(f"{max(r['episodes'] for r in rows):,} episodes")
    if evaluation is not None:
        scores = [f"{k} {v:.2f}" for k, v in evaluation.items()
                  if ("/avg@" in k or "/pass@" in k) and isinstance(v, float) and not math.isnan(v)]
        parts.append(f"held-out v{evaluation['version']}: " + ", ".join(scores))
    if stalled is not None:
        parts.append(f"stalled: {stalled}")
    if learned:
        parts.append("learned: " + ", ".join(learned))
    if error is not None:
        parts.append(f"error: {type(error).__name__}: {error}")
    return " · ".join(parts)


def to_png(spec: Mapping[str, Any], dpi: int = 72) -> bytes:
    """Draw a `figure()` dict with matplotlib (no pyplot state); returns PNG bytes."""
    from matplotlib.figure import Figure

    known = {key: (key, name, xlabel)
             for key, name, xlabel in (*PANELS, HELDOUT_PANEL, *LEAGUE_PANELS)}
    keys = spec.get("layout", {}).get("meta", {}).get("panels") or [k for k, _, _ in PANELS]
    panels = [known[key] for key in keys]
    rows = math.ceil(len(panels) / COLUMNS)
    fig = Figure(figsize=(16, 3.2 * rows + 0.4), layout="constrained")
    grid = list(fig.subplots(rows, COLUMNS, squeeze=False).flat)
    for ax in grid[len(panels):]:
        ax.set_axis_off()  # the grid's empty cells
    title = spec.get("layout", {}).get("title", {}).get("text", "")
    if title:
        fig.suptitle(title, fontsize=10)
    for ax, (key, name, xlabel) in zip(grid, panels, strict=False):  # more axes than panels
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if key == "throughput":
            ax.set_yscale("symlog")
    axes = list(fig.axes)
    bars: dict[int, list[Mapping[str, Any]]] = {}
    for trace in spec["data"]:
        index = int(trace["xaxis"][1:] or 1) - 1
        if trace["type"] == "bar":
            bars.setdefault(index, []).append(trace)
            continue
        if trace.get("mode") == "markers":
            axes[index].plot(trace["x"], trace["y"], "x", color=trace["marker"]["color"])
            continue
        line = trace.get("line", {})
        style = {"solid": "-", "dot": ":", "dash": "--", "dashdot": "-."}.get(
            line.get("dash", "solid"), "-")
        axes[index].plot(trace["x"], trace["y"], style, color=line.get("color"),
                         label=trace["name"] if trace.get("showlegend") else None, linewidth=1.2)
    for index, group in bars.items():  # side by side, one bar per policy
        width = 0.8 / len(group)
        for i, trace in enumerate(group):
            x = [v + (i - (len(group) - 1) / 2) * width for v in trace["x"]]
            axes[index].bar(x, trace["y"], width=width, color=trace["marker"]["color"],
                            label=trace["name"])
    legends = [axes[0]] + ([axes[len(PANELS)]] if keys[len(PANELS):][:1] == ["heldout"] else [])
    for ax in legends:  # the policies, and the held-out roles
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _axis_suffix(panel: str, panels: Sequence[tuple[str, str, str]] = PANELS) -> str:
    index = [key for key, _, _ in panels].index(panel)
    return "" if index == 0 else str(index + 1)


def _layout(title: str, panels: Sequence[tuple[str, str, str]] = PANELS) -> dict[str, Any]:
    rows = math.ceil(len(panels) / COLUMNS)
    gap_x, gap_y = 0.05, 0.16
    width = (1 - gap_x * (COLUMNS - 1)) / COLUMNS
    height = (1 - gap_y * (rows - 1)) / rows
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 13}, "x": 0.01},
        "height": 330 * rows + 60,
        "margin": {"l": 40, "r": 10, "t": 70, "b": 40},
        "autosize": True,
        "legend": {"orientation": "h", "y": 1.1, "x": 0, "xanchor": "left"},
        "barmode": "group",
        "annotations": [],
        "meta": {"panels": [key for key, _, _ in panels]},  # which panels, for to_png
    }
    for i, (key, name, xlabel) in enumerate(panels):
        row, col = divmod(i, COLUMNS)
        x0 = col * (width + gap_x)
        y1 = 1 - row * (height + gap_y)
        suffix = "" if i == 0 else str(i + 1)
        layout[f"xaxis{suffix}"] = {"domain": [x0, x0 + width], "anchor": f"y{suffix}",
                                    "title": {"text": xlabel, "font": {"size": 10}}}
        layout[f"yaxis{suffix}"] = {"domain": [y1 - height, y1], "anchor": f"x{suffix}"}
        if key == "throughput":
            layout[f"yaxis{suffix}"]["type"] = "log"
        layout["annotations"].append({
            "text": name, "x": x0 + width / 2, "y": y1, "xref": "paper", "yref": "paper",
            "xanchor": "center", "yanchor": "bottom", "showarrow": False, "font": {"size": 11},
        })
    return layout


def _thin(x: list, y: list, max_points: int) -> tuple[list, list]:
    """Every k-th point and the last one, with k chosen to keep at most max_points + 1."""
    if len(x) <= max_points:
        return x, y
    stride = math.ceil(len(x) / max_points)
    keep = list(range(0, len(x) - 1, stride)) + [len(x) - 1]
    return [x[i] for i in keep], [y[i] for i in keep]


def _plays_games(rows: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> bool:
    """Whether some policy's own rows count game results (`OUTCOMES`)."""
    keys = {f"count/{outcome}/{p}": p for p in policies for outcome in OUTCOMES}
    return any(keys.get(key) == row.get("policy") for row in rows for key in row)


def _league_series(rows: Sequence[Mapping[str, Any]], policy: str
                   ) -> tuple[list[Any], list[float | None], list[float | None], list[float]]:
    """`policy`'s steps, and at each its win rate and draw rate over the role-games counted in
    its rows so far (None before its first game) and its Elo rating."""
    steps: list[Any] = []
    won: list[float | None] = []
    drawn: list[float | None] = []
    elo: list[float] = []
    totals = dict.fromkeys((*OUTCOMES, "elo_milli"), 0)
    for row in rows:
        for name in totals:
            totals[name] += int(row.get(f"count/{name}/{policy}", 0) or 0)
        games = sum(totals[outcome] for outcome in OUTCOMES)
        steps.append(row["step"])
        won.append(totals["win"] / games if games else None)
        drawn.append(totals["draw"] / games if games else None)
        elo.append(ELO_START + totals["elo_milli"] / 1000.0)
    return steps, won, drawn, elo


def _col(rows: Sequence[Mapping[str, Any]], key: str) -> list:
    values = []
    for row in rows:
        value = row.get(key)
        # NaN is not JSON: a step without finished episodes has no reward
        values.append(None if isinstance(value, float) and math.isnan(value) else value)
    return values


def _rates(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """Rollout tokens/s and episodes/s over the last few rows, at each row's time."""
    ordered = sorted(rows, key=lambda r: r["time"])
    times, tokens, episodes = [], [], []
    for i in range(1, len(ordered)):
        a, b = ordered[max(0, i - _RATE_WINDOW)], ordered[i]
        dt = b["time"] - a["time"]
        if dt <= 0:
            continue
        times.append(round(b["time"], 3))
        tokens.append((b["rollout_tokens"] - a["rollout_tokens"]) / dt)
        episodes.append((b["episodes"] - a["episodes"]) / dt)
    return times, tokens, episodes


# -- throttle -----------------------------------------------------------------------------------
class Throttle:
    """Calls `render` on its own thread at most once per `interval` seconds, after `poke()`.

    Pokes that arrive faster are merged into the next render, so a fast metrics stream costs the
    frontend a bounded number of messages. `poke` only sets a flag: it is safe and cheap to call
    from the training loop. An exception in `render` goes to `on_error` and ends the thread; it
    never reaches the caller of `poke`.
    """

    def __init__(self, render: Callable[[], None], interval: float,
                 on_error: Callable[[BaseException], None], name: str = "astranb-throttle"):
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self.renders = 0
        """How many times `render` ran."""
        self._render, self._on_error = render, on_error
        self._dirty, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Something changed: render soon (at most once per interval)."""
        self._dirty.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (a render in progress finishes first)."""
        self._closed.set()
        self._dirty.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        last = -math.inf
        while True:
            self._dirty.wait()
            if self._closed.is_set():
                return
            pause = last + self.interval - time.monotonic()
            if pause > 0 and self._closed.wait(pause):
                return
            self._dirty.clear()
            try:
                self._render()
            except BaseException as error:  # noqa: BLE001 - a view must never take training down
                self._on_error(error)
                return
            self.renders += 1
            last = time.monotonic()


# -- headless forms -----------------------------------------------------------------------------
class View:
    """What the waiting cell calls on a dashboard: tick() while waiting, finish() at the end."""

    def __init__(self, run: Run):
        self.run = run

    def figure(self) -> dict[str, Any]:
        """The panels now, as a plotly figure dict (with the held-out panel when the run
        evaluates)."""
        run = self.run
        heldout = run.heldout
        resumed = [e["step"] for e in run.events if e.get("kind") == "resumed"]
        if heldout is None:
            return figure(run.rows, run.policies, run.config.max_staleness, self.status(),
                          resumed=resumed)
        return figure(run.rows, run.policies, run.config.max_staleness, self.status(),
                      evaluations=run.evaluation_rows, eval_roles=heldout.env.roles,
                      eval_k=heldout.k, resumed=resumed)

    def status(self) -> str:
        run = self.run
        windows = run.evaluation_rows if run.heldout is not None else []
        return status_line(run.status, run.rows, run.policies, run.config.steps,
                           run.error, windows[-1] if windows else None, run.stalled,
                           list(run.learned))

    def png(self) -> bytes:
        """The panels now, drawn as a PNG."""
        return to_png(self.figure())

    def tick(self) -> None:
        """Called by the waiting cell a few times a second."""

    def finish(self) -> None:
        """Called by the waiting cell once the run has ended."""
