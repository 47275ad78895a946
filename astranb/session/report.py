"""run.json: what a run was asked for and how it ended, beside its metrics.

metrics.jsonl tells what happened step by step, but not which settings produced it, whether the
run is still going, or why it ended. A folder of past runs (a sweep, weeks of experiments) can
only be compared if each run says so itself, in one small file that is cheap to read: `ab.runs`
reads run.json files and never the episodes.

The session writes it twice (`RunInfo`). When the run starts: its name, the `RunConfig`, each
policy's model, algorithm and learning rate, the environments, "status": "running", the start
time, and the process id and host, so that a reader can tell a run whose process died without
saying so ("interrupted", see `folder.status_of`). When it ends, from inside the run's task (so
the file is complete before `run.wait()` returns): "finished", "stopped" or "failed", the end
time, the wall time, the final numbers (`summarize`, the same as `Run.summary`) and, for a
failure, the error's first line. Each write replaces the file atomically (`folder.write_json`),
so a reader never sees half a record. A resumed run keeps its first start time and
adds the time of each resumption.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..algorithms.config import algorithm_to_dict
from ..dataflow.config import RunConfig
from ..types import jsonable
from .folder import RUN_FILE, read_json, write_json

if TYPE_CHECKING:
    from ..environments.base import Environment
    from .policy import Policy
    from .recorder import Recorder

__all__ = ["RunInfo", "error_line", "policy_info", "read_info", "start_info", "summarize"]

ENDED = ("finished", "stopped", "failed")


# -- pure parts --------------------------------------------------------------------------------
def policy_info(policy: Policy) -> dict[str, Any]:
    """What a run.json says of one policy: its name, model, algorithm and optimizer settings."""
    try:
        algorithm = algorithm_to_dict(policy.algorithm)
    except TypeError:  # a custom Algorithm: its kind is all that can be said as JSON
        algorithm = {"kind": type(policy.algorithm).__name__}
    optimizer = policy.optimizer
    return {"name": policy.name, "model": policy.spec.name, "algorithm": jsonable(algorithm),
            "lr": optimizer.lr, "weight_decay": optimizer.weight_decay,
            "grad_clip": optimizer.grad_clip}


def start_info(name: str, config: RunConfig, policies: Iterable[Policy],
               environments: Iterable[str], *, started: float, pid: int,
               host: str) -> dict[str, Any]:
    """The record of a run that is starting."""
    return {"run": name, "config": dataclasses.asdict(config),
            "policies": [policy_info(p) for p in sorted(policies, key=lambda p: p.name)],
            "environments": sorted(set(environments)), "status": "running",
            "started": started, "pid": pid, "host": host}


def summarize(rows: Sequence[Mapping[str, Any]], evaluations: Sequence[Mapping[str, Any]] = (),
              steps: int | None = None) -> dict[str, Any]:
    """A run's headline numbers from its metrics rows, as `Run.summary` gives them: steps,
    reward_last_10pct (the mean reward over the last tenth of each policy's steps), seconds,
    episodes, staleness_max, the last window's `eval/...` numbers; plus reward_last (the mean
    over policies of each one's last reward).

    Args:
        rows: the metrics rows (metrics.jsonl).
        evaluations: the "evaluation" events (events.jsonl), in order.
        steps: steps per policy the run was asked for (sets the tail); default: those done.
    """
    if not rows:
        return {"steps": 0}
    by_policy: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_policy.setdefault(str(row.get("policy")), []).append(row)
    done = max(len(part) for part in by_policy.values())
    tail_length = max(1, math.ceil((steps or done) / 10))
    tail = [row for part in by_policy.values() for row in part[-tail_length:]]
    summary: dict[str, Any] = {
        "steps": max(int(row["step"]) for row in rows) + 1,
        "reward_last_10pct": _mean(row.get("reward") for row in tail),
        "reward_last": _mean(part[-1].get("reward") for part in by_policy.values()),
        "seconds": max(float(row.get("time") or 0.0) for row in rows),
        "episodes": max(int(row.get("episodes") or 0) for row in rows),
        "staleness_max": max(int(row.get("staleness_max") or 0) for row in rows),
    }
    if evaluations:
        last = evaluations[-1]
        summary["eval/version"] = last.get("version")
        summary.update({f"eval/{k}": float(v) for k, v in last.items()
                        if ("/avg@" in k or "/pass@" in k) and v is not None})
    return summary


def _mean(values: Iterable[Any]) -> float:
    """The mean of the numbers among `values` (None and NaN are left out; NaN if none)."""
    numbers = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(numbers) / len(numbers) if numbers else math.nan


def error_line(error: BaseException) -> str:
    """`Type: first line of the message`, for a table cell."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# -- files -------------------------------------------------------------------------------------
def read_info(directory: str | Path) -> dict[str, Any] | None:
    """The run.json of a run folder, or None without one (a run of an older astranb) or when
    it cannot be read."""
    return read_json(Path(directory) / RUN_FILE)


# -- the session's side ------------------------------------------------------------------------
class RunInfo:
    """The run.json of one run: written at once by `begin`, completed by `watch` when the run's
    task ends. Writing it never fails the run: an error writing it is a warning."""

    def __init__(self, recorder: Recorder, config: RunConfig, info: dict[str, Any],
                 stopped: Callable[[], bool]):
        self.path = recorder.directory / RUN_FILE
        self._recorder, self._config, self.info, self._stopped = recorder, config, info, stopped

    @classmethod
    def begin(cls, recorder: Recorder, config: RunConfig,
              wired: Iterable[tuple[Environment, Mapping[str, Policy], float]],
              stopped: Callable[[], bool]) -> RunInfo:
        """Write the "running" record of a run that starts in `recorder.directory`.

        Args:
            recorder: the run's recorder (its folder; its rows make the final summary).
            config: what the run was asked for.
            wired: (environment, role -> policy, weight) of each wired environment.
            stopped: whether the run was asked to stop (its cancel scope was cancelled).
        """
        wired = list(wired)
        policies = {p.name: p for _, wiring, _ in wired for p in wiring.values()}
        now = time.time()
        info = start_info(recorder.directory.name, config, policies.values(),
                          [env.name for env, _, _ in wired], started=now, pid=os.getpid(),
                          host=socket.gethostname())
        earlier = read_info(recorder.directory)
        if earlier is not None and "started" in earlier:  # a resumed run: same folder, same start
            info["started"] = earlier["started"]
            info["resumed"] = [*earlier.get("resumed", []), now]
        record = cls(recorder, config, info, stopped)
        record._write(info)
        return record

    async def watch(self, main: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `main(*args)` (the run's task) and write how it ended before returning."""
        import anyio

        try:
            await main(*args)
        except BaseException as error:
            cancelled = isinstance(error, anyio.get_cancelled_exc_class())
            self.end("stopped" if cancelled else "failed", None if cancelled else error)
            raise
        self.end("stopped" if self._stopped() else "finished")

    def end(self, status: str, error: BaseException | None = None) -> None:
        """Complete the record: status, end and wall time, summary, error."""
        now = time.time()
        info = {**self.info, "status": status, "ended": now,
                "wall_s": round(now - float(self.info["started"]), 3),
                "summary": summarize(self._recorder.rows, self._recorder.evaluations,
                                     self._config.steps)}
        if error is not None:
            info["error"] = error_line(error)
        self.info = info
        self._write(info)

    def _write(self, info: dict[str, Any]) -> None:
        try:
            write_json(self.path, info)
        except (OSError, ValueError, TypeError) as error:
            warnings.warn(f"could not write {self.path} ({error!r}); the run goes on, but "
                          "ab.runs will not know its settings or how it ended",
                          RuntimeWarning, stacklevel=2)
