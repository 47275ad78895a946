"""The step inspector's record: what sampled train steps trained, kept in the run folder.

`train(inspect_every=N)` (10 by default) has the trainer record step 0 and every N-th step
after it, token by token (training/trace.py: logprobs of the engine and the trainer, advantages,
the loss mask, the token versions, dLoss/dlogp, the algorithm's clipped/dropped/capped masks,
each parameter's gradient norm). Each recorded step is one safetensors file,
`trained-steps/<policy>/step-NNNNNN.safetensors`, whose header holds the step's metrics row
(its numbers and `flags`, `dataflow.loop.silent_flags`) and the text of every token id it
holds, so it reads back without a tokenizer. Bounded: the newest `STEPS_KEPT` per policy stay;
writing one more removes the oldest.

`run.steps` (and `ab.open_run(folder).steps`) is a `StepLog`: a list-like view, oldest step
first; `run.steps[i]` is a `RecordedStep` with its numbers, `text()` for scripts, `show()` in a
notebook and `save_html(path)` (one file, no kernel needed).
"""

from __future__ import annotations

import math
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch

from ..training.trace import StepTrace
from ..types import jsonable
from .folder import RecordWriteError, RunFiles, step_trace_file, step_traces_in, step_traces_of

if TYPE_CHECKING:
    from ..notebook.inspector import StepInspector

__all__ = ["STEPS_KEPT", "StepStore", "StepLog", "RecordedStep"]

STEPS_KEPT = 100
"""Recorded steps kept per policy (the newest)."""

NUMBERS = ("reward", "batch_reward", "loss", "grad_norm", "tokens", "entropy", "clip_frac",
           "m2po_masked_frac", "tis_capped_frac", "cispo_clip_frac", "ratio_mean", "approx_kl",
           "logp_gap_mean", "logp_gap_max", "staleness_mean", "staleness_max",
           "token_version_min", "token_version_max", "trained_groups", "tied_trained",
           "cut_completions", "completions", "step_seconds")
"""The row's numbers a recorded step shows first (those it has)."""


class StepStore:
    """Writes recorded steps into a run folder, keeping the newest `keep` per policy.

    Args:
        directory: the run's folder.
        decode: token ids -> text, per policy name (each token's text goes in the header).
        keep: recorded steps kept per policy (default `STEPS_KEPT`).
    """

    def __init__(self, directory: Path, decode: Mapping[str, Callable[[list[int]], str]],
                 keep: int | None = None):
        self.directory, self._decode = directory, dict(decode)
        self.keep = STEPS_KEPT if keep is None else keep

    def add(self, row: Mapping[str, Any], trace: StepTrace) -> Path:
        """Write the step of metrics row `row`; the oldest of its policy's beyond `keep` go."""
        policy, step = str(row["policy"]), int(row["step"])
        header = {**trace.header, "policy": policy, "step": step, "row": jsonable(dict(row)),
                  "tokens": self._texts(policy, trace)}
        root = step_traces_of(self.directory, policy)
        path = step_trace_file(root, step)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(StepTrace(trace.tensors, header).to_bytes())
            os.replace(tmp, path)
            kept = step_traces_in(root)
            for old in kept[:max(len(kept) - self.keep, 0)]:
                old.unlink(missing_ok=True)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise RecordWriteError(path, error) from error
        return path

    def _texts(self, policy: str, trace: StepTrace) -> dict[str, str]:
        """The text of each distinct token id of the trace (JSON keys are strings)."""
        decode = self._decode.get(policy)
        if decode is None:
            return {}
        ids = torch.unique(trace.tensors["input_ids_B_T"]).tolist()
        return {str(i): decode([int(i)]) for i in ids}


@dataclass(frozen=True, eq=False)
class RecordedStep:
    """One recorded train step: its metrics row, its flags, and what it trained per token."""

    path: Path
    """Its file in the run folder."""
    trace: StepTrace
    """The tensors (`training.trace.StepTrace`) and the header they were stored with."""

    @classmethod
    def read(cls, path: Path) -> RecordedStep:
        return cls(path, StepTrace.from_bytes(path.read_bytes()))

    @property
    def policy(self) -> str:
        return str(self.trace.header.get("policy", ""))

    @property
    def step(self) -> int:
        """The step (the version it trained from; its weights are version step + 1)."""
        return int(self.trace.header.get("step", -1))

    @property
    def row(self) -> dict[str, Any]:
        """The step's metrics row, as `run.metrics` has it."""
        return dict(self.trace.header.get("row") or {})

    @property
    def flags(self) -> list[str]:
        """Why the step silently taught (next to) nothing: "tied", "truncated", "zero_loss",
        "mismatch" (see `dataflow.loop.silent_flags`); [] when it taught."""
        return list(self.row.get("flags") or [])

    @property
    def numbers(self) -> dict[str, float]:
        """The step's headline numbers (loss, grad_norm, clip_frac, ...), those it has."""
        row = self.row
        return {k: row[k] for k in NUMBERS if isinstance(row.get(k), (int, float))}

    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """The algorithm's token masks by name ("clipped", "dropped", "capped")."""
        return self.trace.masks()

    def token_text(self, token_id: int) -> str:
        """A token's text as the policy's tokenizer decodes it, else `<id>`."""
        return str((self.trace.header.get("tokens") or {}).get(str(token_id), f"<{token_id}>"))

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """Per batch row: reward, advantage, trained tokens, token versions, share of the
        step's gradient weight (its tokens' |dLoss/dlogp| over all tokens'), marked tokens per
        mask, mean |trainer - engine| logprob gap."""
        t = self.trace.tensors
        trained_B_T = t["loss_mask_B_T"] > 0
        weight_B = t["grad_logp_B_T"].abs().where(trained_B_T, 0.0).sum(1)
        total = float(weight_B.sum())
        gap_B_T = (t["logp_B_T"] - t["old_logp_B_T"]).abs().where(trained_B_T, 0.0)
        out = []
        for b in range(trained_B_T.shape[0]):
            n = int(trained_B_T[b].sum())
            versions = t["versions_B_T"][b][trained_B_T[b]]
            out.append({
                "row": b, "reward": float(t["rewards_B"][b]),
                "advantage": float(t["advantages_B_T"][b][trained_B_T[b]].mean()) if n else 0.0,
                "tokens": n,
                "versions": sorted({int(v) for v in versions.tolist()}),
                "share": float(weight_B[b]) / total if total > 0 else 0.0,
                "gap_mean": float(gap_B_T[b].sum()) / max(n, 1),
                **{name: int(m[b].sum()) for name, m in self.masks.items()},
            })
        return out

    @cached_property
    def layer_norms(self) -> list[tuple[str, float]]:
        """Gradient norm per layer before clipping (parameters grouped by layer, in model order)."""
        norms: dict[str, float] = {}
        names = self.trace.header.get("parameters") or []
        for name, norm in zip(names, self.trace.tensors["grad_norm_P"].tolist(), strict=True):
            layer = _layer(name)
            norms[layer] = norms.get(layer, 0.0) + norm * norm
        return [(layer, math.sqrt(total)) for layer, total in norms.items()]

    def text(self, rows: int | None = 8, tokens: int = 40) -> str:
        """The step as plain text (scripts, logs): numbers, flags, per-row table, the first
        `rows` rows' trained tokens with their marks, per-layer gradient norms."""
        head = f"step {self.step} of {self.policy!r} ({self.trace.header.get('algorithm', '?')})"
        lines = [head + (f"  FLAGS: {', '.join(self.flags)}" if self.flags else ""),
                 "  " + "  ".join(f"{k} {_number(v)}" for k, v in self.numbers.items())]
        masks = list(self.masks)
        lines.append("  row  reward  advantage  tokens  versions  share  gap   "
                     + "  ".join(masks))
        for r in self.rows:
            versions = "-".join(str(v) for v in (r["versions"][:1] + r["versions"][1:][-1:]))
            lines.append(f"  {r['row']:<4} {r['reward']:<7.3g} {r['advantage']:<+10.3g} "
                         f"{r['tokens']:<7} {versions or '-':<9} {r['share']:<6.1%} "
                         f"{r['gap_mean']:<5.3f} " + "  ".join(f"{r[m]:<{len(m)}}" for m in masks))
        marks = ", ".join(f"{_MARKS[m][0]}token{_MARKS[m][1]} {m}" for m in masks if m in _MARKS)
        lines.append(f"  trained tokens ({marks or 'no marks'}):" if masks else
                     "  trained tokens:")
        for b in range(len(self.rows) if rows is None else min(rows, len(self.rows))):
            lines.append(f"  row {b}: " + self._marked_tokens(b, tokens))
        lines.append("  gradient norm per layer (before clipping):")
        lines += [f"    {layer:<32} {norm:.4g}" for layer, norm in self.layer_norms]
        return "\n".join(lines)

    def _marked_tokens(self, row: int, limit: int) -> str:
        t = self.trace.tensors
        trained = (t["loss_mask_B_T"][row] > 0).nonzero().flatten().tolist()
        masks = {name: m[row] for name, m in self.masks.items() if name in _MARKS}
        out = []
        for position in trained[:limit]:
            text = repr(self.token_text(int(t["input_ids_B_T"][row, position])))[1:-1]
            for name, mask in masks.items():
                if bool(mask[position]):
                    text = _MARKS[name][0] + text + _MARKS[name][1]
            out.append(text)
        more = f" ... (+{len(trained) - limit})" if len(trained) > limit else ""
        return " ".join(out) + more

    def show(self) -> StepInspector:
        """Show the step in the notebook (tokens shaded by advantage, ratio or logprob gap;
        clipped, dropped and capped tokens marked) and return the view."""
        from ..notebook.inspector import StepInspector

        view = StepInspector(self)
        view.display()
        return view

    def save_html(self, path: str | os.PathLike[str]) -> Path:
        """Write the step as one standalone HTML file (no kernel needed)."""
        from ..notebook.inspector import StepInspector

        return StepInspector(self).save_html(path)

    def _repr_html_(self) -> str:
        from ..notebook.inspector import StepInspector

        return StepInspector(self).html()

    def __repr__(self) -> str:
        flags = f", flags={self.flags}" if self.flags else ""
        return f"RecordedStep({self.policy!r}, step={self.step}{flags})"


_MARKS = {"clipped": ("[", "]"), "dropped": ("{", "}"), "capped": ("<", ">")}
"""How `text()` marks a token of each mask."""


def _number(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _layer(name: str) -> str:
    """A parameter's layer: its name up to the layer index ("model.layers.3"), else without
    its last part ("lm_head")."""
    match = re.match(r"(.*?\.\d+)\.", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def _readable(paths: Sequence[Path]) -> Iterator[RecordedStep]:
    """The steps of `paths` still there (a live run's store removes its oldest)."""
    for path in paths:
        try:
            yield RecordedStep.read(path)
        except FileNotFoundError:
            continue


class StepLog(Sequence[RecordedStep]):
    """The recorded steps of a run folder, oldest step first (list-like; each read from its
    file when asked for, so a live run's log grows as it records)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)

    def _paths(self) -> list[Path]:
        return RunFiles(self.directory).step_traces

    def __len__(self) -> int:
        return len(self._paths())

    @overload
    def __getitem__(self, index: int) -> RecordedStep: ...

    @overload
    def __getitem__(self, index: slice) -> list[RecordedStep]: ...

    def __getitem__(self, index: int | slice) -> RecordedStep | list[RecordedStep]:
        if isinstance(index, slice):
            return list(_readable(self._paths()[index]))
        try:
            return RecordedStep.read(self._paths()[index])
        except FileNotFoundError:  # removed by a live run's store meanwhile: list them again
            return RecordedStep.read(self._paths()[index])

    def __iter__(self) -> Iterator[RecordedStep]:
        return _readable(self._paths())

    def at(self, step: int, policy: str | None = None) -> RecordedStep:
        """The recorded step nearest `step` (of `policy`, when given): what a click on a point
        of the dashboard's reward panel opens.

        Raises:
            LookupError: no step of that policy was recorded.
        """
        found = [(abs(int(p.stem.rsplit("-", 1)[1]) - step), p) for p in self._paths()
                 if policy is None or p.parent.name == policy]
        if not found:
            raise LookupError(f"no recorded step{f' of {policy!r}' if policy else ''} in "
                              f"{self.directory}; train(inspect_every=N) records every N-th")
        return RecordedStep.read(min(found, key=lambda pair: (pair[0], pair[1].name))[1])

    def flagged(self) -> list[RecordedStep]:
        """The recorded steps with a flag (see `RecordedStep.flags`)."""
        return [step for step in self if step.flags]

    def __repr__(self) -> str:
        return f"StepLog({len(self)} recorded steps, dir={str(self.directory)!r})"
