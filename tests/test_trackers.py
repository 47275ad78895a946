"""Experiment trackers (astranb.session.trackers): what a run streams to TensorBoard, W&B, MLflow.

The tracker files are read back with each tool's own reader (TensorBoard's EventAccumulator,
W&B's transaction log of an offline run, MLflow's client on a file store) and compared with
`run.rows` and `run.evaluation_rows` value for value. Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import astranb as ab
from astranb.session.trackers import (
    Trackers,
    _wandb_log_ended,
    evaluation_scalars,
    flat_params,
    mlflow_name,
    resolve,
    row_scalars,
)
from tests.envs import CountA

STEPS = 20


class HeldOutCountA(CountA):
    """CountA with a two-problem "test" split, so a run can evaluate (`eval_every`)."""

    splits = ("train", "test")

    def split_samples(self, split, seed=0):
        return iter([{"prompt": "ab="}, {"prompt": "ba="}])


def make_session(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(HeldOutCountA(), solver=policy)
    return session


def train(tmp_path, loggers, steps=STEPS, **kwargs):
    with make_session(tmp_path) as session:
        return session.train(steps=steps, batch_size=8, group_size=4, eval_every=5, eval_n=2,
                             loggers=loggers, **kwargs).wait(progress=False)


def expected(run) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as the trackers must have logged it (from the run's own record)."""
    out: dict[str, dict[int, float]] = {}
    for row in run.rows:
        for tag, value in row_scalars(row).items():
            out.setdefault(tag, {})[int(row["step"])] = value
    for window in run.evaluation_rows:
        for scalars in evaluation_scalars(window, {"solver": "solver"}).values():
            for tag, value in scalars.items():
                out.setdefault(tag, {})[int(window["version"])] = value
    return out


def check_run(run):
    assert run.status == "finished"
    assert [row["step"] for row in run.rows] == list(range(STEPS))
    # windows at 0 and 20, others near every 5th version (one still playing lets the next one
    # play the newest)
    versions = [w["version"] for w in run.evaluation_rows]
    assert versions[0] == 0 and versions[-1] == STEPS and versions == sorted(set(versions))
    assert not [e for e in run.events if e["kind"] == "tracker_failed"]


# -- pure conversions ----------------------------------------------------------------------------

def test_row_scalars_keep_finite_numbers_namespaced_by_policy():
    row = {"policy": "solver", "step": 3, "version": 4, "reward": 0.25, "loss": np.float32(1.5),
           "episodes": np.int64(12), "nan": math.nan, "inf": -math.inf, "none": None,
           "text": "x", "flag": True, "np_flag": np.bool_(False),
           "staleness_counts": [1, 2], "nested": {"a": 1}}
    assert row_scalars(row) == {"solver/version": 4.0, "solver/reward": 0.25,
                                "solver/loss": 1.5, "solver/episodes": 12.0}
    assert all(type(v) is float for v in row_scalars(row).values())


def test_evaluation_scalars_namespace_windows_by_policy():
    window = {"kind": "evaluation", "window": 2, "version": 10, "time": 3.5, "seconds": 0.5,
              "env": "Arith", "split": "test", "solver/avg@2": 0.75, "solver/pass@2": 1.0,
              "n": 4, "k": 2, "failed": 0, "truncated": 1, "token_versions": [9, 10],
              "first_error": None}
    window_numbers = {"window": 2.0, "version": 10.0, "time": 3.5, "seconds": 0.5, "n": 4.0,
                      "k": 2.0, "failed": 0.0, "truncated": 1.0}
    assert evaluation_scalars(window, {"solver": "p1"}) == {"p1": {
        "p1/eval/avg@2": 0.75, "p1/eval/pass@2": 1.0,
        **{f"p1/eval/{k}": v for k, v in window_numbers.items()}}}
    # two roles of one policy (self-play) keep their role; a NaN score is left out
    duet = {"version": 1, "solver/avg@1": 0.5, "verifier/avg@1": math.nan,
            "verifier/pass@1": 0.0}
    assert evaluation_scalars(duet, {"solver": "p", "verifier": "p"}) == {"p": {
        "p/eval/solver/avg@1": 0.5, "p/eval/verifier/pass@1": 0.0, "p/eval/version": 1.0}}
    # ... even in a window where one role has no finite score at all
    assert evaluation_scalars({"version": 2, "solver/avg@1": 0.5},
                              {"solver": "p", "verifier": "p"}) == {
        "p": {"p/eval/solver/avg@1": 0.5, "p/eval/version": 2.0}}
    # roles of two policies: each gets its own scores and the window's numbers
    assert evaluation_scalars(duet, {"solver": "a", "verifier": "b"}) == {
        "a": {"a/eval/avg@1": 0.5, "a/eval/version": 1.0},
        "b": {"b/eval/pass@1": 0.0, "b/eval/version": 1.0}}
    # a role the wiring does not name is its own namespace
    assert evaluation_scalars({"version": 0, "judge/avg@1": 1.0}, {}) == {
        "judge": {"judge/eval/avg@1": 1.0, "judge/eval/version": 0.0}}


def test_flat_params_and_mlflow_names():
    params = {"steps": 3, "lr": 1e-3, "mode": "barrier", "on": True, "none": None,
              "betas": [0.9, 0.999], "policies": {"solver": {"optimizer": {"lr": 0.01}}}}
    assert flat_params(params) == {"steps": 3, "lr": 1e-3, "mode": "barrier", "on": True,
                                   "none": "None", "betas": "[0.9, 0.999]",
                                   "policies/solver/optimizer/lr": 0.01}
    assert mlflow_name("solver/eval/avg@1") == "solver/eval/avg_at_1"
    assert mlflow_name("solver/count/a+b") == "solver/count/a_b"


def test_resolve_shorthands_and_refuses_what_is_not_a_tracker(tmp_path):
    tb = ab.trackers.TensorBoard(tmp_path)
    assert resolve(None) == [] and resolve(()) == [] and resolve(tb) == [tb]
    made = resolve(["tensorboard", "wandb", tb])
    assert [type(t).__name__ for t in made] == ["TensorBoard", "WandB", "TensorBoard"]
    with pytest.raises(ValueError, match="unknown tracker 'neptune'; use one of"):
        resolve(["neptune"])
    with pytest.raises(TypeError, match="is not a tracker"):
        resolve([print])
    with pytest.raises(ValueError, match="mode='later'"):
        ab.trackers.WandB(mode="later")


def test_a_missing_package_names_the_extra_to_install(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'astranb\[wandb\]'"):
        resolve(["wandb"])


def test_a_bad_logger_fails_before_any_work(tmp_path):
    with make_session(tmp_path) as session:
        with pytest.raises(ValueError, match="unknown tracker"):
            session.train(steps=1, batch_size=8, group_size=4, loggers=["tensorbored"])
        assert session.runs == [] and not list((tmp_path / "runs").glob("run-*"))


# -- TensorBoard ---------------------------------------------------------------------------------

@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_tensorboard_holds_every_row_and_window(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = ab.trackers.TensorBoard()
    run = train(tmp_path, [tracker])
    check_run(run)
    assert tracker.path == run.directory / "tb"  # the default logdir
    events = EventAccumulator(str(run.directory / "tb"), size_guidance={"scalars": 0,
                                                                         "tensors": 0})
    events.Reload()
    want = expected(run)
    assert set(events.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        logged = {e.step: e.value for e in events.Scalars(tag)}
        # TensorBoard keeps float32: equal to the value rounded to float32
        assert logged == {s: float(np.float32(v)) for s, v in by_step.items()}, tag
    # every step is logged (a step whose reward is NaN, when no episode finished since the
    # last one, has its other scalars but no reward)
    assert set(want["solver/episodes"]) == set(range(STEPS))
    assert set(want["solver/reward"]) == {r["step"] for r in run.rows
                                          if r["reward"] == r["reward"]}
    assert set(want["solver/eval/avg@1"]) == {w["version"] for w in run.evaluation_rows}
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"steps": 20' in config and '"eval"' in config


# -- Weights & Biases (offline) ------------------------------------------------------------------

def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb` of an offline run).

    The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by LevelDB-style
    32 KiB blocks of chunks: crc32 (seeded with the chunk type), length, type (1 whole record,
    2 first, 3 middle, 4 last part), data."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room  # block trailer too small for a header: zero padding
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break  # unwritten tail
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad chunk at {pos}"
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


@pytest.mark.slow  # imports wandb and syncs an offline run
def test_wandb_offline_run_holds_every_row_and_window(tmp_path, monkeypatch):
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"),
                        "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wbconf"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wbcache")}.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "wandb").mkdir()
    run = train(tmp_path, [ab.trackers.WandB(project="tests", mode="offline")])
    check_run(run)
    [log] = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    logged: dict[str, dict[int, float]] = {}
    config = {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the settings come with the run record
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        if kind != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                 for item in record.history.item}
        axis = "solver/eval/step" if "solver/eval/step" in items else "solver/step"
        for tag, value in items.items():
            if tag.startswith("solver/") and tag != axis:
                logged.setdefault(tag, {})[items[axis]] = value
    assert logged == expected(run)  # float64 all the way: exactly equal
    assert config["steps"] == STEPS and config["policies"]["solver"]["algorithm"]["kind"]
    # what close() waits for: W&B writes the log's last block a moment after finish() returns
    assert _wandb_log_ended(log) is True
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(log.read_bytes()[:32768 * (log.stat().st_size // 32768)])
    assert _wandb_log_ended(cut) is False
    assert _wandb_log_ended(tmp_path / "missing.wandb") is None
    assert _wandb_log_ended(run.directory / "metrics.jsonl") is None


# -- MLflow (file store) -------------------------------------------------------------------------

@pytest.mark.slow  # imports mlflow
def test_mlflow_file_store_holds_every_row_and_window(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 prefers a database
    uri = (tmp_path / "mlruns").as_uri()
    tracker = ab.trackers.MLflow(experiment="tests", tracking_uri=uri)
    run = train(tmp_path, [tracker])
    check_run(run)
    client = MlflowClient(tracking_uri=uri)
    info = client.get_run(tracker.run_id)
    assert info.info.status == "FINISHED" and info.info.run_name == run.directory.name
    assert info.data.params["steps"] == str(STEPS)
    want = expected(run)
    assert set(info.data.metrics) == {mlflow_name(tag) for tag in want}
    for tag, by_step in want.items():
        history = client.get_metric_history(tracker.run_id, mlflow_name(tag))
        assert {m.step: m.value for m in history} == by_step, tag


# -- failures, threads, ordering -----------------------------------------------------------------

class Recording:
    """A tracker that keeps what it is given (and where, and when); `fail_at` makes it raise
    there; `delay` makes each log slow."""

    def __init__(self, fail_at: str | None = None, delay: float = 0.0):
        self.fail_at, self.delay = fail_at, delay
        self.calls: list[str] = []
        self.logged: list[tuple[int, dict[str, float], str, str]] = []
        self.threads: set[int] = set()
        self.closed_at: float | None = None
        self.rows_on_disk_at_close: int | None = None
        self.directory: Path | None = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        self.threads.add(threading.get_ident())
        if name == self.fail_at:
            raise ConnectionError(f"tracker down ({name})")

    def start(self, directory, hyperparameters):
        self.directory = directory
        self._call("start")

    def log(self, step, scalars, *, policy, kind):
        time.sleep(self.delay)
        self._call("log")
        self.logged.append((step, dict(scalars), policy, kind))

    def close(self):
        self._call("close")
        lines = (self.directory / "metrics.jsonl").read_text().splitlines()
        self.rows_on_disk_at_close = len(lines)
        self.closed_at = time.monotonic()

    def __repr__(self):
        return f"Recording(fail_at={self.fail_at!r})"


def test_failing_trackers_are_reported_once_and_never_stop_training(tmp_path):
    broken = {stage: Recording(fail_at=stage) for stage in ("start", "log", "close")}
    healthy = Recording()
    with pytest.warns(RuntimeWarning, match=r"tracker Recording\(fail_at='\w+'\) failed while "
                                            r"\w+ and was switched off") as caught:
        run = train(tmp_path, [*broken.values(), healthy], steps=6)
    assert run.status == "finished" and [r["step"] for r in run.rows] == list(range(6))
    failed = [e for e in run.events if e["kind"] == "tracker_failed"]
    assert sorted(e["stage"] for e in failed) == ["close", "log", "start"]  # once each
    assert all("ConnectionError('tracker down" in e["error"] for e in failed)
    assert len([w for w in caught if "failed while" in str(w.message)]) == 3
    on_disk = [json.loads(line) for line in
               (run.directory / "events.jsonl").read_text().splitlines()]
    assert sorted(e["stage"] for e in on_disk if e["kind"] == "tracker_failed") == [
        "close", "log", "start"]
    # switched off: nothing more reaches it after its failure (closed once to let go)
    assert broken["start"].calls == ["start"]
    assert broken["log"].calls == ["start", "log", "close"]
    assert broken["close"].calls[-1] == "close" and broken["close"].calls.count("close") == 1
    # the others never noticed
    assert [s for s, _, _, kind in healthy.logged if kind == "metrics"] == list(range(6))
    assert healthy.calls[-1] == "close"


def test_slow_tracker_gets_every_row_off_the_loop_and_closes_before_wait_returns(tmp_path):
    slow = Recording(delay=0.05)
    loop_threads = set()

    def on_loop(kind, payload):
        loop_threads.add(threading.get_ident())

    with make_session(tmp_path) as session:
        run = session.train(steps=8, batch_size=8, group_size=4, eval_every=4, eval_n=2,
                            loggers=[slow])
        run.on_event(on_loop)
        run.wait(progress=False)
        returned = time.monotonic()
    # closed (after the recorder: every row on disk), before wait() returned
    assert slow.calls[0] == "start" and slow.calls[-1] == "close"
    assert slow.closed_at is not None and slow.closed_at <= returned
    assert slow.rows_on_disk_at_close == 8
    # every row and window, in order, logged from the tracker's own thread
    assert [(s, p, k) for s, _, p, k in slow.logged if k == "metrics"] == [
        (s, "solver", "metrics") for s in range(8)]
    assert [s for s, _, _, k in slow.logged if k == "evaluation"] == [
        w["version"] for w in run.evaluation_rows]
    assert slow.logged[0][1] == row_scalars(run.rows[0]) or slow.logged[0][3] == "evaluation"
    assert len(slow.threads) == 1 and not slow.threads & loop_threads
    assert "solver/steps" not in slow.logged[-1][1]


def test_trackers_get_the_run_settings_once(tmp_path):
    seen = {}

    class Settings(Recording):
        def start(self, directory, hyperparameters):
            seen.update(hyperparameters, directory=directory)
            super().start(directory, hyperparameters)

    run = train(tmp_path, [Settings()], steps=2)
    assert seen["directory"] == run.directory
    assert seen["steps"] == 2 and seen["batch_size"] == 8 and seen["group_size"] == 4
    assert seen["policies"]["solver"]["optimizer"]["lr"] > 0
    assert seen["policies"]["solver"]["model"]["kind"] == "tiny"
    assert seen["environments"] == {"HeldOutCountA": {"weight": 1.0,
                                                      "roles": {"solver": "solver"}}}
    assert seen["eval"] == {"every": 5, "n": 2, "k": 1, "split": "test",
                            "env": "HeldOutCountA"}


def test_trackers_close_is_idempotent_and_bounded(tmp_path, monkeypatch):
    """A tracker stuck in log is left behind after the timeout and reported, once."""

    class Stuck(Recording):
        def log(self, step, scalars, *, policy, kind):
            release.wait(5)

    class FakeRecorder:
        directory = tmp_path

        def __init__(self):
            self.events, self.observers = [], []

        def on_event(self, observer):
            self.observers.append(observer)
            return lambda: self.observers.remove(observer)

        def add_event(self, kind, payload):
            self.events.append({"kind": kind, **payload})

    monkeypatch.setattr(ab.trackers, "CLOSE_TIMEOUT", 0.2)
    release = threading.Event()
    recorder = FakeRecorder()
    trackers = Trackers([Stuck()], recorder, {})  # type: ignore[arg-type]
    recorder.observers[0]("metrics", {"policy": "p", "step": 0, "reward": 1.0})
    with pytest.warns(RuntimeWarning, match="failed while closing"):
        trackers.close()
    trackers.close()
    release.set()
    assert [e["stage"] for e in recorder.events] == ["close"]
    assert "TimeoutError" in recorder.events[0]["error"] and recorder.observers == []
