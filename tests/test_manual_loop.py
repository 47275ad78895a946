"""A manual loop (astranb/session/manual.py): session.play, policy.build_batch,
forward_backward, optim_step, publish_weights, the blocks a train step is made of."""

from __future__ import annotations

import pytest
import torch

import astranb as ab
from astranb.remote.process import ProcessTrainer
from astranb.training.local import LocalTrainer
from tests.fsdp_worker import SPEC, make_batch
from tests.waiting import wait_until

OPTIMIZER = ab.AdamWConfig(lr=1e-2)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_forward_backward_then_optim_step_is_a_step_bit_for_bit():
    stepped = LocalTrainer(SPEC, ab.M2PO(threshold=0.01, entropy_coef=0.01), OPTIMIZER)
    manual = LocalTrainer(SPEC, ab.M2PO(threshold=0.01, entropy_coef=0.01), OPTIMIZER)
    for seed in range(3):
        batch = make_batch(8, seed)
        metrics = stepped.step(batch)
        before = manual.weights()
        loss = manual.forward_backward(batch)
        assert _same(manual.weights(), before) and manual.version == seed  # nothing applied yet
        assert all(p.grad is not None for p in manual.model.parameters() if p.requires_grad)
        assert loss["loss"] == metrics["loss"] and loss["tokens"] == metrics["tokens"]
        assert manual.optim_step() == {"grad_norm": metrics["grad_norm"]}
        assert manual.version == stepped.version == seed + 1
        assert _same(manual.weights(), stepped.weights())
        assert all(p.grad is None for p in manual.model.parameters())  # cleared for the next


def test_gradients_of_two_forward_backwards_add_up_and_optim_step_needs_one():
    trainer = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER)
    with pytest.raises(RuntimeError, match="call forward_backward"):
        trainer.optim_step()
    a, b = make_batch(4, 0), make_batch(4, 1)
    trainer.forward_backward(a)
    first = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.forward_backward(b)
    both = [p.grad.clone() for p in trainer.model.parameters()]
    alone = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER)
    alone.forward_backward(b)
    for g1, g12, p in zip(first, both, alone.model.parameters(), strict=True):
        assert torch.allclose(g1 + p.grad, g12, atol=1e-7)
    # another algorithm for one call: the trainer's own is left as it was
    other = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER).forward_backward(a, ab.CISPO())
    assert "cispo_clip_frac" in other and trainer.algorithm == ab.GRPO()


@pytest.mark.slow  # a trainer child process
def test_the_child_process_trainer_runs_the_same_blocks(tmp_path):
    torch.set_num_threads(1)  # the child runs one thread: same kernels, same sums
    child = ProcessTrainer("p", SPEC, ab.GRPO(), OPTIMIZER, log=tmp_path / "trainer.log")
    try:
        local = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER)
        for seed in range(2):
            batch = make_batch(6, seed)
            remote_loss, local_loss = child.forward_backward(batch), local.forward_backward(batch)
            assert remote_loss["loss"] == pytest.approx(local_loss["loss"], abs=1e-6)
            assert child.optim_step()["grad_norm"] == pytest.approx(
                local.optim_step()["grad_norm"], rel=1e-5)
            assert child.version == local.version == seed + 1
        remote = child.weights()
        for name, tensor in local.weights().items():
            assert torch.allclose(remote[name], tensor, atol=1e-6), name
        with pytest.raises(ab.errors.AstranbError, match="call forward_backward"):
            child.optim_step()
    finally:
        child.close()


@pytest.mark.slow  # episodes on a real engine
@pytest.mark.parametrize("trainer", ["thread", "process"])
def test_a_manual_loop_plays_builds_trains_and_publishes_cell_by_cell(tmp_path, trainer):
    with ab.Session(tmp_path, trainer=trainer) as session:
        policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                                max_batch_size=32, optimizer=OPTIMIZER,
                                # a gradient even when every group ties (a random policy's do)
                                algorithm=ab.GRPO(entropy_coef=0.05))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        groups = session.play(groups=3, group_size=4)
        assert len(groups) == 3 and all(len(g.trajectories) == 4 for g in groups)
        again = session.play(groups=3, group_size=4)  # the stream goes on: other samples
        assert [g.trajectories[0].sample for g in again] != [g.trajectories[0].sample
                                                             for g in groups]
        assert len({g.id for g in groups + again}) == 6
        batch = policy.build_batch(groups)
        assert batch.size == 12 and int(batch.versions_B_T.max()) == 0
        before = policy.trainer.weights()
        loss = policy.forward_backward(batch)
        assert "loss" in loss and policy.version == 0
        assert _same(policy.trainer.weights(), before)
        assert policy.optim_step()["grad_norm"] > 0 and policy.version == 1
        assert policy.engine is not None and policy.engine.version == 0  # not published yet
        policy.publish_weights()
        assert policy.engine.version == 1
        published = {n: t.to(torch.bfloat16) for n, t in policy.trainer.weights().items()}
        assert policy.engine.published_checksum() == ab.weights.checksum(published)
        later = session.play(samples=[groups[0].trajectories[0].sample], group_size=2)
        assert all(min(turn.generation.versions) == 1 for t in later[0].trajectories
                   for turn in t.turns)
        # a run and a manual step never overlap
        run = session.train(steps=1000, batch_size=8, group_size=4)
        with pytest.raises(RuntimeError, match="a run is training"):
            session.play()
        run.stop()
        wait_until(lambda: run.done, 60, "the run to stop")
    with pytest.raises(ValueError, match="group_size must be"):
        ab.Session(tmp_path / "x").play(group_size=0)
