"""A frozen reference or teacher policy scored by the trainer: KL to it in the loss, on-policy
distillation from it (astranb/training/reference.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import astranb as ab
from astranb.algorithms import token_mean
from astranb.algorithms.corrections import kl_estimate
from astranb.remote.process import ProcessTrainer
from astranb.training.local import KLTerm, LocalTrainer, backward_micro_batches, token_logprobs
from astranb.training.reference import reference_from_dict, reference_to_dict
from tests.fsdp_worker import SPEC, make_batch

TEACHER = dataclasses.replace(SPEC, seed=7)  # another model of the same shape and tokenizer
OPTIMIZER = ab.AdamWConfig(lr=1e-2)


def test_a_reference_is_checked_with_the_fix_and_travels_as_plain_values():
    with pytest.raises(ValueError, match="does nothing; give kl_coef .* or distill"):
        ab.Reference()
    with pytest.raises(ValueError, match="kl_coef must be a number >= 0"):
        ab.Reference(kl_coef=-1)
    with pytest.raises(ValueError, match="estimator must be one of"):
        ab.Reference(kl_coef=0.1, estimator="k4")
    with pytest.raises(TypeError, match="must be a ModelSpec"):
        ab.Reference(model="teacher-dir", distill=1.0)
    for reference in (ab.Reference(kl_coef=0.04), ab.Reference(TEACHER, distill=1.0,
                                                               estimator="k1")):
        assert reference_from_dict(reference_to_dict(reference)) == reference


def test_kl_in_the_loss_is_the_algorithms_loss_plus_the_weighted_estimate():
    """The gradient with a KLTerm equals the one of a loss written out by hand."""
    torch.manual_seed(0)
    algorithm = ab.GRPO()
    trainer = LocalTrainer(SPEC, algorithm, OPTIMIZER)
    teacher = TEACHER.build(dtype=torch.float32, device="cpu").eval()
    batch = make_batch(6, seed=3)
    rows = slice(0, batch.size)
    with torch.no_grad():
        ref_B_T = token_logprobs(teacher, batch, rows)[0]
    num_tokens = batch.num_tokens
    trainer.model.zero_grad()
    backward_micro_batches(trainer.model, algorithm, batch, [rows], num_tokens,
                           KLTerm(ref_B_T, 0.3, "k3"))
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    trainer.model.zero_grad()
    logp, entropy = token_logprobs(trainer.model, batch, rows)
    mask = batch.loss_mask_B_T
    loss, _ = algorithm.loss(logp, batch.old_logp_B_T, batch.advantages_B_T, mask, num_tokens)
    loss = loss - algorithm.entropy_coef * token_mean(entropy, mask, num_tokens)
    # k3 = (r - 1) - log r with log r = ref - logp, over the trained tokens
    log_r = torch.where(mask.bool(), ref_B_T - logp, 0.0)
    loss = loss + 0.3 * token_mean(torch.exp(log_r) - 1 - log_r, mask, num_tokens)
    loss.backward()
    assert torch.allclose(kl_estimate(logp.detach(), ref_B_T, "k3")[mask.bool()],
                          (torch.exp(log_r) - 1 - log_r).detach()[mask.bool()], atol=1e-6)
    for name, parameter in trainer.model.named_parameters():
        if parameter.grad is not None:
            assert torch.allclose(got[name], parameter.grad, atol=1e-7), name


def test_kl_to_the_starting_policy_is_zero_at_the_start_and_grows_as_the_policy_moves():
    plain = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER)
    anchored = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, reference=ab.Reference(kl_coef=0.5))
    batch = make_batch(6, seed=1)
    first = anchored.step(batch)
    plain.step(batch)
    # at the start the reference is the policy: k3 and its gradient are 0, the step the same
    assert first["kl"] == 0.0
    for name, tensor in plain.weights().items():
        assert torch.equal(anchored.weights()[name], tensor), name
    later = [anchored.step(make_batch(6, seed=s)) for s in (2, 3, 4)]
    plain_later = [plain.step(make_batch(6, seed=s)) for s in (2, 3, 4)]
    assert all(m["kl"] > 0 for m in later)
    assert "kl" not in plain_later[0]
    # the KL term pulls towards the start: the anchored policy moved less from it
    start = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER).weights()

    def moved(trainer):
        weights = trainer.weights()
        return sum(float((t.float() - start[n].float()).norm()) for n, t in weights.items())

    assert moved(anchored) < moved(plain)


def test_distillation_adds_the_teachers_per_token_signal_to_the_advantages():
    reference = ab.Reference(TEACHER, distill=0.5)
    trainer = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, reference=reference)
    teacher = TEACHER.build(dtype=torch.float32, device="cpu").eval()
    batch = make_batch(6, seed=5)
    scored, kl, metrics = trainer._scored(batch)
    assert kl is None  # distillation alone adds nothing to the loss itself
    with torch.no_grad():
        ref_B_T = token_logprobs(teacher, batch, slice(0, batch.size))[0]
    mask = batch.loss_mask_B_T
    expected = batch.advantages_B_T + 0.5 * (ref_B_T - batch.old_logp_B_T) * mask
    assert torch.allclose(scored.advantages_B_T, expected, atol=1e-6)
    assert torch.equal(scored.advantages_B_T[mask == 0], batch.advantages_B_T[mask == 0])
    reverse_kl = float(((batch.old_logp_B_T - ref_B_T) * mask).sum() / mask.sum())
    assert metrics["reverse_kl"] == pytest.approx(reverse_kl, rel=1e-5)


@pytest.mark.slow  # a trainer child process
def test_the_child_process_trainer_scores_with_the_reference_as_this_process_does(tmp_path):
    torch.set_num_threads(1)  # the child runs one thread: same kernels, same sums
    reference = ab.Reference(TEACHER, kl_coef=0.2, distill=0.5)
    child = ProcessTrainer("p", SPEC, ab.GRPO(), OPTIMIZER, log=tmp_path / "trainer.log",
                           reference=reference)
    try:
        local = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, reference=reference)
        for seed in range(3):
            batch = make_batch(6, seed)
            remote_metrics, local_metrics = child.step(batch), local.step(batch)
            assert remote_metrics["kl"] == pytest.approx(local_metrics["kl"], abs=1e-6)
        remote = child.weights()
        for name, tensor in local.weights().items():
            assert torch.allclose(remote[name].float(), tensor.float(), atol=1e-6), name
    finally:
        child.close()


@pytest.mark.slow  # a short run
def test_a_session_trains_a_policy_with_kl_to_its_start_and_says_so_in_its_rows(tmp_path):
    session = ab.Session(tmp_path / "runs", trainer="thread")
    with session:
        policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                                max_batch_size=32, reference=ab.Reference(kl_coef=0.1))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=4, batch_size=16, group_size=8, checkpoint_every=2)
        run.wait(timeout=120, progress=False)
        rows = run.rows
        assert len(rows) == 4 and all("kl" in r and "reverse_kl" in r for r in rows)
        assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0.0
    plan = ab.open_run(run.directory)
    assert plan.status == "finished"
    # rollout and trainer services take a reference too: tests/test_services_reference_lora.py


@pytest.mark.slow  # a short run
def test_save_pretrained_writes_a_folder_models_local_reads_back_as_the_trained_weights(tmp_path):
    session = ab.Session(tmp_path / "runs", trainer="thread")
    with session:
        policy = session.policy("teacher", model=ab.models.tiny(hidden_size=32, num_heads=2),
                                max_batch_size=32)
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        session.train(steps=2, batch_size=16, group_size=8).wait(timeout=120, progress=False)
        folder = policy.save_pretrained(tmp_path / "teacher")
        trained = policy.trainer.weights()
    spec = ab.models.local(folder)
    back = spec.build(dtype=torch.float32, device="cpu").state_dict()
    untrained = ab.models.tiny(hidden_size=32, num_heads=2).build().state_dict()
    assert any(not torch.equal(trained[n], untrained[n]) for n in trained)  # it did train
    for name, tensor in trained.items():
        assert torch.equal(back[name], tensor), name
    assert spec.tokenizer().encode("3+4=") == ab.models.tiny().tokenizer().encode("3+4=")
