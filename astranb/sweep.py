"""`astranb sweep NOTEBOOK -p NAME V1 V2 ... [-p NAME2 ...]`: a notebook executed once per point
of a parameter grid, and one table of the outcomes.

The notebook stays the one description of the experiment; a sweep runs it headless for every
combination of the values given (the full grid), so each point leaves what a person would have
got by running it by hand: the executed notebook and its HTML export. Each point is one
`astranb run` in a child process: papermill changes the process's working directory while it
runs, and a point whose kernel crashes or hangs must not take the others down; `--jobs N` keeps
N of them going at once.

Points never share a run folder: when the notebook's parameters cell has `run_dir` or
`results_dir`, the sweep sets them to folders of the point's own (a run folder records which
point made it, so `ab.runs(OUTDIR)` knows each run's parameters). A point that fails (a cell
raised) is recorded with the error and the cell, and the others go on. When a point ends its
record, point.json, is written; `--resume` trusts it and executes only points not recorded as
done. At the end one table, sweep.csv and sweep.parquet, holds a row per point: the parameters,
status (ok | failed), error, failed_cell, wall_s, and the final numbers of its run (its
run.json summary: reward_last_10pct, reward_last, staleness_max, ...) and of the JSON files the
notebook wrote into its results folder.

OUTDIR holds:

    sweep.json                 the notebook and the grid
    <point>.ipynb, .html       the executed notebook and its HTML export
    <point>/point.json         parameters, status, error, failed_cell, wall_s, start and end
    <point>/log.txt            what the point's execution printed
    <point>/runs/run-NNN/      its run folders (when the notebook has `run_dir`)
    <point>/results/           its results (when the notebook has `results_dir`)
    sweep.csv, sweep.parquet   one row per point

A point is named by the values of the parameters that vary, `steps=20_lr=1e-3` (as typed, with
characters unsafe in file names replaced), so the same point has the same name in a resumed
sweep; --resume also checks that its recorded parameters are the ones asked for.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .papermill_run import cell_label, check_parameters, import_papermill, parse_value
from .session.folder import POINT_FILE, read_json, write_json
from .session.history import RENAMED, find_run_folders, read_run_folder

if TYPE_CHECKING:
    import pandas

__all__ = ["Point", "grid", "plan", "point_name", "run_sweep"]

OWNED = {"run_dir": "runs", "results_dir": "results"}  # parameter -> the point's own subfolder
SWEEP_FILE, LOG_FILE = "sweep.json", "log.txt"  # point.json: session/folder.py
NAME_LIMIT = 100


@dataclass(frozen=True)
class Point:
    """One point of the grid: its name and its parameter values (as typed, and as read)."""

    name: str
    texts: dict[str, str]
    values: dict[str, Any]


# -- the grid (pure) ---------------------------------------------------------------------------
def axes_of(parameters: Sequence[Sequence[str]]) -> list[tuple[str, list[str]]]:
    """(name, values as typed) per -p, checked.

    Raises:
        ValueError: a -p without values, a name given twice, a value listed twice.
    """
    if not parameters:
        raise ValueError("a sweep needs at least one -p NAME V1 V2 ...; to run a notebook "
                         "once, use `astranb run`")
    axes: list[tuple[str, list[str]]] = []
    for name, *values in parameters:
        if not values:
            raise ValueError(f"-p {name} has no values; write -p {name} V1 V2 ...")
        if name in dict(axes):
            raise ValueError(f"-p {name} is given twice; list all its values in one -p")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"-p {name} lists {', '.join(repeated)} more than once")
        axes.append((name, list(values)))
    return axes


def grid(axes: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
    """Every combination of the values, the last parameter varying fastest."""
    names = [name for name, _ in axes]
    return [dict(zip(names, combo, strict=True))
            for combo in itertools.product(*(values for _, values in axes))]


def point_name(texts: Mapping[str, str]) -> str:
    """`name=value_name=value`, with characters unsafe in file names replaced by "-" and a
    name longer than NAME_LIMIT cut and given a short hash of the whole."""
    raw = "_".join(f"{name}={text}" for name, text in texts.items())
    name = re.sub(r"[^A-Za-z0-9._=+-]", "-", raw)
    if len(name) > NAME_LIMIT:
        digest = hashlib.sha1(raw.encode()).hexdigest()[:8]
        name = f"{name[:NAME_LIMIT - 9]}-{digest}"
    return name


def plan(axes: Sequence[tuple[str, Sequence[str]]]) -> list[Point]:
    """The points of the grid. A point is named by the parameters that vary (all of them if
    none does); a name taken already gets -2, -3, ..."""
    varying = [name for name, values in axes if len(values) > 1] or [name for name, _ in axes]
    points, taken = [], set()
    for texts in grid(axes):
        base = name = point_name({k: texts[k] for k in varying})
        for n in itertools.count(2):
            if name not in taken:
                break
            name = f"{base}-{n}"
        taken.add(name)
        points.append(Point(name, texts, {k: parse_value(v) for k, v in texts.items()}))
    return points


# -- one point ---------------------------------------------------------------------------------
def point_command(notebook: Path, point: Point, outdir: Path, owned: Mapping[str, Path],
                  cwd: Path, timeout: float | None) -> list[str]:
    """The `astranb run` command line of a point (the current interpreter)."""
    command = [sys.executable, "-m", "astranb.cli", "run", str(notebook)]
    for name, text in [*point.texts.items(), *((k, str(v)) for k, v in owned.items())]:
        command += ["-p", name, text]
    command += ["-o", str(outdir), "--name", point.name, "--cwd", str(cwd)]
    if timeout is not None:
        command += ["--timeout", f"{timeout:g}"]
    return command


def cell_error(executed: Path) -> tuple[str, str] | None:
    """(error, cell) of the first cell of an executed notebook with an error output: the
    exception's type and the first line of its message, and the cell as `astranb run` names
    it. None if no cell has one (or the notebook cannot be read)."""
    import nbformat

    try:
        cells = nbformat.read(executed, as_version=4).cells
    except (OSError, ValueError):
        return None
    for cell in cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "error":
                message = (output.get("evalue") or "").strip().splitlines()
                first = f"{output.get('ename')}: {message[0]}" if message else output.get("ename")
                return str(first), cell_label(cell.get("execution_count"), cell.source)
    return None


def log_error(log: Path) -> str:
    """What a failed point's log says last: `astranb run`'s own message if it printed one."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return "failed (no log)"
    ours = [line for line in lines if line.startswith("astranb:")]
    return (ours or lines or ["failed (nothing printed)"])[-1].removeprefix("astranb: ")


def run_point(point: Point, notebook: Path, outdir: Path, owned: Sequence[str], cwd: Path,
              timeout: float | None) -> dict[str, Any]:
    """Execute one point from a clean slate and write its point.json; returns that record."""
    folder = outdir / point.name
    clear_point(outdir, point.name)
    folder.mkdir(parents=True)
    dirs = {name: (folder / OWNED[name]).resolve() for name in owned}
    command = point_command(notebook, point, outdir.resolve(), dirs, cwd, timeout)
    started = time.time()
    with open(folder / LOG_FILE, "w", encoding="utf-8") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, check=False).returncode
    ended = time.time()
    record: dict[str, Any] = {"point": point.name, "parameters": point.values,
                              "status": "ok" if code == 0 else "failed", "error": None,
                              "failed_cell": None, "wall_s": round(ended - started, 2),
                              "started": started, "ended": ended}
    if code != 0:
        found = cell_error(outdir / f"{point.name}.ipynb")
        record["error"], record["failed_cell"] = found or (log_error(folder / LOG_FILE), None)
    write_json(folder / POINT_FILE, record)
    return record


def clear_point(outdir: Path, name: str) -> None:
    """Remove what an earlier execution of a point left (its folder, notebook and HTML), so a
    rerun never appends to an old run folder."""
    shutil.rmtree(outdir / name, ignore_errors=True)
    for suffix in (".ipynb", ".html"):
        (outdir / f"{name}{suffix}").unlink(missing_ok=True)


def done_record(outdir: Path, point: Point) -> dict[str, Any] | None:
    """The record of a point that ran to the end before with the same parameter values (for
    --resume), else None."""
    record = read_json(outdir / point.name / POINT_FILE)
    if record is None:
        return None
    same = record.get("parameters") == json.loads(json.dumps(point.values))
    executed = outdir / f"{point.name}.ipynb"
    return record if same and record.get("status") == "ok" and executed.is_file() else None


# -- the table ---------------------------------------------------------------------------------
def point_row(outdir: Path, point: Point, record: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the sweep table: the point's parameters and outcome, its last run's final
    numbers (run.json), and the scalars of the JSON files in its results folder. A result
    named like a column already there with another value is kept as `<file stem>/<name>`."""
    row: dict[str, Any] = {"point": point.name, **point.values,
                           **{k: record.get(k) for k in ("status", "wall_s")}}
    folder = outdir / point.name
    runs = find_run_folders(folder)  # a notebook without run_dir leaves none here
    if runs:
        last = read_run_folder(runs[-1], folder)
        row["run_status"] = last.status
        for key, value in last.summary.items():
            _merge(row, RENAMED.get(key, key), value, "run")
    for path in sorted((folder / OWNED["results_dir"]).glob("*.json")):
        for key, value in _scalars(path).items():
            _merge(row, key, value, path.stem)
    row.update({"error": record.get("error"), "failed_cell": record.get("failed_cell"),
                "run": str(runs[-1].relative_to(outdir)) if runs else None})
    return row


def _merge(row: dict[str, Any], key: str, value: Any, prefix: str) -> None:
    if key not in row:
        row[key] = value
    elif not _same(row[key], value):
        row[f"{prefix}/{key}"] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _scalars(path: Path) -> dict[str, Any]:
    """The top-level numbers, strings and booleans of a JSON object file ({} otherwise)."""
    data = read_json(path) or {}
    return {str(k): v for k, v in data.items() if isinstance(v, (int, float, str, bool))}


def write_table(rows: list[dict[str, Any]], outdir: Path) -> tuple[pandas.DataFrame, list[Path]]:
    """sweep.csv and sweep.parquet (when pyarrow is installed); returns the table and the
    files written."""
    import pandas as pd

    table = pd.DataFrame(rows)
    written = [outdir / "sweep.csv"]
    table.to_csv(written[0], index=False)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        print("astranb: sweep.parquet skipped: pip install pyarrow to get it", file=sys.stderr)
    else:
        _parquet_ready(table).to_parquet(outdir / "sweep.parquet", index=False)
        written.append(outdir / "sweep.parquet")
    return table, written


def _parquet_ready(table: pandas.DataFrame) -> pandas.DataFrame:
    """Columns holding values of several types (`-p x 1 a`: an int and a str) as text, which
    parquet needs; other columns as they are."""
    out = table.copy()
    for column in out.columns:
        if out[column].dtype == object:
            kinds = {type(v) for v in out[column] if v is not None and v == v}
            if len(kinds) > 1:
                out[column] = out[column].map(lambda v: None if v is None else str(v))
    return out


def summary_text(table: pandas.DataFrame, parameters: Sequence[str]) -> str:
    """The printed table: parameters, status, wall time and the numeric results; then the
    error of each failed point."""
    hidden = {"point", "error", "failed_cell", "run"}
    numeric = [c for c in table.columns if c not in hidden and c not in parameters
               and c not in ("status", "wall_s", "run_status")
               and table[c].dtype.kind in "fiub"]
    shown = table[[*parameters, "status", "wall_s", *numeric]]
    text = shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    failed = table[table["status"] != "ok"]
    for _, row in failed.iterrows():
        where = f" in {row['failed_cell']}" if row.get("failed_cell") else ""
        text += f"\nfailed: {row['point']}: {row['error']}{where}"
    return text


# -- the command -------------------------------------------------------------------------------
def run_sweep(args: Any) -> int:
    """`astranb sweep` (arguments parsed by cli.py). Returns 0 when every point ran, 1 when
    any failed; bad arguments raise ValueError (exit status 2)."""
    papermill = import_papermill()
    notebook = Path(args.notebook)
    if not notebook.is_file():
        raise ValueError(f"notebook {str(notebook)!r} not found (looked in {Path.cwd()}); "
                         "give the path to an .ipynb file")
    axes = axes_of(args.parameters)
    given = sorted(set(dict(axes)) & set(OWNED))
    if given:
        raise ValueError(f"-p {', '.join(given)}: the sweep gives every point its own "
                         f"{' and '.join(OWNED)} inside OUTDIR (so points never share a run "
                         "folder); leave them out")
    check_parameters(papermill, notebook, {name: parse_value(v[0]) for name, v in axes})
    known = papermill.inspect_notebook(str(notebook))
    owned = [name for name in OWNED if name in known]
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give the number of points to run at once (>= 1)")
    if args.resume and not args.output_dir:
        raise ValueError("--resume needs -o OUTDIR: the folder of the sweep to finish")
    cwd = Path(args.cwd) if args.cwd else notebook.parent
    if not cwd.is_dir():
        raise ValueError(f"--cwd {args.cwd!r} is not a folder")
    outdir = Path(args.output_dir or
                  f"sweeps/{notebook.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (outdir / SWEEP_FILE).exists() and not args.resume:
        raise ValueError(f"{outdir} holds a sweep already; pass --resume to finish it (points "
                         "done are kept) or choose another -o")
    outdir.mkdir(parents=True, exist_ok=True)
    points = plan(axes)
    _write_sweep_file(outdir, notebook, axes)
    began = time.monotonic()
    print(f"sweep of {notebook}: {len(points)} points into {outdir}, {args.jobs} at a time",
          flush=True)
    records = _run_points(points, lambda point: run_point(
        point, notebook.resolve(), outdir, owned, cwd.resolve(), args.timeout),
        outdir, args.resume, args.jobs)
    table, written = write_table(
        [point_row(outdir, p, r) for p, r in zip(points, records, strict=True)], outdir)
    print(summary_text(table, [name for name, _ in axes]))
    failed = int((table["status"] != "ok").sum())
    print(f"{len(points) - failed} of {len(points)} points ok in "
          f"{time.monotonic() - began:.0f} s; table: {', '.join(map(str, written))}")
    return 1 if failed else 0


def _write_sweep_file(outdir: Path, notebook: Path, axes: Sequence[tuple[str, list[str]]]) -> None:
    path = outdir / SWEEP_FILE
    created = (read_json(path) or {}).get("created")
    write_json(path, {"notebook": str(notebook.resolve()), "parameters": dict(axes),
                      "created": created or time.time(), "updated": time.time()})


def _run_points(points: list[Point], execute: Callable[[Point], dict[str, Any]], outdir: Path,
                resume: bool, jobs: int) -> list[dict[str, Any]]:
    """Every point's record, in grid order: the recorded one of a point done before (with
    --resume), else a fresh execution; `jobs` at a time, one line printed per start and end."""
    lock = threading.Lock()
    total = len(points)

    def say(index: int, what: str, point: Point, tail: str = "") -> None:
        with lock:
            print(f"[{time.strftime('%H:%M:%S')}] {what:<7} {index + 1}/{total} "
                  f"{point.name}{tail}", flush=True)

    def one(index: int, point: Point) -> dict[str, Any]:
        if resume:
            record = done_record(outdir, point)
            if record is not None:
                say(index, "skip", point, " (done before)")
                return record
        say(index, "start", point)
        record = execute(point)
        ok = record["status"] == "ok"
        tail = f" ({record['wall_s']:.1f} s)" + ("" if ok else f": {record['error']}")
        say(index, "ok" if ok else "FAILED", point, tail)
        return record

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, range(total), points))
