"""Held-out evaluation: avg@k and pass@k arithmetic, `session.evaluate(split=...)`, evaluation
windows alongside training, and the metrics of truncated and counted episodes."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

import astranb as ab
from astranb.dataflow.buffer import Buffer
from astranb.evaluation import (
    RoleEvaluation,
    avg_at_k,
    check_evaluation,
    evaluate_trajectories,
    pass_at_k,
    summarize,
)
from astranb.session.recorder import Recorder
from astranb.types import Generation, SamplingParams, Trajectory, Turn

# -- pass@k and avg@k ------------------------------------------------------------------------------


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n plays (the first c solved) holding a solved play."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_matches_enumerating_every_subset_of_plays():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)),
                                                           abs=1e-12), (n, c, k)


def test_pass_at_k_is_exact_to_float_precision_at_n_256():
    n = 256
    for c in (0, 1, 2, 17, 128, 200, 255, 256):
        for k in (1, 2, 8, 64, 100, 256):
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    # hand-computed: one solved play of 256, one draw: 1/256; two draws: 1 - 255*254/(256*255)
    assert pass_at_k(256, 1, 1) == pytest.approx(1 / 256, rel=1e-14)
    assert pass_at_k(256, 1, 2) == pytest.approx(2 / 256, rel=1e-14)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(5, 0, 3) == 0.0  # nothing solved
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every draw holds a solved play
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 1) == 0.5
    with pytest.raises(ValueError, match="k=5 is more than the n=4 plays"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5 solved plays out of n=4"):
        pass_at_k(4, 5, 1)
    for bad in ((-1, 0, 1), (4, -1, 1), (4, 1, -2), (4.0, 1, 1), (True, 1, 1)):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            pass_at_k(*bad)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(4, 1, 0)


def test_avg_at_k_averages_problems_not_plays():
    # problem 1: mean 1/4; problem 2: mean 1; avg@k = (0.25 + 1) / 2, not the play mean 3/6
    assert avg_at_k([[1, 0, 0, 0], [1, 1]]) == 0.625
    assert avg_at_k([[0.5, 0.5], [0.0, 1.0]]) == 0.5
    with pytest.raises(ValueError, match="no problems"):
        avg_at_k([])
    with pytest.raises(ValueError, match="at least one play"):
        avg_at_k([[1.0], []])


def test_summarize_hand_example():
    s = summarize([[1, 0], [0, 0], [1, 1]], k=2, versions=[3, 4, 3, 3])
    assert s["avg@k"] == pytest.approx(0.5)  # (0.5 + 0 + 1) / 3
    assert s["pass@k"] == pytest.approx(2 / 3)  # problems 1 and 3 solved by one of 2 plays
    assert (s["n"], s["k"], s["versions"], s["mixed_versions"]) == (3, 2, (3, 4), True)
    # k=1 from 2 plays each: pass@1 = mean over problems of c/n = (1/2 + 0 + 1) / 3
    assert summarize([[1, 0], [0, 0], [1, 1]], k=1)["pass@k"] == pytest.approx(0.5)
    # a problem whose plays partly failed counts with what finished; one with none is left out
    partial = summarize([[1.0], [], [0.0, 0.0]], k=2, failed=3)
    assert partial["avg@k"] == 0.5 and partial["pass@k"] == 0.5
    assert (partial["n"], partial["unscored"], partial["failed"]) == (3, 1, 3)
    assert summarize([[0.6, 0.2]], k=2, solved=lambda r: r > 0.5)["pass@k"] == 1.0
    nothing = summarize([[], []], k=1)
    assert math.isnan(nothing["avg@k"]) and math.isnan(nothing["pass@k"])
    with pytest.raises(ValueError, match="k must be a positive integer"):
        summarize([[1.0]], k=0)


def traj(rewards, versions_by_role, error=None, truncated=None):
    turns = tuple(Turn(role, "p", Generation((1,), tuple(range(len(v))), (0.0,) * len(v),
                                             tuple(v), "stop"), SamplingParams())
                  for role, v in versions_by_role.items())
    return Trajectory({}, turns, rewards, 0, error, truncated=truncated)


def test_evaluate_trajectories_scores_each_role_from_its_own_rewards_and_tokens():
    plays = [
        [traj({"a": 1.0, "b": 0.0}, {"a": [2, 2], "b": [2]}),
         traj({"a": 0.0, "b": 0.0}, {"a": [3], "b": [2]}, truncated="budget: 4 tokens")],
        [traj({}, {"a": [3]}, error="Traceback: boom"),
         traj({"a": 0.5, "b": 1.0}, {"a": [3], "b": [3]})],
    ]
    result = evaluate_trajectories(plays, ("a", "b"), k=2, split="test")
    a, b = result["a"], result["b"]
    assert a.avg_at_k == pytest.approx((0.5 + 0.5) / 2)  # problem 2 has one finished play
    assert a.pass_at_k == pytest.approx(0.5)  # problem 1 solved once; problem 2 never
    assert b.avg_at_k == pytest.approx((0.0 + 1.0) / 2) and b.pass_at_k == pytest.approx(0.5)
    assert a.versions == (2, 3) and a.mixed_versions and b.versions == (2, 3)
    assert (a.failed, a.truncated, a.n, a.k, a.split) == (1, 1, 2, 2, "test")
    assert repr(a) == ("RoleEvaluation(a, test: avg@2=0.500 pass@2=0.500, 2 problems x 2, "
                       "v2-3 (mixed), 1 failed, 1 truncated)")


def test_an_evaluation_that_mixed_versions_warns_and_one_that_all_failed_raises():
    mixed = [[traj({"a": 1.0}, {"a": [0, 1]})]]
    with pytest.warns(RuntimeWarning, match=r"mixed weight versions.*'a': \[0, 1\]"):
        check_evaluation(mixed, evaluate_trajectories(mixed, ("a",), 1, "test"))
    failed = [[traj({}, {"a": [0]}, error="ValueError: broken")]]
    with pytest.raises(RuntimeError, match="(?s)all 1 evaluation episodes failed.*broken"):
        check_evaluation(failed, evaluate_trajectories(failed, ("a",), 1, "test"))


# -- environments ----------------------------------------------------------------------------------

TEST_VALUES = (1.0, 0.0, 0.5, 1.0, 0.25)
"""Rewards of the held-out problems: avg@k 0.55, pass@k 0.4 for any k (every play alike)."""


class Graded(ab.Environment):
    """Training samples score the model's 'a's; held-out samples score their own `value`, so
    avg@k and pass@k are known in advance. Held-out samples carry `heldout`; a problem with
    `alternate` is solved by every second play of it."""

    roles = ("solver",)
    splits = ("train", "test")
    sampling = SamplingParams(max_new_tokens=4)

    def __init__(self, test=None):
        self.test = [dict(s) for s in test] if test is not None else [
            {"prompt": "ab=", "value": v, "heldout": True, "id": i}
            for i, v in enumerate(TEST_VALUES)]
        self.plays: dict[int, int] = {}

    def samples(self, seed=0):
        rng = random.Random(seed)
        while True:
            yield {"prompt": rng.choice(["ab=", "ba=", "aa="])}

    def split_samples(self, split, seed=0):
        return iter(self.test) if split == "test" else super().split_samples(split, seed)

    async def episode(self, ctx, sample):
        out = await ctx.generate("solver", sample["prompt"])
        if "alternate" in sample:
            self.plays[sample["id"]] = self.plays.get(sample["id"], 0) + 1
            return float(self.plays[sample["id"]] % 2)
        if "value" in sample:
            return sample["value"]
        return out.text.count("a") / 4 + 0.01 * len(out.completion_ids)


def make_session(tmp_path, env):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=32)
    session.wire(env, solver=policy)
    return session, policy


# -- session.evaluate ------------------------------------------------------------------------------

def test_evaluate_a_split_gives_avg_and_pass_at_k_per_role(tmp_path):
    test = [{"prompt": "ab=", "value": 1.0, "id": 0}, {"prompt": "ab=", "value": 0.0, "id": 1},
            {"prompt": "ab=", "alternate": True, "id": 2}]
    env = Graded(test)
    session, _ = make_session(tmp_path, env)
    with session:
        result = session.evaluate(split="test", n=3, k=2)
        plain = session.evaluate(n=6)
    solver = result["solver"]
    assert isinstance(solver, RoleEvaluation) and set(result) == {"solver"}
    # problem means 1, 0 and 1/2 (one of its two plays solved it); solved at least once: 2 of 3
    assert solver.avg_at_k == pytest.approx(0.5) and solver.pass_at_k == pytest.approx(2 / 3)
    assert (solver.n, solver.k, solver.versions, solver.failed) == (3, 2, (0,), 0)
    assert env.plays == {2: 2}  # the alternating problem was played exactly k times
    assert set(plain) == {"solver"} and 0.0 <= plain["solver"] <= 1.1  # the old shape


def test_evaluate_arguments_are_checked_with_their_fix(tmp_path):
    session, _ = make_session(tmp_path, Graded())
    with session:
        with pytest.raises(ValueError, match=r"split='dev': Graded has the splits \['train', "
                                             r"'test'\]; pass one of them"):
            session.evaluate(split="dev")
        with pytest.raises(ValueError, match="k=2 needs a split"):
            session.evaluate(k=2)
        with pytest.raises(ValueError, match="n must be a positive integer"):
            session.evaluate(split="test", n=0)
        with pytest.raises(ValueError, match="Graded.split_samples\\('test'\\) gave no samples"):
            session.evaluate(Graded([]), split="test")


# -- evaluation alongside training -----------------------------------------------------------------

def test_training_evaluates_held_out_windows_that_never_reach_a_trainer(tmp_path, monkeypatch):
    buffered = []
    put = Buffer.put

    def spy(self, group):
        buffered.extend(t.sample for t in group.trajectories)
        return put(self, group)

    monkeypatch.setattr(Buffer, "put", spy)
    session, policy = make_session(tmp_path, Graded())
    with session:
        run = session.train(steps=4, batch_size=8, group_size=4, max_staleness=1,
                            eval_every=2, eval_n=4, eval_k=2, record="all").wait(progress=False)
    # nothing held out was buffered, hence trained, or recorded or counted as an episode
    assert buffered and not any(s.get("heldout") for s in buffered)
    assert not any(e.sample.get("heldout") for e in run.episodes)
    assert run.metrics.query("kind == 'step'")["episodes"].max() <= len(run.episodes)
    windows = run.evaluations
    versions = list(windows["version"])
    # the first window before any step, the last at the final version; a window still playing
    # when versions are published lets the next one play the newest
    assert versions[0] == 0 and versions[-1] == 4 and versions == sorted(set(versions))
    assert all(v == 4 or any(m % 2 == 0 for m in range(prev + 1, v + 1))
               for prev, v in itertools.pairwise(versions))
    # the first 4 held-out problems, values 1, 0, 0.5, 1: avg@2 0.625, pass@2 0.5, every window
    assert list(windows["solver/avg@2"]) == [0.625] * len(versions)
    assert list(windows["solver/pass@2"]) == [0.5] * len(versions)
    assert set(windows["n"]) == {4} and set(windows["k"]) == {2} and set(windows["failed"]) == {0}
    assert windows["token_versions"].iloc[0] == [0]
    df = run.metrics
    evals = df[df["kind"] == "eval"]
    assert len(evals) == len(versions) and list(evals["eval/version"]) == versions
    assert list(evals["eval/solver/pass@2"]) == [0.5] * len(versions)
    assert list(df["time"]) == sorted(df["time"])
    assert len(df[df["kind"] == "step"]) == 4 and run.progress == (4, 4)
    summary = run.summary()
    assert summary["eval/version"] == 4 and summary["eval/solver/avg@2"] == 0.625
    assert "held-out v4, solver/avg@2 0.625, solver/pass@2 0.500" in repr(run)
    assert policy.version == 4


def test_train_checks_the_evaluation_settings_before_any_work(tmp_path):
    session, _ = make_session(tmp_path, Graded())
    with session:
        with pytest.raises(ValueError, match="eval_every must be a positive integer .*got 0"):
            session.train(steps=1, batch_size=8, group_size=4, eval_every=0)
        with pytest.raises(ValueError, match="eval_every must be a positive integer .*got 1.5"):
            session.train(steps=1, batch_size=8, group_size=4, eval_every=1.5)
        with pytest.raises(ValueError, match="eval_k must be a positive integer"):
            session.train(steps=1, batch_size=8, group_size=4, eval_every=1, eval_k=0)
        with pytest.raises(ValueError, match=r"eval_split='valid': Graded has the splits "
                                             r"\['train', 'test'\]"):
            session.train(steps=1, batch_size=8, group_size=4, eval_every=1,
                          eval_split="valid")

        class Judge(Graded):
            roles = ("judge",)

        with pytest.raises(ValueError, match=r"Judge is not wired.*\{'judge': \[\]\}"):
            session.train(steps=1, batch_size=8, group_size=4, eval_every=1, eval_env=Judge())
        assert session.runs == []
    assert not list((tmp_path / "runs").glob("run-*"))


def test_an_unwired_environment_is_evaluated_with_the_policies_of_its_roles(tmp_path):
    session, _ = make_session(tmp_path, Graded())
    other = Graded([{"prompt": "ba=", "value": 1.0}, {"prompt": "ba=", "value": 0.0}])
    with session:
        run = session.train(steps=1, batch_size=8, group_size=4, eval_every=1,
                            eval_env=other).wait(progress=False)
    windows = run.evaluations
    assert list(windows["version"]) == [0, 1]
    assert list(windows["solver/avg@1"]) == [0.5, 0.5]
    assert not any(e.sample.get("value") is not None for e in run.episodes)


def test_a_window_whose_plays_fail_records_them_and_training_goes_on(tmp_path):
    broken = Graded([{"value": 1.0}, {"prompt": "ab=", "value": 0.5}])  # no prompt: KeyError
    session, _ = make_session(tmp_path, broken)
    with session:
        run = session.train(steps=1, batch_size=8, group_size=4, eval_every=1,
                            eval_k=2).wait(progress=False)
    windows = run.evaluations
    assert run.status == "finished" and list(windows["version"]) == [0, 1]
    assert list(windows["failed"]) == [2, 2]  # both plays of the first problem
    # only the second problem is scored: avg@2 0.5, never solved
    assert list(windows["solver/avg@2"]) == [0.5, 0.5]
    assert list(windows["solver/pass@2"]) == [0.0, 0.0]
    assert all("KeyError: 'prompt'" in error for error in windows["first_error"])


# -- truncated and counted episodes in the metrics rows --------------------------------------------

class CutShort(ab.Environment):
    """Every episode counts a try; samples marked `cut` sample a second turn past the episode's
    one-token budget, so they end truncated (and count a cut first). Samples carry `_epoch`."""

    roles = ("solver",)
    sampling = SamplingParams(max_new_tokens=4)
    max_episode_tokens = 1

    def __init__(self):
        self.rng = random.Random(0)

    def samples(self, seed=0):
        rng = random.Random(seed)
        for i in itertools.count():
            yield {"prompt": "ab=", "cut": rng.random() < 0.5, "_epoch": i // 4}

    async def episode(self, ctx, sample):
        ctx.count("tries")
        await ctx.generate("solver", sample["prompt"])
        if sample["cut"]:
            ctx.count("cuts", 2)
            await ctx.generate("solver", sample["prompt"])  # past the budget: truncated
        return self.rng.random()  # varied rewards: every uncut group trains


class Logged(Recorder):
    """A recorder that keeps the order in which episodes and rows arrive."""

    log: list = []

    def add_episode(self, traj, trainer_version, **kw):
        Logged.log.append(("episode", traj))
        return super().add_episode(traj, trainer_version, **kw)

    def add_row(self, row, **kw):
        Logged.log.append(("row", dict(row)))
        super().add_row(row, **kw)


def test_rows_count_truncated_episodes_counts_and_the_sample_epoch(tmp_path, monkeypatch):
    Logged.log = []
    monkeypatch.setattr("astranb.session.session.Recorder", Logged)
    session, _ = make_session(tmp_path, CutShort())
    with session:
        run = session.train(steps=3, batch_size=8, group_size=4).wait(progress=False)
    # replay the arrival order: each row holds what arrived since the row before it
    rows, truncated, counts, epoch = [], 0, {"tries": 0, "cuts": 0}, None
    for kind, item in Logged.log:
        if kind == "episode":
            truncated += item.truncated is not None
            for name, n in item.counts.items():
                counts[name] += n
            epoch = item.sample["_epoch"] if epoch is None else max(epoch, item.sample["_epoch"])
            assert (item.truncated is not None) == item.sample["cut"]
            assert item.truncated is None or item.truncated.startswith("budget")
            continue
        rows.append(item)
        assert item["truncated"] == truncated and item["count/tries"] == counts["tries"]
        assert item.get("count/cuts", 0) == counts["cuts"] and item["epoch"] == epoch
        truncated, counts = 0, {"tries": 0, "cuts": 0}
    assert len(rows) == 3 and rows == run.rows
    assert sum(r["count/tries"] for r in rows) > 0 and sum(r["truncated"] for r in rows) > 0
    cut = next(e for e in run.episodes if e.sample["cut"])
    assert cut.truncated.startswith("budget") and cut.counts == {"tries": 1, "cuts": 2}
    again = ab.Episode.from_json(cut.to_json())  # a line of episodes.jsonl keeps both
    assert (again.truncated, again.counts) == (cut.truncated, cut.counts)


def test_rows_without_counts_or_epochs_have_no_such_columns(tmp_path):
    session, _ = make_session(tmp_path, Graded())
    with session:
        run = session.train(steps=1, batch_size=8, group_size=4).wait(progress=False)
    row = run.rows[0]
    assert row["truncated"] == 0 and "epoch" not in row
    assert not [key for key in row if key.startswith("count/")]
    assert "kind" not in run.metrics.columns and run.evaluations.empty


# -- on rollout services ---------------------------------------------------------------------------

def test_rollout_services_play_the_windows_and_nothing_held_out_is_trained(tmp_path,
                                                                           monkeypatch):
    from tests.envs import CountA
    from tests.services import in_process_services

    class HeldOutCountA(CountA):
        registry_name = "CountA"  # the services build CountA and play the samples sent to them
        splits = ("train", "test")

        def split_samples(self, split, seed=0):
            return iter([{"prompt": p, "heldout": True} for p in ("ab=", "ba=", "bb=")])

    buffered = []
    put = Buffer.put
    monkeypatch.setattr(Buffer, "put", lambda self, group: (
        buffered.extend(t.sample for t in group.trajectories), put(self, group))[1])
    session, _, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), trainer=False)
    with session:
        policy = session.policy("solver", ab.models.tiny())
        session.wire(HeldOutCountA(), solver=policy)
        run = session.train(steps=2, batch_size=8, group_size=4, max_staleness=1, eval_every=1,
                            eval_n=3, eval_k=2).wait(progress=False)
        again = session.evaluate(split="test", n=3, k=2)
    assert buffered and not any(s.get("heldout") for s in buffered)
    assert not any(e.sample.get("heldout") for e in run.episodes)
    windows = run.evaluations
    assert list(windows["version"])[0] == 0 and list(windows["version"])[-1] == 2
    assert set(windows["n"]) == {3} and set(windows["failed"]) == {0}
    for _, window in windows.iterrows():  # avg@2 of CountA's rewards, in their range
        assert 0.0 <= window["solver/avg@2"] <= 1.1 and 0.0 <= window["solver/pass@2"] <= 1.0
    books = run.accounting
    assert books["lost"] == 0 and books["trained_twice"] == 0 and books["duplicates"] == 0
    assert again["solver"].versions == (2,) and again["solver"].n == 3
