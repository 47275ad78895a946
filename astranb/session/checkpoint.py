"""Checkpoints of an embedded run, and what a resumed run needs to go on after the kernel died.

`session.train(..., checkpoint_every=N)` writes, for every policy whose trainer stands at a
multiple of N versions (and at the run's end), one checkpoint into the run's folder:

    runs/x/run-000/
      plan.json                       what the run is: settings, target versions, each policy's
                                      recipe (model spec, algorithm, optimizer, engine options),
                                      the wiring (environment names, roles, weights)
      checkpoints/<policy>/
        step-000005/
          model.safetensors           the trainer's weights (full precision)
          optimizer.safetensors       AdamW's state, tensor by tensor
          trainer.json                version, optimizer settings and param groups
          state.json                  sample-stream positions and the samples drawn but not
                                      yet accounted for (dataflow/ledger.py), environment-choice
                                      RNG, the run's clock, the episodes played so far
          rng.safetensors             torch's and Python's global RNG states
          manifest.json               written last: size and xxh3-64 of every file above, and
                                      the checksum of the weights (`weights.codec.checksum`)
        step-000010/ ...

safetensors and JSON only: a checkpoint is read by another process, so no pickle. A checkpoint
is written into a hidden temporary folder, hashed, fsynced and renamed into place, so a killed
writer leaves either a whole checkpoint or a `.tmp-*` folder that nothing reads. The newest
`keep` checkpoints of each policy stay. Reading checks every file against the manifest before
anything is loaded; a checkpoint that fails (torn, truncated, edited) is skipped with a warning
naming it, and the previous good one is taken.

Resuming (see `Session.resume`) loads each policy's newest good checkpoint, checks that the
trainer's weights hash to the manifest's checksum (bit for bit what was saved), publishes them to
the engine, sets metrics rows recorded after the checkpoint aside (`metrics.discarded.jsonl`: the
steps they describe are trained again) and trains on to the plan's target versions. Nothing
generated before the restart is trained on: the buffers died with the process, and the samples
they held are played again first (the checkpoint keeps them).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import AstranbError
from ..weights.codec import checksum
from .folder import (  # the write errors live with the writing; re-exported here
    MANIFEST_FILE,
    METRICS_DISCARDED_FILE,
    METRICS_FILE,
    PLAN_FILE,
    RNG_FILE,
    SAMPLES_DISCARDED_FILE,
    SAMPLES_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointWriteError,
    RecordWriteError,
    append_synced,
    atomic_write_text,
    checkpoint_folder,
    checkpoint_folders,
    fsync_dir,
    fsync_file,
    json_line,
    jsonl_lines,
    read_json,
    unfinished_folder,
    unfinished_folders,
    write_synced,
)

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "RecordWriteError",
    "NoCheckpoint",
    "Checkpoint",
    "write_checkpoint",
    "read_checkpoints",
    "latest_good",
    "write_plan",
    "read_plan",
    "set_aside_rows",
]

FORMAT = 1


# -- errors ----------------------------------------------------------------------------------------

class NoCheckpoint(CheckpointError, FileNotFoundError):
    """There is nothing good to resume from."""


# -- writing ---------------------------------------------------------------------------------------

def write_checkpoint(root: Path, version: int, save: Any, state: Mapping[str, Any], *,
                     keep: int = 3) -> Path:
    """Write one checkpoint of one policy at `version` under `root` (checkpoints/<policy>).

    Args:
        save: `save(directory)` writes the trainer's files (`LocalTrainer.save` and
            `ProcessTrainer.save` write model.safetensors, optimizer.safetensors, trainer.json).
        state: JSON-able run state to keep beside them (state.json).
        keep: checkpoints of this policy to keep (the newest); at least 2, so a torn newest one
            always has a predecessor.

    Raises:
        CheckpointWriteError: on any OSError (full disk, read-only folder), naming the path.
    """
    final = checkpoint_folder(root, version)
    tmp = unfinished_folder(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        save(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(dict(state), indent=1))
        save_file(_rng_tensors(), tmp / RNG_FILE)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        weights = load_file(tmp / WEIGHTS_FILE)
        manifest = {"format": FORMAT, "version": version, "created": time.time(),
                    "weights_checksum": checksum(weights),
                    "files": {name: _file_facts(tmp / name) for name in files}}
        write_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        for name in files:
            fsync_file(tmp / name)
        if final.exists():  # the same version again (a run resumed from an earlier point)
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
    # AstranbError: a trainer process's failed save; SafetensorError: safetensors' own I/O
    except (OSError, AstranbError, SafetensorError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        where = getattr(error, "filename", None) or tmp
        raise CheckpointWriteError(Path(where), error) from error
    _prune(root, max(2, keep))
    return final


def _rng_tensors() -> dict[str, torch.Tensor]:
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(list(py_internal), dtype=torch.int64),
        "python_meta": torch.tensor([py_version, -1 if py_gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss or 0.0], dtype=torch.float64),
    }


def restore_rng(directory: Path) -> None:
    """Set torch's and Python's global RNGs to what a checkpoint saved."""
    tensors = load_file(directory / RNG_FILE)
    torch.set_rng_state(tensors["torch"])
    version, has_gauss = (int(v) for v in tensors["python_meta"])
    gauss = float(tensors["python_gauss"][0]) if has_gauss > 0 else None
    random.setstate((version, tuple(int(v) for v in tensors["python"]), gauss))


def _prune(root: Path, keep: int) -> None:
    for old in checkpoint_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in unfinished_folders(root):  # a writer killed earlier left it
        shutil.rmtree(tmp, ignore_errors=True)


def _file_facts(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "xxh3": _hash_file(path)}


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# -- reading ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint of one policy."""

    path: Path
    version: int
    weights_checksum: int
    state: Mapping[str, Any]


def read_checkpoints(root: Path) -> list[Path]:
    """The finished checkpoint folders under `root`, oldest first (temporary ones left out)."""
    return checkpoint_folders(root)


def verify(path: Path) -> Checkpoint:
    """Check every file of a checkpoint against its manifest; CheckpointError saying what is
    wrong (a missing manifest, a file missing, short or with another hash)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: no readable {MANIFEST_FILE} ({error}): the writer was "
                              "killed before it finished") from error
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, this "
                              f"astranb reads format {FORMAT}")
    for name, facts in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = file.stat().st_size
        if size != facts["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says "
                                  f"{facts['bytes']} (truncated or overwritten)")
        if _hash_file(file) != facts["xxh3"]:
            raise CheckpointError(f"{path}: {name} does not match its hash in the manifest")
    state = json.loads((path / STATE_FILE).read_text())
    return Checkpoint(path, int(manifest["version"]), int(manifest["weights_checksum"]), state)


def latest_good(root: Path, *, at_most: int | None = None) -> Checkpoint:
    """The newest checkpoint under `root` that verifies (and is at version <= at_most).

    A newer one that fails is reported with a warning that names it and says which one is
    taken instead. NoCheckpoint when none is good.
    """
    skipped: list[str] = []
    for path in reversed(read_checkpoints(root)):
        try:
            found = verify(path)
        except CheckpointError as error:
            skipped.append(str(error))
            continue
        if at_most is not None and found.version > at_most:
            continue
        if skipped:
            warnings.warn(f"skipped {len(skipped)} damaged checkpoint(s): "
                          f"{'; '.join(skipped)}. Resuming from {path.name} instead",
                          RuntimeWarning, stacklevel=2)
        return found
    raise NoCheckpoint(_nothing_found(root, skipped, at_most))


def _nothing_found(root: Path, skipped: Sequence[str], at_most: int | None) -> str:
    """Why `latest_good` found nothing, from what is in `root`: damaged checkpoints (each with
    why), only newer ones than asked for, an empty folder, or no folder at all."""
    again = "; start the run again with session.train"
    found = read_checkpoints(root)
    if found:
        damaged = f"damaged: {'; '.join(skipped)}" if skipped else ""
        newer = len(found) - len(skipped)
        past = (f"{newer} past version {at_most} (asked for at most that)"
                if newer and at_most is not None else "")
        what = " and ".join(part for part in (damaged, past) if part)
        return (f"none of the {len(found)} checkpoint(s) in {root} can be resumed from: "
                f"{what}{again}")
    if root.is_dir():
        leftovers = sorted(p.name for p in root.iterdir())
        found_here = (f"only unfinished writes ({', '.join(leftovers)}): the process was killed "
                      "while it wrote its first checkpoint" if leftovers else
                      "it is empty: the run stopped before its first checkpoint, or they were "
                      "deleted")
        return f"no checkpoint in {root}: {found_here}{again}"
    return (f"no checkpoints folder {root}: the run stopped before its first checkpoint "
            "(train(checkpoint_every=N) writes one every N versions), or the folder was "
            f"deleted{again}")


# -- the run's plan -------------------------------------------------------------------------------

def write_plan(directory: Path, plan: Mapping[str, Any]) -> None:
    """Write plan.json (what a resumed run needs to rebuild the run) atomically. Plain
    `json.dumps`: a value JSON cannot hold is an error here, never a changed value at resume
    (an infinite stall_seconds stays Infinity)."""
    atomic_write_text(directory / PLAN_FILE, json.dumps(dict(plan), indent=1))


def read_plan(directory: Path) -> dict[str, Any]:
    """plan.json of a run folder; NoCheckpoint without one."""
    if not (directory / PLAN_FILE).is_file():
        raise NoCheckpoint(f"{directory} has no {PLAN_FILE}: it was not trained with "
                           "checkpoint_every=N, so there is nothing to resume")
    plan = read_json(directory / PLAN_FILE)
    if plan is None:
        raise CheckpointError(f"{directory / PLAN_FILE} cannot be read as JSON (damaged); "
                              "the run cannot be resumed, start it again with session.train")
    return plan


# -- the metrics record ----------------------------------------------------------------------------

def set_aside_rows(directory: Path, versions: Mapping[str, int]) -> list[dict[str, Any]]:
    """Keep in metrics.jsonl only the rows of steps before each policy's resumed version.

    Rows of later steps (trained by the process that died, after its last checkpoint) are
    appended to metrics.discarded.jsonl, nothing is deleted. Returns the rows kept. A torn last
    line (the process died mid-write) is set aside too. samples.jsonl's lines go the same way
    (to samples.discarded.jsonl).
    """
    _set_aside(directory / SAMPLES_FILE, directory / SAMPLES_DISCARDED_FILE, versions)
    return _set_aside(directory / METRICS_FILE, directory / METRICS_DISCARDED_FILE, versions)


def _set_aside(path: Path, discarded: Path, versions: Mapping[str, int]) -> list[dict[str, Any]]:
    """Move the lines of `path` whose (policy, step) is at or past that policy's version in
    `versions`, and torn ones, to the end of `discarded`; return the lines kept."""
    kept: list[dict[str, Any]] = []
    dropped: list[str] = []
    for line, row in jsonl_lines(path):
        step = None if row is None else row.get("step")
        if row is not None and not (isinstance(step, int) and row.get("policy") in versions
                                    and step >= versions[row["policy"]]):
            kept.append(row)
        else:
            dropped.append(line)
    if dropped:
        append_synced(discarded, "".join(line + "\n" for line in dropped).encode("utf-8"))
        atomic_write_text(path, "".join(json_line(r) + "\n" for r in kept))
    return kept
