"""The algorithm zoo (Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++), truncated importance
sampling and the KL estimators: against values worked out by hand (arithmetic in the comments),
and, where TRL implements the same loss, against TRL's own code on the same tensors."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import astranb as ab
from astranb.algorithms import (
    aggregate,
    cispo_loss,
    clipped_surrogate_loss,
    kl_estimate,
    kl_loss_term,
    kl_reward_penalty,
    leave_one_out_advantages,
    overlong_penalty,
    ppo_clip_loss,
    truncated_is_weights,
    whiten,
)
from astranb.algorithms.config import algorithm_from_dict, algorithm_to_dict, travels_as_config
from astranb.training.caller_loss import gradient_batch, trainer_algorithm
from astranb.training.local import step_advantages
from astranb.types import Batch

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = ROOT / "bench" / ".venv-trl" / "bin" / "python"
ZOO = [ab.DrGRPO, ab.DAPO, ab.GSPO, ab.CISPO, ab.RLOO, ab.ReinforcePP]


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def num(x: torch.Tensor) -> float:
    return float(x.detach())


def leaf(values) -> torch.Tensor:
    return t(values).requires_grad_(True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# --------------------------------------------------------------------------- advantages


def test_leave_one_out_advantages():
    # [1, 0, 0, 1]: others' means 1/3, 2/3, 2/3, 1/3 -> [2/3, -2/3, -2/3, 2/3]
    #               (= N/(N-1) * (r - mean) = 4/3 * +-0.5)
    # [3, 1, 5]:    others' means (1+5)/2=3, (3+5)/2=4, (3+1)/2=2 -> [0, -3, 3]
    torch.testing.assert_close(leave_one_out_advantages(t([[1.0, 0.0, 0.0, 1.0]])),
                               t([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    torch.testing.assert_close(ab.RLOO().advantages(t([[3.0, 1.0, 5.0]])), t([[0.0, -3.0, 3.0]]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        leave_one_out_advantages(t([[1.0]]))


def test_dr_grpo_advantages_do_not_divide_by_the_std():
    # [3, 1, 5]: mean 3 -> [0, -2, 2]; GRPO would divide by the std sqrt(8/3)
    torch.testing.assert_close(ab.DrGRPO().advantages(t([[3.0, 1.0, 5.0]])), t([[0.0, -2.0, 2.0]]))


def test_reinforce_pp_normalises_over_the_batch_tokens():
    # group [1, 0, 0, 1] -> r - mean = [0.5, -0.5, -0.5, 0.5]
    assert ab.ReinforcePP().advantages(t([[1.0, 0.0, 0.0, 1.0]])).tolist() == [[0.5, -0.5, -0.5,
                                                                                 0.5]]
    assert ab.ReinforcePP(group_baseline=False).advantages(t([[1.0, 0.0]])).tolist() == [[1.0,
                                                                                        0.0]]
    # row 0: advantage 0.5 on 1 token; row 1: -0.5 on 3 tokens (its 4th position is padding)
    # tokens [0.5, -0.5, -0.5, -0.5]: mean -0.25, deviations [0.75, -0.25 x3]
    # population var (0.5625 + 3 * 0.0625) / 4 = 0.1875, std 0.4330127 = sqrt(3)/4
    # -> 0.75 / (sqrt(3)/4) = sqrt(3), -0.25 / (sqrt(3)/4) = -1/sqrt(3); padding stays 0
    adv_B_T = t([[0.5, 0.5, 0.5, 0.5], [-0.5, -0.5, -0.5, -0.5]])
    mask_B_T = t([[1, 0, 0, 0], [1, 1, 1, 0]])
    s3 = math.sqrt(3)
    expected = t([[s3, 0, 0, 0], [-1 / s3, -1 / s3, -1 / s3, 0]])
    torch.testing.assert_close(whiten(adv_B_T, mask_B_T, eps=0.0), expected)
    torch.testing.assert_close(ab.ReinforcePP().batch_advantages(adv_B_T, mask_B_T), expected,
                               atol=1e-5, rtol=0)
    # the other configs keep the batch's advantages as they are
    assert ab.GRPO().batch_advantages(adv_B_T, mask_B_T) is adv_B_T


def tiny_batch(adv_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> Batch:
    rows, steps = mask_B_T.shape
    return Batch(
        input_ids_B_T=torch.zeros(rows, steps, dtype=torch.long),
        attention_mask_B_T=torch.ones(rows, steps, dtype=torch.long),
        loss_mask_B_T=mask_B_T, old_logp_B_T=torch.zeros(rows, steps), advantages_B_T=adv_B_T,
        versions_B_T=torch.zeros(rows, steps, dtype=torch.long),
        temperature_B=torch.ones(rows), rewards_B=torch.zeros(rows))


def test_trainers_normalise_the_whole_step_before_splitting_it():
    # step_advantages is what LocalTrainer.step, the FSDP step and a caller-side loss call on
    # the whole batch; a micro-batch of row 1 alone would have std 0 and whiten to all zeros
    adv_B_T = t([[0.5, 0.5, 0.5, 0.5], [-0.5, -0.5, -0.5, -0.5]], torch.float32)
    mask_B_T = t([[1, 0, 0, 0], [1, 1, 1, 0]], torch.float32)
    batch = step_advantages(ab.ReinforcePP(), tiny_batch(adv_B_T, mask_B_T))
    s3 = math.sqrt(3)
    torch.testing.assert_close(batch.advantages_B_T[1], torch.tensor([-1 / s3] * 3 + [0.0]),
                               atol=1e-5, rtol=0)
    unchanged = tiny_batch(adv_B_T, mask_B_T)
    assert step_advantages(ab.GRPO(), unchanged) is unchanged


def test_a_loss_run_in_the_caller_trains_the_normalised_advantages():
    class Whitened(ab.ReinforcePP):
        """A user's subclass: it does not travel, so its loss runs in the caller."""

    adv_B_T = t([[0.5, 0.5], [-0.5, -0.5]], torch.float32)
    mask_B_T = t([[1, 0], [1, 1]], torch.float32)
    algorithm = Whitened()
    assert not travels_as_config(algorithm)
    assert trainer_algorithm(algorithm) == ab.algorithms.config.LogpGradient()
    # tokens [0.5, -0.5, -0.5]: mean -1/6, std sqrt(2)/3 -> [sqrt(2), -1/sqrt(2), -1/sqrt(2)]
    # ratio 1 (logp = old = 0): dloss/dlogp = -A' / 3 tokens
    sent, _ = gradient_batch(algorithm, tiny_batch(adv_B_T, mask_B_T), torch.zeros(2, 2))
    r2 = math.sqrt(2)
    torch.testing.assert_close(sent.advantages_B_T, torch.tensor([[-r2 / 3, 0.0],
                                                                  [1 / r2 / 3, 1 / r2 / 3]]),
                               atol=1e-5, rtol=0)


def test_overlong_penalty():
    # DAPO's budget 20480 with a 4096 buffer: free up to 16384, -0.5 at 18432, -1 at 20480 and on
    lengths = t([100, 16384, 18432, 20480, 20481])
    torch.testing.assert_close(overlong_penalty(lengths), t([0.0, 0.0, -0.5, -1.0, -1.0]),
                               check_dtype=False)
    # budget 10, buffer 4: 6 -> 0, 7 -> (6 - 7) / 4 = -0.25, 9 -> -0.75, 11 -> -1
    small = ab.DAPO(max_tokens=10, overlong_cache=4)
    torch.testing.assert_close(small.overlong_penalty(t([6, 7, 9, 11])),
                               t([0.0, -0.25, -0.75, -1.0]), check_dtype=False)
    with pytest.raises(ValueError, match="overlong_cache"):
        ab.DAPO(max_tokens=10, overlong_cache=11)


# --------------------------------------------------------------------------- aggregation


def test_the_three_aggregations():
    # row 0: losses [1, 2] on 2 tokens (3rd is padding, its NaN ignored); row 1: [3, 4, 5]
    loss_B_T = t([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]])
    mask_B_T = t([[1, 1, 0], [1, 1, 1]])
    # token:    (1 + 2 + 3 + 4 + 5) / 5 tokens = 3
    # row:      mean of the rows' means (1.5 + 4) / 2 = 2.75
    # constant: 15 / (max_tokens 4 * 2 rows) = 1.875
    assert num(aggregate(loss_B_T, mask_B_T, "token")) == pytest.approx(3.0)
    assert num(aggregate(loss_B_T, mask_B_T, "row")) == pytest.approx(2.75)
    assert num(aggregate(loss_B_T, mask_B_T, "constant", max_tokens=4)) == pytest.approx(1.875)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(loss_B_T, mask_B_T, "constant")
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(loss_B_T, mask_B_T, "sum")


def test_row_means_split_into_micro_batches_weigh_each_by_its_tokens():
    # two rows of 2 tokens each: row means 1.5 and 3.5, step mean 2.5; called one row at a time
    # with the step's 4 tokens, each call is weighted by 2/4: 1.5/2 + 3.5/2 = 2.5
    loss_B_T = t([[1.0, 2.0], [3.0, 4.0]])
    mask_B_T = t([[1, 1], [1, 1]])
    parts = [aggregate(loss_B_T[i:i + 1], mask_B_T[i:i + 1], "row", num_tokens=4)
             for i in range(2)]
    assert num(sum(parts)) == pytest.approx(2.5)
    assert num(aggregate(loss_B_T, mask_B_T, "row", num_tokens=4)) == pytest.approx(2.5)
    # a step with no trained token (an idle FSDP rank's blank batch) is 0, not NaN
    assert num(aggregate(loss_B_T, torch.zeros(2, 2), "row", num_tokens=4)) == 0.0


# --------------------------------------------------------------------------- losses


def test_dr_grpo_loss_divides_by_a_constant():
    # ratio 1 everywhere, so each token's loss is -A: row 0 A=+1 on 2 tokens, row 1 A=-0.5 on 3
    # token losses sum to -1 * 2 + 0.5 * 3 = -0.5
    # Dr. GRPO, max_tokens 4: -0.5 / (4 * 2 rows) = -0.0625
    # (GRPO's token mean would be -0.5 / 5 = -0.1; per-sequence means (-1 + 0.5) / 2 = -0.25)
    logp_B_T = leaf([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    adv_B_T = t([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask_B_T = t([[1, 1, 0], [1, 1, 1]])
    loss, metrics = ab.DrGRPO(max_tokens=4).loss(logp_B_T, logp_B_T.detach(), adv_B_T, mask_B_T)
    assert num(loss) == pytest.approx(-0.0625)
    assert metrics["clip_frac"] == 0.0
    # every token's gradient is -A / 8, whatever its row's length
    torch.testing.assert_close(grad_of(loss, logp_B_T),
                               t([[-1 / 8, -1 / 8, 0], [1 / 16, 1 / 16, 1 / 16]]))
    grpo, _ = ab.GRPO().loss(logp_B_T, logp_B_T.detach(), adv_B_T, mask_B_T)
    assert num(grpo) == pytest.approx(-0.1)


def test_dapo_clips_higher():
    # token 0: r = 1.25, A = +1. GRPO clips at 1.2: -1.2 (clipped); DAPO's 1.28 keeps -1.25
    # token 1: r = 0.75, A = -1. Both clip below at 0.8: -min(-0.75, -0.8) = 0.8 (clipped)
    # DAPO: (-1.25 + 0.8) / 2 = -0.225, clip_frac 1/2; GRPO: (-1.2 + 0.8) / 2 = -0.2, clip_frac 1
    old_B_T = t([[-1.0, -1.0]])
    logp_B_T = leaf([[-1.0 + math.log(1.25), -1.0 + math.log(0.75)]])
    adv_B_T = t([[1.0, -1.0]])
    mask_B_T = t([[1, 1]])
    loss, metrics = ab.DAPO().loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    assert num(loss) == pytest.approx(-0.225)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    # unclipped token: d(-r A)/dlogp / 2 = -1.25 / 2; the clipped one gets none
    torch.testing.assert_close(grad_of(loss, logp_B_T), t([[-0.625, 0.0]]))
    grpo, grpo_metrics = ab.GRPO().loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    assert num(grpo) == pytest.approx(-0.2) and grpo_metrics["clip_frac"] == 1.0


def test_gspo_sequence_ratio():
    # row 0: log ratios [0.1, -0.3], mean -0.1: s = exp(-0.1) = 0.904837, inside nothing: the
    #        clip [1 - 3e-4, 1 + 4e-4] binds only for A < 0 below, and A = +1 -> -0.904837
    # row 1: log ratios 0.001 x3, mean 0.001: s = 1.0010005 > 1.0004, A = +1 -> clipped, -1.0004
    # loss = mean over sequences = (-0.904837 - 1.0004) / 2 = -0.952619
    old_B_T = t([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    logp_B_T = leaf([[-0.9, -1.3, 0.0], [-1.999, -1.999, -1.999]])
    adv_B_T = torch.ones(2, 3, dtype=torch.float64)
    mask_B_T = t([[1, 1, 0], [1, 1, 1]])
    loss, metrics = ab.GSPO().loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    s0 = math.exp(-0.1)
    assert num(loss) == pytest.approx((-s0 - 1.0004) / 2)
    assert metrics["clip_frac"] == pytest.approx(3 / 5)  # row 1's three tokens
    # row 0: d(-s A)/dlogp_t = -s / 2 tokens, then / 2 sequences; row 1 clipped: 0
    torch.testing.assert_close(grad_of(loss, logp_B_T),
                               t([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]]))


def test_rloo_whole_sequence_ratio():
    # row 0: log ratios [0.1, 0.1], sum 0.2: s = exp(0.2) = 1.2214 > 1.2, A = +1 -> -1.2 (clipped)
    # row 1: log ratios -0.05 x3, sum -0.15: s = 0.860708 in [0.8, 1.2], A = -1 -> +0.860708
    # loss = (-1.2 + 0.860708) / 2 = -0.169646
    old_B_T = t([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    logp_B_T = leaf([[-0.9, -0.9, 0.0], [-2.05, -2.05, -2.05]])
    adv_B_T = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask_B_T = t([[1, 1, 0], [1, 1, 1]])
    loss, _ = ab.RLOO().loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    s1 = math.exp(-0.15)
    assert num(loss) == pytest.approx((-1.2 + s1) / 2)
    # row 1: d(-s A)/dlogp_t = s (ds/dlogp_t = s for a sum), / 2 sequences; row 0 clipped
    torch.testing.assert_close(grad_of(loss, logp_B_T),
                               t([[0.0, 0.0, 0.0], [s1 / 2, s1 / 2, s1 / 2]]))


def test_cispo_clips_the_weight_and_keeps_the_gradient():
    # token 0: r = 6 -> weight capped at 5; A = +1, logp = -1: -5 * 1 * -1 = 5
    # token 1: r = 0.5 (no floor); A = -2, logp = -2: -0.5 * -2 * -2 = -2
    # loss = (5 - 2) / 2 = 1.5
    logp_B_T = leaf([[-1.0, -2.0]])
    old_B_T = t([[-1.0 - math.log(6.0), -2.0 - math.log(0.5)]])
    adv_B_T = t([[1.0, -2.0]])
    mask_B_T = t([[1, 1]])
    loss, metrics = ab.CISPO().loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    assert num(loss) == pytest.approx(1.5)
    assert metrics["cispo_clip_frac"] == pytest.approx(0.5)
    # stop-gradient on the weight: dloss/dlogp = -w * A / 2 = [-2.5, 0.5]; the capped token
    # still learns (PPO's clip would give it 0). Were the weight differentiated, token 1 would
    # get -A * (r * logp + r) / 2 = 2 * (-1 + 0.5) / 2 = -0.5 and token 0 nothing.
    torch.testing.assert_close(grad_of(loss, logp_B_T), t([[-2.5, 0.5]]))
    # a floor: min_weight 0.6 lifts token 1's weight to 0.6: (5 - 2.4) / 2 = 1.3
    floored, _ = cispo_loss(logp_B_T, old_B_T, adv_B_T, mask_B_T, min_weight=0.6)
    assert num(floored) == pytest.approx(1.3)


def test_reinforce_pp_loss_is_the_clipped_surrogate():
    # ratio 1.1, A = +1: not clipped at 0.2 -> -1.1; same as ppo_clip_loss
    logp_B_T = leaf([[math.log(1.1)]])
    old_B_T = t([[0.0]])
    loss, _ = ab.ReinforcePP().loss(logp_B_T, old_B_T, t([[1.0]]), t([[1]]))
    reference, _ = ppo_clip_loss(logp_B_T, old_B_T, t([[1.0]]), t([[1]]))
    assert num(loss) == pytest.approx(-1.1) == num(reference)


def test_surrogate_levels_agree_on_a_one_token_row():
    # one trained token: its ratio, its row's mean ratio and its row's product are one number
    logp_B_T = leaf([[-0.5, 0.0]])
    old_B_T = t([[-0.6, 0.0]])
    args = (logp_B_T, old_B_T, t([[2.0, 2.0]]), t([[1, 0]]))
    values = {level: num(clipped_surrogate_loss(*args, level=level)[0])
              for level in ("token", "sequence", "sequence_sum")}
    assert len({round(v, 12) for v in values.values()}) == 1
    assert values["token"] == pytest.approx(-2 * math.exp(0.1))
    with pytest.raises(ValueError, match="level"):
        clipped_surrogate_loss(*args, level="row")


# --------------------------------------------------------------------------- corrections


def test_truncated_is_weights_token_and_sequence():
    # row 0: trainer - engine = [0.5, -1] -> token ratios [1.6487, 0.3679]; cap 1.5 -> [1.5, 0.3679]
    #        sequence: exp(0.5 - 1) = exp(-0.5) = 0.6065 for both tokens
    # row 1: [1, 1] and a padding token -> sequence exp(2) = 7.389 capped at 2; padding 0
    trainer_B_T = t([[-1.0, -2.0, 0.0], [0.0, 0.0, 5.0]])
    engine_B_T = t([[-1.5, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask_B_T = t([[1, 1, 0], [1, 1, 0]])
    token = truncated_is_weights(trainer_B_T, engine_B_T, mask_B_T, cap=1.5)
    torch.testing.assert_close(token, t([[1.5, math.exp(-1), 0], [1.5, 1.5, 0]]))
    sequence = truncated_is_weights(trainer_B_T, engine_B_T, mask_B_T, level="sequence")
    e = math.exp(-0.5)
    torch.testing.assert_close(sequence, t([[e, e, 0], [2.0, 2.0, 0]]))
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(trainer_B_T, engine_B_T, mask_B_T, level="row")


def test_a_loss_with_truncated_is():
    # the ratio is measured against the trainer's own logprobs (1 at the step's start), and each
    # token's loss is multiplied by w = min(exp(logp - engine_logp), 2):
    # logp [-1, -2], engine [-1.5, -1]: w = [exp(0.5), exp(-1)] = [1.6487, 0.3679]
    # A = +1: loss = -(1.6487 + 0.3679) / 2 = -1.00833; dloss/dlogp = -w / 2
    logp_B_T = leaf([[-1.0, -2.0]])
    engine_B_T = t([[-1.5, -1.0]])
    adv_B_T = t([[1.0, 1.0]])
    mask_B_T = t([[1, 1]])
    w = [math.exp(0.5), math.exp(-1.0)]
    for config in (ab.GRPO(tis_cap=2.0), ab.DAPO(tis_cap=2.0), ab.DrGRPO(tis_cap=2.0, max_tokens=2),
                   ab.CISPO(tis_cap=2.0)):
        loss, metrics = config.loss(logp_B_T, engine_B_T, adv_B_T, mask_B_T)
        if isinstance(config, ab.CISPO):  # -1 * w * A * logp: -(1.6487 * -1 + 0.3679 * -2) / 2
            assert num(loss) == pytest.approx((w[0] + 2 * w[1]) / 2)
        else:
            assert num(loss) == pytest.approx(-(w[0] + w[1]) / 2)
        torch.testing.assert_close(grad_of(loss, logp_B_T), t([[-w[0] / 2, -w[1] / 2]]))
        assert metrics["tis_weight_mean"] == pytest.approx(sum(w) / 2)
        assert metrics["tis_capped_frac"] == 0.0
    # sequence level: w = exp(0.5 - 1) = 0.6065 for both: loss -0.6065
    loss, _ = ab.DAPO(tis_cap=2.0, tis_level="sequence").loss(logp_B_T, engine_B_T, adv_B_T,
                                                              mask_B_T)
    assert num(loss) == pytest.approx(-math.exp(-0.5))


def test_kl_estimators():
    # token 0: logp -1, ref -2: log r = ref - logp = -1 -> k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1
    # token 1: logp -2, ref -1: log r = +1 -> k1 = -1, k2 = 0.5, k3 = e - 1 - 1 = 0.718282
    logp_B_T = leaf([[-1.0, -2.0]])
    ref_B_T = t([[-2.0, -1.0]])
    torch.testing.assert_close(kl_estimate(logp_B_T, ref_B_T, "k1"), t([[1.0, -1.0]]),
                               check_stride=False)
    torch.testing.assert_close(kl_estimate(logp_B_T, ref_B_T, "k2"), t([[0.5, 0.5]]))
    k3 = kl_estimate(logp_B_T, ref_B_T, "k3")
    torch.testing.assert_close(k3, t([[math.exp(-1), math.e - 2]]))
    # in the loss: 0.1 * token mean = 0.1 * (0.367879 + 0.718282) / 2 = 0.054308
    # dk3/dlogp = 1 - exp(ref - logp): [1 - e^-1, 1 - e], times 0.1 / 2
    term = kl_loss_term(logp_B_T, ref_B_T, t([[1, 1]]), kl_coef=0.1)
    assert num(term) == pytest.approx(0.1 * (math.exp(-1) + math.e - 2) / 2)
    torch.testing.assert_close(grad_of(term, logp_B_T),
                               t([[0.05 * (1 - math.exp(-1)), 0.05 * (1 - math.e)]]))
    # in the reward: -coef * k1 per token, nothing off the mask, no gradient
    penalty = kl_reward_penalty(logp_B_T, ref_B_T, t([[1, 0]]), kl_coef=0.5)
    assert penalty.tolist() == [[-0.5, 0.0]] and not penalty.requires_grad
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp_B_T, ref_B_T, "k4")


# --------------------------------------------------------------------------- configs


def test_defaults_come_from_the_papers():
    assert (ab.DAPO().clip_low, ab.DAPO().clip_high) == (0.2, 0.28)
    assert (ab.DAPO().max_tokens, ab.DAPO().overlong_cache, ab.DAPO().filter_groups) == (
        20480, 4096, True)
    assert (ab.GSPO().clip_low, ab.GSPO().clip_high) == (3e-4, 4e-4)
    assert (ab.CISPO().max_weight, ab.CISPO().min_weight) == (5.0, 0.0)
    assert ab.DrGRPO().normalize_std is False
    assert [cls().name for cls in ZOO] == ["dr_grpo", "dapo", "gspo", "cispo", "rloo",
                                           "reinforce_pp"]


@pytest.mark.parametrize("cls", [*ZOO, ab.GRPO])
def test_zoo_configs_travel_as_json(cls):
    config = cls(entropy_coef=0.01, tis_cap=2.0, tis_level="sequence")
    assert travels_as_config(config)
    data = json.loads(json.dumps(algorithm_to_dict(config)))
    assert algorithm_from_dict(data) == config
    with pytest.raises(ValueError, match="no field"):
        algorithm_from_dict({**data, "clip": 0.1})


def test_zoo_configs_check_their_arguments():
    with pytest.raises(ValueError, match="clip_high"):
        ab.DAPO(clip_high=1.5)
    with pytest.raises(ValueError, match="tis_cap"):
        ab.GSPO(tis_cap=0.5)
    with pytest.raises(ValueError, match="tis_level"):
        ab.RLOO(tis_level="row")
    with pytest.raises(ValueError, match="max_weight"):
        ab.CISPO(max_weight=0.9)
    with pytest.raises(ValueError, match="max_tokens"):
        ab.DrGRPO(max_tokens=0)
    with pytest.raises(TypeError, match="group_baseline"):
        ab.ReinforcePP(group_baseline="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ab.DAPO(0.2, 0.28)  # type: ignore[misc]  # keyword only


# --------------------------------------------------------------------------- against TRL


def trl_tensors() -> dict[str, torch.Tensor]:
    """4 rows of up to 6 tokens, ratios spread enough that PPO's and GSPO's clips both bind."""
    generator = torch.Generator().manual_seed(7)
    mask = torch.zeros(4, 6)
    for row, length in enumerate([6, 3, 5, 1]):
        mask[row, :length] = 1
    old_logp = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    logp = old_logp + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.3
    ref_logp = old_logp + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
    return {"logp": logp, "old_logp": old_logp, "ref_logp": ref_logp, "adv": adv,
            "mask": mask.to(torch.float64)}


def small_ratios(tensors):
    """GSPO's clip is about +-4e-4: the same tensors with log ratios 150 times smaller (rows'
    mean log ratios [4.5e-4, 5.9e-4, -1.4e-3, -3.3e-4] with advantages [1, -0.5, 0.7, -1.2]:
    rows 0 and 3 are clipped)."""
    return {**tensors, "logp": tensors["old_logp"] + (tensors["logp"] - tensors["old_logp"]) / 150}


def ours(tensors, algorithm, **extra):
    logp = tensors["logp"].clone().requires_grad_(True)
    adv_B_T = tensors["adv"][:, None].expand_as(logp)
    loss, _ = algorithm.loss(logp, tensors["old_logp"], adv_B_T, tensors["mask"])
    if "kl" in extra:
        loss = loss + kl_loss_term(logp, tensors["ref_logp"], tensors["mask"], kl_coef=extra["kl"])
    return float(loss.detach()), grad_of(loss, logp)


@pytest.mark.slow
def test_losses_match_trls_on_the_same_tensors(tmp_path):
    """TRL 1.16's own code, run in bench/.venv-trl on the tensors written here:
    `GRPOTrainer._compute_loss` with loss_type "bnpo" (GRPO's token mean), "dapo", "dr_grpo",
    "cispo", "grpo" with importance_sampling_level "sequence" (GSPO), "bnpo" with beta 0.04 (the
    k3 KL in the loss), "dapo" and "bnpo" with the vLLM importance-sampling correction (weights:
    TRL computes them in its generation step, checked by hand above), and
    `RLOOTrainer._compute_loss` (RLOO's sequence ratio). tests/trl_zoo_runner.py calls them on a
    stand-in trainer whose `_get_per_token_logps_and_entropies` returns these logprobs."""
    if not TRL_PYTHON.is_file():
        pytest.skip("bench/.venv-trl is missing; create it with bench/vs_trl.py's "
                    "ensure_trl_venv (see that file) to compare the losses with TRL's")
    base = trl_tensors()
    tiny = small_ratios(base)
    engine = base["old_logp"]
    is_ratio = truncated_is_weights(base["logp"], engine, base["mask"], cap=2.0)
    grpo = {"loss_type": "bnpo"}
    cases = [
        ("grpo", base, grpo, ab.GRPO(), {}),
        ("dapo", base, {"loss_type": "dapo", "epsilon_high": 0.28}, ab.DAPO(), {}),
        ("dr_grpo", base, {"loss_type": "dr_grpo", "max_completion_length": 6},
         ab.DrGRPO(max_tokens=6), {}),
        # a cap of 1.5 (not the default 5) so that two of these tokens' weights are capped
        ("cispo", base, {"loss_type": "cispo", "epsilon_high": 1.5}, ab.CISPO(max_weight=1.5),
         {}),
        ("gspo", tiny, {"loss_type": "grpo", "importance_sampling_level": "sequence",
                        "epsilon_low": 3e-4, "epsilon_high": 4e-4}, ab.GSPO(), {}),
        ("kl", base, {**grpo, "beta": 0.04}, ab.GRPO(), {"kl": 0.04}),
        ("tis", base, {"loss_type": "dapo", "epsilon_high": 0.28, "use_vllm": True,
                       "vllm_importance_sampling_correction": True}, ab.DAPO(tis_cap=2.0), {}),
        ("grpo_tis", base, {**grpo, "use_vllm": True, "vllm_importance_sampling_correction": True},
         ab.GRPO(tis_cap=2.0), {}),
        ("rloo", base, {}, ab.RLOO(), {}),
    ]
    specs = []
    files = {}
    for name, tensors, settings, _, extra in cases:
        files.update({f"{name}.{key}": value.clone() for key, value in tensors.items()})
        spec = {"name": name, "trainer": "rloo" if name == "rloo" else "grpo",
                "settings": settings, "ref": "kl" in extra, "prefix": name}
        if name in ("tis", "grpo_tis"):
            files[f"{name}.is_ratio"] = is_ratio.clone()
            spec.update(is_ratio=True, old_is_current=True)
        specs.append(spec)
    save_file(files, tmp_path / "tensors.safetensors")
    (tmp_path / "cases.json").write_text(json.dumps(specs))
    out = tmp_path / "out.json"
    done = subprocess.run([str(TRL_PYTHON), str(ROOT / "tests" / "trl_zoo_runner.py"),
                           str(tmp_path / "tensors.safetensors"), str(tmp_path / "cases.json"),
                           str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(out.read_text())
    for name, tensors, _, algorithm, extra in cases:
        loss, grad = ours(tensors, algorithm, **extra)
        assert loss == pytest.approx(theirs[name]["loss"], abs=1e-9), name
        torch.testing.assert_close(grad, torch.tensor(theirs[name]["grad"], dtype=torch.float64),
                                   atol=1e-9, rtol=1e-7, msg=name)
    # the comparison can fail: TRL's constant normalisation is not the token mean, and the clips
    # bind on these tensors (GSPO's two rows, CISPO's two capped weights, GRPO's 2 of 15 tokens)
    assert ours(base, ab.GRPO())[0] != pytest.approx(theirs["dr_grpo"]["loss"], abs=1e-6)
    adv_B_T = base["adv"][:, None].expand(4, 6)
    for tensors, algorithm, key in [(tiny, ab.GSPO(), "clip_frac"),
                                    (base, ab.CISPO(max_weight=1.5), "cispo_clip_frac"),
                                    (base, ab.GRPO(), "clip_frac")]:
        _, metrics = algorithm.loss(tensors["logp"], tensors["old_logp"], adv_B_T, tensors["mask"])
        assert metrics[key] > 0, algorithm


# --------------------------------------------------------------------------- in the trainer


def trainer_batch(algorithm):
    from astranb.dataflow.batcher import build_batch
    from tests.test_dataflow import group

    # four answers of 3, 1, 2 and 3 tokens; rewards 1, 0, 0.5, 0
    return build_batch([group(0, [(0, 0, 0), (0,), (0, 0), (0, 0, 0)], [1.0, 0.0, 0.5, 0.0])],
                       "p", algorithm, pad_id=0)


@pytest.mark.parametrize("algorithm", [cls() for cls in ZOO] + [
    ab.DAPO(tis_cap=2.0), ab.GSPO(tis_cap=2.0, tis_level="sequence"), ab.CISPO(entropy_coef=0.01)],
    ids=lambda a: repr(a)[:40])
def test_each_config_takes_a_trainer_step(algorithm):
    from astranb.training.local import LocalTrainer

    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    trainer = LocalTrainer(spec, algorithm, ab.AdamWConfig(lr=1e-2))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step(trainer_batch(algorithm))
    assert trainer.version == 1 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                       strict=True))
    assert moved


@pytest.mark.parametrize("algorithm", [ab.DAPO(), ab.CISPO(), ab.ReinforcePP(),
                                       ab.DAPO(tis_cap=2.0, tis_level="sequence")],
                         ids=lambda a: a.name)
def test_token_mean_losses_give_the_same_step_in_micro_batches(algorithm):
    # REINFORCE++ included: its batch normalisation happens before the split (a one-row
    # micro-batch alone would whiten to zeros and not move the model)
    from astranb.training.local import LocalTrainer

    spec = ab.models.tiny(hidden_size=32, num_heads=2)
    batch = trainer_batch(algorithm)
    whole = LocalTrainer(spec, algorithm, micro_batch_size=4)
    parts = LocalTrainer(spec, algorithm, micro_batch_size=1)
    m1, m2 = whole.step(batch), parts.step(batch)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    for (name, a), b in zip(whole.model.named_parameters(), parts.model.parameters(),
                            strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
