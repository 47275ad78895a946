"""Bounded episode records: which episodes a run keeps ("sample", "all", "none"), the framed
zstd file they are kept in, and reading a run folder back (`ab.open_run`, `EpisodeLog`).

The Recorder is driven directly with Trajectory objects; every count below is worked out by
hand from the episodes offered."""

from __future__ import annotations

import json
import random

import pytest
import zstandard

import astranb as ab
from astranb.session import episodes as records
from astranb.session.episodes import (
    DamagedRecord,
    RecordPolicy,
    Selection,
    load_frames,
    reservoir_slot,
)
from astranb.session.folder import EPISODES_FILE as DATA_FILE
from astranb.session.folder import EPISODES_INDEX_FILE as INDEX_FILE
from astranb.session.recorder import EpisodeLog, Recorder
from astranb.types import Generation, SamplingParams, Trajectory, Turn


def traj(i: int, *, error: bool = False, truncated: bool = False, tokens: int = 4) -> Trajectory:
    """An episode whose sample says which one it is (`n`), with one turn of `tokens` tokens."""
    gen = Generation(prompt_ids=(1, 2, i % 50), completion_ids=tuple(range(tokens)),
                     logprobs=tuple(-0.5 for _ in range(tokens)),
                     versions=tuple(0 for _ in range(tokens)), finish_reason="stop",
                     text=f"answer {i}")
    turn = Turn("solver", "solver", gen, SamplingParams())
    return Trajectory(sample={"n": i}, turns=(turn,), rewards={} if error else {"solver": 1.0},
                      group=i // 4, error="Traceback: boom" if error else None,
                      truncated="budget" if truncated else None, env="Toy")


@pytest.fixture
def new(tmp_path):
    """Recorder(folder, {}, **kw) for a test, closed when the test ends (files stay open
    until then, as in a run)."""
    made: list[Recorder] = []

    def make(folder=tmp_path, **kw) -> Recorder:
        made.append(Recorder(folder, {}, **kw))
        return made[-1]

    yield make
    for recorder in made:
        recorder.close()


def play(recorder: Recorder, trajectories, row: dict | None = None) -> None:
    """Record the trajectories, then one metrics row (which closes the step's pool)."""
    for t in trajectories:
        recorder.add_episode(t, 0)
    recorder.add_row(row or {"step": 0})


def kept_samples(episodes) -> list[int]:
    return [e.sample["n"] for e in episodes]


# -- which episodes are kept -------------------------------------------------------------------
def test_reservoir_keeps_exactly_k_per_step_when_more_arrive_and_all_when_fewer(tmp_path, new):
    recorder = new(tmp_path, record="sample", per_step=3)
    play(recorder, [traj(i) for i in range(10)])        # step 0: 10 ok episodes -> 3 kept
    play(recorder, [traj(i) for i in range(10, 12)])    # step 1: 2 ok episodes -> both kept
    play(recorder, [traj(i) for i in range(12, 15)])    # step 2: exactly 3 -> all 3
    kept = kept_samples(recorder.episodes)
    assert len(kept) == 3 + 2 + 3
    step0 = kept[:3]
    assert len(set(step0)) == 3 and set(step0) <= set(range(10))
    assert kept[3:] == [10, 11, 12, 13, 14]
    assert kept == sorted(kept)                          # completion order
    assert recorder.played == 15 and len(recorder.recent_episodes) == 15
    # each Episode keeps its completion index among all played
    assert [e.index for e in recorder.episodes] == kept


def test_failures_and_truncations_are_always_kept_besides_the_sample(tmp_path, new):
    recorder = new(tmp_path, record="sample", per_step=2)
    batch = [traj(i, error=i in (1, 7), truncated=i == 4) for i in range(12)]
    play(recorder, batch)
    kept = list(recorder.episodes)
    special = [e.sample["n"] for e in kept if e.error or e.truncated]
    assert special == [1, 4, 7]
    assert len(kept) == 3 + 2                              # and 2 of the 9 others
    assert kept_samples(kept) == sorted(kept_samples(kept))


def test_all_keeps_every_episode_and_none_only_failed_and_truncated_ones(tmp_path, new):
    everything = new(tmp_path / "all", record="all")
    failures = new(tmp_path / "none", record="none")
    batch = [traj(i, error=i % 5 == 0, truncated=i == 3) for i in range(20)]
    for recorder in (everything, failures):
        play(recorder, batch[:12])
        play(recorder, batch[12:])
        recorder.close()
    assert kept_samples(everything.episodes) == list(range(20))
    assert kept_samples(failures.episodes) == [0, 3, 5, 10, 15]
    assert failures.played == 20


def test_the_sample_is_uniform_over_the_pool():
    """Algorithm R: over many pools of 10, each position is kept 3 times in 10."""
    hits = [0] * 10
    rng = random.Random(1)
    for _ in range(20_000):
        sample: list[int] = []
        for seen in range(1, 11):
            slot = reservoir_slot(seen, 3, rng)
            if slot == len(sample):
                sample.append(seen - 1)
            elif slot is not None:
                sample[slot] = seen - 1
        for i in sample:
            hits[i] += 1
    assert all(abs(h / 20_000 - 0.3) < 0.02 for h in hits), hits


def test_the_last_pool_is_written_when_the_recorder_closes(tmp_path, new):
    recorder = new(tmp_path, record="sample", per_step=2)
    play(recorder, [traj(i) for i in range(2)])
    for i in range(2, 4):                                  # after the last row
        recorder.add_episode(traj(i, error=i == 3), 0)
    assert len(recorder.episodes) == 2
    recorder.close()
    assert kept_samples(recorder.episodes) == [0, 1, 2, 3]
    assert kept_samples(EpisodeLog(tmp_path)) == [0, 1, 2, 3]


def test_every_episode_is_announced_even_when_not_kept(tmp_path, new):
    recorder = new(tmp_path, record="none")
    seen = []
    recorder.on_event(lambda kind, payload: seen.append(payload.index) if kind == "episode"
                      else None)
    play(recorder, [traj(i) for i in range(6)])
    assert seen == list(range(6)) and len(recorder.episodes) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"record": "some"}, r"record='some' is not a record mode; use \"sample\".*\"all\".*\"none\""),
    ({"record": "sample", "per_step": 0}, r"record_per_step=0: keep at least 1"),
    ({"record": "all", "recent": 0}, r"recent=0"),
])
def test_an_invalid_record_setting_is_refused_before_anything_is_written(tmp_path, kwargs,
                                                                          message, new):
    with pytest.raises(ValueError, match=message):
        new(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_session_train_refuses_an_unknown_record_mode(tmp_path):
    session = ab.Session(tmp_path)
    policy = session.policy("solver", ab.models.tiny(hidden_size=32, num_heads=2))
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    with session, pytest.raises(ValueError, match=r"record='everything'.*\"sample\""):
        session.train(steps=1, batch_size=4, group_size=2, record="everything")


# -- memory ------------------------------------------------------------------------------------
def test_memory_holds_only_the_most_recent_episodes(tmp_path, new):
    recorder = new(tmp_path, record="all", recent=5)
    for step in range(4):
        play(recorder, [traj(i) for i in range(step * 4, step * 4 + 4)])
        assert recorder._selection.pending == 0
    assert len(recorder.recent_episodes) == 5
    assert [e.index for e in recorder.recent_episodes] == list(range(11, 16))
    assert len(recorder._kept) == 5                        # the rest is read back from disk
    assert kept_samples(recorder.episodes) == list(range(16))
    # in "all" mode a long step is written in frames of `recent` episodes: memory stays bounded
    for i in range(16, 29):
        recorder.add_episode(traj(i), 0)
        assert recorder._selection.pending < 5
    assert len(recorder.episodes) == 16 + 10               # two full frames of 5 written early


def test_episodes_read_back_in_a_live_run_keep_their_environment(tmp_path, new):
    class Tokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    env, tokenizer = object(), Tokenizer()
    recorder = new(tmp_path, record="all", recent=2)
    for i in range(6):
        recorder.add_episode(traj(i), 0, environment=env, tokenizers={"solver": tokenizer})
    recorder.add_row({"step": 0})
    first = recorder.episodes[0]                           # not in memory: from disk
    assert all(first is not e for e in recorder._kept) and first.environment is env
    assert first.tokenizers == {"solver": tokenizer} and first.turns[0]["prompt"] == "1 2 0"


# -- the view ----------------------------------------------------------------------------------
def test_the_view_indexes_slices_and_iterates_like_a_list(tmp_path, new):
    recorder = new(tmp_path, record="all", recent=3)
    for step in range(3):
        play(recorder, [traj(i) for i in range(step * 5, step * 5 + 5)])
    view = recorder.episodes
    expected = list(range(15))
    assert len(view) == 15 and kept_samples(view) == expected
    assert view[-1].sample["n"] == 14 and view[-15].sample["n"] == 0
    assert kept_samples(view[3:12]) == expected[3:12]
    assert kept_samples(view[::4]) == expected[::4]
    assert kept_samples(view[-3:]) == expected[-3:] and view[20:] == []
    assert kept_samples(reversed(view)) == expected[::-1]
    with pytest.raises(IndexError, match="episode 15 of 15 kept"):
        view[15]
    snapshot = recorder.episodes
    play(recorder, [traj(15)])
    assert len(snapshot) == 15 and len(recorder.episodes) == 16  # a view keeps its length
    assert "15 episodes" in repr(snapshot) and "record='all'" in repr(snapshot)


# -- on disk -----------------------------------------------------------------------------------
def test_reopening_a_folder_gives_equal_episodes(tmp_path, new):
    recorder = new(tmp_path, record="sample", per_step=2)
    for step in range(5):
        play(recorder, [traj(i, error=i % 7 == 0) for i in range(step * 6, step * 6 + 6)])
    recorder.close()
    log = EpisodeLog(tmp_path)
    assert len(log) == len(recorder.episodes) > 0
    assert [e.to_json() for e in log] == [e.to_json() for e in recorder.episodes]
    assert all(e.environment is None for e in log)
    # and the file is plain concatenated zstd frames of JSON lines
    text = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
    lines = text.decompress((tmp_path / DATA_FILE).read_bytes()).splitlines()
    assert [json.loads(line) for line in lines] == [e.to_json() for e in log]


def test_random_access_decodes_only_the_frame_it_needs(tmp_path, monkeypatch, new):
    recorder = new(tmp_path, record="all")
    for step in range(4):
        play(recorder, [traj(i) for i in range(step * 3, step * 3 + 3)])
    recorder.close()
    decoded = []
    real = records.decode_frame
    monkeypatch.setattr(records, "decode_frame",
                        lambda data: decoded.append(len(data)) or real(data))
    log = EpisodeLog(tmp_path)
    assert log[7].sample["n"] == 7 and log[8].sample["n"] == 8
    assert len(decoded) == 1                               # frame 2 only, decoded once
    frames = load_frames(tmp_path)
    assert [f.episodes for f in frames] == [3, 3, 3, 3] and decoded == [frames[2].length]


def test_a_damaged_frame_fails_only_its_own_episodes(tmp_path, new):
    recorder = new(tmp_path, record="all")
    for step in range(3):
        play(recorder, [traj(i) for i in range(step * 3, step * 3 + 3)])
    recorder.close()
    first = load_frames(tmp_path)[0]
    data = bytearray((tmp_path / DATA_FILE).read_bytes())
    data[first.offset + first.length // 2] ^= 0xFF         # flip bits inside frame 0
    (tmp_path / DATA_FILE).write_bytes(bytes(data))
    log = EpisodeLog(tmp_path)
    assert len(log) == 9
    assert kept_samples(log[3:]) == list(range(3, 9))
    with pytest.raises(DamagedRecord, match="frame at byte 0 .*other frames are still readable"):
        log[1]


def test_a_writer_killed_mid_frame_loses_only_that_frame(tmp_path, new):
    recorder = new(tmp_path, record="all")
    for step in range(3):
        play(recorder, [traj(i) for i in range(step * 4, step * 4 + 4)])
    recorder.close()
    last = load_frames(tmp_path)[-1]
    with open(tmp_path / DATA_FILE, "r+b") as f:
        f.truncate(last.offset + last.length - 5)          # the last frame is torn
    log = EpisodeLog(tmp_path)
    assert kept_samples(log) == list(range(8))
    # a recorder on the same folder goes on after the readable frames
    again = new(tmp_path, record="all")
    play(again, [traj(100)])
    again.close()
    assert kept_samples(EpisodeLog(tmp_path)) == list(range(8)) + [100]


def test_a_frame_written_but_not_indexed_is_still_found(tmp_path, new):
    recorder = new(tmp_path, record="all")
    for step in range(3):
        play(recorder, [traj(i) for i in range(step * 2, step * 2 + 2)])
    recorder.close()
    index = (tmp_path / INDEX_FILE).read_bytes()
    (tmp_path / INDEX_FILE).write_bytes(index[:-16 - 7])   # the crash hit between the writes
    assert kept_samples(EpisodeLog(tmp_path)) == list(range(6))
    (tmp_path / INDEX_FILE).unlink()                       # or the index is lost altogether
    assert kept_samples(EpisodeLog(tmp_path)) == list(range(6))



def test_selection_takes_its_pool_in_completion_order():
    class Item:
        def __init__(self, index, error=None):
            self.index, self.error, self.truncated = index, error, None

    selection = Selection(RecordPolicy("sample", per_step=1), seed=3)
    for i in range(6):
        selection.offer(Item(i, error="x" if i == 4 else None))
    taken = [item.index for item in selection.take()]
    assert 4 in taken and len(taken) == 2 and taken == sorted(taken)
    assert selection.take() == []


# -- a whole run -------------------------------------------------------------------------------
def test_open_run_reads_a_finished_run_in_a_fresh_view(tmp_path):
    session = ab.Session(tmp_path)
    policy = session.policy("solver", ab.models.tiny(hidden_size=32, num_heads=2))
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    with session:
        run = session.train(steps=2, batch_size=8, group_size=4, max_staleness=0,
                            record_per_step=3).wait(progress=False)
    assert run.metrics["episodes"].max() >= 16
    per_row = 3 * len(run.metrics)
    assert len(run.episodes) == per_row + sum(1 for e in run.episodes if e.error or e.truncated)
    opened = ab.open_run(run.directory)
    assert opened.status == "finished" and opened.error is None
    assert opened.metrics[["step", "reward"]].equals(run.metrics[["step", "reward"]])
    assert [e.to_json() for e in opened.episodes] == [e.to_json() for e in run.episodes]
    debugger = opened.episodes[-1].show()
    assert debugger.steps[-1].kind == "reward"
    assert "finished" in repr(opened) and "kept episodes" in repr(opened)
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        ab.open_run(tmp_path / "nothing-here")


def test_count_columns_are_0_in_rows_before_the_name_was_first_counted(tmp_path):
    rows = [{"policy": "p", "step": 0, "time": 0.0},
            {"policy": "p", "step": 1, "time": 1.0, "count/retokenized": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ab.open_run(tmp_path).metrics["count/retokenized"].tolist() == [0, 2]
