"""Experiment trackers: stream a run's metrics rows and evaluation windows to TensorBoard,
Weights & Biases or MLflow.

    run = session.train(steps=200, loggers=["tensorboard", ab.trackers.WandB(project="arith")])

Researchers keep their runs in a tracker next to every other experiment; the run's own files
(metrics.jsonl, events.jsonl) stay the record of truth and `run.metrics` reads those. So a
tracker is a passenger, never a driver:

- **Off the event loop.** Each tracker gets a worker thread and a queue. The recorder's observer
  (called on the session's loop for every row) only converts the row to scalars and enqueues
  them; opening the tracker (`wandb.init` starts a service process), logging and closing happen
  in the worker, so a slow tracker never slows rollouts or train steps.
- **Contained failures.** A tracker that raises while it opens, logs or closes is reported once
  (a RuntimeWarning naming it and the error, and a "tracker_failed" event in `run.events` and
  events.jsonl) and switched off; training goes on and every row stays in `run.metrics`.
- **Complete at the end.** The session closes the trackers when the run ends, after the
  recorder: queued rows are logged and the trackers' files are closed before `run.wait()` or
  `await run` returns (for W&B, until its service has written the run's exit record: its
  `finish()` returns a moment before that).
- **Plain numbers only.** A row is turned into finite numeric scalars (`row_scalars`); lists,
  strings, None, booleans, NaN and infinities are left out. Tags are namespaced by policy
  (`solver/reward`), evaluation windows by policy and "eval" (`solver/eval/avg@1`). The step is
  the row's `step`; for a window it is the `version` it evaluated (the number of train steps
  its weights had taken), the axis the dashboard draws windows on.

The tracker libraries are optional extras (`pip install 'astranb[tensorboard]'`, `[wandb]`,
`[mlflow]`) and imported only when a tracker opens. Anything with `start(directory,
hyperparameters)`, `log(step, scalars, *, policy, kind)` and `close()` is a tracker too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import numbers
import os
import queue
import re
import struct
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..algorithms.config import algorithm_to_dict
from .folder import EVALUATION

if TYPE_CHECKING:
    from ..dataflow.config import RunConfig
    from ..dataflow.flow import HeldOut
    from ..environments.base import Environment
    from .recorder import Recorder

__all__ = [
    "MLflow",
    "TensorBoard",
    "Tracker",
    "Trackers",
    "WandB",
    "evaluation_scalars",
    "flat_params",
    "resolve",
    "row_scalars",
    "run_hyperparameters",
]

CLOSE_TIMEOUT = 120.0
"""Seconds the end of a run waits, at most, for its trackers to log what is queued and close
(an online tracker may still be connecting: wandb.init waits up to 90 s for its server; or
uploading). One still busy after that is reported as failed and left behind."""


@runtime_checkable
class Tracker(Protocol):
    """What `session.train(loggers=[...])` accepts besides the shorthand strings.

    All three methods are called from the tracker's own worker thread, in this order: `start`
    once, `log` for each row and window, `close` once.
    """

    def start(self, directory: Path, hyperparameters: Mapping[str, Any]) -> None:
        """Open the tracker for the run writing to `directory`, with its settings."""

    def log(self, step: int, scalars: Mapping[str, float], *, policy: str, kind: str) -> None:
        """Log finite scalars (tags already namespaced) at `step`; `kind` is "metrics" for a
        train step's row, "evaluation" for a held-out window."""

    def close(self) -> None:
        """Flush and close (the run has ended)."""


# -- rows to scalars (pure) ----------------------------------------------------------------------

def scalar(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (Python or numpy), else None.
    Booleans are flags, not measurements: None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if type(value).__name__ == "bool_":  # numpy.bool_ registers as a number in some versions
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def row_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics row as `<policy>/<column>` -> value: the finite numbers only, without "step"
    (it is the step axis) and "policy" (it is the namespace)."""
    policy = str(row["policy"])
    out = {}
    for key, value in row.items():
        if key in ("policy", "step"):
            continue
        number = scalar(value)
        if number is not None:
            out[f"{policy}/{key}"] = number
    return out


def evaluation_scalars(event: Mapping[str, Any],
                       roles: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """An "evaluation" event as policy -> {tag: value}.

    A role's numbers (`<role>/avg@<k>`, `<role>/pass@<k>`) become `<policy>/eval/avg@<k>`,
    or `<policy>/eval/<role>/avg@<k>` when the policy fills several roles of the evaluated
    environment (self-play). The window's own numbers (version, window, time, seconds, n, k,
    failed, truncated) go under every evaluated policy: `<policy>/eval/failed`. `roles` is the
    evaluated environment's role -> policy name; a role missing from it is its own namespace.
    Non-finite and non-numeric values (token_versions, env, split, first_error) are left out.
    """
    window: dict[str, float] = {}
    per_role: dict[str, dict[str, float]] = {}
    for key, value in event.items():
        number = scalar(value)
        if number is None:
            continue
        if "/" in key:
            role, metric = key.split("/", 1)
            per_role.setdefault(role, {})[metric] = number
        else:
            window[key] = number
    fills = Counter(roles.values())  # from the wiring, so tags never change between windows
    out: dict[str, dict[str, float]] = {policy: {} for policy in roles.values()}
    for role, metrics in per_role.items():
        policy = roles.get(role, role)
        prefix = f"{policy}/eval/{role}/" if fills[policy] > 1 else f"{policy}/eval/"
        out.setdefault(policy, {}).update({prefix + m: v for m, v in metrics.items()})
    for policy, scalars in out.items():
        scalars.update({f"{policy}/eval/{k}": v for k, v in window.items()})
    return out


# -- hyperparameters (pure) ----------------------------------------------------------------------

def run_hyperparameters(config: RunConfig,
                        wired: Sequence[tuple[Environment, Mapping[str, Any], float]],
                        heldout: HeldOut | None = None) -> dict[str, Any]:
    """What a run was asked for, as nested plain values: the RunConfig, each policy's model,
    algorithm and optimizer, each environment's roles and weight, and the evaluation plan."""
    policies = {p.name: p for _, wiring, _ in wired for p in wiring.values()}
    params: dict[str, Any] = dataclasses.asdict(config)
    params["policies"] = {
        name: {"model": _plain(p.spec), "algorithm": _algorithm(p.algorithm),
               "optimizer": _plain(p.optimizer)}
        for name, p in sorted(policies.items())}
    params["environments"] = {
        env.name: {"weight": weight, "roles": {role: p.name for role, p in wiring.items()}}
        for env, wiring, weight in wired}
    if heldout is not None:
        params["eval"] = {"every": heldout.every, "n": len(heldout.samples), "k": heldout.k,
                          "split": heldout.split, "env": heldout.env.name}
    return params


def _algorithm(algorithm: Any) -> Any:
    try:
        return algorithm_to_dict(algorithm)
    except TypeError:  # a user's own Algorithm subclass
        return {"kind": type(algorithm).__name__, **_plain(algorithm)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested hyperparameters as one level of `a/b/c` keys with bool, int, float or str values
    (None as "None", lists as JSON): what TensorBoard's hparams and MLflow's params take."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif value is None:
            out[name] = "None"
        else:
            out[name] = json.dumps(value, default=repr)
    return out


# -- the trackers ------------------------------------------------------------------------------

def _require(module: str, what: str, extra: str) -> None:
    """An ImportError saying what to install, raised when the tracker is made (in the cell that
    asks for it) rather than later in a worker thread."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{what} needs the {module} package: pip install 'astranb[{extra}]' "
                          f"(or pip install {module})")


class TensorBoard:
    """Write the run's scalars as TensorBoard event files (`tensorboard --logdir <dir>`).

    Args:
        logdir: where the event files go; default: the run's folder / "tb".

    The settings are written once as hyperparameters (the HParams tab) and as a "config" text.
    """

    def __init__(self, logdir: str | os.PathLike[str] | None = None):
        _require("tensorboard", "TensorBoard logging", "tensorboard")
        self.logdir = None if logdir is None else Path(logdir)
        self.path: Path | None = None
        """Where the current (or last) run's event files went."""
        self._writer: Any = None

    def start(self, directory: Path, hyperparameters: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.path = self.logdir if self.logdir is not None else directory / "tb"
        self._writer = SummaryWriter(str(self.path))
        policies = hyperparameters.get("policies") or {}
        for summary in hparams(flat_params(hyperparameters),  # type: ignore[no-untyped-call]
                               {f"{name}/reward": 0.0 for name in policies}):
            self._writer.file_writer.add_summary(summary)
        text = json.dumps(hyperparameters, indent=2, default=repr)
        self._writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, step: int, scalars: Mapping[str, float], *, policy: str, kind: str) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def __repr__(self) -> str:
        return f"TensorBoard(logdir={None if self.logdir is None else str(self.logdir)!r})"


class WandB:
    """Log the run to Weights & Biases.

    Args:
        project: the W&B project (default "astranb").
        mode: "online", "offline" (synced later with `wandb sync`) or "disabled"; None: what
            WANDB_MODE says, else online.
        **init_kwargs: passed on to `wandb.init` (entity, name, tags, group, dir, ...). The run
            is named after its folder ("run-000") and writes under it unless `name`, `dir` or
            WANDB_DIR say otherwise; the settings become the W&B config.

    Each policy's rows are logged against its own step (`<policy>/step`) and its evaluation
    windows against `<policy>/eval/step` (the evaluated version), so policies training at
    different speeds and windows finishing late are never dropped as out of order.
    """

    def __init__(self, project: str | None = "astranb", mode: str | None = None,
                 **init_kwargs: Any):
        _require("wandb", "Weights & Biases logging", "wandb")
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"mode={mode!r}: use 'online', 'offline' or 'disabled' (or None "
                             "to follow WANDB_MODE)")
        self.project, self.mode, self.init_kwargs = project, mode, dict(init_kwargs)
        self._run: Any = None
        self._defined: set[str] = set()

    def start(self, directory: Path, hyperparameters: Mapping[str, Any]) -> None:
        import wandb

        kwargs: dict[str, Any] = {"project": self.project, "mode": self.mode,
                                  "name": directory.name, "config": dict(hyperparameters)}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(directory)
        kwargs.update(self.init_kwargs)
        self._defined = set()
        self._run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})

    def log(self, step: int, scalars: Mapping[str, float], *, policy: str, kind: str) -> None:
        axis = f"{policy}/eval/step" if kind == EVALUATION else f"{policy}/step"
        for tag in scalars.keys() - self._defined:
            self._run.define_metric(tag, step_metric=axis)
            self._defined.add(tag)
        self._run.log({axis: step, **scalars})

    def close(self) -> None:
        if self._run is None:
            return
        log = getattr(self._run.settings, "sync_file", None)
        self._run.finish()
        if log:  # finish() returns before the W&B service has written the log's last block
            deadline = time.monotonic() + WANDB_FLUSH_WAIT
            while _wandb_log_ended(Path(log)) is False and time.monotonic() < deadline:
                time.sleep(0.05)

    def __repr__(self) -> str:
        return f"WandB(project={self.project!r}, mode={self.mode!r})"


WANDB_FLUSH_WAIT = 30.0
"""Seconds `WandB.close` waits, at most, for the run's transaction log to end with its exit
record."""

_WANDB_BLOCK = 32768


def _wandb_log_ended(path: Path) -> bool | None:
    """Whether a W&B transaction log (`run-<id>.wandb`) ends with the run's exit record; None
    when that cannot be told (no such file, another format).

    `wandb.finish()` returns once the W&B service has the run's last records, but the service
    writes the log in 32 KiB blocks and its last block only when it closes the run's stream, a
    moment later; so an offline run synced or read right after `finish()` may miss its last
    rows. The log is a 7-byte header (":W&B", magic, version) and LevelDB-style blocks of
    chunks (crc32, length, type: 1 whole record, 2 first, 3 middle, 4 last part); the
    service's last record is "exit"."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if data[:4] != b":W&B":
        return None
    pos, parts, last = 7, b"", b""
    while pos + 7 <= len(data):
        room = _WANDB_BLOCK - pos % _WANDB_BLOCK
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if room < 7 or kind == 0:
            pos += room  # padding at the end of a block
            continue
        if pos + 7 + length > len(data):
            break  # a chunk not written whole yet
        chunk = data[pos + 7:pos + 7 + length]
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            last = parts
        pos += 7 + length
    try:
        from wandb.proto import wandb_internal_pb2

        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(last)
    except Exception:  # noqa: BLE001 - a format this reader does not know: do not wait
        return None
    return bool(record.WhichOneof("record_type") == "exit")


_MLFLOW_NAME = re.compile(r"[^0-9A-Za-z_\-. :/]")


def mlflow_name(tag: str) -> str:
    """A tag MLflow accepts: "@" spelled "_at_" (`avg@1` -> `avg_at_1`), any other character
    MLflow refuses as "_"."""
    return _MLFLOW_NAME.sub("_", tag.replace("@", "_at_"))


class MLflow:
    """Log the run to MLflow: one MLflow run per astranb run, metrics with their step, the
    settings as params.

    Args:
        experiment: the MLflow experiment (created if missing).
        tracking_uri: where MLflow stores runs; None: MLFLOW_TRACKING_URI, else MLflow's default.
        run_name: default: the run's folder name ("run-000").
        tags: MLflow tags of the run.

    MLflow allows no "@" in names: `solver/eval/avg@1` is logged as `solver/eval/avg_at_1`.
    """

    def __init__(self, experiment: str = "astranb", tracking_uri: str | None = None, *,
                 run_name: str | None = None, tags: Mapping[str, str] | None = None):
        _require("mlflow", "MLflow logging", "mlflow")
        self.experiment, self.tracking_uri = experiment, tracking_uri
        self.run_name, self.tags = run_name, dict(tags or {})
        self._client: Any = None
        self.run_id: str | None = None
        """The MLflow run's id, once started."""

    def start(self, directory: Path, hyperparameters: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = (found.experiment_id if found is not None
                         else client.create_experiment(self.experiment))
        run = client.create_run(experiment_id, run_name=self.run_name or directory.name,
                                tags=self.tags)
        self._client, self.run_id = client, run.info.run_id
        params = [Param(mlflow_name(k), str(v)[:500])
                  for k, v in flat_params(hyperparameters).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: Mapping[str, float], *, policy: str, kind: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(tag), value, now, step) for tag, value in scalars.items()]
        for i in range(0, len(metrics), 1000):  # at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflow(experiment={self.experiment!r}, tracking_uri={self.tracking_uri!r})"


SHORTHANDS: dict[str, Callable[[], Tracker]] = {
    "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def resolve(loggers: Sequence[Tracker | str] | Tracker | str | None) -> list[Tracker]:
    """`train(loggers=...)` as tracker objects: the strings "tensorboard", "wandb", "mlflow"
    become trackers with their defaults; anything else must have start, log and close.

    Raises:
        ValueError: an unknown string.
        TypeError: an object that is no tracker.
        ImportError: the tracker's package is not installed (says which extra to install).
    """
    if loggers is None:
        return []
    if isinstance(loggers, str) or not isinstance(loggers, Sequence):
        loggers = [loggers]  # one tracker given on its own
    out: list[Tracker] = []
    for logger in loggers:
        if isinstance(logger, str):
            make = SHORTHANDS.get(logger.lower())
            if make is None:
                raise ValueError(f"loggers: unknown tracker {logger!r}; use one of "
                                 f"{sorted(SHORTHANDS)} or a tracker object such as "
                                 "ab.trackers.TensorBoard(logdir)")
            out.append(make())
        elif isinstance(logger, Tracker):
            out.append(logger)
        else:
            raise TypeError(f"loggers: {logger!r} is not a tracker; pass 'tensorboard', "
                            "'wandb', 'mlflow', an ab.trackers object, or an object with "
                            "start(directory, hyperparameters), log(step, scalars, *, policy, "
                            "kind) and close()")
    return out


# -- running them beside a run -----------------------------------------------------------------

_STOP = object()


class _Worker:
    """One tracker, its queue and its thread: start, log what arrives, close on _STOP."""

    def __init__(self, tracker: Tracker, directory: Path, hyperparameters: Mapping[str, Any],
                 report: Callable[[Tracker, str, BaseException], None]):
        self.tracker = tracker
        self.active = True
        self._report = report
        self._failing = threading.Lock()  # the worker and a timed-out close may both fail it
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._main, args=(directory, dict(hyperparameters)), daemon=True,
            name=f"astranb-tracker-{type(tracker).__name__}")
        self._thread.start()

    def put(self, step: int, scalars: dict[str, float], policy: str, kind: str) -> None:
        if self.active and scalars:
            self._queue.put((step, scalars, policy, kind))

    def _main(self, directory: Path, hyperparameters: dict[str, Any]) -> None:
        stage = "start"
        try:
            self.tracker.start(directory, hyperparameters)
            stage = "log"
            while (item := self._queue.get()) is not _STOP:
                step, scalars, policy, kind = item
                self.tracker.log(step, scalars, policy=policy, kind=kind)
            stage = "close"
            self.tracker.close()
        except BaseException as error:  # noqa: BLE001 - a tracker never stops training
            self.fail(stage, error)
            if stage == "log":
                try:
                    self.tracker.close()  # release what it holds; its error was reported
                except BaseException:  # noqa: BLE001, S110
                    pass

    def fail(self, stage: str, error: BaseException) -> None:
        with self._failing:
            first, self.active = self.active, False
        if first:
            self._report(self.tracker, stage, error)

    def stop(self) -> None:
        """Let it log what is queued, then close."""
        self._queue.put(_STOP)

    def join(self, deadline: float, timeout: float) -> None:
        """Wait until `deadline` (time.monotonic) for it to close; report it if it has not."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.fail("close", TimeoutError(
                f"still logging or closing {timeout:.0f} s after the run ended; rows after "
                "that may be missing from it (everything is in run.metrics)"))


class Trackers:
    """The trackers of one run, subscribed to its recorder.

    Made by `Session.train` once the run's recorder exists; `close()` when the run ends (the
    session calls it after the recorder is closed). Rows reach each tracker in the order the
    recorder saw them.

    Args:
        trackers: from `resolve`.
        recorder: the run's recorder (rows and windows come from it; failures go to it).
        hyperparameters: the run's settings (`run_hyperparameters`), logged once at start.
        roles: role -> policy name of the evaluated environment (namespaces of the windows).
    """

    def __init__(self, trackers: Sequence[Tracker], recorder: Recorder,
                 hyperparameters: Mapping[str, Any], roles: Mapping[str, str] | None = None):
        self._recorder = recorder
        self._roles = dict(roles or {})
        self._closed = False
        self._workers = [_Worker(t, recorder.directory, hyperparameters, self._report)
                         for t in trackers]
        self._unsubscribe = recorder.on_event(self._observe)

    def _observe(self, kind: str, payload: Any) -> None:
        """The recorder's observer, on the event loop: convert and enqueue, nothing more."""
        if kind == "metrics":
            scalars, step = row_scalars(payload), int(payload["step"])
            for worker in self._workers:
                worker.put(step, scalars, str(payload["policy"]), "metrics")
        elif kind == EVALUATION:
            step = int(payload["version"])
            for policy, scalars in evaluation_scalars(payload, self._roles).items():
                for worker in self._workers:
                    worker.put(step, scalars, policy, EVALUATION)

    def _report(self, tracker: Tracker, stage: str, error: BaseException) -> None:
        """Tell once that a tracker failed and is off: a warning and a run event."""
        what = {"start": "opening", "log": "logging", "close": "closing"}[stage]
        message = (f"tracker {tracker!r} failed while {what} and was switched off ({error!r}); "
                   "training goes on and run.metrics keeps every row")
        try:
            self._recorder.add_event("tracker_failed", {
                "tracker": repr(tracker), "stage": stage, "error": repr(error),
                "traceback": "".join(traceback.format_exception(error))})
        except Exception:  # noqa: BLE001, S110 - the warning below still tells
            pass
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001, S110 - warnings turned into errors (a test's
            pass           # filter) must not take the worker down; the event is recorded

    def close(self, wait: bool = True) -> None:
        """Stop listening, let every tracker log what is queued and close, and (`wait`) wait
        for them, `CLOSE_TIMEOUT` seconds at most in all. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        for worker in self._workers:
            worker.stop()
        if wait:
            deadline = time.monotonic() + CLOSE_TIMEOUT
            for worker in self._workers:
                worker.join(deadline, CLOSE_TIMEOUT)

    @property
    def trackers(self) -> list[Tracker]:
        return [w.tracker for w in self._workers]
