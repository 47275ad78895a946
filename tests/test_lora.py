"""LoRA through PEFT: only the adapters train; engines get the merged weights; checkpoints,
resume and `save_pretrained` hold the adapters (astranb/training/lora.py)."""

from __future__ import annotations

import json

import pytest
import torch

import astranb as ab
from astranb.remote.process import ProcessTrainer
from astranb.training.local import LocalTrainer
from astranb.training.lora import lora_from_dict, lora_to_dict
from astranb.weights import checksum
from tests.fsdp_worker import SPEC, make_batch
from tests.waiting import wait_until

peft = pytest.importorskip("peft")
# PEFT 0.21 asks transformers 5 for a deprecated alias when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

OPTIMIZER = ab.AdamWConfig(lr=1e-2)
LORA = ab.LoRA(rank=4, alpha=8)


def test_a_lora_is_checked_with_the_fix_and_travels_as_plain_values():
    for bad, match in (({"rank": 0}, "rank must be an integer"),
                       ({"alpha": -1.0}, "alpha must be a number"),
                       ({"dropout": 1.0}, "dropout must be in"),
                       ({"target_modules": ()}, "target_modules must be")):
        with pytest.raises(ValueError, match=match):
            ab.LoRA(**bad)
    lora = ab.LoRA(rank=2, alpha=4, target_modules=["q_proj", "v_proj"], dropout=0.1)
    assert lora.target_modules == ("q_proj", "v_proj")
    assert lora_from_dict(json.loads(json.dumps(lora_to_dict(lora)))) == lora
    with pytest.raises(ValueError, match="matches no layer.*linear layers are named"):
        LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=ab.LoRA(target_modules=("nope",)))


def test_only_the_adapters_train_and_the_published_weights_are_peft_s_merge():
    trainer = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=LORA)
    base = SPEC.build(dtype=torch.float32, device="cpu").state_dict()
    start = trainer.weights()
    assert set(start) == set(base)
    for name, tensor in base.items():  # B starts at zero: version 0 is the base model, bit for bit
        assert torch.equal(start[name], tensor), name
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = sum(p.numel() for group in trainer.optimizer.param_groups
                    for p in group["params"])
    assert optimized == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    for seed in range(3):
        metrics = trainer.step(make_batch(8, seed))
        assert metrics["grad_norm"] > 0
    after = trainer.weights()
    changed = {n for n in base if not torch.equal(after[n], base[n])}
    assert changed and all(n.endswith("proj.weight") for n in changed)  # only adapted layers
    assert "model.embed_tokens.weight" not in changed and "model.norm.weight" not in changed
    # PEFT's own merge of a copy gives the same weights (merge_and_unload is PEFT's maths)
    copy = peft.get_peft_model(SPEC.build(dtype=torch.float32, device="cpu"),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    peft.set_peft_model_state_dict(copy, trainer.adapter_weights())
    merged = copy.merge_and_unload().state_dict()
    for name, tensor in after.items():
        assert torch.allclose(merged[name], tensor, atol=1e-7, rtol=0), name
    # and the merged weights give the adapted model's logits
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    plain = SPEC.build(dtype=torch.float32, device="cpu")
    plain.load_state_dict(after)
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5)


def test_modules_to_save_train_in_full_travel_merged_and_resume_with_the_adapters(tmp_path):
    with pytest.raises(ValueError, match="modules_to_save must be a tuple"):
        ab.LoRA(modules_to_save="norm")
    lora = ab.LoRA(rank=4, alpha=8, modules_to_save=["norm"])
    assert lora.modules_to_save == ("norm",)
    assert lora_from_dict(json.loads(json.dumps(lora_to_dict(lora)))) == lora
    assert "modules_to_save" not in lora_to_dict(LORA)  # plans of runs without it read as before
    trainer = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=lora)
    base = SPEC.build(dtype=torch.float32, device="cpu").state_dict()
    for seed in range(3):
        trainer.step(make_batch(8, seed))
    after = trainer.weights()
    assert set(after) == set(base)
    changed = {n for n in base if not torch.equal(after[n], base[n])}
    norms = {n for n in base if "norm" in n}
    assert norms <= changed  # every RMSNorm weight trained, under the base model's name
    assert all(n in norms or n.endswith("proj.weight") for n in changed)
    assert "model.embed_tokens.weight" not in changed
    # PEFT's own merge of a copy with the same adapters and modules gives the same weights
    copy = peft.get_peft_model(SPEC.build(dtype=torch.float32, device="cpu"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["norm"]))
    peft.set_peft_model_state_dict(copy, trainer.adapter_weights())
    merged = copy.merge_and_unload().state_dict()
    for name, tensor in after.items():
        assert torch.allclose(merged[name], tensor, atol=1e-7, rtol=0), name
    # a checkpoint holds them with the adapters: the resumed trainer goes on the same way
    again = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=lora)
    again.load(trainer.save(tmp_path / "ckpt"))
    batch = make_batch(8, 7)
    trainer.step(batch)
    again.step(batch)
    a, b = trainer.weights(), again.weights()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_full_weights_trainer_has_no_adapter_to_save(tmp_path):
    trainer = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER)
    with pytest.raises(ValueError, match="no adapter"):
        trainer.save_adapter(tmp_path / "a")


def test_a_checkpoint_holds_the_adapters_and_resumes_the_same_steps(tmp_path):
    first = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=LORA)
    first.step(make_batch(8, 0))
    saved = first.save(tmp_path / "ckpt")
    assert (saved / "adapter.safetensors").exists() and (saved / "model.safetensors").exists()
    assert json.loads((saved / "trainer.json").read_text())["lora"] == lora_to_dict(LORA)
    second = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=LORA)
    second.load(saved)
    assert second.version == first.version == 1
    for seed in (1, 2):
        batch = make_batch(8, seed)
        first.step(batch)
        second.step(batch)
    a, b = first.weights(), second.weights()
    assert all(torch.equal(a[n], b[n]) for n in a)  # same adapters and same Adam moments
    with pytest.raises(ValueError, match="resume with the same LoRA settings"):
        LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=ab.LoRA(rank=2)).load(saved)
    with pytest.raises(ValueError, match="resume with the same LoRA settings"):
        LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER).load(saved)


@pytest.mark.slow  # a trainer child process
def test_the_child_process_trainer_trains_the_same_adapters_and_writes_peft_s_folder(tmp_path):
    torch.set_num_threads(1)  # the child runs one thread: same kernels, same sums
    child = ProcessTrainer("p", SPEC, ab.GRPO(), OPTIMIZER, log=tmp_path / "trainer.log",
                           lora=LORA)
    try:
        local = LocalTrainer(SPEC, ab.GRPO(), OPTIMIZER, lora=LORA)
        for seed in range(3):
            batch = make_batch(6, seed)
            child.step(batch)
            local.step(batch)
        remote = child.weights()
        for name, tensor in local.weights().items():
            assert torch.allclose(remote[name], tensor, atol=1e-6), name
        folder = child.save_adapter(tmp_path / "adapter")
    finally:
        child.close()
    assert (folder / "adapter_config.json").exists()
    loaded = peft.PeftModel.from_pretrained(SPEC.build(dtype=torch.float32, device="cpu"), folder)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits,
                              local.model(input_ids=ids).logits, atol=1e-5)


@pytest.mark.slow  # a short run and its resume
def test_a_session_trains_a_lora_policy_resumes_it_and_saves_a_folder_peft_loads(tmp_path):
    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    with ab.Session(tmp_path, trainer="process") as session:
        policy = session.policy("solver", model=spec, max_batch_size=32,
                                lora=ab.LoRA(rank=4, alpha=8))
        session.wire(ab.environments.load("arithmetic"), solver=policy)
        run = session.train(steps=6, batch_size=16, group_size=8, checkpoint_every=2)
        wait_until(lambda: len(run.rows) >= 3, 120,
                   lambda: f"3 steps ({run.status}, {run.stalled}, {run.error}, {len(run.rows)})")
        run.stop()
        wait_until(lambda: run.status != "running", 60, "the run to stop")
        folder = policy.save_pretrained(tmp_path / "adapter")
        merged_folder = policy.save_pretrained(tmp_path / "merged", merged=True)
        trained = policy.trainer.weights()
    assert (folder / "adapter_model.safetensors").exists()
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(folder).encode("3+4=") == spec.tokenizer().encode("3+4=")
    loaded = peft.PeftModel.from_pretrained(spec.build(dtype=torch.float32, device="cpu"), folder)
    merged = loaded.merge_and_unload().state_dict()
    back = ab.models.local(merged_folder).build(dtype=torch.float32, device="cpu").state_dict()
    for name, tensor in trained.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name
        assert torch.equal(back[name], tensor), name
    # resume in a fresh session: the plan keeps the LoRA, the checkpoint its adapters
    with ab.Session(tmp_path, trainer="process") as again:
        resumed = again.resume()
        assert resumed.events[0]["versions"]["solver"] >= 2
        resumed.wait(timeout=180, progress=False)
        assert resumed.status == "finished"
        assert again.policies["solver"].lora == ab.LoRA(rank=4, alpha=8)
        policy = again.policies["solver"]
        assert policy.version == 6
        # the engine samples from the merged weights the trainer published, bit for bit
        assert policy.engine is not None
        wait_until(lambda: policy.engine.version == policy.version, 30,
                   lambda: f"the last publish (engine at {policy.engine.version})")
        published = {n: t.to(torch.bfloat16) for n, t in policy.trainer.weights().items()}
        assert policy.engine.published_checksum() == checksum(published)
