"""The run folder module (astranb/session/folder.py): its names, readers, atomic writes and the
folder reader that `ab.open_run` and `ab.runs` share; and a check that no other module of the
package spells a folder's file name itself."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import astranb as ab
from astranb.errors import AstranbError, FolderNotWritable
from astranb.session import checkpoint, folder
from astranb.session.folder import (
    CheckpointError,
    CheckpointWriteError,
    RecordWriteError,
    RunFiles,
    atomic_write_bytes,
    evaluation_windows,
    jsonl_lines,
    next_run_folder,
    read_json,
    read_jsonl,
    write_json,
)
from astranb.session.history import read_run_folder

PACKAGE = Path(ab.__file__).resolve().parent
OWNER = Path("session/folder.py")
ELSEWHERE = {
    # a trainer service's own work folder (services/ray_supervisor.py), not a run folder
    (Path("services/ray_supervisor.py"), "checkpoints"),
}


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the JSON-lines reader ---------------------------------------------------------------------
def test_jsonl_reader_leaves_out_blank_lines_and_a_torn_last_line(tmp_path):
    path = tmp_path / folder.METRICS_FILE
    path.write_text('{"step": 0}\n\n   \n{"step": 1}\n[1, 2]\n{"step": 2, "rew')  # killed mid-line
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    # the raw lines stay available: a resumed run sets the torn one aside, it does not vanish
    assert [(line, value) for line, value in jsonl_lines(path)] == [
        ('{"step": 0}', {"step": 0}), ('{"step": 1}', {"step": 1}), ("[1, 2]", None),
        ('{"step": 2, "rew', None)]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_jsonl_reader_survives_a_character_cut_in_two(tmp_path):
    path = tmp_path / folder.EVENTS_FILE
    path.write_bytes(b'{"kind": "a"}\n{"kind": "\xc3')  # the first byte of "é", then the kill
    assert read_jsonl(path) == [{"kind": "a"}]


# -- atomic writes -----------------------------------------------------------------------------
def test_a_failed_rename_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / folder.RUN_FILE
    write_json(path, {"status": "running"})

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CheckpointWriteError) as caught:
        write_json(path, {"status": "finished"})
    assert read_json(path) == {"status": "running"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.RUN_FILE]
    message = str(caught.value)
    assert str(path) in message and "No space left on device" in message and "free" in message
    assert isinstance(caught.value, OSError)


def test_a_write_that_fails_midway_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / folder.PLAN_FILE

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointWriteError):
        atomic_write_bytes(path, b"x" * 1000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fds through /proc")
def test_an_atomic_write_fsyncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic_write_bytes(tmp_path / "x.bin", b"abc")
    assert (tmp_path / "x.bin").read_bytes() == b"abc"
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path and Path(synced[0]).name.startswith(".x.bin.")
    assert synced[1] == str(tmp_path)  # the rename itself reaches the disk


def test_write_json_writes_strict_json_and_read_json_refuses_what_is_not_an_object(tmp_path):
    path = tmp_path / "x.json"
    write_json(path, {"reward": math.nan, "n": 3})
    assert json.loads(path.read_text()) == {"reward": None, "n": 3}
    path.write_text("[1, 2]")
    assert read_json(path) is None
    path.write_text('{"torn": ')
    assert read_json(path) is None
    assert read_json(tmp_path / "missing.json") is None


def test_the_write_errors_keep_their_names_and_bases():
    assert issubclass(RecordWriteError, CheckpointWriteError)
    assert issubclass(CheckpointWriteError, CheckpointError)
    assert issubclass(CheckpointWriteError, OSError)
    assert issubclass(CheckpointError, AstranbError) and issubclass(CheckpointError, RuntimeError)
    assert issubclass(checkpoint.NoCheckpoint, CheckpointError)
    assert issubclass(checkpoint.NoCheckpoint, FileNotFoundError)
    assert issubclass(FolderNotWritable, OSError) and issubclass(FolderNotWritable, AstranbError)
    # one class each, wherever it is imported from
    assert checkpoint.RecordWriteError is RecordWriteError
    assert checkpoint.CheckpointWriteError is CheckpointWriteError
    assert checkpoint.CheckpointError is CheckpointError


# -- the evaluation filter ---------------------------------------------------------------------
def test_evaluation_windows_are_the_evaluation_events_in_order():
    events = [
        {"kind": "rollback", "policy": "a"},
        {"kind": "evaluation", "window": 0, "version": 2, "solver/avg@4": 0.5},
        {"kind": "stalled", "message": "waiting"},
        {"window": 9},  # no kind at all: not a window
        {"kind": "evaluation", "window": 1, "version": 4, "solver/avg@4": 0.75},
    ]
    windows = evaluation_windows(events)
    assert [w["window"] for w in windows] == [0, 1]
    windows[0]["window"] = 99  # copies: the recorder's own list stays as it was
    assert events[1]["window"] == 0
    assert evaluation_windows([]) == []


# -- the folder reader -------------------------------------------------------------------------
def a_run_folder(path: Path, *, info: dict | None) -> Path:
    path.mkdir(parents=True)
    rows = [{"policy": "solver", "step": s, "reward": r, "time": float(s), "episodes": 8 * s,
             "staleness_max": 1} for s, r in enumerate([0.1, 0.3, 0.5])]
    (path / folder.METRICS_FILE).write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"policy": "sol')
    events = [{"kind": "rollback", "policy": "solver"},
              {"kind": "evaluation", "window": 0, "version": 2, "time": 1.5,
               "solver/avg@2": 0.25}]
    (path / folder.EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    if info is not None:
        write_json(path / folder.RUN_FILE, info)
    return path


def test_the_folder_reader_reads_rows_events_windows_and_run_json(tmp_path):
    info = {"run": "run-000", "status": "running", "pid": dead_pid(), "host": os.uname()[1],
            "config": {"steps": 3}, "policies": [{"name": "solver", "lr": 0.001}],
            "started": 100.0}
    path = a_run_folder(tmp_path / "run-000", info=info)
    files = RunFiles(path)
    assert files.holds_a_run()
    assert [r["step"] for r in files.rows] == [0, 1, 2]
    assert [e["kind"] for e in files.events] == ["rollback", "evaluation"]
    assert [w["window"] for w in files.evaluations] == [0]
    assert files.info == info
    assert files.status == "interrupted"  # "running", but its process is gone
    assert files.error is None

    # open_run and ab.runs read the same folder through it, and agree
    record = ab.open_run(path)
    assert record.rows == files.rows and record.events == files.events
    assert record.status == "interrupted" and record.info == info
    assert record.evaluation_rows == [{"window": 0, "version": 2, "time": 1.5,
                                       "solver/avg@2": 0.25}]
    listed = read_run_folder(path)
    assert listed.status == "interrupted"
    assert listed.summary["steps"] == 3 and listed.summary["eval/solver/avg@2"] == 0.25
    assert listed.config == {"steps": 3} and listed.started == 100.0


def test_the_folder_reader_without_run_json_takes_status_json(tmp_path):
    path = a_run_folder(tmp_path / "run-001", info=None)
    (path / folder.STATUS_FILE).write_text('{"status": "failed", "error": "ValueError: x"}')
    files = RunFiles(path)
    assert files.info is None
    assert (files.status, files.error) == ("failed", "ValueError: x")
    (path / folder.STATUS_FILE).unlink()
    assert RunFiles(path).status == "unknown"
    assert not RunFiles(tmp_path).holds_a_run()


def test_run_folders_are_numbered_after_the_last_one(tmp_path):
    assert next_run_folder(tmp_path) == tmp_path / "run-000"
    for name in ("run-000", "run-002", "run-x", "other"):
        (tmp_path / name).mkdir()
    assert next_run_folder(tmp_path) == tmp_path / "run-003"


# -- no other module spells a folder's names ---------------------------------------------------
def _unchecked(tree: ast.AST) -> set[int]:
    """Strings that are not paths: docstrings and bare strings, dict keys, subscripts."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        elif isinstance(node, ast.Dict):
            skip.update(id(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            skip.add(id(node.slice))
    return skip


def _names_in(text: str) -> list[str]:
    named = [n for n in folder.NAMES if text == n or text.endswith("/" + n)]
    return named + [p for p in folder.PREFIXES if text.startswith(p)]


def spelled_names(package: Path) -> list[str]:
    """`file:line spells 'name'` for every string constant of the package, outside folder.py,
    that is a folder's file or folder name (or begins a run-NNN, step-NNNNNN, trainer-<policy>
    name)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative == OWNER:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _unchecked(tree)
        strings = sorted((node.lineno, node.value) for node in ast.walk(tree)
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and id(node) not in skip)
        found += [f"{package.name}/{relative}:{line} spells {name!r}"
                  for line, text in strings for name in _names_in(text)
                  if (relative, name) not in ELSEWHERE]
    return found


def test_no_module_but_folder_py_spells_a_folder_name():
    assert spelled_names(PACKAGE) == []


def test_the_check_names_a_planted_literal(tmp_path):
    planted = tmp_path / "astranb"
    (planted / "session").mkdir(parents=True)
    (planted / "session" / "folder.py").write_text('METRICS = "metrics.jsonl"\n')
    (planted / "session" / "bad.py").write_text(
        '"""Reads metrics.jsonl (a docstring may say so)."""\n'
        'from pathlib import Path\n'
        'row = {"checkpoints": 3}["checkpoints"]\n'
        'rows = Path("x") / "metrics.jsonl"\n'
        'name = f"run-{3:03d}"\n')
    assert spelled_names(planted) == [
        f"astranb/{Path('session/bad.py')}:4 spells 'metrics.jsonl'",
        f"astranb/{Path('session/bad.py')}:5 spells 'run-'"]
