"""The step-through episode debugger: every generate call and tool call of one episode, in order.

    dbg = run.episodes[3].show()                  # a recorded episode (displayed, and returned)
    dbg = ab.debug(env, sample, solver=policy)    # a fresh episode, played now (notebook/debug.py)
    dbg.forward(); dbg.back(); dbg.goto(2)        # each returns the step it lands on
    dbg.run_until(lambda s: s.kind == "tool" and s.result is False)
    fixed = dbg.edit(0, "7").rescore()            # the episode played again with turn 0 saying "7"
    fixed.rewards                                 # what the environment makes of that
    dbg.export_html("episode.html")               # one file that steps without a kernel

The steps are each generate turn and each tool call in the order the episode made them, then a
final "reward" step. `rescore` re-runs the environment's own `episode()` (see
astranb.notebook.replay: recorded turns before the edit, the edited text, fresh samples or
recorded replays after it; tools are called again) and returns a new debugger; this one keeps its
steps and edits.

This module is the core and imports neither ipywidgets nor plotly; `astranb.notebook.widgets` puts
buttons on it, `astranb.notebook.viewer` renders it as HTML.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyio.from_thread import start_blocking_portal

from ..types import agent_depth, jsonable
from . import viewer
from .display import cell_number, display_mode, in_kernel, publish
from .replay import replay

if TYPE_CHECKING:  # Episode.debugger() opens this module: it reads episodes, never imports them
    from ..environments.base import Environment
    from ..session.policy import Policy
    from ..session.recorder import Episode

__all__ = ["EpisodeDebugger", "Step"]


@dataclass(frozen=True, repr=False)
class Step:
    """One step of an episode: a generate turn, a tool call, or the final rewards."""

    index: int
    """Position among the episode's steps."""
    kind: str
    """"generate", "tool" or "reward"."""
    role: str = ""
    """generate: the role that made the call."""
    policy: str = ""
    """generate: the policy wired to that role."""
    turn: int = -1
    """generate: index of the turn among the generate calls (what `edit` takes); else -1."""
    prompt: str = ""
    """generate: the prompt text."""
    completion: str = ""
    """generate: the completion text."""
    token_ids: tuple[int, ...] = ()
    """generate: completion token ids."""
    tokens: tuple[str, ...] = ()
    """generate: each completion token decoded alone ("#id" without a tokenizer)."""
    logprobs: tuple[float | None, ...] = ()
    """generate: logprob of each token under the sampling weights (None: unknown, e.g. edited)."""
    versions: tuple[int | None, ...] = ()
    """generate: weight version that produced each token (None: unknown)."""
    finish_reason: str = ""
    """generate: "stop", "length", or "edited"."""
    origin: str = ""
    """generate: "sampled" (by a model in this episode), "edited", or "replayed" (by rescore)."""
    tool: str = ""
    """tool: the tool's name."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """tool: its arguments by parameter name."""
    result: Any = None
    """tool: what it returned."""
    error: str | None = None
    """tool: "Type: message" if it raised; reward: the episode's traceback if it failed."""
    rewards: Mapping[str, float] = field(default_factory=dict)
    """reward: reward per role."""
    note: str = ""
    """Why this step differs from the recording (rescore), or the rewards before the edit."""
    extends: int = -1
    """generate: the earlier turn whose prompt + completion this prompt starts with, token for
    token (a conversation kept as sampled; trained as one sequence), or -1."""
    new_prompt: str = ""
    """generate: the prompt text after that turn's tokens (the observation), when it extends."""
    mask: str = ""
    """generate: the loss mask of the turn's tokens, in words."""
    agent: str = ""
    """generate: the sub-agent that made the call ("" the episode's own agent; "0", "0.1", ...
    the agents `ctx.spawn` started: the episode tree)."""

    @property
    def title(self) -> str:
        """A one-line label: "turn 0 solver", "tool check", "rewards"."""
        if self.kind == "generate":
            return f"turn {self.turn} {self.role}" + (f" @{self.agent}" if self.agent else "")
        return f"tool {self.tool}" if self.kind == "tool" else "rewards"

    def to_json(self) -> dict[str, Any]:
        """The step as JSON values (what the HTML viewer embeds)."""
        return jsonable({name: getattr(self, name) for name in self.__dataclass_fields__})

    def render(self) -> str:
        """The step as text."""
        if self.kind == "generate":
            return _render_generate(self)
        if self.kind == "tool":
            args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
            outcome = f"raised {self.error}" if self.error else f"-> {self.result!r}"
            return f"[{self.index}] tool {self.tool}({args}) {outcome}"
        lines = [f"[{self.index}] rewards {dict(self.rewards)}" if self.error is None
                 else f"[{self.index}] FAILED:\n    " + self.error.strip().replace("\n", "\n    ")]
        return "\n".join(lines + ([f"    ({self.note})"] if self.note else []))

    def __repr__(self) -> str:
        return self.render()


class EpisodeDebugger:
    """Steps through one episode: `forward`, `back`, `goto`, `run_until`, `edit`, `rescore`.

    Args:
        episode: the recorded episode (`run.episodes[i]`, or what `debug` played).
        policies: role -> policy; with them `rescore` samples the turns after an edit afresh
            (without: it replays their recorded completions).
        previous: the debugger this one was re-scored from (its rewards are shown as "before").

    Example:
        >>> dbg = run.episodes[0].debugger()
        >>> dbg.run_until(lambda s: s.kind == "reward").rewards
        {'solver': 0.0}
    """

    def __init__(self, episode: Episode, policies: Mapping[str, Policy] | None = None, *,
                 previous: EpisodeDebugger | None = None):
        self.episode = episode
        self._policies = dict(policies or {})
        self._tokenizers = {**episode.tokenizers,
                            **{p.name: p.tokenizer for p in self._policies.values()}}
        before = dict(previous.episode.rewards) if previous is not None else None
        self._steps = _build_steps(episode, self._tokenizers, before)
        self._position = 0
        self._edits: dict[int, str] = {}

    # -- where we are ----------------------------------------------------------------------------
    @property
    def steps(self) -> list[Step]:
        """Every step, in the order the episode made them (the reward step last)."""
        return list(self._steps)

    @property
    def position(self) -> int:
        """Index of the current step."""
        return self._position

    @property
    def current(self) -> Step:
        """The current step."""
        return self._steps[self._position]

    @property
    def rewards(self) -> dict[str, float]:
        """The episode's reward per role ({} if it failed)."""
        return dict(self.episode.rewards)

    @property
    def edits(self) -> dict[int, str]:
        """Turn index -> edited completion, waiting for `rescore`."""
        return dict(self._edits)

    # -- moving ----------------------------------------------------------------------------------
    def forward(self) -> Step:
        """Go to the next step (stays on the last one) and return it."""
        return self.goto(min(self._position + 1, len(self._steps) - 1))

    def back(self) -> Step:
        """Go to the previous step (stays on the first one) and return it."""
        return self.goto(max(self._position - 1, 0))

    def goto(self, index: int) -> Step:
        """Go to step `index` (negative counts from the end) and return it.

        Raises:
            IndexError: no such step.
        """
        n = len(self._steps)
        if not isinstance(index, int) or not -n <= index < n:
            raise IndexError(f"step {index!r} does not exist; this episode has {n} steps "
                             f"(0..{n - 1}, or -1 for the last)")
        self._position = index % n
        return self.current

    def run_until(self, predicate: Callable[[Step], bool]) -> Step:
        """Go forward to the first step after the current one for which `predicate(step)` is
        true, and return it.

        Raises:
            LookupError: no later step matches (the position does not change).
        """
        for step in self._steps[self._position + 1:]:
            if predicate(step):
                return self.goto(step.index)
        name = getattr(predicate, "__name__", repr(predicate))
        raise LookupError(f"no step after step {self._position} (of {len(self._steps)}) "
                          f"matches {name}; still at step {self._position}")

    # -- editing ---------------------------------------------------------------------------------
    def edit(self, turn: int, completion: str) -> EpisodeDebugger:
        """Replace the completion of generate turn `turn` (see `Step.turn`) for the next `rescore`.

        Returns:
            This debugger, so `dbg.edit(0, "7").rescore()` reads as one action.

        Raises:
            IndexError: the episode has no such turn.
            TypeError: `completion` is not text.
        """
        turns = len(self.episode.turns)
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < turns:
            raise IndexError(f"turn {turn!r} does not exist; this episode made {turns} generate "
                             f"call(s) (turns 0..{turns - 1}). edit() takes a turn index "
                             f"(step.turn), not a step index")
        if not isinstance(completion, str):
            raise TypeError(f"the edited completion must be text, got {type(completion).__name__}")
        self._edits[turn] = completion
        return self

    def rescore(self, env: Environment | None = None) -> EpisodeDebugger:
        """Play the episode again with the edits and return a debugger of the new episode.

        Turns before the first edit return their recorded completions, edited turns the edited
        text, later turns are sampled afresh when this debugger has policies (else replayed);
        tools are called again, so the rewards are whatever the environment makes of the edits.
        The new debugger starts at the first edited turn; this one keeps its steps, and its
        pending edits are used up (edit again for another variant).

        Args:
            env: the environment to play (default: the one that recorded the episode).

        Raises:
            ValueError: the episode's environment is not known and `env` was not given.
            ReplayError: the episode needs a turn the recording lacks and no policy can sample it.
        """
        env = env if env is not None else self.episode.environment
        if env is None:
            raise ValueError(
                f"episode {self.episode.index} does not know its environment "
                f"({self.episode.env or 'unnamed'}; episodes read back from a run's folder keep "
                "only its name); pass it: dbg.rescore(env=ab.environments.load(...))")
        edits, self._edits = dict(self._edits), {}
        try:
            played = _call(replay, env, self.episode, edits, self._policies)
        except BaseException:
            self._edits = edits  # nothing was re-scored: keep them
            raise
        # the episode's own class (see the TYPE_CHECKING import above)
        episode = type(self.episode)(
            self.episode.index, self.episode.group, dict(self.episode.sample), played.turns,
            played.rewards, played.error, self.episode.trainer_version, played.tool_calls,
            env.name, env, self._tokenizers)
        new = EpisodeDebugger(episode, self._policies, previous=self)
        first = min(edits, default=None)
        edited = next((s for s in new._steps if s.kind == "generate" and s.turn == first), None)
        if edited is not None:
            new.goto(edited.index)
        return new

    # -- views -----------------------------------------------------------------------------------
    def to_html(self) -> str:
        """One self-contained HTML page (inline CSS and JS, no network) that steps through the
        episode with Prev/Next buttons and the arrow keys."""
        return viewer.document(self._steps, self.title, self._position)

    def export_html(self, path: str | Path) -> Path:
        """Write `to_html()` to `path` (folders created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path

    def step_html(self, index: int | None = None) -> str:
        """HTML of one step (default: the current one), for a widget pane."""
        step = self._steps[self._position if index is None else index]
        # inside an .astranb-dbg root: every rule of viewer.STYLE is scoped to one
        return (viewer.STYLE + '<div class="astranb-dbg">'
                + viewer.step_section(step, len(self._steps), current=True) + "</div>")

    def display(self) -> None:
        """Show the debugger in the current cell: a widget in JupyterLab, the HTML viewer
        headless (papermill, nbmake), the text outside a kernel (see astranb.notebook.display)."""
        self._shown_in = cell_number()
        mode = display_mode()
        if not in_kernel() or mode == "none":
            print(repr(self))
            return
        if mode == "widgets":
            try:
                from .widgets import debugger_widget
            except ImportError:  # no notebook extra: the HTML viewer steps too
                pass
            else:
                from IPython.display import display

                display(debugger_widget(self))
                return
        publish({"text/html": self._repr_html_(), "text/plain": repr(self)})

    def _ipython_display_(self) -> None:
        # `episode.show()` as a cell's last expression: it displayed itself already
        if getattr(self, "_shown_in", None) is None or self._shown_in != cell_number():
            self.display()

    def _repr_html_(self) -> str:
        return viewer.fragment(self._steps, self.title, self._position)

    def __repr__(self) -> str:
        lines = [self.title]
        for step in self._steps:
            marker = ">" if step.index == self._position else " "
            lines.append(marker + " " + step.render().replace("\n", "\n  "))
        if self._edits:
            lines.append(f"  pending edits (call rescore()): {self._edits}")
        return "\n".join(lines)

    @property
    def title(self) -> str:
        """What episode this is: environment, index, group, sample."""
        e = self.episode
        env = f"{e.env} " if e.env else ""
        which = (f"{env}episode {e.index} (group {e.group})" if e.index >= 0
                 else f"fresh {env}episode")
        return f"{which}, sample {dict(e.sample)}"


# -- internals -------------------------------------------------------------------------------------

def _call(fn, *args):
    """Run `fn(*args)` to completion on an event loop of its own, in a background thread (like
    the Session's), so it works the same from a script and from a notebook cell whose thread
    already runs a loop. Engines take requests from any thread."""
    with start_blocking_portal("asyncio") as portal:
        return portal.call(fn, *args)


def _build_steps(episode: Episode, tokenizers: Mapping[str, Any],
                 before: Mapping[str, float] | None) -> tuple[Step, ...]:
    """Tool calls and turns in call order (a tool call at position p came after p turns)."""
    tools = sorted(episode.tool_calls, key=lambda c: c["position"])  # stable: call order kept
    steps: list[Step] = []
    for turn, record in enumerate(episode.turns):
        steps += [_tool_step(len(steps) + k, c)
                  for k, c in enumerate(c for c in tools if c["position"] == turn)]
        tokenizer = tokenizers.get(record["policy"])
        step = _generate_step(len(steps), turn, record, tokenizer)
        steps.append(_with_mask(step, record, episode.turns[:turn], tokenizer))
    late = [c for c in tools if c["position"] >= len(episode.turns)]
    steps += [_tool_step(len(steps) + k, c) for k, c in enumerate(late)]
    note = f"before the edit: {dict(before)}" if before is not None else ""
    steps.append(Step(len(steps), "reward", rewards=dict(episode.rewards), error=episode.error,
                      note=note))
    return tuple(steps)


def _generate_step(index: int, turn: int, record: Mapping[str, Any], tokenizer) -> Step:
    ids = tuple(int(t) for t in record["completion_ids"])
    pad = lambda values: tuple(values[:len(ids)]) + (None,) * (len(ids) - len(values))  # noqa: E731
    return Step(
        index, "generate", role=record["role"], policy=record["policy"], turn=turn,
        prompt=record["prompt"], completion=record["completion"], token_ids=ids,
        tokens=tuple(_token_text(tokenizer, t) for t in ids),
        logprobs=pad(list(record["logprobs"])), versions=pad(list(record["versions"])),
        finish_reason=record["finish_reason"], origin=record.get("origin", "sampled"),
        note=record.get("note", ""), agent=record.get("agent", ""),
    )


def _with_mask(step: Step, record: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]],
               tokenizer) -> Step:
    """Which earlier turn the prompt extends (the latest one whose tokens it starts with) and
    what the loss mask is over the turn's tokens."""
    prompt = list(record["prompt_ids"])
    completion = len(record["completion_ids"])
    extends, carried = -1, 0
    for j in range(len(earlier) - 1, -1, -1):
        before = list(earlier[j]["prompt_ids"]) + list(earlier[j]["completion_ids"])
        if earlier[j]["policy"] == record["policy"] and prompt[: len(before)] == before:
            extends, carried = j, len(before)
            break
    mask = f"prompt {len(prompt)} tokens: loss 0; completion {completion} tokens: loss 1"
    new_prompt = ""
    if extends >= 0:
        mask = (f"prompt {len(prompt)} tokens = turn {extends}'s {carried} tokens as sampled + "
                f"{len(prompt) - carried} new (loss 0); completion {completion} tokens: loss 1")
        new = prompt[carried:]
        new_prompt = (tokenizer.decode(new, skip_special_tokens=False) if tokenizer is not None
                      else " ".join(f"#{t}" for t in new))
    return replace(step, extends=extends, new_prompt=new_prompt, mask=mask)


def _tool_step(index: int, call: Mapping[str, Any]) -> Step:
    return Step(index, "tool", tool=call["name"], args=dict(call["args"]), result=call["result"],
                error=call.get("error"))


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"#{token_id}"
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except Exception:  # a tokenizer that cannot decode a lone id: show the id
        return f"#{token_id}"


def _render_generate(step: Step) -> str:
    versions = sorted({v for v in step.versions if v is not None})
    how = step.origin
    if step.finish_reason != step.origin:
        how += f", {step.finish_reason}"
    who = f"sub-agent {step.agent}: " if step.agent else ""
    indent = "  " * agent_depth(step.agent)
    head = (f"{indent}[{step.index}] turn {step.turn} {who}{step.role} -> {step.policy} "
            f"({how}, versions {versions or '?'})")
    tokens = " ".join(f"{t!r}({_lp(lp)}, v{v if v is not None else '?'})"
                      for t, lp, v in zip(step.tokens, step.logprobs, step.versions, strict=True))
    if step.extends >= 0:
        prompt = f"    prompt:     turn {step.extends}'s tokens + {step.new_prompt!r}"
    else:
        prompt = f"    prompt:     {step.prompt!r}"
    lines = [head, prompt, f"    completion: {step.completion!r}"]
    if step.mask:
        lines.append(f"    loss mask:  {step.mask}")
    if tokens:
        lines.append(f"    tokens:     {tokens}")
    if step.note:
        lines.append(f"    note: {step.note}")
    return "\n".join(lines)


def _lp(logprob: float | None) -> str:
    return "?" if logprob is None or not math.isfinite(logprob) else f"{logprob:.2f}"
