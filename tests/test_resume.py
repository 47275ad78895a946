"""Checkpoints and resume of an embedded run (astranb/checkpoint.py, astranb/resuming.py).

The main case runs real processes: a script trains with checkpoint_every=5 and is killed with
SIGKILL at a random step; a second process resumes it. The others check the pieces: a torn
checkpoint is skipped with a warning, the folder lock, full and read-only disks (a small tmpfs;
root only), and the errors that say what to do.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zstandard
from safetensors.torch import load_file

import astranb as ab
from astranb.errors import FolderNotWritable, SessionClosed
from astranb.session.checkpoint import (
    CheckpointError,
    NoCheckpoint,
    latest_good,
    read_checkpoints,
    set_aside_rows,
    verify,
)
from astranb.session.folder import FolderLocked, RunFiles
from astranb.weights.codec import checksum
from tests.waiting import wait_until

STEPS = 30
EVERY = 5
STALENESS = 2

TRAIN = """\
import sys
import astranb as ab
session = ab.Session(sys.argv[1])
policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                        optimizer=ab.AdamWConfig(lr=3e-3), max_batch_size=32)
session.wire(ab.environments.load("arithmetic"), solver=policy)
run = session.train(steps={steps}, batch_size=32, group_size=8, max_staleness={staleness},
                    checkpoint_every={every}{extra})
run.wait(progress=False)
print(run.summary())
"""

RESUME = """\
import json, sys
import astranb as ab
run = ab.Session.resume(sys.argv[1])
run.wait(progress=False)
rows = run.rows
print(json.dumps({"steps": [r["step"] for r in rows],
                  "stale": [r["step"] - r["token_version_min"] for r in rows],
                  "events": [e for e in run.events if e["kind"] == "resumed"],
                  "reward": run.summary()["reward_last_10pct"]}))
"""


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_rows(run_dir: Path, n: int, proc: subprocess.Popen, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while len(_rows(run_dir)) < n:
        assert proc.poll() is None, f"the training process ended early ({proc.returncode})"
        assert time.monotonic() < deadline, f"fewer than {n} rows after {limit} s"
        time.sleep(0.1)


def _resumed(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum('"kind": "resumed"' in line for line in lines)


def _kill_after_rows(script: Path, folder: Path, rows: int, resumed: int = 0) -> None:
    """Run `script` on `folder` and SIGKILL it once run-000 has `rows` metrics rows (and the
    `resumed`-th "resumed" event, written after a resume has set the later rows aside)."""
    proc = subprocess.Popen([sys.executable, str(script), str(folder)])
    try:
        deadline = time.monotonic() + 240
        while _resumed(folder / "run-000") < resumed:
            assert proc.poll() is None, f"the process ended early ({proc.returncode})"
            assert time.monotonic() < deadline, "the run did not resume within 240 s"
            time.sleep(0.1)
        _wait_for_rows(folder / "run-000", rows, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _zstd_lines(path: Path) -> list[bytes]:
    """The lines of every zstd frame of a file, one frame after another."""
    data, lines = path.read_bytes(), []
    while data:
        frame = zstandard.ZstdDecompressor().decompressobj()
        lines += frame.decompress(data).splitlines()
        data = frame.unused_data
    return lines


def _episodes(run_dir: Path) -> list[dict]:
    from astranb.session.recorder import EpisodeLog

    return [e.to_json() for e in EpisodeLog(run_dir)]


@pytest.mark.slow  # training scripts in subprocesses, killed twice
def test_a_run_killed_twice_resumes_with_every_sample_and_episode_accounted_for(tmp_path):
    rng = random.Random()
    folder = tmp_path / "runs"
    run_dir = folder / "run-000"
    train = _script(tmp_path, "train.py", TRAIN.format(steps=STEPS, staleness=STALENESS,
                                                      every=EVERY, extra=""))
    resume = _script(tmp_path, "resume.py", RESUME)
    kill_after = rng.randint(EVERY + 2, STEPS // 2)  # rows seen before the first SIGKILL
    _kill_after_rows(train, folder, kill_after)
    before = _rows(run_dir)
    assert (folder / "session.lock").is_file()  # the dead owner's lock is left behind
    first = latest_good(run_dir / "checkpoints" / "solver")
    assert first.version % EVERY == 0 and first.version <= len(before)
    saved = checksum(load_file(first.path / "model.safetensors"))
    pending = [e["sample_id"] for e in first.state["position"]["pending"]]
    assert pending and all(e["sample"] is not None for e in first.state["position"]["pending"])

    # the resumed run is killed too, a few steps on (before or after its next checkpoint)
    again = first.version + rng.randint(2, 8)
    print(f"killing after {kill_after} rows, then after {again}")
    _kill_after_rows(resume, folder, again, resumed=1)
    second = latest_good(run_dir / "checkpoints" / "solver")
    out = subprocess.run([sys.executable, str(resume), str(folder)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = _rows(run_dir)

    # the step series is continuous: every step once, the ones before the checkpoint kept
    assert result["steps"] == [r["step"] for r in rows] == list(range(STEPS))
    assert rows[:first.version] == [r for r in before if r["step"] < first.version]
    # the trainer went on from exactly the checkpointed weights, each time
    assert result["events"][0]["versions"] == {"solver": second.version}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "resumed"]
    assert [e["versions"] for e in events] == [{"solver": first.version},
                                               {"solver": second.version}]
    assert events[0]["weights_checksum"] == {"solver": saved}
    assert events[0]["replayed_samples"] == len(pending)
    # rows of steps the dead processes took after their checkpoints are set aside, not lost
    discarded = [json.loads(line) for line in
                 (run_dir / "metrics.discarded.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.discarded.jsonl").exists() else []
    assert [r["step"] for r in discarded][:len(before) - first.version] == \
        [r["step"] for r in before if r["step"] >= first.version]
    # the staleness bound held at every step, before and after the restarts
    assert max(result["stale"]) <= STALENESS
    assert not (folder / "session.lock").exists()

    # every sample the stream yielded is accounted for exactly once: trained, dropped by a rule
    # the rows name, or pending at the final checkpoint (a continued run would play it first)
    final = latest_good(run_dir / "checkpoints" / "solver")
    assert final.version == STEPS
    # (a row holds counts; the names are in samples.jsonl, a line per row)
    accounts = RunFiles(run_dir).samples
    assert [(a["policy"], a["step"]) for a in accounts] == [(r["policy"], r["step"]) for r in rows]
    assert [len(a["trained"]) for a in accounts] == [r["samples_trained"] for r in rows]
    assert [{k: len(v) for k, v in a["dropped"].items()} for a in accounts] == \
        [r["samples_dropped"] for r in rows]
    trained = [k for a in accounts for k in a["trained"]]
    dropped = [k for a in accounts for ks in a["dropped"].values() for k in ks]
    left = [e["sample_id"] for e in final.state["position"]["pending"]]
    every = trained + dropped + left
    assert len(every) == len(set(every)), "a sample was accounted for twice"
    (drawn,) = final.state["position"]["drawn"]
    assert sorted(every, key=lambda k: int(k.split(":")[1])) == [f"0:{i}" for i in range(drawn)]
    assert set(r for a in accounts for r in a["dropped"]) <= {"filtered", "failed", "stale",
                                                              "unused"}
    assert set(pending) <= set(trained + dropped)  # the first checkpoint's pending were played
    # the filtered groups the rows count are the filtered samples they name (one stream)
    assert sum(len(a["dropped"].get("filtered", [])) for a in accounts) > 0

    # episodes: indices go on across the restarts (each once, in completion order), and those
    # played after a checkpoint or on a replayed sample are set aside, not kept
    kept = _episodes(run_dir)
    indices = [e["index"] for e in kept]
    assert indices == sorted(set(indices))
    assert all(e["sample_id"] for e in kept)
    aside = run_dir / "episodes.discarded.jsonl.zst"
    moved = [json.loads(line) for line in _zstd_lines(aside)] if aside.exists() else []
    assert sum(e["episodes_set_aside"] for e in events) == len(moved)
    replayed = set(pending) | {e["sample_id"] for e in second.state["position"]["pending"]}
    assert all(e["index"] >= first.state["episodes"] or e["sample_id"] in replayed
               for e in moved)
    print(f"resumed from steps {first.version} and {second.version}; {len(trained)} samples "
          f"trained, {len(dropped)} dropped, {len(left)} pending at the end; {len(moved)} "
          f"episodes set aside; final reward {result['reward']:.3f}")


def _train_here(folder: Path, steps: int, every: int | None, **kw) -> ab.Run:
    session = ab.Session(folder, trainer="thread")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            optimizer=ab.AdamWConfig(lr=3e-3), max_batch_size=32)
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=steps, batch_size=16, group_size=8, max_staleness=1,
                        checkpoint_every=every, **kw)
    run.wait(progress=False)
    return run


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_torn_checkpoint_is_skipped_with_a_warning_and_the_previous_one_taken(tmp_path):
    run = _train_here(tmp_path, 12, 5)
    run.session.close()
    root = run.directory / "checkpoints" / "solver"
    assert [p.name for p in read_checkpoints(root)] == ["step-000005", "step-000010",
                                                          "step-000012"]
    model = root / "step-000012" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])  # a writer killed mid-file
    with pytest.raises(CheckpointError, match="1000 bytes"):
        verify(root / "step-000012")

    session = ab.Session(tmp_path, trainer="thread")
    with pytest.warns(RuntimeWarning, match="step-000012.*Resuming from step-000010"):
        resumed = session.resume()
    resumed.wait(progress=False)
    assert [r["step"] for r in resumed.rows] == list(range(12))
    assert resumed.events[0]["versions"] == {"solver": 10}
    assert session.policies["solver"].version == 12
    session.close()


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_finished_run_and_a_run_without_checkpoints_say_what_to_do(tmp_path):
    run = _train_here(tmp_path / "a", 5, 5)
    run.session.close()
    with pytest.raises(ValueError, match="finished.*session.train"):
        ab.Session.resume(tmp_path / "a")
    assert not (tmp_path / "a" / "session.lock").exists()  # the failed resume closed it
    run = _train_here(tmp_path / "b", 3, None)
    run.session.close()
    with pytest.raises(NoCheckpoint, match="checkpoint_every"):
        ab.Session(tmp_path / "b").resume()
    with pytest.raises(ValueError, match="checkpoint_every"):
        _train_here(tmp_path / "c", 3, 0)


def test_runs_of_one_folder_stay_separate_across_sessions(tmp_path):
    first = _train_here(tmp_path, 2, None)
    first.session.close()
    second = _train_here(tmp_path, 2, None)
    second.session.close()
    assert (first.directory.name, second.directory.name) == ("run-000", "run-001")
    assert len(_rows(first.directory)) == len(_rows(second.directory)) == 2


@pytest.mark.slow  # a second interpreter holds the folder
def test_a_second_session_on_a_live_folder_is_refused(tmp_path):
    holder = _script(tmp_path, "hold.py", textwrap.dedent("""\
        import sys, time
        import astranb as ab
        session = ab.Session(sys.argv[1])
        print("open", flush=True)
        time.sleep(600)
        """))
    proc = subprocess.Popen([sys.executable, str(holder), str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        with pytest.raises(FolderLocked, match=f"pid {proc.pid} on host"):
            ab.Session(tmp_path / "runs")
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # its owner is gone: the lock is taken over
    session = ab.Session(tmp_path / "runs")
    lock = json.loads((tmp_path / "runs" / "session.lock").read_text())
    assert lock["pid"] == os.getpid()
    # in one process: a Session that trains keeps the folder; an idle one is closed
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=1000, batch_size=16, group_size=8)
    with pytest.raises(FolderLocked, match="trains in"):
        ab.Session(tmp_path / "runs")
    run.stop()
    wait_until(lambda: run.status != "running", 60, "the run to stop")
    with pytest.warns(RuntimeWarning, match=f"{tmp_path / 'runs'} open and ran nothing; it is "
                                            "closed now"):
        again = ab.Session(tmp_path / "runs")  # the idle one is closed for it
    assert session.closed and not again.closed
    again.close()
    assert not (tmp_path / "runs" / "session.lock").exists()


def test_set_aside_rows_keeps_earlier_steps_and_moves_later_ones(tmp_path):
    rows = [{"policy": "a", "step": s} for s in range(6)] + \
           [{"policy": "b", "step": s} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"policy": "a", "st')  # a torn last line
    kept = set_aside_rows(tmp_path, {"a": 4, "b": 5})
    assert kept == rows[:4] + rows[6:]
    assert _rows(tmp_path) == kept
    moved = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert moved[:2] == [json.dumps(rows[4]), json.dumps(rows[5])]
    assert moved[2] == '{"policy": "a", "st'


# -- full and read-only disks: a small tmpfs (needs root) ------------------------------------------

def _tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.mark.slow  # a training script in a subprocess, on a tmpfs
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_disk_stops_the_run_with_a_clear_error(tmp_path, fault):
    disk = tmp_path / "disk"
    _tmpfs(disk, "64m")
    mounts = [disk]
    proc = None
    try:
        extra = ", keep_checkpoints=2"
        train = _script(tmp_path, "train.py", TRAIN.format(steps=400, staleness=1, every=2,
                                                          extra=extra))
        proc = subprocess.Popen([sys.executable, str(train), str(disk / "runs")],
                                stderr=subprocess.PIPE, text=True)
        run_dir = disk / "runs" / "run-000"
        _wait_for_rows(run_dir, 5, proc)
        if fault == "full":
            # fill the disk to its last byte, unbuffered: a buffered file would raise again
            # on close, flushing what did not fit
            fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 65536):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
        else:
            # the open metrics file keeps a whole-disk remount busy: the checkpoints' folder,
            # where the next write goes, becomes a read-only bind mount of itself
            folder = run_dir / "checkpoints"
            subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
            mounts.append(folder)
            # a checkpoint being written at that moment keeps even this mount busy for a while:
            # try again until it is closed
            deadline = time.monotonic() + 30
            while (done := subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)],
                                          capture_output=True, text=True)).returncode:
                assert "busy" in done.stderr and time.monotonic() < deadline, done.stderr
                time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        reason = "No space left on device" if fault == "full" else "Read-only file system"
        where = run_dir if fault == "full" else run_dir / "checkpoints"
        assert "CheckpointWriteError" in err or "RecordWriteError" in err, err[-3000:]
        assert reason in err and "free on that disk" in err and str(where) in err, err[-3000:]
        # what was written stays readable: every metrics line parses, the last checkpoint
        # verifies
        rows = _rows(run_dir)
        assert len(rows) >= 5
        latest_good(run_dir / "checkpoints" / "solver")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", str(mount)], check=False)


def _fake_checkpoint(root: Path, version: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from astranb.session.checkpoint import write_checkpoint

    def save(directory: Path) -> None:
        directory.mkdir(parents=True)
        save_file({"w": torch.full((4,), float(version))}, directory / "model.safetensors")

    return write_checkpoint(root, version, save, {"version": version}, keep=5)


def test_no_checkpoint_says_what_it_found(tmp_path):
    root = tmp_path / "checkpoints" / "solver"
    with pytest.raises(NoCheckpoint, match="no checkpoints folder .*or the folder was deleted"):
        latest_good(root)
    root.mkdir(parents=True)
    with pytest.raises(NoCheckpoint, match="it is empty: .*or they were deleted"):
        latest_good(root)
    (root / ".tmp-step-000005-1234abcd").mkdir()
    with pytest.raises(NoCheckpoint, match="only unfinished writes"):
        latest_good(root)
    first, second = _fake_checkpoint(root, 5), _fake_checkpoint(root, 10)
    (first / "manifest.json").unlink()
    model = second / "model.safetensors"
    model.write_bytes(model.read_bytes()[:10])
    with pytest.raises(NoCheckpoint) as error:
        latest_good(root)
    message = str(error.value)
    assert "none of the 2 checkpoint(s) in" in message and "damaged:" in message
    assert "step-000010: model.safetensors has 10 bytes" in message
    assert "step-000005: no readable manifest.json" in message
    assert "stopped before its first checkpoint" not in message
    good = _fake_checkpoint(root, 15)
    with pytest.raises(NoCheckpoint,
                       match="3 checkpoint.* damaged: .*step-000010.*1 past version 12"):
        latest_good(root, at_most=12)
    assert latest_good(root).path == good


def test_a_session_closed_by_a_newer_one_on_its_folder_says_so_when_used(tmp_path):
    first = ab.Session(tmp_path, trainer="thread")
    policy = first.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
    env = first.wire(ab.environments.load("arithmetic"), solver=policy)
    with pytest.warns(RuntimeWarning, match="closed now.*raises SessionClosed"):
        second = ab.Session(tmp_path, trainer="thread")
    uses = {
        "evaluate": lambda: first.evaluate(n=8),
        "train": lambda: first.train(steps=1, batch_size=8, group_size=8),
        "policy": lambda: first.policy("other", model=ab.models.tiny(hidden_size=32)),
        "wire": lambda: first.wire(env, solver=policy),
        "resume": lambda: first.resume(),
        "add_rollout": lambda: first.add_rollout("http://127.0.0.1:1"),
    }
    for name, use in uses.items():
        with pytest.raises(SessionClosed, match=f"Session on {tmp_path} was closed") as error:
            use()
        assert "ab.Session(" in str(error.value), name
    first.close()  # closing again is fine
    second.close()


# -- read-only folders: a read-only tmpfs (needs root) ---------------------------------------------

def _mount_tmpfs(path: Path, *options: str) -> None:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=8m", *options)),
                           "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def test_a_read_only_folder_gets_a_clear_error_and_close_does_not_raise(tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro")
    try:
        for folder in (ro, ro / "runs"):
            with pytest.raises(FolderNotWritable, match=f"{folder} is not writable "
                               r"\(Read-only file system\).*writable.*ab.open_run") as error:
                ab.Session(folder, trainer="thread")
            assert isinstance(error.value, OSError) and error.value.errno == errno.EROFS
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)

    disk = tmp_path / "disk"
    _mount_tmpfs(disk)
    try:
        session = ab.Session(disk, trainer="thread")
        policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(FolderNotWritable, match=f"{disk / 'run-000'} is not writable "
                                                    r"\(Read-only file system\)"):
            session.train(steps=1, batch_size=8, group_size=8)
        session.close()  # its lock file cannot be removed: no error over it
        assert (disk / "session.lock").exists()
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        again = ab.Session(disk, trainer="thread")  # the lock left behind is taken over
        again.close()
        assert not (disk / "session.lock").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_set_aside_episodes_moves_the_refused_ones_and_keeps_the_record_readable(tmp_path):
    from astranb.session.episodes import FrameWriter, set_aside_episodes
    from astranb.session.recorder import EpisodeLog

    def line(index: int, sample: str) -> bytes:
        episode = ab.Episode(index, 0, {}, (), {"a": 1.0}, None, 0, sample_id=sample)
        return (json.dumps(episode.to_json()) + "\n").encode()

    writer = FrameWriter(tmp_path)
    writer.write([line(0, "0:0"), line(1, "0:0")])
    writer.write([line(2, "0:1"), line(3, "0:2"), line(4, "0:3")])
    writer.write([line(5, "0:4")])
    writer.close()
    # a checkpoint after 4 episodes, with sample 0:1 still pending
    moved = set_aside_episodes(tmp_path, lambda e: e["index"] < 4 and e["sample_id"] != "0:1")
    assert moved == 3
    assert [(e.index, e.sample_id) for e in EpisodeLog(tmp_path)] == \
        [(0, "0:0"), (1, "0:0"), (3, "0:2")]
    aside = _zstd_lines(tmp_path / "episodes.discarded.jsonl.zst")
    assert [json.loads(x)["index"] for x in aside] == [2, 4, 5]
    writer = FrameWriter(tmp_path)  # a resumed run appends after the rewritten record
    writer.write([line(4, "0:1")])
    writer.close()
    assert [e.index for e in EpisodeLog(tmp_path)] == [0, 1, 3, 4]
    assert set_aside_episodes(tmp_path, lambda e: True) == 0
