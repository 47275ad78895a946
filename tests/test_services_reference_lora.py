"""A reference and LoRA on rollout and trainer services, as real processes on loopback: the
create body carries them as plain values, the trainer service builds them, bad values get a 422
naming the field, and a LoRA policy's adapters come back as PEFT's folder."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import torch
from safetensors.torch import load_file

import astranb as ab
from astranb.models import ModelSpec
from astranb.remote.serialize import spec_to_wire
from astranb.services import trainer_app
from astranb.services.local import launch_local
from astranb.training.lora import adapter_to_bytes, lora_to_dict, write_adapter
from astranb.training.reference import reference_to_dict
from tests.fsdp_worker import SPEC

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(300),
              # PEFT 0.21 asks transformers 5 for a deprecated alias when it wraps a model
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]

MODEL = ab.models.tiny(hidden_size=32, num_heads=2)
LORA = ab.LoRA(rank=4, alpha=8)
# every step trains, tied groups too (a random tiny model ties most of them: with the filter a
# run can wait minutes for two groups with a signal), and the entropy bonus moves the weights
MOVING = ab.GRPO(filter_groups=False, entropy_coef=0.05)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("services")
    with launch_local(rollout=1, trainer=True, engine="hf", log_dir=root / "logs", threads=1,
                      trainer_args=["--checkpoint-dir", str(root / "checkpoints")]) as started:
        yield started, root / "checkpoints"


def short_run(session: ab.Session, policy: ab.Policy, steps: int = 4, **train) -> ab.Run:
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=steps, batch_size=16, group_size=8, **train)
    run.wait(timeout=240, progress=False)
    assert run.status == "finished", (run.status, run.error)
    return run


def kl_grows_from_zero(rows: list[dict]) -> None:
    assert len(rows) == 4 and all("kl" in r and "reverse_kl" in r for r in rows)
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0.0


@pytest.mark.slow  # real service processes
def test_kl_to_the_start_trains_on_a_trainer_service(services, tmp_path):
    started, _ = services
    with ab.Session(tmp_path, rollout=started.rollout_urls,
                    trainer=started.trainer_url) as session:
        policy = session.policy("kl", model=MODEL, max_batch_size=32,
                                reference=ab.Reference(kl_coef=0.1), algorithm=MOVING)
        kl_grows_from_zero(short_run(session, policy).rows)
        assert session.context.recipes["kl"]["reference"]["kl_coef"] == 0.1


@pytest.mark.slow  # a real rollout service
def test_kl_to_the_start_trains_here_with_rollout_services(services, tmp_path):
    started, _ = services
    with ab.Session(tmp_path, rollout=started.rollout_urls) as session:
        policy = session.policy("kl_here", model=MODEL, max_batch_size=32,
                                reference=ab.Reference(kl_coef=0.1), algorithm=MOVING)
        kl_grows_from_zero(short_run(session, policy).rows)
        adapted = session.policy("lora_here", model=MODEL, lora=LORA)
        assert adapted.trainer.lora == LORA and adapted.lora == LORA
        recipes = session.context.recipes  # what a run's plan keeps for resume
        assert recipes["kl_here"]["reference"] == reference_to_dict(ab.Reference(kl_coef=0.1))
        assert recipes["lora_here"]["lora"] == lora_to_dict(LORA)


@pytest.mark.slow  # real service processes
def test_a_lora_policy_on_a_trainer_service_trains_only_adapters_and_saves_them(services,
                                                                                tmp_path):
    started, checkpoints = services
    with ab.Session(tmp_path, rollout=started.rollout_urls,
                    trainer=started.trainer_url) as session:
        policy = session.policy("adapted", model=MODEL, max_batch_size=32, lora=LORA,
                                algorithm=MOVING)
        assert len(short_run(session, policy, steps=2).rows) == 2
        folder = policy.save_pretrained(tmp_path / "adapter")
        with pytest.raises(RuntimeError, match="live on the trainer service"):
            policy.save_pretrained(tmp_path / "merged", merged=True)
    latest = json.loads((checkpoints / "adapted" / "latest.json").read_text())
    saved = checkpoints / "adapted" / latest["path"]
    assert latest["version"] == 2 and (saved / "adapter.safetensors").exists()
    published, base = load_file(saved / "model.safetensors"), MODEL.build().state_dict()
    changed = {n for n in base if not torch.equal(published[n], base[n])}
    assert changed and all(n.endswith("proj.weight") for n in changed)  # only adapted layers
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    model = peft.PeftModel.from_pretrained(MODEL.build(), folder).merge_and_unload()
    for name, tensor in model.state_dict().items():
        assert torch.allclose(tensor, published[name], atol=1e-6), name


@pytest.mark.slow  # a real trainer service
def test_bad_reference_or_lora_bodies_get_a_422_naming_the_field(services, tmp_path):
    started, _ = services
    body = {"name": "bad", "model": spec_to_wire(SPEC)}
    teacher = spec_to_wire(ModelSpec(name="teacher", path=str(tmp_path / "absent"), kind="local"))
    for extra, words in (
            ({"reference": {"kl_coef": -1}}, ["reference.kl_coef"]),
            ({"reference": {"kl_coef": 0.0}}, ["invalid reference", "does nothing"]),
            ({"reference": {"kl_coef": 0.1, "estimator": "k9"}}, ["reference", "estimator"]),
            ({"reference": {"model": teacher, "distill": 1.0}},
             ["reference.model.path", "not a directory on the trainer service's host"]),
            ({"reference": "teacher"}, ["reference"]),
            ({"lora": {"rank": 0, "alpha": 8}}, ["lora.rank"]),
            ({"lora": {"rank": 4}}, ["lora.alpha"]),
            ({"lora": {"rank": 4, "alpha": 8, "target_modules": ["nope"]}},
             ["could not build", "matches no layer"])):
        answer = httpx.post(f"{started.trainer_url}/v1/policies", json={**body, **extra},
                            timeout=60)
        assert answer.status_code == 422, (extra, answer.text)
        assert all(w in answer.json()["error"] for w in words), (extra, answer.text)
    refused = httpx.post(f"{started.trainer_url}/v1/policies", json=body, timeout=60)
    assert refused.status_code == 200  # nothing half-made is left under the name
    teacher_dir = dataclasses.replace(SPEC, seed=7).save(tmp_path / "teacher")  # on its host
    distilled = {"name": "distilled", "model": spec_to_wire(SPEC), "reference": {
        "model": spec_to_wire(ab.models.local(teacher_dir)), "distill": 1.0}}
    answer = httpx.post(f"{started.trainer_url}/v1/policies", json=distilled, timeout=60)
    assert answer.status_code == 200, answer.text
    no_adapter = httpx.get(f"{started.trainer_url}/v1/adapter/bad", timeout=60)
    assert no_adapter.status_code == 409 and "full weights" in no_adapter.json()["error"]


def test_the_adapter_payload_is_peft_s_folder_again(tmp_path):
    model = peft.get_peft_model(SPEC.build(), peft.LoraConfig(r=2, lora_alpha=4,
                                                              target_modules="all-linear"))
    write_adapter(adapter_to_bytes(model), tmp_path / "again")
    model.save_pretrained(tmp_path / "peft")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "again" / name).exists()
    assert (json.loads((tmp_path / "again" / "adapter_config.json").read_text())
            == json.loads((tmp_path / "peft" / "adapter_config.json").read_text()))
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("again",
                                                                                    "peft"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(ValueError, match="adapter_config"):
        write_adapter(b"\x02\x00\x00\x00\x00\x00\x00\x00{}", tmp_path / "bad")


def test_fsdp_refuses_a_reference_or_lora_with_the_fix():
    from astranb.training.fsdp import FSDPBackend

    backend = FSDPBackend.__new__(FSDPBackend)  # no process group: create refuses first
    for kw in ({"reference": ab.Reference(kl_coef=0.1)}, {"lora": LORA}):
        with pytest.raises(ValueError, match="not trained by FSDP yet.*--nproc 1"):
            backend.create("p", SPEC, ab.GRPO(), **kw)
    assert "reference" in trainer_app.TrainerPolicyIn.model_fields
