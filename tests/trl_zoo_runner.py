"""Run TRL's own loss code on tensors a test wrote; run with the TRL venv's python.

    python trl_zoo_runner.py TENSORS.safetensors CASES.json OUT.json

tests/test_algorithm_zoo.py writes the tensors (safetensors) and the cases (JSON: a name, the
trainer, its settings); this script calls `GRPOTrainer._compute_loss` or
`RLOOTrainer._compute_loss` of the installed TRL on a stand-in trainer object that holds only the
attributes those methods read, whose `_get_per_token_logps_and_entropies` returns the test's
logprobs as a leaf tensor instead of running a model. It writes, per case, the loss and its
gradient with respect to those logprobs. Nothing of astranb is imported here.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer


class _Accelerator:
    """What the loss code asks of an accelerate.Accelerator, for one process."""

    num_processes = 1

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor


def _stand_in(cls, settings: dict, leaf: torch.Tensor):
    """A `cls` instance that skips __init__ and holds what `_compute_loss` reads."""
    trainer = object.__new__(cls)
    entropies = torch.zeros_like(leaf)
    attributes = dict(
        accelerator=_Accelerator(), model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, beta=0.0, importance_sampling_level="token",
        epsilon_low=0.2, epsilon_high=0.2, max_completion_length=leaf.shape[1],
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    attributes.update(settings)
    for name, value in attributes.items():
        object.__setattr__(trainer, name, value)
    object.__setattr__(trainer, "_get_per_token_logps_and_entropies",
                       lambda *args, **kwargs: (leaf, entropies, None))
    return trainer


def _inputs(tensors: dict, case: dict) -> dict:
    mask = tensors["mask"]
    rows = mask.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": tensors["adv"],
        "num_items_in_batch": mask.sum(),
    }
    if case["trainer"] == "rloo":
        inputs["old_logps"] = (tensors["old_logp"] * mask).sum(1)
    elif not case.get("old_is_current"):
        inputs["old_per_token_logps"] = tensors["old_logp"]
    if case.get("ref"):
        inputs["ref_per_token_logps"] = tensors["ref_logp"]
    if case.get("is_ratio"):
        inputs["importance_sampling_ratio"] = tensors["is_ratio"]
    return inputs


def run(case: dict, tensors: dict) -> dict:
    leaf = tensors["logp"].clone().requires_grad_(True)
    cls = RLOOTrainer if case["trainer"] == "rloo" else GRPOTrainer
    trainer = _stand_in(cls, case["settings"], leaf)
    loss = cls._compute_loss(trainer, None, _inputs(tensors, case))
    (grad,) = torch.autograd.grad(loss, leaf)
    return {"loss": float(loss), "grad": grad.tolist()}


def main() -> None:
    tensors_path, cases_path, out_path = sys.argv[1:4]
    tensors = load_file(tensors_path)
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:  # each case's tensors are stored as "<prefix>.<name>"
        prefix = case["prefix"] + "."
        own = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
        results[case["name"]] = run(case, own)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
