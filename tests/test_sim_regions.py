"""Rollouts over regions on the simulator: links, weight bytes from the codec, relays, routing,
the staleness bound far from the trainer, and autoscaling. Hand-computed where possible."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch

pytest.importorskip("trio", reason="the simulator's virtual clock is trio's MockClock")

from astranb import sim  # noqa: E402
from astranb.sim import (  # noqa: E402
    Autoscale,
    GpuPool,
    Lengths,
    LengthSchedule,
    Link,
    LinkSpec,
    ModelWeights,
    Pool,
    Region,
    RegionSimConfig,
    RolloutCosts,
    Signals,
    TrainCosts,
    Workload,
)
from astranb.sim.payload import measured_bytes_per_change  # noqa: E402
from astranb.weights import codec  # noqa: E402

WAN = LinkSpec(4e9, 0.3)
HOME = Region("home", LinkSpec(400e9, 0.001), sync="direct")


def small(pools=(("home", "home", 2, 1.0), ("west", "west", 2, 0.6), ("east", "east", 2, 0.3)),
          regions=None, **overrides) -> RegionSimConfig:
    """Three pools at 100/60/30 % per GPU (two behind 4 Gbit/s, 300 ms links), 8-sequence
    batches, short answers, a 1B-parameter model: a cross-region run in about a second."""
    if regions is None:
        known = {"home": HOME, "west": Region("west", WAN), "east": Region("east", WAN)}
        regions = tuple(known[name] for name in dict.fromkeys(p[1] for p in pools))
    config = RegionSimConfig(
        regions=tuple(regions),
        pools=tuple(Pool(name, region, gpus, speed) for name, region, gpus, speed in pools),
        rollout=RolloutCosts(gpus=1, max_batch=8, step_base=0.012, step_per_seq=0.0003,
                             prefill_per_token=1e-5, update_seconds=0.2),
        training=TrainCosts(gpus=8, gpu_seconds_per_token=1e-4, step_overhead=0.5),
        workload=Workload(prompt_tokens=32, solver=Lengths(100, 0.5, 400), token_scale=4),
        weights=ModelWeights(1e9, bytes_per_change=1.5),
        steps=8, warmup=3, batch_size=256, group_size=8, max_staleness=2)
    return dataclasses.replace(config, **overrides)


# -- links ---------------------------------------------------------------------------------------

def test_one_transfer_takes_a_round_trip_plus_bytes_over_bandwidth():
    async def pull(spec: LinkSpec, nbytes: float) -> float:
        return await Link(spec).transfer(nbytes)

    # 500 MB over 4 Gbit/s: 0.3 s round trip + 4e9 bits / 4e9 bits/s
    assert sim.run_virtual(pull, WAN, 500e6) == pytest.approx(1.3)
    assert WAN.seconds(500e6) == pytest.approx(1.3)
    # three round trips for handshakes and slow start: 0.9 + 1.0
    assert sim.run_virtual(pull, LinkSpec(4e9, 0.3, rtts=3), 500e6) == pytest.approx(1.9)
    assert sim.run_virtual(pull, WAN, 0) == pytest.approx(0.3)


def test_concurrent_pulls_share_the_bandwidth():
    async def together() -> list[float]:
        link, ends = Link(WAN), [0.0, 0.0]

        async def one(i: int) -> None:
            await link.transfer(500e6)
            ends[i] = anyio.current_time()

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
        return [end - start for end in ends]

    # each gets 2 Gbit/s: 0.3 + 4e9 / 2e9
    assert sim.run_virtual(together) == pytest.approx([2.3, 2.3])
    assert WAN.seconds(500e6, sharing=2) == pytest.approx(2.3)

    async def staggered() -> tuple[float, float]:
        link, ends = Link(WAN), {}

        async def pull(name: str, delay: float, nbytes: float) -> None:
            await anyio.sleep(delay)
            await link.transfer(nbytes)
            ends[name] = anyio.current_time() - start

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pull, "a", 0.0, 1e9)
            tg.start_soon(pull, "b", 0.5, 250e6)
        return ends["a"], ends["b"]

    # a: 8e9 bits from 0.3 s, alone until 0.8 s (2e9 bits moved); b's 2e9 bits flow from 0.8 s
    # at half the bandwidth and end at 1.8 s; a moved 2e9 more meanwhile, its last 4e9 bits take
    # 1 s alone: 2.8 s
    a, b = sim.run_virtual(staggered)
    assert a == pytest.approx(2.8) and b == pytest.approx(1.8)


# -- weight bytes from the codec -----------------------------------------------------------------

def test_delta_bytes_are_the_real_codecs():
    per_change = [measured_bytes_per_change(d) for d in (0.001, 0.01, 0.1)]
    assert per_change[0] > per_change[1] > per_change[2]  # denser changes: shorter gaps to code
    assert 1.0 < per_change[1] < 2.0
    # the model's figure for a tensor matches what the codec sends for another one (other seed)
    n, p = 1 << 20, 0.01
    generator = torch.Generator().manual_seed(7)
    old = (torch.randn(n, generator=generator) * 0.02).to(torch.bfloat16)
    new = old.clone()
    positions = torch.randperm(n, generator=generator)[: int(n * p)]
    steps = torch.randint(1, 5, (positions.numel(),), generator=generator, dtype=torch.int16)
    signs = torch.randint(0, 2, (positions.numel(),), generator=generator, dtype=torch.int16)
    new.view(torch.int16)[positions] += steps * (2 * signs - 1)  # +-1..4 ulps, as an AdamW step
    sent = len(codec.encode({"w": old}, {"w": new})) - len(codec.encode({"w": old}, {"w": old}))
    assert ModelWeights(n, changed_fraction=p).delta_bytes == pytest.approx(sent, rel=0.05)
    # a full snapshot is bf16: 2 bytes per element; Qwen3-14B's 14.8e9 are 29.6 GB
    assert sim.QWEN3_14B.full_bytes == pytest.approx(29.6e9)
    assert sim.QWEN3_14B.delta_bytes < 0.01 * sim.QWEN3_14B.full_bytes


# -- relays --------------------------------------------------------------------------------------

@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
@pytest.mark.parametrize("sync", ["relay", "direct"])
def test_a_relay_pulls_each_version_once_per_region_direct_pulls_once_per_service(sync):
    config = small(pools=(("home", "home", 2, 1.0), ("far", "west", 4, 1.0)), sync=sync,
                   steps=6, full_every=4)
    result = sim.simulate_regions(config)
    syncs = [s for s in result.sync_log if s.region == "west"]
    assert [s.version for s in syncs] == list(range(1, len({s.version for s in syncs}) + 1))
    assert {s.kind for s in syncs} == {"delta", "full"}  # version 4 is a forced full snapshot
    # what one service needs: every version's payload once
    one_service = sum(config.weights.full_bytes if s.kind == "full"
                      else config.weights.delta_bytes for s in syncs)
    over_link = result.link_bytes["west"]
    if sync == "relay":
        assert over_link <= 1.1 * one_service
    else:
        assert over_link == pytest.approx(4 * one_service)
    # the home region pulls directly either way (its Region says so): 2 services, 2 copies
    home = sum(config.weights.full_bytes if s.kind == "full" else config.weights.delta_bytes
               for s in result.sync_log if s.region == "home")
    assert result.link_bytes["home"] == pytest.approx(2 * home)


# -- routing -------------------------------------------------------------------------------------

@pytest.mark.slow  # long simulated runs
@pytest.mark.parametrize("routing", ["throughput", "round_robin"])
def test_throughput_aware_routing_gives_a_slow_pool_proportionally_less_work(routing):
    # two pools of 2 GPUs beside the trainer, one a quarter as fast: 20% of the capacity
    config = small(pools=(("fast", "home", 2, 1.0), ("slow", "home", 2, 0.25)), routing=routing,
                   steps=6)
    result = sim.simulate_regions(config)
    assert result.capacity_share["slow"] == pytest.approx(0.2)
    share = result.work_share["slow"]
    if routing == "throughput":  # measured from what each pool decoded, not declared
        assert share == pytest.approx(0.2, abs=0.06)
    else:
        assert share == pytest.approx(0.5, abs=0.02)


@pytest.mark.slow  # a long simulated run
def test_a_pool_far_behind_gets_no_new_work_and_holds_nothing_back():
    # a 10 Mbit/s link: even a delta (15 MB) takes 12 s, so the far pool falls behind
    slow_link = LinkSpec(10e6, 0.3)
    config = small(pools=(("home", "home", 4, 1.0), ("far", "far", 4, 1.0)),
                   regions=(HOME, Region("far", slow_link)), steps=8)
    result = sim.simulate_regions(config)
    alone = sim.simulate_regions(small(pools=(("home", "home", 4, 1.0),), regions=(HOME,),
                                       steps=8))
    assert result.work_share["far"] < 0.3  # work only while it is at most a version behind
    assert result.accounting["rerouted"] > 0  # what waited there for weights went elsewhere
    assert result.staleness_max <= config.max_staleness
    assert result.seconds_per_step <= 1.05 * alone.seconds_per_step  # never waited on


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_staleness_bound_holds_at_every_step_across_regions(max_staleness):
    result = sim.simulate_regions(small(max_staleness=max_staleness, steps=10))
    rows = result.metrics
    assert (rows["staleness_max"] <= max_staleness).all()
    # per-token versions: every trained token was sampled at most max_staleness versions back
    assert (rows["step"] - rows["token_version_min"] <= max_staleness).all()
    assert rows["staleness_max"].max() >= 1  # rollouts do run ahead
    assert result.accounting["lost"] == 0


# -- autoscaling ---------------------------------------------------------------------------------

def test_autoscale_rule_matches_throughput():
    rule = Autoscale(min_gpus=2, max_gpus=12, utilization=0.8)

    def signals(**kw) -> Signals:
        base = dict(time=600.0, steps=3, gpus=4, starting=0, draining=0, queue=0.5, ready=1.0,
                    trainer_idle=0.0, demand=10_000.0, gpu_rate=2_000.0)
        return Signals(**{**base, **kw})

    assert rule.needed(signals()) == 7  # 10k tokens/s / (2k x 0.8) = 6.25
    assert rule.decide(signals()) == 3  # work waits: add up to what is needed
    assert rule.decide(signals(queue=0.0)) == 0  # nothing waits: more GPUs would idle
    assert rule.decide(signals(gpus=10, queue=0.0)) == -1  # too many: drain one per look
    assert rule.decide(signals(gpus=10, trainer_idle=0.1)) == 0  # the trainer waited: keep
    assert rule.decide(signals(gpus=10, starting=1)) == 0
    assert rule.decide(signals(steps=0)) == 0  # the pipeline is still filling
    assert rule.clamp(20, signals()) == 8 and rule.clamp(-20, signals()) == -2
    custom = Autoscale(policy=lambda s: 5 if s.queue > 1 else 0)
    assert custom.decide(signals(queue=2.0)) == 5 and custom.decide(signals()) == 0
    with pytest.raises(ValueError, match="min_gpus"):
        Autoscale(min_gpus=0)


def test_draining_gpu_finishes_what_it_decodes_and_hands_on_its_queue():
    costs = RolloutCosts(gpus=2, max_batch=2, step_base=1.0, step_per_seq=0.0,
                         prefill_per_token=0.0, update_seconds=0.0)

    async def scenario():
        pool = GpuPool(costs)
        pool.versions["p"] = 0
        finished: list[tuple[int, float]] = []

        async def request(i: int, tokens: int) -> None:
            await pool.decode("p", 1, tokens)
            finished.append((i, anyio.current_time()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run)
            for i in range(6):  # 3 per GPU: 2 decoding, 1 queued on each
                tg.start_soon(request, i, 4)
            await anyio.sleep(0.5)
            assert pool.drain()
            while len(finished) < 6:
                await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
        return pool, finished

    pool, finished = sim.run_virtual(scenario)
    # the drained GPU ran its 2 sequences to the end (4 steps of 1 s) and left at 4 s; its
    # queued one ran on the other GPU after that GPU's own two (4 s), with that GPU's queued one
    assert pool.drained_sequences == 2
    assert len(pool.retired) == 1 and pool.retired[0].left == pytest.approx(4.0)
    assert sorted(t for _, t in finished) == pytest.approx([4.0] * 4 + [8.0] * 2)
    assert pool.gpu_seconds(8.0) == pytest.approx(4.0 + 8.0)  # billed until it left
    assert not pool.drain()  # the last serving GPU stays


@pytest.mark.slow  # a long simulated run
def test_autoscaler_adds_when_work_waits_and_drains_when_idle_losing_nothing():
    # long answers first (rollouts are the bottleneck: work queues), then short ones (training
    # is: ~4 GPUs keep up)
    long, short = Lengths(400, 0.3, 800), Lengths(40, 0.3, 800)
    rule = Autoscale(min_gpus=1, max_gpus=8, interval=10.0, startup_seconds=5.0)
    config = small(pools=(("home", "home", 2, 1.0),), regions=(HOME,), steps=16,
                   training=TrainCosts(gpus=1, gpu_seconds_per_token=2e-4, step_overhead=2.0),
                   schedule=LengthSchedule.phases((0, long), (4, short)))
    scaled = dataclasses.replace(config, pools=(Pool("home", "home", 2, autoscale=rule),))
    result = sim.simulate_regions(scaled)
    added = [s for s in result.scaling if s.change > 0]
    drained = [s for s in result.scaling if s.change < 0]
    assert added and drained
    assert all(s.signals.queue >= rule.up_queue for s in added)  # work was waiting
    assert all(s.signals.trainer_idle <= rule.down_idle for s in drained)
    # up while the long answers queue, down once the short ones leave GPUs idle
    assert min(s.time for s in added) < min(s.time for s in drained)
    assert min(s.signals.steps for s in drained) >= 4
    books = result.accounting
    assert books["lost"] == 0 and books["drained_sequences"] > 0
    assert books["submitted"] == books["completed"] + books["abandoned"] + books["playing"]
    static = sim.simulate_regions(config)
    assert result.time_to_target < static.time_to_target  # the added GPUs were used


# -- the bench's headline, small -----------------------------------------------------------------

@pytest.mark.slow  # a long simulated run
def test_throughput_aware_with_relays_reaches_the_pools_capacity():
    best = sim.simulate_regions(small(sync="relay", routing="throughput"))
    naive = sim.simulate_regions(small(sync="direct", routing="round_robin"))
    assert best.fraction >= 0.9
    assert naive.fraction < best.fraction - 0.2  # the 30% pool gets a third of the work
    assert best.link_bytes["west"] < naive.link_bytes["west"]
    assert best.accounting["lost"] == naive.accounting["lost"] == 0


def test_bad_region_configs_say_what_to_do():
    with pytest.raises(ValueError, match="add Region"):
        small(regions=(HOME,))
    with pytest.raises(ValueError, match="routing"):
        small(routing="fastest")
    with pytest.raises(ValueError, match="bits/s"):
        LinkSpec(0, 0.3)
    with pytest.raises(ValueError, match="changed_fraction"):
        ModelWeights(1e9, changed_fraction=2.0)
    with pytest.raises(ValueError, match="increasing"):
        LengthSchedule(((4, Lengths(10)), (2, Lengths(20))))
