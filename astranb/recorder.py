"""What a run leaves behind: one metrics row per (policy, step) and every episode.

The recorder is written from the session's event loop and read from anywhere (the notebook's
thread, widgets), so it guards its lists with a lock and hands out copies. Rows and episodes are
also appended to JSON-lines files in the run's folder as they arrive, so a crashed kernel loses
nothing that was already collected. Observers (dashboards, progress bars) subscribe with
`on_event`; an observer that raises is reported with its name and then switched off, never
allowed to stop training.
"""

from __future__ import annotations

import json
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .types import Trajectory

__all__ = ["Episode", "Recorder"]


@dataclass(frozen=True)
class Episode:
    """A recorded episode, readable without a tokenizer."""

    index: int
    """Order of completion within the run."""
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

    def show(self) -> None:
        """Print the episode turn by turn."""
        print(self.render())

    def render(self) -> str:
        lines = [f"episode {self.index} (group {self.group}) sample={dict(self.sample)}"]
        for i, turn in enumerate(self.turns):
            versions = sorted(set(turn["versions"]))
            lines.append(
                f"  turn {i} [{turn['role']} -> {turn['policy']}, versions {versions}]"
                f"\n    prompt:     {turn['prompt']!r}\n    completion: {turn['completion']!r}"
            )
        lines.append(f"  rewards: {dict(self.rewards)}" if self.error is None else "  FAILED:")
        if self.error:
            lines.append("    " + self.error.strip().replace("\n", "\n    "))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "group": self.group,
            "sample": _jsonable(self.sample),
            "turns": list(self.turns),
            "rewards": dict(self.rewards),
            "error": self.error,
            "trainer_version": self.trainer_version,
        }


class Recorder:
    """Collects a run's metrics rows and episodes, mirrors them to disk, notifies observers.

    Args:
        directory: the run's folder (metrics.jsonl and episodes.jsonl are written there).
        decode: token ids -> text, per policy name (to store readable prompts).
    """

    def __init__(self, directory: Path, decode: Mapping[str, Callable[[list[int]], str]]):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._decode = dict(decode)
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._episodes: list[Episode] = []
        self._observers: list[Callable[[str, Any], None]] = []
        self._metrics_file = open(directory / "metrics.jsonl", "a", encoding="utf-8")
        self._episodes_file = open(directory / "episodes.jsonl", "a", encoding="utf-8")
        self._events: list[dict[str, Any]] = []
        self._events_path = directory / "events.jsonl"

    # -- writing (event loop) ------------------------------------------------------------------
    def add_row(self, row: Mapping[str, Any]) -> None:
        row = dict(row)
        with self._lock:
            self._rows.append(row)
            self._metrics_file.write(json.dumps(_jsonable(row)) + "\n")
            self._metrics_file.flush()
        self._emit("metrics", row)

    def add_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Something that happened outside the step rhythm (a trainer rollback, a failover)."""
        event = {"kind": kind, **payload}
        with self._lock:
            self._events.append(event)
            with open(self._events_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(_jsonable(event)) + "\n")
        self._emit(kind, event)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def add_episode(self, traj: Trajectory, trainer_version: int) -> Episode:
        with self._lock:
            episode = Episode(
                index=len(self._episodes),
                group=traj.group,
                sample=dict(traj.sample),
                turns=tuple(self._turn(t) for t in traj.turns),
                rewards=dict(traj.rewards),
                error=traj.error,
                trainer_version=trainer_version,
            )
            self._episodes.append(episode)
            self._episodes_file.write(json.dumps(episode.to_json()) + "\n")
        self._emit("episode", episode)
        return episode

    def close(self) -> None:
        with self._lock:
            for f in (self._metrics_file, self._episodes_file):
                if not f.closed:
                    f.flush()
                    f.close()

    # -- reading (any thread) ------------------------------------------------------------------
    @property
    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows)

    @property
    def episodes(self) -> list[Episode]:
        with self._lock:
            return list(self._episodes)

    def on_event(self, observer: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call `observer(kind, payload)` for every "metrics" row and "episode"; returns an
        unsubscribe function."""
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

    def _turn(self, turn) -> dict[str, Any]:
        gen = turn.generation
        decode = self._decode.get(turn.policy, lambda ids: "")
        return {
            "role": turn.role,
            "policy": turn.policy,
            "prompt": decode(list(gen.prompt_ids)),
            "completion": gen.text,
            "prompt_ids": list(gen.prompt_ids),
            "completion_ids": list(gen.completion_ids),
            "logprobs": list(gen.logprobs),
            "versions": list(gen.versions),
            "finish_reason": gen.finish_reason,
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
