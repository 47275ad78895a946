"""A handle on a training run that executes in the session's background loop.

`session.train(...)` returns a Run at once. The notebook stays free: inspect `run.metrics` or
`run.episodes` while it trains, `await run` (JupyterLab: the kernel keeps handling widget clicks)
or `run.wait()` (scripts, papermill) to block until it ends. Both re-raise an error from the
background and show a progress bar in the waiting cell; `run.stop()` cancels the run cleanly.

`open_run(folder)` reads a run back from its folder alone (another process, a later day): the
same metrics, events, evaluations and kept episodes, read-only, without loading the episode
record into memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import html
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dataflow.config import RunConfig
from ..dataflow.flow import HeldOut
from .folder import EPISODES_FILE, METRICS_FILE, RunFiles, evaluation_windows
from .recorder import Episode, EpisodeLog, EpisodeView, Recorder
from .report import summarize
from .steps import StepLog

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

__all__ = ["Run", "RunConfig", "RunRecord", "open_run"]


class Run:
    """A running (or finished) training run. Created by `Session.train`."""

    def __init__(
        self,
        config: RunConfig,
        recorder: Recorder,
        future: concurrent.futures.Future[None],
        stop: Callable[[], None],
        policies: list[str],
        accounting: Callable[[], dict[str, int]] = dict,
        heldout: HeldOut | None = None,
    ):
        self.config = config
        self.heldout = heldout
        """What the run evaluates while it trains (`train(eval_every=...)`), or None."""
        self.directory: Path = recorder.directory
        self._recorder = recorder
        self._future = future
        self._stop = stop
        self._policies = policies
        self._stopped = False
        self._accounting = accounting
        self._views: list[Any] = []
        self.session: Any = None
        """The Session that runs it (set by `Session.train` and `Session.resume`)."""

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """"running", "stalled" (still running, but not moving: `run.stalled` says why),
        "finished", "stopped" or "failed"."""
        if not self._future.done():
            return "stalled" if self.stalled is not None else "running"
        if self._stopped:
            return "stopped"
        return "failed" if self._future.exception() else "finished"

    @property
    def stalled(self) -> str | None:
        """Why the run is not moving, while it is not: the message of its latest "stalled"
        event (in `run.events`, with what it waits for), until a policy that event names
        publishes a step. None while the run moves, and once it has ended."""
        if self._future.done():
            return None
        event = next((e for e in reversed(self.events) if e.get("kind") == "stalled"), None)
        if event is None:
            return None
        named = set(event["policies"])
        if any(r["policy"] in named and r["time"] >= event["time"] for r in self.rows):
            return None
        message: str = event["message"]
        return message

    @property
    def learned(self) -> dict[str, str]:
        """Policy -> the message of its "learned" event (its last groups all tied at its best
        reward: the task is learned at this difficulty), for the policies that had one."""
        return {e["policy"]: e["message"] for e in self.events if e.get("kind") == "learned"}

    @property
    def done(self) -> bool:
        """Whether the run has ended (finished, stopped or failed)."""
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the run, if any."""
        return self._future.exception() if self._future.done() else None

    @property
    def metrics(self) -> pandas.DataFrame:
        """One row per (policy, step): rewards, staleness, buffer, drops, loss, timings.

        A run that evaluates (`train(eval_every=...)`) also has one row per evaluation window,
        in time order among the step rows, and a `kind` column telling them apart ("step" or
        "eval"). An eval row has `time` and the window's numbers as `eval/<name>`:
        `eval/<role>/avg@<k>`, `eval/<role>/pass@<k>`, `eval/version` (the policies' version
        when it began), `eval/token_versions`, `eval/failed`, `eval/truncated`, `eval/n`,
        `eval/k`, `eval/window`, `eval/seconds`. `run.evaluations` has the windows alone.
        """
        return _metrics_frame(self._recorder.rows,
                              None if self.heldout is None else self._recorder.evaluations)

    @property
    def evaluations(self) -> pandas.DataFrame:
        """One row per held-out evaluation window (`train(eval_every=...)`): window, version
        (the policies' version when it began), time, seconds, env, split, `<role>/avg@<k>` and
        `<role>/pass@<k>` per role, n (problems), k, failed, truncated, token_versions (the
        weight versions that sampled it: more than one when a new version was published while
        it played), first_error (the traceback of one failed play, else None; evaluation
        episodes are not in `run.episodes`)."""
        import pandas as pd

        return pd.DataFrame(self.evaluation_rows)

    @property
    def evaluation_rows(self) -> list[dict[str, Any]]:
        """The evaluation windows as plain dicts (what the dashboard draws from)."""
        return _window_rows(self._recorder.evaluations)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The metrics rows as plain dicts (a copy; cheaper than `metrics` for frequent reads,
        which is what the dashboard redraws from)."""
        return self._recorder.rows

    @property
    def episodes(self) -> EpisodeView:
        """The kept episodes so far, in completion order: with `train(record="sample")` (the
        default) every failed or truncated episode and `record_per_step` others a step; with
        "all" every episode; with "none" the failed and truncated ones. A list-like view (len,
        `[i]`, `[-1]`, slices, iteration) whose positions count kept episodes; each Episode
        keeps its completion `index` among all played. Those no longer in memory are read back
        from the run's folder when asked for."""
        return self._recorder.episodes

    @property
    def steps(self) -> StepLog:
        """The train steps the step inspector recorded (`train(inspect_every=N)`: step 0 and
        every N-th), oldest first: `run.steps[i].show()` opens what step i trained, token by
        token; `.text()` for scripts; `run.steps.flagged()` the ones that taught nothing."""
        return self._recorder.steps

    @property
    def recent_episodes(self) -> list[Episode]:
        """The last episodes played (256 by default), kept or not, newest last."""
        return self._recorder.recent_episodes

    def on_event(self, observer: Callable[[str, Any], None]) -> Callable[[], None]:
        """Subscribe an observer to "metrics" rows and "episode" records (see Recorder)."""
        return self._recorder.on_event(observer)

    @property
    def accounting(self) -> dict[str, int]:
        """Episode accounting: submitted, completed, resubmitted after a failover, duplicates
        discarded, late (results of abandoned episodes), lost (must be 0), and trained_twice
        (must be 0). With rollout services, held-out evaluation episodes are submitted and
        completed too."""
        return self._accounting()

    @property
    def events(self) -> list[dict[str, Any]]:
        """Things that happened outside the step rhythm, each a dict with its "kind": a
        trainer "rollback", a held-out "evaluation" window, "resumed", "stalled" (the run
        stopped moving: "reason", "policies", "waiting_for" and a "message" saying what to
        do; see `run.stalled`), "learned" (a policy's last groups all tied at its best reward:
        "policy", "step", "groups", "reward", "message"; see `run.learned`)."""
        return self._recorder.events

    @property
    def policies(self) -> list[str]:
        """Names of the policies this run trains."""
        return list(self._policies)

    @property
    def progress(self) -> tuple[int, int]:
        """(steps done, steps in total) over all policies."""
        return len(self._recorder.rows), self.config.steps * len(self._policies)

    # -- control -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the run; already collected metrics and episodes stay."""
        if not self._future.done():
            self._stopped = True
            self._stop()

    def wait(self, timeout: float | None = None, progress: bool = True) -> Run:
        """Block until the run ends; re-raise its error. Shows a progress bar unless told not to."""
        with _Progress(self, progress) as bar, self._interruptible(), _sigint_at_a_safe_point() \
                as interrupted:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._future.done():
                if interrupted():
                    raise KeyboardInterrupt
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"run still {self.status} after {timeout} s")
                concurrent.futures.wait([self._future], timeout=0.2)
                bar.update()
                self._tick_views()
        self._finish_views()
        return self._result()

    def __await__(self) -> Generator[Any, None, Run]:
        return self._await().__await__()

    async def _await(self) -> Run:
        with _Progress(self, True) as bar, self._interruptible():
            while not self._future.done():
                await asyncio.sleep(0.2)
                bar.update()
                self._tick_views()
        self._finish_views()
        return self._result()

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """An interrupt (the kernel's stop button, Ctrl-C) stops the waiting, not the run: the
        error raised says so, and how to stop the run."""
        try:
            yield
        except (KeyboardInterrupt, asyncio.CancelledError) as interrupt:
            if self._future.done():
                raise
            step, total = self.progress
            raise type(interrupt)(
                f"stopped waiting; the run goes on in the background (step {step} of {total}). "
                "run.stop() stops it; `await run` or run.wait() waits again. (At the end of "
                "a script the run is stopped when the process exits.)") from None

    def dashboard(self, *, interval: float = 0.5, mode: str | None = None) -> Any:
        """Show the run's dashboard in this cell and return it.

        Panels: reward per policy, staleness (per step, distribution, bound), weight bytes sent
        and share of weights changed per version, throughput, buffer, drops, filtered groups,
        failed and truncated episodes, and (with `train(eval_every=...)`) held-out avg@k and
        pass@k per version, and (when the rows count games won, drawn and lost per policy, as
        TextArena's games do) each policy's win rate and Elo; each policy's version; a Stop
        button. In JupyterLab the panels
        update live (at most once per `interval` seconds); headless (papermill, nbmake) they
        appear as a static figure when `await run` / `run.wait()` sees the run end; in a
        script, one line of text. The `ASTRANB_DISPLAY` environment variable (widgets | static
        | none) or `mode` overrides the guess. A failing dashboard shows its error and never
        stops training.
        """
        from ..notebook.dashboard import open_dashboard
        from ..notebook.display import MODES, display_mode, in_kernel

        if mode is not None and mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {', '.join(MODES)} (or leave it None)")
        view = open_dashboard(self, mode or display_mode(), interval)
        self._views.append(view)
        if in_kernel():
            from IPython.display import display

            display(view)  # type: ignore[no-untyped-call]  # shown once; a cell ending in run.dashboard() shows nothing more
        if self.done:
            self._finish_views()
        return view

    def _tick_views(self) -> None:
        for view in self._views:
            try:
                view.tick()
            except Exception as error:  # noqa: BLE001 - a view never stops the wait
                self._view_failed(view, error)

    def _finish_views(self) -> None:
        views, self._views = self._views, []
        for view in views:
            try:
                view.finish()
            except Exception as error:  # noqa: BLE001 - never hide the run's own result
                self._view_failed(view, error)

    def _view_failed(self, view: Any, error: Exception) -> None:
        import warnings

        if view in self._views:
            self._views.remove(view)
        warnings.warn(f"{type(view).__name__} failed and was switched off ({error!r}); "
                      "the run goes on", RuntimeWarning, stacklevel=3)

    def _result(self) -> Run:
        if self._stopped:
            return self
        error = self._future.exception()
        if error is not None:
            raise error
        return self

    # -- views ---------------------------------------------------------------------------------
    def plot(self, path: str | Path | None = None) -> Figure:
        """Reward and staleness per step (matplotlib); saved to `path` when given."""
        import matplotlib.pyplot as plt

        df = self.metrics
        fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(10, 3.5))
        for name, part in df.groupby("policy") if len(df) else []:
            ax_r.plot(part["step"], part["reward"], label=f"{name} reward")
            ax_s.plot(part["step"], part["staleness_mean"], label=f"{name} mean")
            ax_s.plot(part["step"], part["staleness_max"], "--", label=f"{name} max")
        ax_r.set(xlabel="step", ylabel="mean episode reward", ylim=(-0.02, 1.02))
        ax_s.set(xlabel="step", ylabel="staleness (versions)")
        for ax in (ax_r, ax_s):
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def summary(self) -> dict[str, float]:
        """Headline numbers: final reward (mean over the last 10% of steps), steps, time; with
        held-out evaluation also the last window's `eval/<role>/avg@<k>`, `eval/<role>/pass@<k>`
        and `eval/version` (`runinfo.summarize`, what run.json keeps, less `reward_last`)."""
        summary = summarize(self._recorder.rows, self._recorder.evaluations, self.config.steps)
        summary.pop("reward_last", None)
        return summary

    def _last_evaluation(self) -> dict[str, float]:
        """version and every `<role>/avg@<k>`, `<role>/pass@<k>` of the last window ({} if
        none)."""
        windows = self._recorder.evaluations
        if not windows:
            return {}
        last = windows[-1]
        scores = {k: float(v) for k, v in last.items() if "/avg@" in k or "/pass@" in k}
        return {"version": last["version"], **scores}

    def __repr__(self) -> str:
        done, total = self.progress
        last = self._last_evaluation()
        held = "".join(f", {k} {v:.3f}" for k, v in last.items() if k != "version")
        held = f", held-out v{last['version']}{held}" if last else ""
        return f"Run({self.status}, {done}/{total} steps{held}, dir={str(self.directory)!r})"

    def _repr_html_(self) -> str:
        from ..notebook.html import card, table

        done, total = self.progress
        rows = self._recorder.rows
        last = {row["policy"]: row for row in rows}
        columns = ("policy", "version", "reward", "staleness max", "buffer", "dropped stale",
                   "filtered", "episodes")
        body = table(columns, [
            (p, last[p]["version"], last[p]["reward"], last[p]["staleness_max"],
             last[p]["buffer_size"], last[p]["dropped_stale"], last[p]["filtered_groups"],
             last[p]["episodes"]) if p in last else (p, 0, "", "", "", "", "", "")
            for p in self._policies
        ])
        held = self._last_evaluation()
        if held and self.heldout is not None:
            scores = " · ".join(f"{html.escape(k)} {v:.3f}" for k, v in held.items()
                                if k != "version")
            body += (f"<div style='font-size:12px'>held-out ({html.escape(self.heldout.split)} "
                     f"split) at v{held['version']}: {scores}</div>")
        error = self.error
        if error is not None:
            body += (f"<pre style='color:#d62728'>{type(error).__name__}: "
                     f"{html.escape(str(error))}</pre>")
        c = self.config
        subtitle = (f"{self.status}, {done}/{total} steps, batch {c.batch_size} "
                    f"(groups of {c.group_size}), max_staleness {c.max_staleness}, {c.mode}")
        hint = ("<div style='color:#666;font-size:11px'>run.dashboard() for live panels, "
                "run.metrics for every row, run.episodes[i].show() to step through an "
                f"episode; files in {html.escape(str(self.directory))}</div>")
        return card("Run", subtitle, body + hint, "astranb-run")


def _metrics_frame(rows: list[dict[str, Any]],
                   evaluations: list[dict[str, Any]] | None) -> pandas.DataFrame:
    """The metrics rows, and with `evaluations` one `kind="eval"` row per window in time order.
    A `count/<name>` column is 0, not missing, in the step rows written before the name was
    first counted."""
    import pandas as pd

    names = sorted({key for row in rows for key in row if key.startswith("count/")})
    rows = [{**dict.fromkeys(names, 0), **row} for row in rows]
    if evaluations is None:
        return pd.DataFrame(rows)
    steps = [{"kind": "step", **row} for row in rows]
    evals = [{"kind": "eval", "time": e["time"],
              **{f"eval/{k}": v for k, v in e.items() if k not in ("kind", "time")}}
             for e in evaluations]
    return pd.DataFrame(sorted(steps + evals, key=lambda row: row["time"]))


def _window_rows(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluation windows without their event "kind" (the rows of `evaluations`)."""
    return [{k: v for k, v in e.items() if k != "kind"} for e in windows]


def open_run(directory: str | Path) -> RunRecord:
    """Open a run's folder (`<session dir>/run-NNN`) read-only: its metrics, events, evaluation
    windows, status and kept episodes, as it was when opened.

        >>> old = ab.open_run("runs/arith/run-000")
        >>> old.metrics.tail(); old.episodes[-1].show()

    Raises:
        FileNotFoundError: the folder holds no run (no metrics.jsonl and no episode record).
    """
    return RunRecord(directory)


class RunRecord:
    """A finished (or still running) run read from its folder alone; see `open_run`.

    `episodes` is read lazily (an index, then one frame per episode asked for); the metrics
    rows and events are read when the record is opened. Episodes read back know no environment
    or tokenizer: `episode.debugger().rescore(env=...)` re-scores one."""

    def __init__(self, directory: str | Path):
        files = RunFiles(directory)
        self.directory = files.path
        if not files.holds_a_run():
            raise FileNotFoundError(
                f"{self.directory} is not a run folder (it has none of {METRICS_FILE}, "
                f"{EPISODES_FILE}); a session writes each run to <session directory>/run-NNN")
        self.rows: list[dict[str, Any]] = files.rows
        """The metrics rows as plain dicts."""
        self.events: list[dict[str, Any]] = files.events
        """Things that happened outside the step rhythm (rollbacks, evaluation windows)."""
        self.episodes: EpisodeLog = EpisodeLog(self.directory)
        """The kept episodes, in completion order (list-like, read from disk when asked)."""
        self.steps: StepLog = StepLog(self.directory)
        """The train steps the step inspector recorded, oldest first (see `Run.steps`)."""
        self.info: dict[str, Any] = files.info or {}
        """The folder's run.json (settings, times, summary; see report.py), {} without one."""
        self.status: str = files.status
        """"finished", "stopped", "failed", "running", "interrupted" (its process died before
        the run ended); without run.json (a run of an older astranb) its status.json's, else
        "unknown"."""
        self.error: str | None = files.error
        """The first line of the error that ended a failed run."""

    @property
    def evaluation_rows(self) -> list[dict[str, Any]]:
        return _window_rows(evaluation_windows(self.events))

    @property
    def evaluations(self) -> pandas.DataFrame:
        """One row per held-out evaluation window (empty if the run did not evaluate)."""
        import pandas as pd

        return pd.DataFrame(self.evaluation_rows)

    @property
    def metrics(self) -> pandas.DataFrame:
        """One row per (policy, step), as `Run.metrics`; with evaluation windows also their
        `kind="eval"` rows."""
        return _metrics_frame(self.rows, evaluation_windows(self.events) or None)

    def __repr__(self) -> str:
        return (f"RunRecord({self.status}, {len(self.rows)} metrics rows, "
                f"{len(self.episodes)} kept episodes, dir={str(self.directory)!r})")


@contextlib.contextmanager
def _sigint_at_a_safe_point() -> Iterator[Callable[[], bool]]:
    """Ctrl-C while `wait()` waits, turned into a flag the waiting loop checks.

    Python raises KeyboardInterrupt wherever the main thread is, and can do so between a
    lock's acquire and the `try` that releases it; a lock of the recorder left held that way
    froze the event loop for good (seen once in many runs). The loop raises it itself instead,
    holding nothing. Only where Python's own handler is installed (the main thread of a script
    or papermill), so another handler (a kernel's) is left alone.
    """
    pressed: list[bool] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: False
        return
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(True))
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _Progress:
    """A tqdm bar in the waiting cell (never touched from background threads), and the
    stall notices (`run.stalled`), printed there whether the bar is shown or not."""

    def __init__(self, run: Run, enabled: bool):
        self.run, self.enabled, self.bar = run, enabled, None
        self._said: str | None = None
        self._learned: set[str] = set()

    def _say_stalled(self) -> None:
        """Print why the run is stalled, once per stall, in the waiting cell (with or
        without the bar): a run that makes no progress must say so where one looks."""
        stalled = self.run.stalled
        if stalled is not None and stalled != self._said:
            from tqdm.auto import tqdm

            tqdm.write(f"astranb: the run is stalled: {stalled}", file=sys.stderr)
        self._said = stalled

    def _say_learned(self) -> None:
        """Print each "learned" event once in the waiting cell."""
        for policy, message in self.run.learned.items():
            if policy not in self._learned:
                from tqdm.auto import tqdm

                tqdm.write(f"astranb: {message}", file=sys.stderr)
                self._learned.add(policy)

    def __enter__(self) -> _Progress:
        if self.enabled:
            from tqdm.auto import tqdm

            done, total = self.run.progress
            self.bar = tqdm(total=total, initial=done, desc="training", unit="step")
        return self

    def update(self) -> None:
        self._say_stalled()
        self._say_learned()
        if self.bar is None:
            return
        done, _ = self.run.progress
        rows = self.run.rows
        if rows:
            last = rows[-1]
            self.bar.set_postfix(reward=f"{last['reward']:.2f}", stale=last["staleness_max"])
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.update()
            self.bar.close()

