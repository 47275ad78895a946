"""What a run leaves behind: one metrics row per (policy, step), every episode, and events.

The recorder is written from the session's event loop and read from anywhere (the notebook's
thread, widgets), so it guards its lists with a lock and hands out copies. Rows, episodes and
events are also appended to JSON-lines files in the run's folder as they arrive, so a crashed
kernel loses nothing that was already collected. Events are what happens outside the step
rhythm: a trainer rollback, or a held-out evaluation window ("evaluation", see `evaluations`).
Observers (dashboards, progress bars) subscribe with `on_event`; an observer that raises is
reported with its name and then switched off, never allowed to stop training.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .types import Trajectory, Turn, agent_depth, jsonable, register_html_view

if TYPE_CHECKING:
    from .environments.base import Environment
    from .notebook.debugger import EpisodeDebugger
    from .policy import Policy

__all__ = ["Episode", "Recorder", "turn_record"]


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
        from .notebook.debugger import EpisodeDebugger

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
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Episode:
        """An episode from one line of episodes.jsonl (it knows no environment or tokenizer:
        pass `rescore(env=...)` to re-score it)."""
        return cls(int(data["index"]), int(data["group"]), dict(data["sample"]),
                   tuple(data["turns"]), dict(data["rewards"]), data.get("error"),
                   int(data.get("trainer_version", 0)), tuple(data.get("tool_calls") or ()),
                   str(data.get("env", "")), truncated=data.get("truncated"),
                   counts={str(k): int(v) for k, v in (data.get("counts") or {}).items()})

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
        # episodes are many and small: written in 1 MB blocks, flushed with every metrics row
        # (a syscall per episode cost the event loop more than playing the episode on a small
        # model); metrics.jsonl is flushed per row
        self._episodes_file = open(directory / "episodes.jsonl", "a", encoding="utf-8",
                                   buffering=1 << 20)
        self._events: list[dict[str, Any]] = []
        self._events_path = directory / "events.jsonl"

    # -- writing (event loop) ------------------------------------------------------------------
    def add_row(self, row: Mapping[str, Any]) -> None:
        row = dict(row)
        with self._lock:
            self._rows.append(row)
            self._episodes_file.flush()  # every episode that led up to this row is on disk
            self._metrics_file.write(_json_line(row) + "\n")
            self._metrics_file.flush()
        self._emit("metrics", row)

    def add_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Something that happened outside the step rhythm (a trainer rollback, a failover)."""
        event = {"kind": kind, **payload}
        with self._lock:
            self._events.append(event)
            with open(self._events_path, "a", encoding="utf-8") as f:
                f.write(_json_line(event) + "\n")
        self._emit(kind, event)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """The held-out evaluation windows recorded so far ("evaluation" events), in order."""
        with self._lock:
            return [e for e in self._events if e["kind"] == "evaluation"]

    def add_episode(self, traj: Trajectory, trainer_version: int, *,
                    environment: Environment | None = None,
                    tokenizers: Mapping[str, Any] | None = None) -> Episode:
        """Record a finished episode.

        Args:
            traj: the trajectory.
            trainer_version: version of the first policy's trainer now.
            environment: the environment that played it (kept in memory so the debugger can
                re-score the episode; never written to disk).
            tokenizers: policy name -> tokenizer (per-token text in the debugger).
        """
        with self._lock:
            episode = Episode.from_trajectory(traj, len(self._episodes), trainer_version,
                                              environment=environment, tokenizers=tokenizers,
                                              decode=self._decode)
            self._episodes.append(episode)
            self._episodes_file.write(_json_line(episode.to_json()) + "\n")
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


def _json_line(value: Any) -> str:
    """One line of strict JSON: NaN and infinities become null (`types.jsonable`). Records are
    JSON-ready already almost always, so the recursive conversion only runs when the fast
    encoder refuses (an episode holds thousands of token ids and logprobs)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(jsonable(value), allow_nan=False)


def _trajectory_html(traj: Trajectory) -> str:
    return Episode.from_trajectory(traj).debugger()._repr_html_()


register_html_view(_trajectory_html)
