"""Staleness gate, buffer order and drops, batch building: pure dataflow, no model."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astranb.algorithms import GRPO
from astranb.dataflow.batcher import build_batch, group_rewards, has_signal_for
from astranb.dataflow.buffer import Buffer, Group
from astranb.dataflow.staleness import StalenessGate, staleness
from astranb.types import Generation, SamplingParams, Trajectory, Turn


def traj(group: int, reward: float, versions=(0,), prompt=(5, 6), policy="p") -> Trajectory:
    gen = Generation(prompt, tuple(range(10, 10 + len(versions))), tuple([-1.0] * len(versions)),
                     tuple(versions), "length", "x")
    turn = Turn("solver", policy, gen, SamplingParams(temperature=1.0))
    return Trajectory({"i": group}, (turn,), {"solver": reward}, group)


def group(gid: int, versions_per_episode, rewards=None) -> Group:
    rewards = rewards or [float(i % 2) for i in range(len(versions_per_episode))]
    trajs = tuple(traj(gid, r, v) for r, v in zip(rewards, versions_per_episode, strict=True))
    return Group(gid, trajs, min(min(v) for v in versions_per_episode), frozenset({"p"}))


def test_staleness_is_current_minus_oldest_token():
    assert staleness(5, [3, 4, 5]) == 2  # 5 - min(3, 4, 5)
    assert staleness(5, [-1, 5]) == 0  # -1 marks prompt tokens: ignored
    assert staleness(7, []) == 0


def test_gate_capacity_is_staleness_plus_one_batches():
    gate = StalenessGate(["p"], groups_per_batch=2, max_staleness=1)
    assert gate.capacity == 4  # (1 + 1) * 2

    async def main():
        for _ in range(4):
            await gate.admit(["p"])
        assert not gate.has_room(["p"])
        with anyio.move_on_after(0.05) as scope:
            await gate.admit(["p"])
        assert scope.cancelled_caught  # the fifth group waits
        gate.release({"p": 1})
        await gate.admit(["p"])
        assert gate.live["p"] == 4

    anyio.run(main)


def test_gate_rejects_negative_staleness_and_over_release():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(["p"], 1, -1)
    gate = StalenessGate(["p"], 1, 0)
    with pytest.raises(RuntimeError, match="only 0 live"):
        gate.release({"p": 1})


def test_buffer_edf_pops_oldest_tokens_first_and_fifo_by_arrival():
    async def main(order):
        buf = Buffer("p", order)
        buf.put(group(0, [(3,), (3,)]))
        buf.put(group(1, [(1,), (2,)]))
        buf.put(group(2, [(2,), (2,)]))
        dropped = []
        batch = await buf.pop(3, version=3, max_staleness=5, on_drop=dropped.append)
        return [g.id for g in batch], dropped

    assert anyio.run(main, "edf") == ([1, 2, 0], [])
    assert anyio.run(main, "fifo") == ([0, 1, 2], [])


def test_buffer_drops_groups_too_stale_at_pop():
    async def main():
        buf = Buffer("p", "edf")
        buf.put(group(0, [(1,), (4,)]))  # oldest token v1: 5 - 1 = 4 > 2, dropped
        buf.put(group(1, [(3,), (4,)]))  # 5 - 3 = 2 <= 2, kept
        buf.put(group(2, [(4,), (5,)]))
        dropped = []
        batch = await buf.pop(2, version=5, max_staleness=2, on_drop=dropped.append)
        return [g.id for g in batch], [g.id for g in dropped]

    assert anyio.run(main) == ([1, 2], [0])


def test_a_pop_cancelled_while_waiting_puts_back_what_it_took():
    """The train loop collects the next batch ahead and may cancel that (a rollback, a stop):
    groups taken so far return to the buffer, in their order."""
    async def main():
        buf = Buffer("p", "edf")
        buf.put(group(0, [(2,), (2,)]))
        buf.put(group(1, [(1,), (3,)]))
        with anyio.move_on_after(0.05):
            await buf.pop(3, version=3, max_staleness=5)  # 2 of 3: waits for a third
        assert len(buf) == 2
        buf.put(group(2, [(3,), (3,)]))
        return [g.id for g in await buf.pop(3, version=3, max_staleness=5)]

    assert anyio.run(main) == [1, 0, 2]

    async def fifo():
        buf = Buffer("p", "fifo")
        buf.put(group(0, [(2,), (2,)]))
        with anyio.move_on_after(0.05):
            await buf.pop(2, version=3, max_staleness=5)
        buf.put(group(1, [(1,), (3,)]))
        return [g.id for g in await buf.pop(2, version=3, max_staleness=5)]

    assert anyio.run(fifo) == [0, 1]  # back in arrival order, ahead of a later arrival


def test_has_signal_filters_groups_with_equal_rewards():
    assert has_signal_for(group(0, [(0,), (0,)], [1.0, 0.0]), "p")
    assert not has_signal_for(group(0, [(0,), (0,)], [1.0, 1.0]), "p")
    assert not has_signal_for(group(0, [(0,)], [1.0]), "p")


def test_build_batch_aligns_masks_logprobs_and_advantages():
    g = group(0, [(0, 0), (0, 1)], [1.0, 0.0])
    batch = build_batch([g], "p", GRPO(), pad_id=0)
    # rows: prompt (5, 6) + completion (10, 11); loss on positions 2 and 3
    assert batch.input_ids_B_T.tolist() == [[5, 6, 10, 11], [5, 6, 10, 11]]
    assert batch.loss_mask_B_T.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert batch.versions_B_T.tolist() == [[-1, -1, 0, 0], [-1, -1, 0, 1]]
    # group rewards [1, 0]: mean 0.5, std 0.5 -> advantages +1 and -1 (up to eps)
    adv = batch.advantages_B_T
    assert torch.allclose(adv[:, 2:], torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), atol=1e-5)
    assert adv[:, :2].abs().sum() == 0
    assert batch.old_logp_B_T[:, 2:].eq(-1.0).all()


def selfplay(winner: str) -> Trajectory:
    """One game of a policy "p" against itself: player0's turn (prompt 1), player1's (prompt 2),
    +1 to the winner and -1 to the other (their mean is 0)."""
    def turn(role, prompt):
        gen = Generation((prompt,), (10,), (-1.0,), (0,), "stop", "x")
        return Turn(role, "p", gen, SamplingParams(temperature=1.0))
    rewards = {"player0": 1.0 if winner == "player0" else -1.0}
    rewards["player1"] = -rewards["player0"]
    return Trajectory({"i": 0}, (turn("player0", 1), turn("player1", 2)), rewards, 0)


def test_self_play_is_normalised_per_seat_not_by_the_zero_sum_mean():
    g = Group(0, (selfplay("player0"), selfplay("player1")), 0, frozenset({"p"}))
    assert has_signal_for(g, "p")          # the mean of each game is 0; each seat's is not
    assert group_rewards(g, "p") == [1.0, -1.0, -1.0, 1.0]
    batch = build_batch([g], "p", GRPO(), pad_id=0)
    # rows per seat: player0's of games 1, 2 (rewards +1, -1), then player1's (-1, +1)
    assert batch.input_ids_B_T.tolist() == [[1, 10], [1, 10], [2, 10], [2, 10]]
    assert torch.allclose(batch.advantages_B_T[:, 1],
                          torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    tied = Group(0, (selfplay("player0"), selfplay("player0")), 0, frozenset({"p"}))
    assert not has_signal_for(tied, "p")   # player0 won both: each seat tied


# -- property: nothing trained is ever staler than the bound -----------------------------------

@settings(max_examples=150, deadline=None)
@given(
    max_staleness=st.integers(0, 3),
    groups_per_batch=st.integers(1, 3),
    steps=st.integers(1, 6),
    lags=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    spans=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    order=st.sampled_from(["edf", "fifo"]),
)
def test_trained_groups_never_exceed_max_staleness(
    max_staleness, groups_per_batch, steps, lags, spans, order
):
    """Simulate rollouts racing the trainer under the real gate and buffer. Every other group
    starts some versions behind the trainer (an engine lagging on updates) and every group's
    tokens may span later versions (in-flight updates). Every trained group must be within the
    bound, and training must never deadlock."""
    trained: list[int] = []
    state = {"version": 0}

    async def producer(gate, buf):
        gid = 0
        while True:
            await gate.admit(["p"])
            lag = lags[gid % len(lags)] if gid % 2 else 0
            start = max(0, state["version"] - lag)
            end = start + spans[gid % len(spans)]
            await anyio.sleep(0)
            buf.put(group(gid, [(start, end), (start + 1, end)]))
            gid += 1

    async def main():
        gate = StalenessGate(["p"], groups_per_batch, max_staleness)
        buf = Buffer("p", order)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(producer, gate, buf)
                while state["version"] < steps:
                    batch = await buf.pop(
                        groups_per_batch, state["version"], max_staleness,
                        on_drop=lambda g: gate.release({"p": 1}),
                    )
                    trained.extend(state["version"] - g.min_version("p") for g in batch)
                    state["version"] += 1
                    gate.release({"p": len(batch)})
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(trained) == steps * groups_per_batch
    assert max(trained) <= max_staleness


def test_a_sample_stream_that_ends_while_a_worker_waits_at_the_gate_ends_cleanly():
    """Two workers, room for one group: worker B picks the one-sample stream, then waits at the
    gate while worker A takes the only sample and finds the stream empty. B must then see the
    stream ended (and release its admission), not call next() on it."""
    import types

    from astranb.dataflow.orchestrator import Orchestrator, Source
    from astranb.environments import Environment

    class OneSample(Environment):
        roles = ("solver",)

        def samples(self, seed=0):
            yield {"prompt": "1+1="}

        async def episode(self, ctx, sample):
            await ctx.generate("solver", [5, 6])
            return 1.0

    class Engine:
        async def generate(self, request):
            await anyio.sleep(0.01)
            return Generation(request.prompt_ids, (7,), (-0.1,), (0,), "stop")

    tokenizer = types.SimpleNamespace(eos_token_id=None)
    policy = types.SimpleNamespace(name="p", version=0, tokenizer=tokenizer, engine=Engine(),
                                   algorithm=GRPO(filter_groups=False))
    recorder = types.SimpleNamespace(add_episode=lambda *a, **k: None)
    gate = StalenessGate(["p"], groups_per_batch=1, max_staleness=0)  # capacity: 1 group
    buffers = {"p": Buffer("p")}
    orchestrator = Orchestrator([Source(OneSample(), {"solver": policy})], buffers, gate,
                                recorder, group_size=2)

    async def main():
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(orchestrator.run, 2)
                await anyio.sleep(0.2)  # A played the sample into the buffer; B waits for room
                assert len(buffers["p"]) == 1
                gate.release({"p": 1})  # the trainer took A's group: B is admitted
        return orchestrator.counters.episodes

    assert anyio.run(main) == 2  # one group of two episodes, then both workers stop
    assert gate.live["p"] == 0  # B gave its admission back
