"""Several policies in one run: credit assignment, shared parameters, weighted environments,
per-policy staleness in both coordination modes, and the barrier's version lockstep."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import astranb as ab

from .envs import CountA, Duet, OnlyB

TINY = dict(hidden_size=32, num_heads=2)


def two_policies(tmp_path, **wire):
    session = ab.Session(tmp_path / "runs")
    solver = session.policy("solver", ab.models.tiny(**TINY), max_batch_size=32)
    verifier = session.policy("verifier", ab.models.tiny(seed=1, **TINY), max_batch_size=32)
    return session, solver, verifier


def capture_batches(policy, seconds: float = 0.0):
    """Record every batch the policy's trainer steps on (optionally making steps slow)."""
    seen, step = [], policy.trainer.step

    def spy(batch):
        seen.append(batch)
        time.sleep(seconds)
        return step(batch)

    policy.trainer.step = spy
    return seen


def test_each_policy_trains_only_on_its_own_turns(tmp_path):
    session, solver, verifier = two_policies(tmp_path)
    tok = solver.tokenizer
    marker = {"solver": tok.encode("s")[0], "verifier": tok.encode("v")[0]}
    batches = {p.name: capture_batches(p) for p in (solver, verifier)}
    with session:
        session.wire(Duet(), solver=solver, verifier=verifier)
        run = session.train(steps=3, batch_size=8, group_size=4, max_staleness=1,
                            record="all").wait(progress=False)
    episodes = {e.index: e for e in run.episodes}
    assert set(run.metrics["policy"]) == {"solver", "verifier"}
    for name, seen in batches.items():
        assert len(seen) == 3
        for batch in seen:
            first = batch.input_ids_B_T[:, 0].tolist()  # prompts start with the role's marker
            assert first == [marker[name]] * batch.size, name
            # the reward a row is trained with is its role's reward, never the other role's
            rewards = {e.rewards[name] for e in episodes.values() if e.rewards}  # quarters: exact
            assert set(batch.rewards_B.tolist()) <= rewards


def test_one_policy_in_two_roles_trains_one_set_of_weights(tmp_path):
    session = ab.Session(tmp_path / "runs")
    shared = session.policy("shared", ab.models.tiny(**TINY), max_batch_size=32)
    seen = capture_batches(shared)
    with session:
        session.wire(Duet(), solver=shared, verifier=shared)
        run = session.train(steps=3, batch_size=8, group_size=4,
                            max_staleness=1).wait(progress=False)
    assert list(run.metrics["policy"]) == ["shared"] * 3 and shared.version == 3
    tok = shared.tokenizer
    for batch in seen:  # both roles' turns in the same batch: 2 rows per episode
        firsts = Counter(batch.input_ids_B_T[:, 0].tolist())
        assert firsts[tok.encode("s")[0]] == firsts[tok.encode("v")[0]] == batch.size // 2
    assert shared.engine.weights_checksum == shared.weights_checksum


def test_environments_are_sampled_by_weight(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", ab.models.tiny(**TINY), max_batch_size=32)
    with session:
        session.wire(CountA(), weight=3.0, solver=policy)
        session.wire(OnlyB(), weight=1.0, solver=policy)
        run = session.train(steps=6, batch_size=16, group_size=4, max_staleness=1,
                            record="all").wait(progress=False)
        with pytest.raises(ValueError, match="several environments are wired"):
            session.evaluate(n=4)
        with pytest.raises(ValueError, match="weight must be a number > 0"):
            session.wire(OnlyB(), weight=0, solver=policy)
    prompts = Counter("zz=" if e.sample["prompt"] == "zz=" else "other" for e in run.episodes)
    share = prompts["zz="] / sum(prompts.values())
    assert 0.1 < share < 0.45, prompts  # 1 in 4 expected


@pytest.mark.slow  # six full two-policy training runs
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(max_staleness=st.integers(0, 2), mode=st.sampled_from(["independent", "barrier"]),
       slow=st.sampled_from(["solver", "verifier"]))
def test_each_policys_staleness_bound_holds_in_both_modes(tmp_path_factory, max_staleness, mode,
                                                           slow):
    session, solver, verifier = two_policies(tmp_path_factory.mktemp("s"))
    capture_batches(solver if slow == "solver" else verifier, seconds=0.05)
    with session:
        session.wire(Duet(), solver=solver, verifier=verifier)
        run = session.train(steps=4, batch_size=8, group_size=2, max_staleness=max_staleness,
                            mode=mode).wait(progress=False)
    df = run.metrics
    assert len(df) == 8
    for name, rows in df.groupby("policy"):
        assert rows["staleness_max"].max() <= max_staleness, name
        assert (rows["token_version_min"] >= rows["step"] - max_staleness).all(), name


def _spread_observer(session, spreads):
    def observe(kind, payload):
        if kind == "metrics":
            versions = [p.version for p in session.policies.values()]
            spreads.append(max(versions) - min(versions))
    return observe


@pytest.mark.slow  # two full training runs with a deliberately slow trainer
def test_barrier_keeps_versions_within_one_and_independent_does_not(tmp_path):
    spreads = {}
    for mode in ("barrier", "independent"):
        session, solver, verifier = two_policies(tmp_path / mode)
        capture_batches(verifier, seconds=1.0)  # the verifier trains much slower (margin for
        # busy cores: the solver must have time to run ahead on rollouts alone)
        with session:
            session.wire(Duet(), solver=solver, verifier=verifier)
            run = session.train(steps=6, batch_size=8, group_size=2, max_staleness=3, mode=mode)
            spreads[mode] = []
            run.on_event(_spread_observer(session, spreads[mode]))
            run.wait(progress=False)
        assert solver.version == verifier.version == 6
    assert max(spreads["barrier"]) <= 1
    assert max(spreads["independent"]) >= 2  # without the barrier the fast policy runs ahead
