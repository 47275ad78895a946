"""Past runs: `ab.runs(folder)` lists every run folder under a folder as a table, and
`ab.compare(...)` draws their reward and staleness curves on one figure.

Experiments pile up as folders (`<session dir>/run-NNN/`, sweeps of them); the question is
then which settings did best. Each run says what it was asked for and how it ended in its
run.json (see report.py), so listing a thousand runs reads a thousand small files: never the
episodes, and metrics.jsonl only for runs that have no final summary (still running, or written
by an older astranb without run.json). A run whose run.json says "running" while its process is
gone (a killed kernel) is listed as "interrupted".

Only pandas (`runs`) and matplotlib (`compare`) are needed, imported when called.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .folder import METRICS_FILE, POINT_FILE, RUN_FILE, RunFiles, read_json
from .report import summarize

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

__all__ = ["RunFolder", "compare", "find_run_folders", "read_run_folder", "runs"]

CONFIG_FIELDS = ("steps", "batch_size", "group_size", "max_staleness", "order", "seed", "mode")
RENAMED = {"steps": "steps_done"}  # summary keys that would hide a config column of that name


@dataclass
class RunFolder:
    """What one run folder says of itself (see `read_run_folder`)."""

    path: Path
    status: str
    """finished, stopped, failed, running, interrupted, or unknown (no record of it)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The RunConfig fields (empty for folders without run.json)."""
    policies: list[dict[str, Any]] = field(default_factory=list)
    """Per policy: name, model, algorithm, lr, weight_decay, grad_clip."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Final numbers (`runinfo.summarize`): steps, reward_last_10pct, reward_last, ..."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The sweep point's notebook parameters, when the run was made by `astranb sweep`."""
    started: float | None = None
    wall_s: float | None = None
    error: str | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """Config, learning rates (`lr`, or `lr/<policy>` with several policies) and sweep
        parameters (`param/<name>`) as one flat dict: what tells runs apart."""
        flat = dict(self.config)
        many = len(self.policies) > 1
        for policy in self.policies:
            flat[f"lr/{policy['name']}" if many else "lr"] = policy.get("lr")
        flat.update({f"param/{name}": value for name, value in self.parameters.items()})
        return flat

    def row(self) -> dict[str, Any]:
        """One row of `ab.runs`."""
        summary = {RENAMED.get(k, k): v for k, v in self.summary.items()}
        started = (datetime.fromtimestamp(self.started) if self.started is not None
                   else None)
        return {"path": str(self.path), "session": str(self.path.parent), "run": self.path.name,
                "status": self.status, **self.settings,
                "policies": ",".join(p["name"] for p in self.policies), **summary,
                "started": started, "wall_s": self.wall_s, "error": self.error}


def find_run_folders(folder: str | Path) -> list[Path]:
    """Every folder under `folder` (itself included) holding run.json or metrics.jsonl, sorted.
    Run folders are not searched further, and neither are hidden folders."""
    found = []
    for root, dirs, files in os.walk(folder):
        if RUN_FILE in files or METRICS_FILE in files:
            found.append(Path(root))
            dirs[:] = []
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
    return sorted(found)


def read_run_folder(path: str | Path, root: str | Path | None = None) -> RunFolder:
    """Read what a run folder says of itself: run.json, else the metrics rows and status.json.

    Args:
        path: the run folder.
        root: where the scan started: a sweep's point.json is looked for between it and the
            run folder (default: the run folder's parents up to two levels).
    """
    files = RunFiles(path)
    parameters = _sweep_parameters(files.path, Path(root) if root is not None else None)
    info = files.info
    if info is None:
        return RunFolder(files.path, files.status, summary=summarize(files.rows,
                                                                     files.evaluations),
                         parameters=parameters, error=files.error)
    final = info.get("summary")
    if not isinstance(final, dict):  # still running, or interrupted: the rows so far
        final = summarize(files.rows, files.evaluations,
                          steps=(info.get("config") or {}).get("steps"))
    return RunFolder(files.path, files.status, dict(info.get("config") or {}),
                     list(info.get("policies") or []), dict(final), parameters,
                     info.get("started"), info.get("wall_s"), files.error)


def _sweep_parameters(path: Path, root: Path | None) -> dict[str, Any]:
    """The parameters of the sweep point a run folder belongs to ({} if none): a point.json in
    a folder above it (`astranb sweep` lays out <point>/runs/run-NNN)."""
    above = list(path.parents)
    if root is not None:
        root = root.resolve()
        above = [p for p in above if p.resolve() == root or root in p.resolve().parents]
    for folder in above[:3]:
        point = read_json(folder / POINT_FILE)
        if point:
            return dict(point.get("parameters") or {})
    return {}


def runs(folder: str | Path = "runs") -> pandas.DataFrame:
    """Every run under `folder` (searched recursively), one row each.

        ab.runs("runs/")                                   # every run so far
        ab.runs("sweeps/quickstart-...").sort_values("reward_last_10pct")

    Columns: path, session (the session's folder), run (run-NNN), status (finished, stopped,
    failed, running, interrupted: its process died; unknown: no run.json), the RunConfig
    fields (steps, batch_size, group_size, max_staleness, order, seed, mode), lr (per policy
    `lr/<name>` when there are several), `param/<name>` for runs of an `astranb sweep`,
    policies, the final numbers (steps_done, reward_last_10pct, reward_last, seconds, episodes,
    staleness_max, `eval/...`), started (local time), wall_s and error (first line).

    Args:
        folder: where to look (a session's folder, a folder of them, a sweep's output).

    Raises:
        FileNotFoundError: the folder does not exist.
    """
    import pandas as pd

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; pass the folder your "
                                "sessions write to, e.g. ab.runs('runs')")
    rows = [read_run_folder(path, folder).row() for path in find_run_folders(folder)]
    if not rows:
        return pd.DataFrame(columns=["path", "session", "run", "status", *CONFIG_FIELDS])
    return pd.DataFrame(rows)


# -- compare -----------------------------------------------------------------------------------
@dataclass
class _Curves:
    name: str
    settings: dict[str, Any]
    rows: list[dict[str, Any]]


def _curves(item: Any) -> list[_Curves]:
    """What to draw for one argument of `compare`: a Run (live rows), a run folder's path, a
    row of `ab.runs` (or a dict with "path"), or a whole `ab.runs` table (each row)."""
    if hasattr(item, "iterrows") and hasattr(item, "columns"):  # a DataFrame of ab.runs
        return [c for _, row in item.iterrows() for c in _curves(row)]
    if hasattr(item, "directory"):  # a Run (its live rows), or a run read back (ab.open_run)
        folder = Path(item.directory)
        rows = list(item.rows) if hasattr(item, "rows") else RunFiles(folder).rows
        settings = read_run_folder(folder).settings or _config_of(getattr(item, "config", None))
        return [_Curves(_name(folder), settings, rows)]
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
    elif isinstance(item, Mapping) or hasattr(item, "get"):
        path_value = item.get("path")
        if path_value is None:
            raise TypeError("compare() got a row without a 'path'; pass rows of ab.runs(...)")
        path = Path(path_value)
    else:
        raise TypeError(f"compare() takes Runs, run folders or rows of ab.runs, not "
                        f"{type(item).__name__}")
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a run folder (<session dir>/run-NNN)")
    return [_Curves(_name(path), read_run_folder(path).settings, RunFiles(path).rows)]


def _config_of(config: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return {}


def _name(path: Path) -> str:
    return f"{Path(path).parent.name}/{Path(path).name}"


def _labels(settings: list[dict[str, Any]], names: list[str]) -> list[str]:
    """One label per run: the settings that differ between the runs (`lr=0.003 steps=40`),
    else the run's name; runs alike in every setting get their name too."""
    keys = sorted({k for s in settings for k in s})
    differ = [k for k in keys if len({_text(s.get(k)) for s in settings}) > 1]
    found = [_label(s, differ) for s in settings]
    out = []
    for label, name in zip(found, names, strict=True):
        alike = not label or found.count(label) > 1
        out.append(f"{name} {label}".strip() if alike else label)
    return out


def _label(settings: dict[str, Any], keys: list[str]) -> str:
    """`name=value ...` of `keys`; a sweep parameter that repeats a setting of the same name
    and value (`param/lr` beside `lr`) is said once."""
    shown: dict[str, str] = {}
    for key in keys:
        text, name = _text(settings.get(key)), key.removeprefix("param/")
        if shown.get(name) == text:
            continue
        shown[name if name not in shown else key] = text
    return " ".join(f"{name}={text}" for name, text in shown.items())


def _text(value: Any) -> str:
    if isinstance(value, float) and not math.isnan(value):
        return f"{value:g}"
    return str(value)


def compare(*runs: Any, path: str | Path | None = None) -> Figure:
    """Overlay the reward and staleness curves of several runs, per step, on one figure.

        ab.compare(run_a, run_b)                       # Run objects
        ab.compare("runs/a/run-000", "runs/b/run-000")  # run folders
        table = ab.runs("sweeps/x"); ab.compare(table[table.status == "finished"])

    Left: the mean episode reward of each step; right: staleness_max (the most versions any
    trained token lagged behind). Each run has one colour on both axes and is labelled by the
    settings that differ between the runs (config, lr, sweep parameters), else by its name; a
    run with several policies draws one line per policy.

    Args:
        *runs: Runs, run folder paths, rows of `ab.runs` (or the whole table).
        path: save the figure here too (any format matplotlib knows from the suffix).

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    curves = [c for item in runs for c in _curves(item)]
    if not curves:
        raise ValueError("compare() needs at least one run: Runs, run folders or rows of "
                         "ab.runs(...)")
    names = _labels([c.settings for c in curves], [c.name for c in curves])
    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for i, (curve, label) in enumerate(zip(curves, names, strict=True)):
        by_policy: dict[str, list[dict[str, Any]]] = {}
        for row in curve.rows:
            if row.get("kind", "step") == "step":
                by_policy.setdefault(str(row.get("policy")), []).append(row)
        colour = colours[i % len(colours)]
        for j, (policy, rows) in enumerate(sorted(by_policy.items())):
            name = label if len(by_policy) == 1 else f"{label} · {policy}"
            style = ("-", "--", ":", "-.")[j % 4]
            steps = [row["step"] for row in rows]
            ax_r.plot(steps, [_number(row.get("reward")) for row in rows], style,
                      color=colour, label=name)
            ax_s.plot(steps, [_number(row.get("staleness_max")) for row in rows], style,
                      color=colour, label=name)
    ax_r.set(xlabel="step", ylabel="mean episode reward", title="reward")
    ax_s.set(xlabel="step", ylabel="staleness max (versions)", title="staleness")
    for ax in (ax_r, ax_s):
        ax.grid(alpha=0.3)
    ax_r.legend(loc="best", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
