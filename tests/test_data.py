"""DataSource: local files, Hugging Face datasets in memory, column checks, splits and streams.
Every dataset here is written by the test; nothing is downloaded."""

from __future__ import annotations

import itertools
import json

import pytest

from astranb.data import DataError, DataSource

ROWS = [{"problem": f"{i}+{i}=?", "solution": f"#### {2 * i}", "level": i % 3} for i in range(10)]


def take(stream, n):
    return list(itertools.islice(stream, n))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(params=["jsonl", "json", "json-lines", "parquet", "list", "dataset"])
def source_data(request, tmp_path):
    """ROWS in every form DataSource reads."""
    kind = request.param
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", ROWS)
    if kind == "json":
        (tmp_path / "rows.json").write_text(json.dumps(ROWS))
        return str(tmp_path / "rows.json")
    if kind == "json-lines":  # a .json file holding JSON lines, as Hugging Face writes them
        return write_jsonl(tmp_path / "rows.json", ROWS)
    if kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
        return tmp_path / "rows.parquet"
    if kind == "list":
        return list(ROWS)
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_list(ROWS)


def test_every_form_gives_the_same_renamed_rows(source_data):
    source = DataSource(source_data, columns={"question": "problem", "answer": "solution"})
    assert source.splits == ("train",) and len(source) == 10 and source.size("train") == 10
    first = source.rows("train", n=2)
    assert first == [
        {"question": "0+0=?", "answer": "#### 0", "level": 0, "_epoch": 0, "_index": 0},
        {"question": "1+1=?", "answer": "#### 2", "level": 1, "_epoch": 0, "_index": 1},
    ]
    assert len(source.rows("train")) == 10 and source.rows("train", n=50)[-1]["_index"] == 9


def test_stream_visits_every_row_once_per_epoch_in_a_seeded_order():
    source = DataSource(ROWS)
    samples = take(source.stream("train", seed=3), 30)
    epochs = [samples[0:10], samples[10:20], samples[20:30]]
    for e, epoch in enumerate(epochs):
        assert sorted(s["_index"] for s in epoch) == list(range(10))  # each row once
        assert {s["_epoch"] for s in epoch} == {e}
        assert all(s["problem"] == ROWS[s["_index"]]["problem"] for s in epoch)
    orders = [[s["_index"] for s in epoch] for epoch in epochs]
    assert orders[0] != orders[1] != orders[2]                   # reshuffled every epoch
    assert orders[0] != list(range(10))                          # shuffled at all
    again = take(DataSource(ROWS).stream("train", seed=3), 30)   # same seed, same order
    assert [s["_index"] for s in again] == [s["_index"] for s in samples]
    other = take(source.stream("train", seed=4), 10)
    assert [s["_index"] for s in other] != orders[0]


def test_unshuffled_stream_repeats_the_stored_order():
    samples = take(DataSource(ROWS).stream("train", shuffle=False), 13)
    assert [s["_index"] for s in samples] == [*range(10), 0, 1, 2]
    assert [s["_epoch"] for s in samples] == [0] * 10 + [1] * 3


def test_samples_are_fresh_dicts():
    source = DataSource(ROWS)
    sample = next(source.stream())
    sample["problem"] = "changed"
    assert "changed" not in {s["problem"] for s in source.rows("train")}
    assert ROWS[sample["_index"]]["problem"] != "changed"


def test_test_size_holds_out_a_fixed_disjoint_split():
    source = DataSource(ROWS, test_size=0.3, holdout_seed=1)
    assert source.splits == ("train", "test")
    assert (source.size("train"), source.size("test")) == (7, 3)
    train = {s["problem"] for s in source.rows("train")}
    test = {s["problem"] for s in source.rows("test")}
    assert train.isdisjoint(test) and len(train | test) == 10
    assert test == {s["problem"] for s in DataSource(ROWS, test_size=3, holdout_seed=1)
                    .rows("test")}                                # int size, same seed: same rows
    assert test != {s["problem"] for s in DataSource(ROWS, test_size=3, holdout_seed=2)
                    .rows("test")}
    # rows keep their source order inside each split; _index counts within the split
    indices = [int(s["problem"].split("+")[0]) for s in source.rows("test")]
    assert indices == sorted(indices) and [s["_index"] for s in source.rows("test")] == [0, 1, 2]


def test_holdout_of_a_hugging_face_dataset():
    datasets = pytest.importorskip("datasets")
    source = DataSource(datasets.Dataset.from_list(ROWS), test_size=2, holdout_seed=1)
    listed = DataSource(ROWS, test_size=2, holdout_seed=1)
    assert source.rows("test") == listed.rows("test") and source.size("train") == 8


def test_dataset_dict_and_dict_of_files_give_their_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    both = datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:6]),
                                test=datasets.Dataset.from_list(ROWS[6:]))
    source = DataSource(both, columns={"question": "problem"})
    assert source.splits == ("train", "test") and source.size("test") == 4
    assert source.rows("test", n=1)[0]["question"] == "6+6=?"
    files = DataSource({"train": write_jsonl(tmp_path / "a.jsonl", ROWS[:6]),
                        "test": str(write_jsonl(tmp_path / "b.jsonl", ROWS[6:]))})
    assert files.rows("test") == DataSource(both).rows("test")
    with pytest.raises(DataError, match=r"already has splits \['train', 'test'\]"):
        DataSource(both, test_size=0.5)


def test_nested_columns_by_dotted_path():
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(3)]
    source = DataSource(rows, columns={"question": "prompt.0.content",
                                       "answer": "reward_model.ground_truth"})
    sample = source.rows("train", n=1)[0]
    assert (sample["question"], sample["answer"]) == ("q0", "0")
    with pytest.raises(DataError, match=r"'reward_model' has no 'truth'"):
        DataSource(rows, columns={"answer": "reward_model.truth"})


def test_a_missing_column_fails_at_construction_naming_it_and_the_columns():
    with pytest.raises(DataError) as caught:
        DataSource(ROWS, columns={"question": "problme"})
    message = str(caught.value)
    assert "'problme'" in message and "['level', 'problem', 'solution']" in message
    with pytest.raises(DataError, match=r"field 'answer' reads column 'answer'.*"
                                        r"pass columns=\{'answer': <one of those>\}"):
        DataSource(ROWS, required=("answer",))
    assert DataSource(ROWS, columns={"answer": "solution"}, required=("answer",))


def test_a_column_some_rows_lack_is_not_usable():
    rows = [{"q": "a", "hint": "h"}, {"q": "b"}]
    with pytest.raises(DataError, match=r"column 'hint'.*columns \['q'\]"):
        DataSource(rows, columns={"hint": "hint"})


def test_hugging_face_column_errors_list_the_dataset_columns():
    datasets = pytest.importorskip("datasets")
    with pytest.raises(DataError, match=r"'question'.*\['level', 'problem', 'solution'\]"):
        DataSource(datasets.Dataset.from_list(ROWS), required=("question",))


def test_unknown_split_lists_the_splits():
    source = DataSource(ROWS)
    with pytest.raises(DataError, match=r"no split 'test'; this data has \['train'\].*test_size"):
        source.rows("test")
    with pytest.raises(DataError, match="no split 'validation'"):
        next(source.stream("validation"))


def test_empty_data_and_bad_sizes_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="split 'train' has no rows"):
        DataSource([])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="split 'train' has no rows"):
        DataSource(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="no splits given"):
        DataSource({})
    with pytest.raises(DataError, match="leaving a split empty"):
        DataSource(ROWS, test_size=10)
    with pytest.raises(DataError, match=r"fraction in \(0, 1\)"):
        DataSource(ROWS, test_size=1.5)
    with pytest.raises(ValueError, match="n must be >= 0"):
        DataSource(ROWS).rows("train", n=-1)


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(DataError, match="no file .*missing.jsonl"):
        DataSource(tmp_path / "missing.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"not a \.jsonl, \.json, \.parquet file"):
        DataSource(tmp_path / "rows.csv")
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{"q": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not a JSON object"):
        DataSource(tmp_path / "bad.jsonl")
    (tmp_path / "scalars.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="row 0 is of type int, not an object"):
        DataSource(tmp_path / "scalars.json")
    with pytest.raises(DataError, match="is of type int; give a datasets.Dataset"):
        DataSource(3)


def test_streaming_datasets_are_refused():
    datasets = pytest.importorskip("datasets")
    streaming = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
    with pytest.raises(DataError, match="streaming IterableDataset; load it without streaming"):
        DataSource(streaming)
