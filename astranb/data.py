"""Datasets for environments: Hugging Face datasets or local files, as endless seeded streams.

An environment that learns from a dataset (math word problems, competition problems) takes a
`DataSource`. It reads a Hugging Face `datasets.Dataset` or `DatasetDict`, a list of dicts, or
local `.jsonl` / `.json` / `.parquet` files, renames the dataset's columns to the fields the
environment reads (`columns`), and checks when it is built that those columns exist, so a typo
fails in the notebook cell that made the source, not in the middle of a run.

    source = DataSource("gsm8k_train.jsonl", columns={"question": "question"}, test_size=0.1)
    source.splits                           # ("train", "test")
    sample = next(source.stream("train", seed=0))
    sample["question"], sample["_epoch"], sample["_index"]
    source.rows("test", n=100)              # the first 100 held-out rows, always the same

Training reads `stream(split, seed)`: every row once per epoch, in an order drawn from
(seed, epoch), forever; each sample carries `_epoch` (0-based) and `_index` (the row's position
in its split). Evaluation reads `rows(split, n)` or `stream(split, shuffle=False)`: the split in
its stored order. `datasets` and `pyarrow` are imported only when a Dataset object or a parquet
file is given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DataSource", "DataError"]

_FILE_TYPES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A dataset that cannot serve an environment: a missing column, split or file, or no rows."""


class DataSource:
    """Rows of one or more splits, renamed to an environment's fields and streamed by seed.

    Args:
        data: a `datasets.Dataset` (one split, "train"), a `datasets.DatasetDict` (its splits), a
            path to a `.jsonl`, `.json` (a list of objects, or JSON lines) or `.parquet` file, a
            list of dicts, or a dict split name -> any of those.
        columns: environment field -> dataset column (`{"question": "problem"}`). A column may
            reach into nested values with dots: `"reward_model.ground_truth"`, `"prompt.0.content"`.
            Fields not named here keep their column's name.
        required: fields every sample must have (checked on every split when the source is built;
            a field missing from `columns` is looked up under its own name).
        test_size: for data with one split only: hold out this fraction (a float in (0, 1)) or
            number of rows (an int) as split "test", drawn once with `holdout_seed`.
        holdout_seed: seed of that draw (the same seed holds out the same rows).

    Raises:
        DataError: a column or file that does not exist (the message lists what does), an empty
            split, or a `test_size` that leaves a split empty.
    """

    def __init__(self, data: Any, *, columns: Mapping[str, str] | None = None,
                 required: Sequence[str] = (), test_size: float | int | None = None,
                 holdout_seed: int = 0):
        self.columns = dict(columns or {})
        self.required = tuple(required)
        self._splits = _load_splits(data)
        if test_size is not None:
            self._splits = _hold_out(self._splits, test_size, holdout_seed)
        for split, table in self._splits.items():
            if len(table) == 0:
                raise DataError(f"split {split!r} has no rows; give a dataset with at least one")
            self._check_columns(split, table)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {len(table)}" for name, table in self._splits.items())
        return f"DataSource({sizes}; columns {self.columns or 'as stored'})"

    @property
    def splits(self) -> tuple[str, ...]:
        """Names of the splits, in the order the data gave them."""
        return tuple(self._splits)

    def __len__(self) -> int:
        """Rows in the "train" split (or the first split, where there is no "train")."""
        return len(self._table("train" if "train" in self._splits else self.splits[0]))

    def size(self, split: str) -> int:
        """Number of rows in `split`."""
        return len(self._table(split))

    def stream(self, split: str = "train", seed: int = 0, *,
               shuffle: bool = True) -> Iterator[dict[str, Any]]:
        """Every row of `split`, epoch after epoch, forever.

        Each epoch visits every row once, in an order drawn from (seed, epoch) (`shuffle=False`:
        the stored order every epoch). Samples carry `_epoch` (0-based) and `_index` (the row's
        position in the split).
        """
        table = self._table(split)
        order = list(range(len(table)))
        epoch = 0
        while True:
            if shuffle:
                random.Random(f"{seed}/{epoch}").shuffle(order)
            for index in order:
                yield self._sample(table, index, epoch)
            epoch += 1

    def rows(self, split: str = "test", n: int | None = None) -> list[dict[str, Any]]:
        """The first `n` rows of `split` in stored order (all of them for None), as samples."""
        table = self._table(split)
        count = len(table) if n is None else min(n, len(table))
        if count < 0:
            raise ValueError(f"n must be >= 0 or None, got {n}")
        return [self._sample(table, i, 0) for i in range(count)]

    def _table(self, split: str) -> _Table:
        try:
            return self._splits[split]
        except KeyError:
            raise DataError(f"no split {split!r}; this data has {list(self._splits)}. For data "
                            "with one split, DataSource(..., test_size=0.1) holds out a "
                            "'test' split") from None

    def _fields(self) -> dict[str, str]:
        return {**{field: field for field in self.required}, **self.columns}

    def _sample(self, table: _Table, index: int, epoch: int) -> dict[str, Any]:
        row = dict(table.row(index))
        for field, column in self._fields().items():
            value = _lookup(row, column)
            row.pop(column, None)
            row[field] = value
        row["_epoch"], row["_index"] = epoch, index
        return row

    def _check_columns(self, split: str, table: _Table) -> None:
        first = table.row(0)
        for field, column in self._fields().items():
            top = column if column in table.columns else column.split(".")[0]
            try:
                if top not in table.columns:
                    raise LookupError("no such column")
                _lookup(first, column)
            except LookupError as missing:
                hint = (f"pass columns={{{field!r}: <one of those>}}" if field == column
                        else f"fix columns[{field!r}]")
                raise DataError(
                    f"field {field!r} reads column {column!r}, but {missing.args[0]}; split "
                    f"{split!r} has columns {sorted(table.columns)}: {hint}") from None


class _Table:
    """One split's rows: a list of dicts, or a Hugging Face Dataset read row by row."""

    def __init__(self, rows: Any, columns: Sequence[str]):
        self._rows = rows
        self.columns = tuple(columns)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> Mapping[str, Any]:
        return self._rows[index]

    def take(self, indices: Sequence[int]) -> _Table:
        if hasattr(self._rows, "select"):  # a Dataset: an indices mapping, no copy
            return _Table(self._rows.select(indices), self.columns)
        return _Table([self._rows[i] for i in indices], self.columns)


def _load_splits(data: Any) -> dict[str, _Table]:
    if isinstance(data, Mapping):  # a DatasetDict is a dict too
        if not data:
            raise DataError("no splits given; pass a dataset, a file or a dict split -> data")
        return {str(split): _load_table(part, f"split {split!r}") for split, part in data.items()}
    return {"train": _load_table(data, "data")}


def _load_table(data: Any, what: str) -> _Table:
    if isinstance(data, (str, Path)):
        return _read_file(Path(data))
    if _is_hf_dataset(data):
        return _Table(data, data.column_names)
    if isinstance(data, Sequence) and all(isinstance(row, Mapping) for row in data):
        return _rows_table(list(data), what)
    kind = type(data).__name__
    if kind in ("IterableDataset", "IterableDatasetDict"):
        raise DataError(f"{what} is a streaming {kind}; load it without streaming=True "
                        "(rows are read by index)")
    raise DataError(f"{what} is of type {kind}; give a datasets.Dataset or DatasetDict, a path "
                    f"to a {'/'.join(_FILE_TYPES)} file, a list of dicts, or a dict split -> one "
                    "of those")


def _is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets.") and hasattr(data, "column_names") \
        and hasattr(data, "select")


def _read_file(path: Path) -> _Table:
    if path.suffix not in _FILE_TYPES:
        raise DataError(f"{path} is not a {', '.join(_FILE_TYPES)} file; convert it, or load it "
                        "with datasets.load_dataset and pass the Dataset")
    if not path.is_file():
        raise DataError(f"no file {path}; check the path (relative paths start at {Path.cwd()})")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return _rows_table(pq.read_table(path).to_pylist(), str(path))
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return _rows_table(json.loads(text), str(path))
    return _rows_table(_json_lines(text, path), str(path))


def _json_lines(text: str, path: Path) -> list[Any]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number} is not a JSON object ({error.msg}); write one "
                                "object per line (or a .json file holding one list)") from None
    return rows


def _rows_table(rows: list[Any], what: str) -> _Table:
    for number, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{what}: row {number} is of type {type(row).__name__}, not an object; "
                            "every row must map column names to values")
    columns = set(rows[0]) if rows else set()
    for row in rows[1:]:
        columns &= set(row)  # a column is usable only where every row has it
    return _Table(rows, sorted(columns))


def _hold_out(splits: dict[str, _Table], test_size: float | int,
              seed: int) -> dict[str, _Table]:
    if list(splits) != ["train"]:
        raise DataError(f"test_size holds out part of a single split, but this data already has "
                        f"splits {list(splits)}; use them, or drop test_size")
    table = splits["train"]
    n = len(table)
    if isinstance(test_size, float) and 0 < test_size < 1:
        held = round(n * test_size)
    elif isinstance(test_size, int) and not isinstance(test_size, bool) and test_size > 0:
        held = test_size
    else:
        raise DataError(f"test_size must be a fraction in (0, 1) or a number of rows >= 1, "
                        f"got {test_size!r}")
    if not 0 < held < n:
        raise DataError(f"test_size={test_size!r} holds out {held} of {n} rows, leaving a split "
                        "empty; give a size that leaves rows in both")
    chosen = set(random.Random(f"holdout/{seed}").sample(range(n), held))
    return {"train": table.take([i for i in range(n) if i not in chosen]),
            "test": table.take(sorted(chosen))}


def _lookup(row: Mapping[str, Any], column: str) -> Any:
    """`row[column]`, where dots in `column` step into nested dicts and lists."""
    if column in row:
        return row[column]
    value: Any = row
    walked: list[str] = []
    for part in column.split("."):
        try:
            if isinstance(value, Mapping):
                value = value[part]
            elif isinstance(value, Sequence) and not isinstance(value, str):
                value = value[int(part)]
            else:
                raise LookupError
        except (LookupError, ValueError):
            where = f"{'.'.join(walked)!r} has no {part!r}" if walked else "no such column"
            raise LookupError(where) from None
        walked.append(part)
    return value
