"""Where every drawn sample stands, so that a checkpoint knows the ones not yet accounted for.

A sample is *open* from the moment a worker draws it from its stream until a metrics row of
every policy it was drawn for accounts for it: trained in that row's step, or dropped by a rule
the row names ("filtered": every reward of the group was equal and the algorithm filters such
groups; "failed": fewer than two of its episodes scored, which failed episodes cause; "stale":
past the staleness bound at pop; "unused": the policy made no turn in it; a sample the
open-samples sampler skips, `sampling.OpenSamples`, counts as "filtered"). The row and its line
in samples.jsonl account for them, and only then does the sample stop being open for that
policy; this happens in the same step of the event loop as the row is recorded, so the rows on
record and the open samples always add up to every sample drawn.

A row holds counts only (`samples_trained`: how many; `samples_dropped`: how many per reason), so
its size does not grow with what was dropped: a run whose task is learned drops thousands of
tied groups a step. The names themselves go to the run folder's samples.jsonl beside the row,
in a compact form (`compact`): per stream, runs of consecutive positions as [start, stop)
pairs. Dropped samples mostly come in long runs (every sample drawn while the rest of a batch
fills), so a line stays small; `expand` gives the names back, in stream order, each as often as
it was accounted for (a name accounted twice shows twice).

A checkpoint keeps the open samples (`pending`): the ones in flight, in a buffer, or in a
batch not yet trained. A resumed run plays them first, in stream order, instead of skipping
them with the rest of the stream (they would never be trained, and long episodes, the likeliest
to be in flight, would be the ones lost).

A sample is named by its place in the run's streams, "<stream>:<position>" (stream: the index
of the wired environment; position: 0 for the first sample it yielded), the same before and
after a resume. Episodes carry that name (`Trajectory.sample_id`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SampleLedger", "REASONS", "sample_id", "parse_sample_id", "compact", "expand"]

REASONS = ("filtered", "failed", "stale", "unused")
"""Why a sample was dropped without training (keys of a row's `samples_dropped`)."""


def sample_id(stream: int, position: int) -> str:
    """The name of the `position`-th sample (from 0) of the `stream`-th wired environment."""
    return f"{stream}:{position}"


def parse_sample_id(name: str) -> tuple[int, int]:
    """(stream, position) of a `sample_id`."""
    stream, position = name.split(":")
    return int(stream), int(position)


def compact(names: Iterable[str]) -> dict[str, list[list[int]]]:
    """Sample names as runs of consecutive positions per stream: {"<stream>": [[start, stop],
    ...]} (stop exclusive), streams and runs in order. A name given twice is kept twice (a run
    of its own), so `expand(compact(names))` is `names` sorted, duplicates included.

    >>> compact(["0:4", "0:2", "0:3", "1:0", "0:7"])
    {'0': [[2, 5], [7, 8]], '1': [[0, 1]]}
    """
    by_stream: dict[int, list[int]] = {}
    for name in names:
        stream, position = parse_sample_id(name)
        by_stream.setdefault(stream, []).append(position)
    runs: dict[str, list[list[int]]] = {}
    for stream in sorted(by_stream):
        mine: list[list[int]] = []
        for position in sorted(by_stream[stream]):
            if mine and mine[-1][1] == position:
                mine[-1][1] = position + 1
            else:
                mine.append([position, position + 1])
        runs[str(stream)] = mine
    return runs


def expand(runs: Mapping[str, Iterable[Sequence[int]]]) -> list[str]:
    """The sample names of a `compact` form, in stream order."""
    return [sample_id(int(stream), position) for stream in sorted(runs, key=int)
            for start, stop in runs[stream] for position in range(int(start), int(stop))]


@dataclass
class _Open:
    sample: Mapping[str, Any]
    waiting: set[str]
    """Policies whose rows have not accounted for it yet."""


@dataclass
class SampleLedger:
    """The open samples of a run, and what each policy's next row will report."""

    _open: dict[str, _Open] = field(default_factory=dict)
    _trained: dict[str, list[str]] = field(default_factory=dict)
    _dropped: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def drawn(self, name: str, sample: Mapping[str, Any], policies: Iterable[str]) -> None:
        """A worker took sample `name` from its stream, for `policies`."""
        self._open[name] = _Open(sample, set(policies))

    def dropped(self, policy: str, name: str, reason: str) -> None:
        """`policy` will not train sample `name`, for `reason` (one of REASONS)."""
        if name:
            self._dropped.setdefault(policy, {}).setdefault(reason, []).append(name)

    def forget(self, policy: str, name: str) -> None:
        """`policy` is done (it writes no more rows): it no longer waits for sample `name`."""
        self._settle(policy, [name])

    def take(self, policy: str, trained: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """What `policy`'s row accounts for, whose step trained the samples `trained`: those, and
        the samples it dropped since its last row; all of them stop being open for it.

        Returns:
            (the row's columns: `samples_trained`, a count, and `samples_dropped`, a count per
            reason; the names for samples.jsonl: {"trained": compact, "dropped": {reason:
            compact}}).
        """
        names = [n for n in trained if n]
        dropped = self._dropped.pop(policy, {})
        self._settle(policy, names + [n for group in dropped.values() for n in group])
        columns = {"samples_trained": len(names),
                   "samples_dropped": {reason: len(group) for reason, group in dropped.items()}}
        record = {"trained": compact(names),
                  "dropped": {reason: compact(group) for reason, group in dropped.items()}}
        return columns, record

    def pending(self) -> list[dict[str, Any]]:
        """The open samples, in stream order, as JSON: {"sample_id", "sample"} where "sample" is
        None for a sample that is not plain JSON (a resumed run draws it again from its
        stream)."""
        return [{"sample_id": name, "sample": _plain(self._open[name].sample)}
                for name in sorted(self._open, key=parse_sample_id)]

    def __len__(self) -> int:
        return len(self._open)

    def _settle(self, policy: str, names: Iterable[str]) -> None:
        for name in names:
            entry = self._open.get(name)
            if entry is None:
                continue
            entry.waiting.discard(policy)
            if not entry.waiting:
                del self._open[name]


def _plain(sample: Mapping[str, Any]) -> dict[str, Any] | None:
    """The sample as it reads back from JSON, or None when JSON would change it."""
    try:
        text = json.dumps(dict(sample), allow_nan=False)
    except (TypeError, ValueError):
        return None
    back = json.loads(text)
    return back if back == dict(sample) else None
