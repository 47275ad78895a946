"""Tiny model and tokenizer built offline, local directories, and the local trainer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import astranb as ab
from astranb.dataflow.batcher import build_batch
from astranb.training.local import LocalTrainer, token_logprobs
from tests.test_dataflow import group


def test_tiny_model_is_deterministic_and_tokenizer_round_trips():
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    a, b = spec.build(), spec.build()
    assert all(x.equal(y)
               for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    tok = spec.tokenizer()
    assert tok.decode(tok.encode("12+3=15")) == "12+3=15"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_local_directory_loads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    spec.save(tmp_path / "model")
    local = ab.models.local(tmp_path / "model")
    model = local.build()
    for name, tensor in spec.build().state_dict().items():
        assert model.state_dict()[name].equal(tensor), name
    assert local.tokenizer().encode("7-3=") == spec.tokenizer().encode("7-3=")


def test_local_rejects_a_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ab.models.local(tmp_path)


def test_token_logprobs_match_a_manual_log_softmax():
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    trainer = LocalTrainer(spec, ab.GRPO())
    batch = build_batch([group(0, [(0, 0), (0, 0)], [1.0, 0.0])], "p", ab.GRPO(), pad_id=0)
    logp, entropy = token_logprobs(trainer.model, batch, slice(0, 2))
    logits = trainer.model(batch.input_ids_B_T).logits
    manual = torch.log_softmax(logits[0, 1], -1)[batch.input_ids_B_T[0, 2]]  # token 2 given 0..1
    assert torch.allclose(logp[0, 2], manual, atol=1e-5)
    probs, logps = torch.softmax(logits[0, 1], -1), torch.log_softmax(logits[0, 1], -1)
    assert torch.allclose(entropy[0, 2], -(manual.new_tensor(0) + (probs * logps).sum()),
                          atol=1e-5)


def test_micro_batching_gives_the_same_step_as_one_batch():
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    batch = build_batch([group(0, [(0, 0, 0), (0,), (0, 0), (0, 0, 0)], [1.0, 0.0, 0.5, 0.0])],
                        "p", ab.GRPO(), pad_id=0)
    whole = LocalTrainer(spec, ab.GRPO(), micro_batch_size=4)
    parts = LocalTrainer(spec, ab.GRPO(), micro_batch_size=1)
    m1, m2 = whole.step(batch), parts.step(batch)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    for (name, a), b in zip(whole.model.named_parameters(), parts.model.parameters(),
                            strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    assert whole.version == parts.version == 1


def test_trainer_save_and_load_round_trip(tmp_path):
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    batch = build_batch([group(0, [(0, 0), (0, 0)], [1.0, 0.0])], "p", ab.M2PO(), pad_id=0)
    trainer = LocalTrainer(spec, ab.M2PO(), ab.AdamWConfig(lr=1e-2))
    trainer.step(batch)
    trainer.save(tmp_path / "ckpt")
    restored = LocalTrainer(spec, ab.M2PO(), ab.AdamWConfig(lr=1e-2))
    restored.load(tmp_path / "ckpt")
    assert restored.version == 1
    trainer.step(batch)
    restored.step(batch)  # same optimizer state -> same next step
    for name, tensor in trainer.weights().items():
        assert torch.equal(restored.weights()[name], tensor), name
    assert not list(tmp_path.glob("**/*.pkl")) and not list(tmp_path.glob("**/*.pt"))


def test_entropy_bonus_raises_entropy():
    spec = ab.models.tiny(hidden_size=32, num_heads=2, initializer_range=0.5)
    batch = build_batch([group(0, [(0, 0), (0, 0)], [1.0, 1.0])], "p", ab.GRPO(), pad_id=0)
    trainer = LocalTrainer(spec, ab.GRPO(entropy_coef=1.0, filter_groups=False),
                           ab.AdamWConfig(lr=1e-2))
    first = trainer.step(batch)["entropy"]  # equal rewards: zero advantage, only the bonus acts
    for _ in range(5):
        last = trainer.step(batch)["entropy"]
    assert last > first


def test_optimizer_validation():
    with pytest.raises(ValueError, match="lr must be a positive number"):
        ab.AdamWConfig(lr=0)


def test_the_logp_gap_metric_is_the_mean_and_max_distance_to_the_engine_logprobs():
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    batch = build_batch([group(0, [(0, 0, 0), (0,), (0, 0), (0, 0, 0)], [1.0, 0.0, 0.5, 0.0])],
                        "p", ab.GRPO(), pad_id=0)
    trainer = LocalTrainer(spec, ab.GRPO())
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, batch, slice(0, batch.size))
    trained = batch.loss_mask_B_T > 0
    # the engine's logprobs, off from the trainer's by known amounts: 9 trained tokens with
    # offsets 0.01, -0.02, ..., (-1)^i (i+1)/100: mean |offset| 0.05, max 0.09
    offsets = torch.tensor([(-1) ** i * (i + 1) / 100 for i in range(int(trained.sum()))])
    assert len(offsets) == 9
    old = batch.old_logp_B_T.clone()
    old[trained] = logp[trained] + offsets
    batch = dataclasses.replace(batch, old_logp_B_T=old)
    for rows in (4, 1):  # one forward, or one per row: micro-batches combine to the same
        metrics = LocalTrainer(spec, ab.GRPO(), micro_batch_size=rows).step(batch)
        assert metrics["logp_gap_mean"] == pytest.approx(0.05, abs=1e-6)
        assert metrics["logp_gap_max"] == pytest.approx(0.09, abs=1e-6)


@pytest.mark.parametrize("trainer", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_engine_samples_with_bf16_weights_so_the_logp_gap_is_above_zero_at_version_0(
        tmp_path, trainer):
    def first_row(folder, **options):
        with ab.Session(folder, trainer=trainer) as session:
            policy = session.policy("p", model=ab.models.tiny(hidden_size=32, num_heads=2),
                                    **options)
            session.wire(ab.environments.load("arithmetic"), solver=policy)
            run = session.train(steps=1, batch_size=16, group_size=8, max_staleness=0)
            run.wait(progress=False)
            return run.rows[0]

    bf16 = first_row(tmp_path / "bf16")  # fp32 trainer, engine on its bf16-rounded weights
    assert bf16["token_version_max"] == 0  # every token sampled by the trainer's own version
    assert 1e-5 < bf16["logp_gap_mean"] <= bf16["logp_gap_max"] < 0.1
    if trainer == "thread":  # full-precision copies: only the kernels differ
        fp32 = first_row(tmp_path / "fp32", weight_transfer="state")
        assert fp32["logp_gap_max"] < bf16["logp_gap_max"] / 10
