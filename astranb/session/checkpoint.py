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
import os
import random
import shutil
import socket
import time
import uuid
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
    "atomic_write_bytes",
    "atomic_write_text",
]

FORMAT = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"


# -- errors ----------------------------------------------------------------------------------------

class CheckpointError(AstranbError, RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint (or a run's record) failed: a full disk, a read-only folder."""

    def __init__(self, path: Path, error: BaseException):
        free = _free_space(path)
        reason = (error.strerror if isinstance(error, OSError) and error.strerror
                  else str(error).strip().splitlines()[-1] if str(error).strip() else repr(error))
        super().__init__(
            f"could not write {path}: {reason} ({free} free on that disk). The "
            "run stopped; its metrics so far and its last checkpoint stay readable. Free some "
            "space (or make the folder writable) and resume with `session.resume()`")
        self.path, self.error = path, error


class RecordWriteError(CheckpointWriteError):
    """Writing the run's record (metrics, events, episodes) failed: a full disk, a read-only
    folder."""


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
    final = root / f"step-{version:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        save(tmp)
        (tmp / "state.json").write_text(json.dumps(dict(state), indent=1))
        save_file(_rng_tensors(), tmp / "rng.safetensors")
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        weights = load_file(tmp / "model.safetensors")
        manifest = {"format": FORMAT, "version": version, "created": time.time(),
                    "weights_checksum": checksum(weights),
                    "files": {name: _file_facts(tmp / name) for name in files}}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        for name in files:
            _fsync(tmp / name)
        if final.exists():  # the same version again (a run resumed from an earlier point)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
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
    tensors = load_file(directory / "rng.safetensors")
    torch.set_rng_state(tensors["torch"])
    version, has_gauss = (int(v) for v in tensors["python_meta"])
    gauss = float(tensors["python_gauss"][0]) if has_gauss > 0 else None
    random.setstate((version, tuple(int(v) for v in tensors["python"]), gauss))


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):  # a writer killed earlier left it
        shutil.rmtree(tmp, ignore_errors=True)


def _file_facts(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "xxh3": _hash_file(path)}


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems cannot fsync a directory: the rename is still atomic
        pass


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsynced, renamed over it.
    CheckpointWriteError (an OSError) naming the path and the free space when that fails."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(path, error) from error


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _free_space(path: Path) -> str:
    for candidate in (path, *path.parents):
        try:
            free = shutil.disk_usage(candidate).free
        except OSError:
            continue
        return _bytes(free)
    return "unknown"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


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
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def verify(path: Path) -> Checkpoint:
    """Check every file of a checkpoint against its manifest; CheckpointError saying what is
    wrong (a missing manifest, a file missing, short or with another hash)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({error}): the writer was "
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
    state = json.loads((path / "state.json").read_text())
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
    """Write plan.json (what a resumed run needs to rebuild the run) atomically."""
    atomic_write_text(directory / PLAN, json.dumps(dict(plan), indent=1))


def read_plan(directory: Path) -> dict[str, Any]:
    path = directory / PLAN
    if not path.is_file():
        raise NoCheckpoint(f"{directory} has no {PLAN}: it was not trained with "
                           "checkpoint_every=N, so there is nothing to resume")
    plan: dict[str, Any] = json.loads(path.read_text())
    return plan


def lock_owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}


# -- the metrics record ----------------------------------------------------------------------------

def set_aside_rows(directory: Path, versions: Mapping[str, int]) -> list[dict[str, Any]]:
    """Keep in metrics.jsonl only the rows of steps before each policy's resumed version.

    Rows of later steps (trained by the process that died, after its last checkpoint) are
    appended to metrics.discarded.jsonl, nothing is deleted. Returns the rows kept. A torn last
    line (the process died mid-write) is set aside too.
    """
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return []
    kept: list[dict[str, Any]] = []
    dropped: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            dropped.append(line)
            continue
        policy, step = row.get("policy"), row.get("step")
        if isinstance(step, int) and policy in versions and step >= versions[policy]:
            dropped.append(line)
        else:
            kept.append(row)
    if dropped:
        with open(directory / "metrics.discarded.jsonl", "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in dropped))
        atomic_write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    return kept


def describe_wiring(wired: Sequence[tuple[Any, Mapping[str, Any], float]]) -> list[dict[str, Any]]:
    """The wiring as plain values: environment name, role -> policy name, sampling weight."""
    return [{"env": env.name, "roles": {role: p.name for role, p in wiring.items()},
             "weight": weight} for env, wiring, weight in wired]
