"""Dynamic sampling with a bound, the "learned" event, and records whose size does not grow
with what was dropped (astranb/dataflow/sampling.py, ledger.py)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import astranb as ab
from astranb.dataflow.ledger import SampleLedger, compact, expand, sample_id
from astranb.dataflow.sampling import (
    OpenSamples,
    Ties,
    filter_budget,
    in_batch,
    learned_message,
    learned_streak,
)
from astranb.notebook.dashboard import View
from astranb.session.folder import RunFiles
from tests.waiting import wait_until

DEADLINE = 120


# -- the pure parts -------------------------------------------------------------------------------
def test_the_filter_budget_is_the_batches_past_the_first_and_none_is_no_bound():
    # 3 batches of 16 groups a step at most: 2 batches' worth may be dropped (2: one batch)
    assert filter_budget(3, 16) == 32 and filter_budget(2, 16) == 16
    assert filter_budget(1, 16) == 0  # no tied group is ever dropped once warm
    assert filter_budget(None, 16) is None
    assert learned_streak(2) == 64 and learned_streak(16) == 64 and learned_streak(32) == 128


def test_a_batch_past_the_budget_trains_its_groups_with_a_signal_or_else_all():
    assert in_batch([True, False, True, False], filters=True) == [True, False, True, False]
    assert in_batch([False, False], filters=True) == [True, True]  # nothing else to train
    assert in_batch([True, False], filters=False) == [True, True]  # no filter: all, as asked
    assert in_batch([], filters=True) == []


def test_ties_count_streaks_and_learned_needs_the_best_reward_and_a_signal_before():
    ties = Ties()
    assert ties.add([1.0, 1.0]) is True  # tied, but nothing else was ever earned
    assert ties.learned(1) is None  # no worse reward seen yet: not "learned", maybe too easy
    assert ties.add([0.0, 1.0]) is False and ties.signal and ties.streak == 0
    for _ in range(3):
        assert ties.add([1.0, 1.0, 1.0])
    assert (ties.streak, ties.values) == (3, {1.0: 3})
    assert ties.learned(4) is None  # one short
    ties.add([1.0, 1.0])
    assert ties.learned(4) == {1.0: 4}
    assert ties.learned(4) is None  # said once
    ties.add([1.0, 1.0])
    assert ties.learned(4) is None
    # a group with a signal ends the streak; a learned task is still said only once
    ties.add([1.0, 0.0])
    for _ in range(4):
        ties.add([1.0, 1.0])
    assert ties.streak == 4 and ties.learned(4) is None
    # a single scored episode counts for nothing
    assert ties.add([1.0]) is False and ties.streak == 4


def test_ties_all_below_the_best_reward_are_not_learned_and_mixed_ones_say_how_many():
    ties = Ties()
    ties.add([0.0, 1.0])
    for _ in range(10):
        ties.add([0.0, 0.0])  # collapsed to 0: every group ties, none at the best
    assert ties.learned(4) is None
    mixed = Ties()
    mixed.add([0.0, 1.0])
    for i in range(10):  # some samples solved always, the others never
        mixed.add([1.0, 1.0] if i % 3 else [0.0, 0.0])
    assert mixed.learned(4) == {1.0: 6, 0.0: 4}  # best first


def test_the_learned_message_names_the_policy_the_groups_the_rewards_and_the_choices():
    message = learned_message("solver", 64, {1.0: 64})
    assert message.startswith("solver: the last 64 groups all scored 1: the task is learned "
                              "at this difficulty. No group carries a signal")
    for choice in ("run.stop()", "stop_when_learned=True", "harder"):
        assert choice in message
    mixed = learned_message("solver", 64, {1.0: 60, 0.5: 1, 0.0: 3})
    assert mixed.startswith("solver: the last 64 groups all tied, 60 at its best reward 1 and "
                            "1 at 0.5, 3 at 0: the task is learned as far as its samples can "
                            "teach it")


def test_compact_runs_of_positions_by_hand():
    names = ["0:4", "0:2", "0:3", "1:0", "0:7", "0:8", "1:1", "0:9"]
    assert compact(names) == {"0": [[2, 5], [7, 10]], "1": [[0, 2]]}
    assert expand(compact(names)) == ["0:2", "0:3", "0:4", "0:7", "0:8", "0:9", "1:0", "1:1"]
    # a name accounted twice stays twice, so a double count cannot hide in the compact form
    assert compact(["0:1", "0:1", "0:2"]) == {"0": [[1, 2], [1, 3]]}
    assert expand(compact(["0:1", "0:1", "0:2"])) == ["0:1", "0:1", "0:2"]
    assert compact([]) == {} and expand({}) == []
    # 10,000 dropped in a row are one pair, not 10,000 names
    assert json.dumps(compact([sample_id(0, i) for i in range(10_000)])) == '{"0": [[0, 10000]]}'


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200)), max_size=300))
def test_expand_gives_back_every_name_compact_was_given_in_stream_order(pairs):
    names = [sample_id(s, p) for s, p in pairs]
    assert expand(compact(names)) == [sample_id(s, p) for s, p in sorted(pairs)]


def test_a_ledger_row_holds_counts_and_the_names_go_apart():
    ledger = SampleLedger()
    for i in range(6):
        ledger.drawn(sample_id(0, i), {"i": i}, ["solver"])
    for i in (0, 1, 2, 4):
        ledger.dropped("solver", sample_id(0, i), "filtered")
    ledger.dropped("solver", sample_id(0, 5), "stale")
    columns, names = ledger.take("solver", [sample_id(0, 3)])
    assert columns == {"samples_trained": 1, "samples_dropped": {"filtered": 4, "stale": 1}}
    assert names == {"trained": {"0": [[3, 4]]},
                     "dropped": {"filtered": {"0": [[0, 3], [4, 5]]}, "stale": {"0": [[5, 6]]}}}
    assert len(ledger) == 0  # every drawn sample is accounted for


def test_max_gen_batches_and_stop_when_learned_are_checked_with_the_fix():
    with pytest.raises(ValueError, match=r"max_gen_batches must be an integer >= 1 or None, "
                                         r"got 0.*None lets filter_groups drop without a bound"):
        ab.RunConfig(1, 4, 2, 1, max_gen_batches=0)
    with pytest.raises(ValueError, match="max_gen_batches"):
        ab.RunConfig(1, 4, 2, 1, max_gen_batches=2.5)
    with pytest.raises(ValueError, match="stop_when_learned must be True or False"):
        ab.RunConfig(1, 4, 2, 1, stop_when_learned="yes")
    assert ab.RunConfig(1, 4, 2, 1).max_gen_batches == 4
    assert ab.RunConfig(1, 4, 2, 1).sampler == "stream"


def test_open_samples_skip_solved_samples_down_to_the_floor_and_forget_slowly():
    seen = OpenSamples(floor=0.25, seed=1)
    a, b = OpenSamples.key({"prompt": "1+1=", "answer": 2}), OpenSamples.key({"answer": 2,
                                                                            "prompt": "1+1="})
    assert a == b and a != OpenSamples.key({"prompt": "1+2=", "answer": 3})  # key order ignored
    assert OpenSamples.key({"x": object()}) is None and OpenSamples.key({"x": math.nan}) is None
    assert seen.solved_rate(a) == 0.0 and all(seen.play(a) for _ in range(100))  # never seen
    assert seen.reward(a, "solver") is None
    seen.record(a, True, {"solver": 1.0})  # the first group: the rates are its own
    assert (seen.solved_rate(a), seen.reward(a, "solver")) == (1.0, 1.0)
    seen.record(a, False, {"solver": 0.5})  # then halfway towards each new group's
    assert (seen.solved_rate(a), seen.reward(a, "solver")) == (0.5, 0.75)
    seen.record(a, True, {"solver": 1.0})
    seen.record(a, True, {"solver": 1.0})
    assert seen.solved_rate(a) == 0.875 and seen.reward(a, "solver") == 0.9375
    plays = sum(seen.play(a) for _ in range(4000)) / 4000
    assert abs(plays - 0.25) < 0.03  # max(floor, 1 - 0.875) = the floor
    seen.record(a, False, {"solver": 0.5})  # open again: played more often
    assert seen.solved_rate(a) == 0.4375
    assert abs(sum(seen.play(a) for _ in range(4000)) / 4000 - 0.5625) < 0.03
    assert seen.play(None)  # a sample that is not JSON is always played
    small = OpenSamples(memory=2)
    for i in range(3):
        small.record(str(i), True, {})
    assert len(small) == 2 and small.solved_rate("0") == 0.0  # the least recently updated went
    with pytest.raises(ValueError, match=r"floor must be in \(0, 1\]"):
        OpenSamples(floor=0)
    with pytest.raises(ValueError, match="sampler must be one of 'stream', 'open'"):
        ab.RunConfig(1, 4, 2, 1, sampler="solved")


class FewProblems(ab.Environment):
    """Four problems drawn again and again; problem 0 is always solved (1.0, the best reward),
    the others score 0.0 or 0.5 by the sampled token's parity (never the best)."""

    roles = ("solver",)
    sampling = ab.SamplingParams(max_new_tokens=1)

    def samples(self, seed=0):
        import random

        rng = random.Random(seed)
        while True:
            yield {"prompt": "a", "problem": rng.randrange(4)}

    async def episode(self, ctx, sample):
        out = await ctx.generate("solver", sample["prompt"])
        if sample["problem"] == 0:
            return 1.0
        return 0.5 * float(len(out.completion_ids) and out.completion_ids[0] % 2)


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_the_open_samples_sampler_skips_the_solved_problem_and_accounts_for_it(tmp_path):
    session = ab.Session(tmp_path / "runs", trainer="thread")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(FewProblems(), solver=policy)
    with session:
        run = session.train(steps=8, batch_size=16, group_size=8, sampler="open")
        run.wait(timeout=DEADLINE, progress=False)
    rows = run.rows
    accounts = RunFiles(run.directory).samples
    filtered = [name for a in accounts for name in a["dropped"].get("filtered", [])]
    stream = FewProblems().samples(0)
    last = max(int(n.split(":")[1]) for a in accounts for n in a["trained"] + filtered)
    problems = [next(stream)["problem"] for _ in range(last + 1)]
    skipped = sum(r["groups_skipped"] for r in rows)
    # skipped samples are accounted as filtered, with the played groups that tied
    assert skipped > 0 and len(filtered) >= skipped
    assert sum(r["samples_dropped"].get("filtered", 0) for r in rows) == len(filtered)
    # the solved problem's draws were mostly skipped; the open ones were played
    zero = [int(n.split(":")[1]) for n in filtered if problems[int(n.split(":")[1])] == 0]
    assert len(zero) / problems.count(0) > 0.7
    trained = [int(n.split(":")[1]) for a in accounts for n in a["trained"]]
    assert all(problems[i] != 0 for i in trained)  # its groups tie: never trained
    # the rows' reward counts the skipped samples at their recent reward (1.0), so it reads
    # above the played episodes' mean once problem 0 is mostly skipped
    assert any(r["reward"] > r["reward_played"] for r in rows if r["groups_skipped"])
    # and nothing is accounted twice
    every = [n for a in accounts for n in a["trained"]] + \
        [n for a in accounts for names in a["dropped"].values() for n in names]
    assert len(every) == len(set(every))


# -- a run whose task gets learned ---------------------------------------------------------------
class LearnedAfter(ab.Environment):
    """Rewards that differ within a group for the first `varied` samples (a signal), then 1.0
    for every episode: the task is "learned" and every group ties."""

    roles = ("solver",)
    sampling = ab.SamplingParams(max_new_tokens=1)

    def __init__(self, varied: int = 6):
        self.varied = varied

    def samples(self, seed=0):
        i = 0
        while True:
            yield {"prompt": "a", "i": i}
            i += 1

    async def episode(self, ctx, sample):
        out = await ctx.generate("solver", sample["prompt"])
        if sample["i"] < self.varied:
            return float(len(out.completion_ids) and out.completion_ids[0] % 2)
        return 1.0


def _train(tmp_path, env, **kw):
    session = ab.Session(tmp_path / "runs", trainer="thread")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(env, solver=policy)
    return session, session.train(batch_size=8, group_size=2, max_staleness=1, **kw)


def _learned(run):
    return [e for e in run.events if e["kind"] == "learned"]


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_the_learned_event_is_recorded_shown_and_ends_training_when_asked(tmp_path, capsys):
    session, run = _train(tmp_path, LearnedAfter(), steps=500, max_gen_batches=2,
                          stop_when_learned=True)
    with session:
        run.wait(timeout=DEADLINE)
        assert run.status == "finished"
        (event,) = _learned(run)
        assert event["policy"] == "solver" and event["reward"] == 1.0
        assert event["groups"] == learned_streak(4) == 64 and event["tied_at"] == {"1": 64}
        assert event["message"] == learned_message("solver", 64, {1.0: 64})
        assert run.learned == {"solver": event["message"]}
        assert f"astranb: {event['message']}" in capsys.readouterr().err  # the waiting cell
        assert "learned: solver" in View(run).status()  # the dashboard's status line
        # training ended at the event: one step after it at most, far before the 500 asked
        assert len(run.rows) <= event["step"] + 1 < 500
        rows = run.rows
        # past it the step trains on what it has: its groups with a signal, or, when none has
        # one (here every group ties after the first few), its tied groups (how many steps
        # hit the budget before the event depends on timing)
        hit = [r for r in rows if r["filter_budget_hit"]]
        assert hit and all(r["tied_trained"] in (0, r["trained_groups"]) for r in hit)
        assert all(r["samples_trained"] <= 4 for r in rows)
        assert rows[-1]["tied_fraction"] == 1.0
        assert all(0.0 <= r["tied_fraction"] <= 1.0 for r in rows
                   if not math.isnan(r["tied_fraction"]))
        # the row counts, samples.jsonl names: the same samples
        accounts = RunFiles(run.directory).samples
        assert [len(a["dropped"].get("filtered", [])) for a in accounts] == \
            [r["samples_dropped"].get("filtered", 0) for r in rows]
    on_disk = ab.open_run(run.directory)
    assert [e["step"] for e in on_disk.events if e["kind"] == "learned"] == [event["step"]]


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_without_stop_when_learned_the_run_goes_on_after_the_event(tmp_path):
    session, run = _train(tmp_path, LearnedAfter(), steps=1000, max_gen_batches=2)
    with session:
        event = wait_until(lambda: _learned(run), DEADLINE, "a learned event")[0]
        wait_until(lambda: len(run.rows) >= event["step"] + 5, DEADLINE, "steps after it")
        assert run.status == "running"
        run.stop()
        run.wait(timeout=DEADLINE, progress=False)
