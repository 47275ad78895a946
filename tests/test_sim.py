"""The cost-model simulator: virtual time, determinism, and the real dataflow's guarantees on it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import anyio
import pytest

pytest.importorskip("trio", reason="the simulator's virtual clock is trio's MockClock")

from astranb import sim  # noqa: E402
from astranb.session.recorder import EpisodeLog  # noqa: E402
from astranb.sim import Lengths, RolloutCosts, SimConfig, TrainCosts, Workload  # noqa: E402


def small(**overrides) -> SimConfig:
    """Two rollout GPUs, two training GPUs, 16 episodes a step: seconds of real time."""
    config = SimConfig(
        rollout=RolloutCosts(gpus=2, max_batch=16, step_base=0.02, step_per_seq=0.001,
                             prefill_per_token=1e-4, update_seconds=0.5),
        training=TrainCosts(gpus=2, gpu_seconds_per_token=2e-3, step_overhead=0.5),
        workload=Workload(prompt_tokens=16, solver=Lengths(64, 1.0, 512),
                          verifier=Lengths(16, 0.5, 64), verifier_prompt_extra=4, token_scale=4),
        batch_size=16, group_size=4, steps=8, warmup=2, sync_steps=3, max_staleness=1,
        schedules=("independent",),
    )
    return dataclasses.replace(config, **overrides)


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_virtual_time_is_virtual():
    started = time.perf_counter()
    assert sim.run_virtual(_sleep_an_hour) == pytest.approx(3600.0)
    # a whole run of GPU-hours, not just one sleep
    slow = dataclasses.replace(small().rollout, step_base=5.0)
    result = sim.simulate(small(rollout=slow, schedules=("independent", "baseline")))
    assert min(r.virtual_seconds for r in result.schedules.values()) > 3600
    # waited for, the sleep alone would take an hour: any bound far below it shows the clock is
    # virtual, and a generous one holds on a loaded machine
    assert time.perf_counter() - started < 300.0


async def _sleep_an_hour() -> float:
    start = anyio.current_time()
    await anyio.sleep(3600)
    return anyio.current_time() - start


def test_runs_from_inside_an_event_loop_as_in_a_notebook_cell():
    async def cell():
        return sim.simulate(small(steps=3, warmup=1))

    result = asyncio.run(cell())
    assert len(result.metrics) == 6  # 2 policies x 3 steps


def test_same_seed_same_run_other_seed_other_run():
    first = sim.simulate(small(seed=3))
    again = sim.simulate(small(seed=3))
    other = sim.simulate(small(seed=4))
    assert first.metrics.equals(again.metrics)
    assert first.schedules["independent"].seconds_per_iteration == \
        again.schedules["independent"].seconds_per_iteration
    assert not first.metrics["time"].equals(other.metrics["time"])


@pytest.mark.parametrize("mode", ["independent", "barrier"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_staleness_bound_holds_per_policy(mode, max_staleness):
    result = sim.simulate(small(max_staleness=max_staleness, schedules=(mode,)))
    rows = result.metrics
    assert set(rows["policy"]) == {"solver", "verifier"}
    assert (rows["staleness_max"] <= max_staleness).all()
    assert (rows["step"] - rows["token_version_min"] <= max_staleness).all()
    assert rows["staleness_max"].max() == max_staleness  # the bound is reached, not idle


def test_in_flight_updates_give_later_tokens_the_new_version(tmp_path):
    sim.simulate(small(), directory=tmp_path)
    episodes = EpisodeLog(tmp_path / "independent")
    turns = [turn for episode in episodes for turn in episode.turns]
    mixed = [t["versions"] for t in turns if len(set(t["versions"])) > 1]
    assert mixed, "some generation should span a weight update"
    assert all(v == sorted(v) for v in mixed)


def _version_gaps(rows) -> list[int]:
    """|difference| of the two policies' trainer versions whenever one starts or ends a step.

    A step starts at time - step_seconds and its training ends at time - transfer_seconds (the
    row is written after publishing)."""
    rows = rows.assign(start=rows["time"] - rows["step_seconds"],
                       trained=rows["time"] - rows["transfer_seconds"])

    def version(policy: str, t: float) -> int:
        mine = rows[rows["policy"] == policy]
        return int((mine["trained"] <= t + 1e-9).sum())

    gaps = []
    for row in rows.itertuples():
        for t in (row.start, row.trained):
            gaps.append(abs(version("solver", t) - version("verifier", t)))
    return gaps


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_barrier_keeps_versions_within_one():
    # the solver trains 3x faster and rollouts are cheap: independent policies drift apart
    training = dataclasses.replace(small().training, gpus=4, placement="split", split=(3, 1))
    lopsided = small(training=training,
                     rollout=dataclasses.replace(small().rollout, step_base=0.005),
                     max_staleness=4)
    independent = sim.simulate(lopsided)
    barrier = sim.simulate(dataclasses.replace(lopsided, schedules=("barrier",)))
    assert max(_version_gaps(independent.metrics)) > 1  # without it the solver runs ahead
    assert max(_version_gaps(barrier.metrics)) <= 1


def test_baseline_iteration_is_rollout_then_each_training_then_publish():
    config = SimConfig(
        rollout=RolloutCosts(gpus=2, max_batch=8, step_base=0.01, step_per_seq=0.001,
                             prefill_per_token=1e-3, update_seconds=0.5),
        training=TrainCosts(gpus=2, gpu_seconds_per_token=1e-3, step_overhead=1.0),
        workload=Workload(prompt_tokens=8, solver=Lengths(40, 0.0, 64),
                          verifier=Lengths(10, 0.0, 16), verifier_prompt_extra=2, token_scale=2),
        batch_size=8, group_size=4, steps=3, warmup=1, sync_steps=3, schedules=("baseline",),
    )
    # 8 episodes on 2 GPUs: 4 sequences per GPU, a step costs (0.01 + 4 * 0.001) per real token.
    # Solver: prefill 4 x 8 tokens x 1e-3 = 0.032, then 40 tokens x 0.014 = 0.56.
    # Verifier reads 8 + 40 + 2 = 50 tokens: prefill 4 x 50 x 1e-3 = 0.2, then 10 x 0.014 = 0.14.
    rollout = 0.032 + 0.56 + 0.2 + 0.14
    # Training on both GPUs, one policy after the other: 1.0 + tokens x 1e-3 / 2, with
    # 8 x (8 + 40) = 384 solver tokens and 8 x (50 + 10) = 480 verifier tokens.
    train_solver, train_verifier = 1.0 + 384e-3 / 2, 1.0 + 480e-3 / 2
    # The first policy's publish overlaps the second one's training; the second's does not.
    publish = 0.5
    expected = rollout + train_solver + train_verifier + publish  # 3.864
    result = sim.simulate(config).schedules["baseline"]
    assert result.seconds_per_iteration == pytest.approx(expected, abs=1e-6)
    rows = sim.simulate(config).metrics
    assert sorted(rows["train_tokens"].unique()) == [384.0, 480.0]


def test_async_beats_the_baseline_and_respects_the_bound():
    result = sim.simulate(small(schedules=("independent", "barrier", "baseline")))
    for name in ("independent", "barrier"):
        r = result.schedules[name]
        assert r.speedup > 1.0
        assert r.bound_fraction <= 1.0
    assert result.schedules["baseline"].speedup == 1.0
    assert list(result.table().index) == ["independent", "barrier", "baseline"]


def test_bad_configs_say_what_to_do():
    with pytest.raises(ValueError, match="unknown schedule"):
        SimConfig(schedules=("fastest",))
    with pytest.raises(ValueError, match="split"):
        TrainCosts(gpus=8, split=(3, 3))
    with pytest.raises(ValueError, match="median"):
        Lengths(100, 1.0, cap=50)


def test_sim_engine_is_a_rollout_engine_with_timed_updates():
    from astranb.engines.base import RolloutEngine
    from astranb.sim import GpuPool, SimEngine
    from astranb.types import GenerationRequest, SamplingParams, WeightUpdate

    costs = RolloutCosts(gpus=1, max_batch=4, step_base=0.1, step_per_seq=0.0,
                         prefill_per_token=0.0, update_seconds=2.0)

    async def scenario():
        pool = GpuPool(costs)
        engine = SimEngine("solver", pool, Lengths(10, 0.0, 64))
        assert isinstance(engine, RolloutEngine)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            await anyio.sleep(0)
            request = GenerationRequest((2, 2), SamplingParams(max_new_tokens=64))
            first = await engine.generate(request)  # 10 steps of 0.1 s under version 0
            t0 = anyio.current_time()
            future = engine.update_weights(WeightUpdate("solver", 1))
            assert engine.availability() == 0  # loading weights
            while not future.done():
                await anyio.sleep(0.01)
            waited = anyio.current_time() - t0
            second = await engine.generate(request)
            tg.cancel_scope.cancel()
        return first, future.result(), waited, second

    first, applied, waited, second = sim.run_virtual(scenario)
    assert first.versions == (0,) * 10 and first.finish_reason == "stop"
    assert applied["kind"] == "simulated" and waited == pytest.approx(2.0, abs=0.011)
    assert second.versions == (1,) * 10
