"""What a run leaves behind: one metrics row per (policy, step), the kept episodes, and events.

The recorder is written from the session's event loop and read from anywhere (the notebook's
thread, widgets), so it guards its lists with a lock and hands out copies. Rows and events are
appended to `metrics.jsonl` and `events.jsonl` in the run's folder as they arrive, so a crashed
kernel loses nothing that was already collected. Events are what happens outside the step
rhythm: a trainer rollback, or a held-out evaluation window ("evaluation", see `evaluations`).
Observers (dashboards, progress bars) subscribe with `on_event`; an observer that raises is
reported with its name and then switched off, never allowed to stop training.

Episodes are many (the 600-step quickstart plays ~156k), so memory and disk stay bounded:
every episode is announced to observers, but only those its record mode keeps ("sample":
failed and truncated ones plus 8 a step; "all"; "none": failed and truncated ones) are written,
one zstd frame per metrics row, to `episodes.jsonl.zst` with its index `episodes.index` (format
and crash behaviour: episodes.py). Memory holds the last 256 played and the last 256 kept;
`episodes` is an `EpisodeView` that reads older kept ones back from the folder when asked, and
`EpisodeLog(folder)` does the same without a recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, overload

from ..errors import FolderNotWritable
from ..types import Trajectory, Turn, agent_depth, jsonable, register_html_view
from .episodes import (
    FrameReader,
    FrameTable,
    FrameWriter,
    RecordPolicy,
    Selection,
    load_frames,
)
from .folder import (
    EPISODES_FILE,
    EVENTS_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    RecordWriteError,
    evaluation_windows,
    json_line,
)
from .steps import StepLog, StepStore

if TYPE_CHECKING:
    from ..environments.base import Environment
    from ..notebook.debugger import EpisodeDebugger
    from .policy import Policy

__all__ = ["Episode", "EpisodeLog", "EpisodeView", "Recorder", "turn_record"]


@dataclass(frozen=True)
class Episode:
    """A recorded episode, readable without a tokenizer.

    `show()` opens it in the step-through debugger; `debugger()` returns that debugger without
    displaying it (headless use and tests).
    """

    index: int
    """Order of completion within the run (-1: a fresh episode played by `ab.debug`)."""
    group: int
    """Group id (episodes of a group share a sample)."""
    sample: Mapping[str, Any]
    """The dataset sample."""
    turns: tuple[Mapping[str, Any], ...]
    """Per turn: role, policy, prompt, completion, tokens, logprobs, versions, finish_reason."""
    rewards: Mapping[str, float]
    """Reward per role (empty if the episode failed)."""
    error: str | None
    """Traceback text if the episode raised."""
    trainer_version: int
    """Version of the first policy's trainer when the episode finished."""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    """Per ctx.tool() call: name, args, result, error, position (turns made before it)."""
    env: str = ""
    """Name of the environment that played it."""
    environment: Environment | None = field(default=None, compare=False, repr=False)
    """The environment object itself (not saved to disk): what `rescore` plays again."""
    tokenizers: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Policy name -> tokenizer (not saved to disk): per-token text and re-tokenized edits."""
    truncated: str | None = None
    """Why the episode was cut short (context or token budget), or None."""
    counts: Mapping[str, int] = field(default_factory=dict)
    """What the episode counted with `ctx.count`."""
    sample_id: str = ""
    """Which sample of the run's streams it played ("<stream>:<position>"; see
    `Trajectory.sample_id`)."""

    def show(self) -> EpisodeDebugger:
        """Open the episode in the step-through debugger, display it, and return it.

        In JupyterLab the debugger is a widget; under papermill/nbmake it is a self-contained
        HTML viewer saved in the notebook; outside a kernel its text is printed (see
        `astranb.notebook.display`). Assign the result (`dbg = episode.show()`) to step with
        methods; as a cell's last expression it is not shown a second time.
        """
        debugger = self.debugger()
        debugger.display()
        return debugger

    def debugger(self, **policies: Policy) -> EpisodeDebugger:
        """The step-through debugger of this episode, not displayed.

        Args:
            **policies: role -> policy; with them `rescore` samples the turns after an edit
                afresh instead of replaying the recorded completions.
        """
        from ..notebook.debugger import EpisodeDebugger

        return EpisodeDebugger(self, policies)

    def render(self) -> str:
        lines = [f"episode {self.index} (group {self.group}) sample={dict(self.sample)}"]
        tools = sorted(self.tool_calls, key=lambda c: c["position"])
        for i, turn in enumerate(self.turns):
            lines += [_render_tool(c) for c in tools if c["position"] == i]
            versions = sorted(set(turn["versions"]))
            agent = turn.get("agent", "")
            pad = "  " * agent_depth(agent)
            who = f"sub-agent {agent}: " if agent else ""
            lines.append(
                f"  {pad}turn {i} [{who}{turn['role']} -> {turn['policy']}, versions {versions}]"
                f"\n    {pad}prompt:     {turn['prompt']!r}\n    {pad}completion: "
                f"{turn['completion']!r}"
            )
        lines += [_render_tool(c) for c in tools if c["position"] >= len(self.turns)]
        lines.append(f"  rewards: {dict(self.rewards)}" if self.error is None else "  FAILED:")
        if self.truncated:
            lines.append(f"  truncated ({self.truncated})")
        if self.error:
            lines.append("    " + self.error.strip().replace("\n", "\n    "))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "group": self.group,
            "sample": jsonable(self.sample),
            "turns": list(self.turns),
            "rewards": dict(self.rewards),
            "error": self.error,
            "trainer_version": self.trainer_version,
            "tool_calls": list(self.tool_calls),
            "env": self.env,
            "truncated": self.truncated,
            "counts": dict(self.counts),
            "sample_id": self.sample_id,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Episode:
        """An episode from one JSON line of a run's episode record (it knows no environment or
        tokenizer: pass `rescore(env=...)` to re-score it)."""
        return cls(int(data["index"]), int(data["group"]), dict(data["sample"]),
                   tuple(data["turns"]), dict(data["rewards"]), data.get("error"),
                   int(data.get("trainer_version", 0)), tuple(data.get("tool_calls") or ()),
                   str(data.get("env", "")), truncated=data.get("truncated"),
                   counts={str(k): int(v) for k, v in (data.get("counts") or {}).items()},
                   sample_id=str(data.get("sample_id", "")))

    @classmethod
    def from_trajectory(cls, traj: Trajectory, index: int = 0, trainer_version: int = 0, *,
                        environment: Environment | None = None,
                        tokenizers: Mapping[str, Any] | None = None,
                        decode: Mapping[str, Callable[[list[int]], str]] | None = None) -> Episode:
        """Record a finished trajectory.

        Args:
            traj: the trajectory.
            index: its order in the run.
            trainer_version: version of the first policy's trainer when it finished.
            environment: the environment that played it (kept so it can be re-scored).
            tokenizers: policy name -> tokenizer (per-token text, re-tokenized edits).
            decode: policy name -> ids-to-text for the prompts (default: the tokenizers').
        """
        tokenizers = dict(tokenizers or {})
        decode = dict(decode or {name: _decoder(tok) for name, tok in tokenizers.items()})
        return cls(
            index=index,
            group=traj.group,
            sample=dict(traj.sample),
            turns=tuple(turn_record(t, decode.get(t.policy)) for t in traj.turns),
            rewards=dict(traj.rewards),
            error=traj.error,
            trainer_version=trainer_version,
            tool_calls=tuple(dataclasses.asdict(c) for c in traj.tool_calls),
            env=traj.env or (environment.name if environment is not None else ""),
            environment=environment,
            tokenizers=tokenizers,
            truncated=traj.truncated,
            counts=dict(traj.counts),
            sample_id=traj.sample_id,
        )


def turn_record(turn: Turn, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    """One turn as plain JSON values; the prompt text is `decode(prompt_ids)` ("" without)."""
    gen = turn.generation
    return {
        "role": turn.role,
        "policy": turn.policy,
        **({"agent": turn.agent} if turn.agent else {}),
        "prompt": decode(list(gen.prompt_ids)) if decode is not None else "",
        "completion": gen.text,
        "prompt_ids": list(gen.prompt_ids),
        "completion_ids": list(gen.completion_ids),
        "logprobs": list(gen.logprobs),
        "versions": list(gen.versions),
        "finish_reason": gen.finish_reason,
    }


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _render_tool(call: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in call["args"].items())
    outcome = f"raised {call['error']}" if call.get("error") else f"-> {call['result']!r}"
    return f"  tool {call['name']}({args}) {outcome}"


class EpisodeView(Sequence[Episode]):
    """A read-only list of a run's kept episodes, in completion order, fixed at its length when
    made: `len`, `view[i]` (negative too), slices (a list), iteration. Positions count kept
    episodes only; each Episode keeps its completion `index` among all played. Episodes not in
    memory are read from the run's folder when asked for, a frame at a time."""

    def __init__(self, source: _Source, length: int, label: str = ""):
        self._source, self._length, self._label = source, length, label

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, key: int) -> Episode: ...

    @overload
    def __getitem__(self, key: slice) -> list[Episode]: ...

    def __getitem__(self, key: int | slice) -> Episode | list[Episode]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._length)
            if step == 1:
                return list(self._source.episodes(start, max(start, stop)))
            return [self._source.episode(i) for i in range(start, stop, step)]
        i = operator.index(key)
        if not -self._length <= i < self._length:
            raise IndexError(f"episode {key} of {self._length} kept episodes")
        return self._source.episode(i % self._length)

    def __iter__(self) -> Iterator[Episode]:
        return self._source.episodes(0, self._length)

    def __repr__(self) -> str:
        label = f"; {self._label}" if self._label else ""
        return f"<{self._length} episodes{label}>"


class _Source(Protocol):
    def episode(self, position: int) -> Episode: ...
    def episodes(self, start: int, stop: int) -> Iterator[Episode]: ...


class _FrameSource:
    """Kept episodes from the frames of a record; `memory(position)` may answer first (the
    recorder's last kept episodes) and `attach` gives disk-read ones what memory knows."""

    def __init__(self, table: FrameTable, reader: FrameReader,
                 memory: Callable[[int], Episode | None] = lambda position: None,
                 attach: Callable[[Episode], Episode] = lambda episode: episode):
        self._table, self._reader, self._memory, self._attach = table, reader, memory, attach

    def episode(self, position: int) -> Episode:
        found = self._memory(position)
        if found is not None:
            return found
        frame, line = self._table.locate(position)
        return self._load(self._reader.lines(self._table.frames[frame])[line])

    def episodes(self, start: int, stop: int) -> Iterator[Episode]:
        position = start
        while position < stop:
            found = self._memory(position)
            if found is not None:
                yield found
                position += 1
                continue
            frame, line = self._table.locate(position)
            for text in self._reader.lines(self._table.frames[frame])[line:]:
                if position >= stop:
                    break
                yield self._load(text)
                position += 1

    def _load(self, line: bytes) -> Episode:
        return self._attach(Episode.from_json(json.loads(line)))


class EpisodeLog(EpisodeView):
    """The kept episodes of a run folder, read from disk without a Recorder: what
    `ab.open_run(path).episodes` is. Reads `episodes.jsonl.zst` (its index, and the frames
    asked for); nothing else is loaded until an episode is asked for. Episodes read back know no
    environment or tokenizer (`rescore(env=...)` re-scores them). A snapshot: episodes a live
    run keeps later need a new EpisodeLog."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        table = FrameTable(load_frames(self.directory))
        super().__init__(_FrameSource(table, FrameReader(self.directory / EPISODES_FILE)),
                         table.total)


class Recorder:
    """Collects a run's metrics rows and episodes, mirrors them to disk, notifies observers.

    Args:
        directory: the run's folder (metrics.jsonl, events.jsonl and the episode record,
            `episodes.jsonl.zst` with `episodes.index`, are written there; see episodes.py).
        decode: token ids -> text, per policy name (to store readable prompts).
        record: which episodes to keep: "sample" (failed and truncated ones plus `per_step`
            others per metrics row), "all" or "none" (failed and truncated ones only).
        per_step: episodes sampled per metrics row in "sample" mode.
        recent: episodes held in memory: the last ones played, and the last ones kept.
        seed: seed of the sampling.
    """

    def __init__(self, directory: Path, decode: Mapping[str, Callable[[list[int]], str]], *,
                 record: str = "sample", per_step: int = 8, recent: int = 256, seed: int = 0):
        self.policy = RecordPolicy(record, per_step, recent)  # checked before touching the disk
        self.directory = directory
        self._decode = dict(decode)
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._observers: list[Callable[[str, Any], None]] = []
        self._events: list[dict[str, Any]] = []
        self._events_path = directory / EVENTS_FILE
        # episodes: chosen per pool, written as one zstd frame per metrics row (a syscall per
        # episode cost the event loop more than playing the episode on a small model)
        self._selection = Selection(self.policy, seed)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._writer = FrameWriter(directory)
        except OSError as error:  # before the run starts: say so, and what to do
            raise FolderNotWritable(directory, getattr(error, "error", error)) from None
        self._metrics_file = open(directory / METRICS_FILE, "a", encoding="utf-8")
        self._samples_file = open(directory / SAMPLES_FILE, "a", encoding="utf-8")
        self._source = _FrameSource(self._writer.table, FrameReader(self._writer.data_path),
                                    self._in_memory, self._attach)
        self._kept: deque[Episode] = deque(maxlen=recent)  # the last kept, newest last
        self._recent: deque[Episode] = deque(maxlen=recent)  # the last played, kept or not
        self._played = 0
        self._context: dict[str, tuple[Environment | None, Mapping[str, Any]]] = {}
        self._steps = StepStore(directory, self._decode)

    # -- writing (event loop) ------------------------------------------------------------------
    def add_row(self, row: Mapping[str, Any], *, samples: Mapping[str, Any] | None = None
                ) -> None:
        """Record a metrics row; `samples` (the names of the samples it accounts for) goes to
        samples.jsonl first, so a row on disk always has its names there too."""
        row = dict(row)
        with self._lock, self._writing(self.directory / METRICS_FILE):
            self._rows.append(row)
            self._write_kept()  # every kept episode that led up to this row is on disk
            if samples is not None:
                line = {"policy": row.get("policy"), "step": row.get("step"), **samples}
                self._samples_file.write(json_line(line) + "\n")
                self._samples_file.flush()
            self._metrics_file.write(json_line(row) + "\n")
            self._metrics_file.flush()
        self._emit("metrics", row)

    def add_trace(self, row: Mapping[str, Any], trace: Any) -> None:
        """What the step of metrics row `row` trained (a `training.trace.StepTrace`), written
        to the run folder's trained-steps/ (session/steps.py; the newest STEPS_KEPT per policy)."""
        self._steps.add(row, trace)

    @property
    def steps(self) -> StepLog:
        """The recorded steps (session/steps.py), oldest first."""
        return StepLog(self.directory)

    def add_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Something that happened outside the step rhythm (a trainer rollback, a failover)."""
        event = {"kind": kind, **payload}
        with self._lock, self._writing(self._events_path):
            self._events.append(event)
            with open(self._events_path, "a", encoding="utf-8") as f:
                f.write(json_line(event) + "\n")
        self._emit(kind, event)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """The held-out evaluation windows recorded so far ("evaluation" events), in order."""
        with self._lock:
            return evaluation_windows(self._events)

    def add_episode(self, traj: Trajectory, trainer_version: int, *,
                    environment: Environment | None = None,
                    tokenizers: Mapping[str, Any] | None = None) -> Episode:
        """Record a finished episode: observers see every one; the record keeps what its mode
        keeps.

        Args:
            traj: the trajectory.
            trainer_version: version of the first policy's trainer now.
            environment: the environment that played it (kept in memory so the debugger can
                re-score the episode; never written to disk).
            tokenizers: policy name -> tokenizer (per-token text in the debugger).
        """
        with self._lock:
            episode = Episode.from_trajectory(traj, self._played, trainer_version,
                                              environment=environment, tokenizers=tokenizers,
                                              decode=self._decode)
            self._played += 1
            self._recent.append(episode)
            self._context[episode.env] = (environment, dict(tokenizers or {}))
            self._selection.offer(episode)
            if self.policy.mode != "sample" and self._selection.pending >= self.policy.recent:
                with self._writing(self._writer.data_path):
                    self._write_kept()  # memory stays bounded; a sample is only known at the row
        self._emit("episode", episode)
        return episode

    def close(self) -> None:
        with self._lock, self._writing(self.directory):
            if not self._writer.closed:
                self._write_kept()  # the last pool: what finished after the last row
                self._writer.close()
            for file in (self._samples_file, self._metrics_file):
                if not file.closed:
                    file.flush()
                    file.close()

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A failed write (a full disk, a read-only folder) becomes an error that names the
        path and the free space; what was written before stays readable."""
        try:
            yield
        except OSError as error:
            if isinstance(error, RecordWriteError):
                raise
            raise RecordWriteError(Path(error.filename or path), error) from error

    def _write_kept(self) -> None:
        kept = self._selection.take()
        if kept:
            self._writer.write([(json_line(e.to_json()) + "\n").encode() for e in kept])
            self._kept.extend(kept)

    def continue_from(self, rows: list[dict[str, Any]], played: int = 0) -> None:
        """Start from the rows a resumed run keeps (already in metrics.jsonl): `rows`, the
        metrics and the dashboard show the whole series; episode indices go on from `played`
        (the episodes the interrupted run played before its checkpoint)."""
        with self._lock:
            self._rows[:0] = [dict(r) for r in rows]
            self._played = max(self._played, played)

    # -- reading (any thread) ------------------------------------------------------------------
    @property
    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows)

    @property
    def episodes(self) -> EpisodeView:
        """The kept episodes so far, in completion order (a fixed-length view; see
        `EpisodeView`). Those no longer in memory are read back from the run's folder."""
        with self._lock:
            length = self._writer.table.total
        return EpisodeView(self._source, length, self.policy.describe())

    @property
    def recent_episodes(self) -> list[Episode]:
        """The last `recent` episodes played, kept or not, newest last."""
        with self._lock:
            return list(self._recent)

    @property
    def played(self) -> int:
        """Episodes recorded so far, kept or not."""
        with self._lock:
            return self._played

    def _in_memory(self, position: int) -> Episode | None:
        with self._lock:
            first = self._writer.table.total - len(self._kept)
            return self._kept[position - first] if position >= first else None

    def _attach(self, episode: Episode) -> Episode:
        """An episode read back from disk, with the environment and tokenizers of this run."""
        environment, tokenizers = self._context.get(episode.env, (None, {}))
        return dataclasses.replace(episode, environment=environment, tokenizers=tokenizers)

    def on_event(self, observer: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call `observer(kind, payload)` for every "metrics" row, "episode" and event (such as
        "evaluation"); returns an unsubscribe function."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def _emit(self, kind: str, payload: Any) -> None:
        for observer in list(self._observers):
            try:
                observer(kind, payload)
            except Exception:
                self._observers.remove(observer)
                name = getattr(observer, "__qualname__", repr(observer))
                warnings.warn(
                    f"observer {name} raised on a {kind!r} event and was switched off; "
                    f"training goes on.\n{traceback.format_exc()}",
                    RuntimeWarning,
                    stacklevel=2,
                )


def _trajectory_html(traj: Trajectory) -> str:
    return Episode.from_trajectory(traj).debugger()._repr_html_()


register_html_view(_trajectory_html)
