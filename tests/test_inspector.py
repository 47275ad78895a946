"""The training-step inspector: what a sampled step trained, recorded by the trainer, kept in the
run folder, read back and shown."""

from __future__ import annotations

import math

import pytest
import torch

import astranb as ab
from astranb.algorithms import DAPO, GRPO, GSPO, M2PO
from astranb.training.local import LocalTrainer
from astranb.training.trace import StepTrace
from astranb.types import Batch

SPEC = ab.models.tiny(hidden_size=32, num_heads=2)


def stale_batch(rows: int = 6, length: int = 12, seed: int = 0) -> Batch:
    """A batch whose engine logprobs are far from the trainer's (as after many versions of
    staleness), so the clip binds on some tokens and M2PO drops some."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, 4:] = 1
    mask[0, -3:] = 0  # a shorter row
    old = (-4 + torch.randn(rows, length, generator=g)) * mask
    sign = torch.tensor([1.0, -1.0] * (rows // 2))[:, None]
    return Batch(ids, torch.ones(rows, length, dtype=torch.long), mask, old,
                 sign.expand(rows, length) * mask, torch.where(mask > 0, 3, -1),
                 torch.ones(rows), (sign[:, 0] > 0).float())


@pytest.mark.parametrize("algorithm, mask, metric", [
    (GRPO(), "clipped", "clip_frac"), (DAPO(), "clipped", "clip_frac"),
    (GSPO(), "clipped", "clip_frac"), (M2PO(), "dropped", "m2po_masked_frac"),
    (GRPO(tis_cap=1.5), "capped", "tis_capped_frac")])
def test_the_marked_tokens_are_exactly_the_ones_the_metric_counts(algorithm, mask, metric):
    # three micro-batches of two rows: each metric is a token-weighted sum of the three
    trainer = LocalTrainer(SPEC, algorithm, micro_batch_size=2)
    metrics, trace = trainer.step_recorded(stale_batch())
    marked = trace.masks()[mask]
    assert marked.shape == trace.tensors["loss_mask_B_T"].shape
    assert not bool((marked & (trace.tensors["loss_mask_B_T"] == 0)).any())
    counted = metrics[metric] * metrics["tokens"]
    assert int(marked.sum()) == round(counted) and abs(counted - round(counted)) < 1e-3
    if mask != "capped":
        assert int(marked.sum()) > 0  # the test means something


def test_a_recorded_step_trains_exactly_as_a_plain_one_and_keeps_its_numbers():
    torch.manual_seed(0)
    plain = LocalTrainer(SPEC, GRPO(), micro_batch_size=4)
    torch.manual_seed(0)
    recorded = LocalTrainer(SPEC, GRPO(), micro_batch_size=4)
    batch = stale_batch()
    expected = plain.step(batch)
    metrics, trace = recorded.step_recorded(batch)
    assert metrics == expected and recorded.version == plain.version == 1
    for name, value in plain.weights().items():
        assert torch.equal(value, recorded.weights()[name])
    t = trace.tensors
    # the gradient norm before clipping is the per-parameter norms' combination
    assert float(t["grad_norm_P"].square().sum().sqrt()) == pytest.approx(metrics["grad_norm"],
                                                                           rel=1e-5)
    assert len(trace.header["parameters"]) == t["grad_norm_P"].numel() > 0
    assert torch.equal(t["versions_B_T"], batch.versions_B_T)
    trained = t["loss_mask_B_T"] > 0
    gap = (t["logp_B_T"] - t["old_logp_B_T"]).abs()[trained]
    assert float(gap.mean()) == pytest.approx(metrics["logp_gap_mean"], rel=1e-5)
    # dLoss/dlogp: none off the trained tokens nor on clipped ones, some elsewhere
    grad = t["grad_logp_B_T"]
    assert not bool(grad[~trained].any()) and not bool(grad[trace.masks()["clipped"]].any())
    assert bool(grad[trained & ~trace.masks()["clipped"]].any())


def test_a_trace_round_trips_through_bytes():
    _, trace = LocalTrainer(SPEC, M2PO()).step_recorded(stale_batch())
    back = StepTrace.from_bytes(trace.to_bytes())
    assert back.header == trace.header and set(back.tensors) == set(trace.tensors)
    assert all(torch.equal(back.tensors[k], v) for k, v in trace.tensors.items())
    assert back.tensors["mask/dropped_B_T"].dtype == torch.bool
    assert math.isfinite(float(back.tensors["grad_norm_P"].sum()))
