"""Tests for astranb.algorithms against values worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from astranb.algorithms import (
    GRPO,
    M2PO,
    Algorithm,
    group_advantages,
    groups_with_signal,
    has_signal,
    m2po_loss,
    m2po_mask,
    ppo_clip_loss,
    token_mean,
)


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def num(x: torch.Tensor) -> float:
    """A scalar tensor as a float (detached: torch warns on float() of a grad tensor)."""
    return float(x.detach())


# --------------------------------------------------------------------------- advantages


def test_group_advantages_binary_rewards():
    rewards_G_N = t([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv_G_N = group_advantages(rewards_G_N)
    # row 0: mean 0.5, deviations +-0.5, population var (4 * 0.25) / 4 = 0.25, std 0.5
    #        adv = +-0.5 / (0.5 + 1e-6) = +-0.999998
    # row 1: mean 1, deviations 0, std 0 -> 0 / (0 + 1e-6) = 0 exactly (eps keeps it finite)
    a = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(adv_G_N, t([[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]]))
    rounded = t([[1.0, -1.0, -1.0, 1.0], [0, 0, 0, 0]])
    torch.testing.assert_close(adv_G_N, rounded, atol=1e-5, rtol=0)
    assert torch.equal(adv_G_N[1], torch.zeros(4, dtype=torch.float64))


def test_group_advantages_non_binary_uses_population_std():
    # rewards [0, 2, 4]: mean 2, deviations [-2, 0, 2]
    # population var (4 + 0 + 4) / 3 = 8/3, std sqrt(8/3) = 1.63299
    # adv = +-2 / sqrt(8/3) = +-sqrt(3/2) = +-1.2247449  (the unbiased std 2 would give +-1)
    adv_G_N = group_advantages(t([[0.0, 2.0, 4.0]]), eps=0.0)
    s = math.sqrt(1.5)
    torch.testing.assert_close(adv_G_N, t([[-s, 0.0, s]]))


def test_group_advantages_eps_matters_for_tiny_spread():
    # rewards [0, 2e-6]: mean 1e-6, deviations +-1e-6, std 1e-6
    # adv = +-1e-6 / (1e-6 + 1e-6) = +-0.5
    adv_G_N = group_advantages(t([[0.0, 2e-6]]))
    torch.testing.assert_close(adv_G_N, t([[-0.5, 0.5]]))


def test_group_advantages_without_std():
    # rewards [3, 1, 5]: mean 3 -> [0, -2, 2];  rewards [1, 1, 1] -> [0, 0, 0]
    adv_G_N = group_advantages(t([[3.0, 1.0, 5.0], [1.0, 1.0, 1.0]]), normalize_std=False)
    torch.testing.assert_close(adv_G_N, t([[0.0, -2.0, 2.0], [0.0, 0.0, 0.0]]))


def test_group_advantages_integer_rewards_and_shape_check():
    adv_G_N = group_advantages(torch.tensor([[1, 0]]))
    assert adv_G_N.is_floating_point()
    # mean 0.5, std 0.5 -> +-0.5 / 0.500001
    torch.testing.assert_close(adv_G_N, torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"rewards\[None, :\]"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_groups_with_signal_and_has_signal():
    rewards_G_N = t([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5 + 1e-12]])
    assert groups_with_signal(rewards_G_N).tolist() == [True, False, True]
    assert groups_with_signal(rewards_G_N).dtype == torch.bool
    assert has_signal([1.0, 0.0]) is True
    assert has_signal([1.0, 1.0, 1.0]) is False
    assert has_signal([0.2, 0.2, 0.2 + 1e-12]) is True  # exact comparison: any difference counts
    assert has_signal([3.0]) is False
    assert has_signal([]) is False
    assert has_signal(iter([0.0, 0.0, 1.0])) is True


# --------------------------------------------------------------------------- token mean


def test_token_mean_with_mask_ignores_masked_values_even_nan():
    x_B_T = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask_B_T = t([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3 = 7/3
    torch.testing.assert_close(token_mean(x_B_T, mask_B_T), t(7.0 / 3.0))
    # bool masks work the same
    torch.testing.assert_close(token_mean(x_B_T, mask_B_T.bool()), t(7.0 / 3.0))


def test_token_mean_micro_batches_add_up_to_minibatch_mean():
    x_B_T = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask_B_T = t([[1, 1, 1], [1, 0, 0]])
    # whole minibatch: (1 + 2 + 3 + 4) / 4 = 2.5
    full = token_mean(x_B_T, mask_B_T)
    torch.testing.assert_close(full, t(2.5))
    # micro-batch rows 0 and 1 with num_tokens=4: 6/4 = 1.5 and 4/4 = 1.0, sum 2.5
    first = token_mean(x_B_T[:1], mask_B_T[:1], num_tokens=4)
    second = token_mean(x_B_T[1:], mask_B_T[1:], num_tokens=torch.tensor(4))
    torch.testing.assert_close(first, t(1.5))
    torch.testing.assert_close(second, t(1.0))
    torch.testing.assert_close(first + second, full)
    # without it each micro-batch averages itself: 2.0 + 4.0 != 2.5
    assert float(token_mean(x_B_T[:1], mask_B_T[:1]) + token_mean(x_B_T[1:], mask_B_T[1:])) == 6.0


def test_token_mean_empty_mask_is_zero_not_nan():
    # denominator clamped to 1: 0 / 1 = 0
    out = token_mean(t([[5.0, 7.0]]), t([[0, 0]]))
    assert float(out) == 0.0


# --------------------------------------------------------------------------- PPO clip


def _ppo_example():
    """Four trained tokens and one padding token, clip 0.2 -> ratio range [0.8, 1.2].

    token  r    A    r*A    clip(r)*A    min     loss=-min  clipped?
      0   1.5   +1   1.5    1.2*1=1.2    1.2     -1.2       yes (A>0, r>1.2)
      1   0.5   +1   0.5    0.8*1=0.8    0.5     -0.5       no
      2   0.5   -2  -1.0    0.8*-2=-1.6  -1.6    +1.6       yes (A<0, r<0.8)
      3   1.1   -2  -2.2    1.1*-2=-2.2  -2.2    +2.2       no (inside the range)
      pad: logp 0, old_logp -100 (r = e^100 would overflow float32) -> must contribute nothing
    """
    ratios = [1.5, 0.5, 0.5, 1.1]
    old_logp_B_T = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -100.0]])
    logp_B_T = torch.tensor([[-1.0 + math.log(r) for r in ratios] + [0.0]], requires_grad=True)
    adv_B_T = torch.tensor([[1.0, 1.0, -2.0, -2.0, 5.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return logp_B_T, old_logp_B_T, adv_B_T, mask_B_T


def test_ppo_clip_loss_value_and_metrics():
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _ppo_example()
    loss, metrics = ppo_clip_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    # (-1.2 - 0.5 + 1.6 + 2.2) / 4 = 2.1 / 4 = 0.525
    assert num(loss) == pytest.approx(0.525, abs=1e-6)
    # tokens 0 and 2 clipped: 2 / 4
    assert metrics["clip_frac"] == pytest.approx(0.5)
    # (1.5 + 0.5 + 0.5 + 1.1) / 4 = 3.6 / 4 = 0.9
    assert metrics["ratio_mean"] == pytest.approx(0.9, abs=1e-6)
    # k3 = (r - 1) - ln r:  1.5 -> 0.5 - 0.4054651 = 0.0945349
    #                       0.5 -> -0.5 + 0.6931472 = 0.1931472 (twice)
    #                       1.1 -> 0.1 - 0.0953102 = 0.0046898
    # sum 0.4855191 / 4 = 0.1213798
    assert metrics["approx_kl"] == pytest.approx(0.1213798, abs=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())


def test_ppo_clip_loss_clipped_tokens_have_zero_gradient():
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _ppo_example()
    loss, _ = ppo_clip_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    loss.backward()
    # unclipped token: d(-r*A)/dlogp = -r*A, divided by 4 tokens
    #   token 1: -(0.5 * 1) / 4 = -0.125;  token 3: -(1.1 * -2) / 4 = 0.55
    # clipped tokens 0, 2 and the padding token: 0
    torch.testing.assert_close(logp_B_T.grad, torch.tensor([[0.0, -0.125, 0.0, 0.55, 0.0]]))


def test_ppo_clip_loss_asymmetric_clip():
    # one token, r = 1.25, A = +1
    # clip_high 0.2:  min(1.25, 1.2) = 1.2   -> loss -1.2, clipped
    # clip_high 0.28: min(1.25, 1.25) = 1.25 -> loss -1.25, not clipped
    logp_B_T = torch.tensor([[math.log(1.25)]])
    args = (logp_B_T, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss, metrics = ppo_clip_loss(*args, clip_high=0.2)
    assert num(loss) == pytest.approx(-1.2) and metrics["clip_frac"] == 1.0
    loss, metrics = ppo_clip_loss(*args, clip_high=0.28)
    assert num(loss) == pytest.approx(-1.25) and metrics["clip_frac"] == 0.0
    # r = 0.75, A = -1: clip_low 0.2 -> min(-0.75, -0.8) = -0.8 -> loss 0.8, clipped
    #                   clip_low 0.3 -> clip(0.75) = 0.75 -> loss 0.75, not clipped
    logp_B_T = torch.tensor([[math.log(0.75)]])
    args = (logp_B_T, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert num(ppo_clip_loss(*args, clip_low=0.2)[0]) == pytest.approx(0.8)
    assert num(ppo_clip_loss(*args, clip_low=0.3)[0]) == pytest.approx(0.75)


# --------------------------------------------------------------------------- M2PO mask


def test_m2po_mask_six_token_example():
    # log r  [0.1, -0.5, 0.3, 0.0, 0.6, -0.2]
    # M2     [0.01, 0.25, 0.09, 0, 0.36, 0.04]   sum 0.75, mean 0.125 > 0.04
    # drop 0.36 (token 4): 0.39 / 5 = 0.078 > 0.04
    # drop 0.25 (token 1): 0.14 / 4 = 0.035 <= 0.04 -> stop
    log_ratio_B_T = torch.tensor([[0.1, -0.5, 0.3, 0.0, 0.6, -0.2]])
    kept_B_T = m2po_mask(log_ratio_B_T, torch.ones(1, 6), threshold=0.04)
    assert kept_B_T.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0, 1.0]]
    # same tokens laid out as 2 x 3
    kept_B_T = m2po_mask(log_ratio_B_T.view(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert kept_B_T.dtype == torch.bool
    assert kept_B_T.tolist() == [[True, False, True], [True, False, True]]


def test_m2po_mask_keeps_all_under_threshold():
    # M2 [0.01, 0.01, 0.0225, 0]: mean 0.0425 / 4 = 0.010625 <= 0.04
    mask_B_T = torch.ones(1, 4)
    assert m2po_mask(torch.tensor([[0.1, -0.1, 0.15, 0.0]]), mask_B_T).tolist() == [[1.0] * 4]
    # exactly at the threshold is kept: M2 [0.25, 0.25], mean 0.25 <= 0.25
    assert m2po_mask(torch.tensor([[0.5, -0.5]]), torch.ones(1, 2), 0.25).tolist() == [[1.0, 1.0]]


def test_m2po_mask_ignores_masked_out_tokens():
    # token 1 is padding with M2 25: ignored. Trained M2 [0.01, 0.01], mean 0.01 -> keep both
    kept_B_T = m2po_mask(torch.tensor([[0.1, 5.0, 0.1]]), torch.tensor([[1.0, 0.0, 1.0]]))
    assert kept_B_T.tolist() == [[1.0, 0.0, 1.0]]
    # trained M2 [0.09, 0]: mean 0.045 > 0.04 -> drop token 0 -> mean 0 (token 1 kept).
    # (Were the two padding zeros counted the mean would be 0.09 / 4 = 0.0225 and all kept.)
    kept_B_T = m2po_mask(torch.tensor([[0.3, 0.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert kept_B_T.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_m2po_mask_ties_drop_first_token_in_row_major_order():
    # M2 [0.25, 0.25, 0, 0], threshold 0.1: mean 0.125 > 0.1
    # drop one 0.25 (the first, token 0): 0.25 / 3 = 0.0833 <= 0.1 -> stop
    kept_B_T = m2po_mask(torch.tensor([[0.5, -0.5, 0.0, 0.0]]), torch.ones(1, 4), 0.1)
    assert kept_B_T.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    # across rows: [[0, 0.5], [0.5, 0]] -> first 0.25 in row-major order is (0, 1)
    kept_B_T = m2po_mask(torch.tensor([[0.0, 0.5], [0.5, 0.0]]), torch.ones(2, 2), 0.1)
    assert kept_B_T.tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_m2po_mask_may_drop_everything():
    # single token, M2 1 > 0.04; dropping it leaves nothing, which is allowed
    assert m2po_mask(torch.tensor([[1.0]]), torch.ones(1, 1)).tolist() == [[0.0]]
    # empty batch
    assert m2po_mask(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)


def test_m2po_mask_only_violating():
    # token  log r   A    violating?                    M2
    #   0    0.5    +1   yes (A>0, r>1)                0.25
    #   1    0.5    -1   no  (A<0, r>1)                0.25
    #   2   -0.5    -1   yes (A<0, r<1)                0.25
    #   3   -0.4    +1   no  (A>0, r<1)                0.16
    #   4    0.1    +1   yes (A>0, r>1)                0.01
    #   5    0.0    -1   no  (r == 1)                  0
    log_ratio_B_T = torch.tensor([[0.5, 0.5, -0.5, -0.4, 0.1, 0.0]])
    adv_B_T = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0]])
    mask_B_T = torch.ones(1, 6)
    # violating M2 [0.25, 0.25, 0.01]: mean 0.51 / 3 = 0.17 > 0.04
    #   drop token 0 (tie, first): 0.26 / 2 = 0.13 > 0.04
    #   drop token 2:              0.01 / 1 = 0.01 <= 0.04 -> stop; tokens 1, 3, 5 always kept
    kept_B_T = m2po_mask(log_ratio_B_T, mask_B_T, only_violating=True, adv_B_T=adv_B_T)
    assert kept_B_T.tolist() == [[0.0, 1.0, 0.0, 1.0, 1.0, 1.0]]
    # default rule on the same tokens: M2 [0.25, 0.25, 0.25, 0.16, 0.01, 0], sum 0.92
    #   0.92 / 6 = 0.1533 -> drop 0: 0.67 / 5 = 0.134 -> drop 1: 0.42 / 4 = 0.105
    #   -> drop 2: 0.17 / 3 = 0.0567 -> drop 3: 0.01 / 2 = 0.005 <= 0.04
    assert m2po_mask(log_ratio_B_T, mask_B_T).tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="adv_B_T"):
        m2po_mask(log_ratio_B_T, mask_B_T, only_violating=True)


# --------------------------------------------------------------------------- M2PO loss


def _m2po_example():
    """Four trained tokens and one padding token.

    token  log r   r = e^log r   A    M2
      0     0.0    1.0           +1   0
      1     0.1    1.1051709     -1   0.01
      2    -0.1    0.9048374     +2   0.01
      3     0.7    2.0137527     +1   0.49
      pad  (logp 0, old_logp -100)
    M2 mean 0.51 / 4 = 0.1275 > 0.04 -> drop token 3 -> 0.02 / 3 = 0.00667 <= 0.04
    """
    log_ratios = [0.0, 0.1, -0.1, 0.7]
    old_logp_B_T = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -100.0]], dtype=torch.float64)
    logp_B_T = torch.tensor(
        [[-2.0 + x for x in log_ratios] + [0.0]], dtype=torch.float64, requires_grad=True
    )
    adv_B_T = t([[1.0, -1.0, 2.0, 1.0, 3.0]])
    mask_B_T = t([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return logp_B_T, old_logp_B_T, adv_B_T, mask_B_T


def test_m2po_loss_value_and_metrics():
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _m2po_example()
    loss, metrics = m2po_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    # kept tokens 0, 1, 2; -r*A: -1.0 + 1.1051709 - 1.8096748 = -1.7045039
    # divided by the ORIGINAL 4 trained tokens: -0.4261260
    assert num(loss) == pytest.approx(-0.4261260, abs=1e-6)
    assert metrics["m2po_masked_frac"] == pytest.approx(0.25)  # 1 of 4 dropped
    assert metrics["m2"] == pytest.approx(0.1275)  # 0.51 / 4
    assert metrics["m2_after"] == pytest.approx(0.02 / 3)  # (0 + 0.01 + 0.01) / 3
    # (1 + 1.1051709 + 0.9048374 + 2.0137527) / 4 = 5.023761 / 4 = 1.2559403
    assert metrics["ratio_mean"] == pytest.approx(1.2559403, abs=1e-6)
    # k3: 0, 0.1051709 - 0.1 = 0.0051709, -0.0951626 + 0.1 = 0.0048374, 1.0137527 - 0.7 = 0.3137527
    # sum 0.3237610 / 4 = 0.0809403
    assert metrics["approx_kl"] == pytest.approx(0.0809403, abs=1e-6)
    # an explicit minibatch token count of 8 halves it: -1.7045039 / 8 = -0.2130630
    loss8, _ = m2po_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=8)
    assert num(loss8) == pytest.approx(-0.2130630, abs=1e-6)


def test_m2po_loss_dropped_tokens_have_zero_gradient():
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _m2po_example()
    loss, _ = m2po_loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    loss.backward()
    # d(-r*A)/dlogp = -r*A, over 4 tokens: token 0 -1/4 = -0.25; token 1 1.1051709/4 = 0.2762927;
    # token 2 -1.8096748/4 = -0.4524187; token 3 dropped -> 0; padding -> 0
    expected = t([[-0.25, 0.2762927, -0.4524187, 0.0, 0.0]])
    torch.testing.assert_close(logp_B_T.grad, expected, atol=1e-6, rtol=0)


def test_m2po_loss_does_not_clip_the_ratio():
    # r = 1.5 on token 0, four tokens at r = 1:
    # M2 (ln 1.5)^2 = 0.1644, mean 0.1644 / 5 = 0.0329 <= 0.04 -> all kept
    # loss = -(1.5 * 1) / 5 = -0.3   (PPO with clip 0.2 would give -1.2 / 5 = -0.24)
    logp_B_T = torch.tensor([[math.log(1.5), 0.0, 0.0, 0.0, 0.0]])
    args = (logp_B_T, torch.zeros(1, 5), t([[1.0, 0, 0, 0, 0]]).float(), torch.ones(1, 5))
    loss, metrics = m2po_loss(*args)
    assert num(loss) == pytest.approx(-0.3) and metrics["m2po_masked_frac"] == 0.0
    assert num(ppo_clip_loss(*args)[0]) == pytest.approx(-0.24)


def test_m2po_loss_everything_dropped_is_zero():
    logp_B_T = torch.tensor([[2.0]], requires_grad=True)
    loss, metrics = m2po_loss(logp_B_T, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert num(loss) == 0.0 and metrics["m2po_masked_frac"] == 1.0 and metrics["m2_after"] == 0.0
    assert float(logp_B_T.grad) == 0.0


# --------------------------------------------------------------------------- M2PO property


def _reference_kept(m2, trained, candidate, threshold):
    """Brute force: drop the largest M2 (first index on ties) while the mean is over threshold.

    Returns the kept flags and the gaps |mean - threshold| seen at every decision.
    """
    kept = [trained[i] for i in range(len(m2))]
    pool = [i for i in range(len(m2)) if candidate[i]]
    gaps = []
    while pool:
        mean = math.fsum(m2[i] for i in pool) / len(pool)
        gaps.append(abs(mean - threshold))
        if mean <= threshold:
            break
        worst = max(pool, key=lambda i: (m2[i], -i))
        pool.remove(worst)
        kept[worst] = False
    return kept, gaps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(
        st.tuples(
            st.floats(-1.5, 1.5, width=32),
            st.booleans(),
            st.sampled_from([-1.0, 0.0, 1.0]),
        ),
        min_size=1,
        max_size=40,
    ),
    threshold=st.floats(0.001, 0.5),
    only_violating=st.booleans(),
)
@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_m2po_mask_matches_brute_force(data, threshold, only_violating):
    log_ratio = torch.tensor([d[0] for d in data], dtype=torch.float32)
    trained = [d[1] for d in data]
    adv = [d[2] for d in data]
    m2 = [float(x) ** 2 for x in log_ratio.tolist()]
    violating = [(a > 0 and x > 0) or (a < 0 and x < 0)
                 for x, a in zip(log_ratio.tolist(), adv, strict=True)]
    candidate = [tr and (v or not only_violating)
                 for tr, v in zip(trained, violating, strict=True)]
    expected, gaps = _reference_kept(m2, trained, candidate, threshold)
    assume(all(g > 1e-9 for g in gaps))  # skip float ties with the bound itself

    kept_B_T = m2po_mask(
        log_ratio[None, :],
        torch.tensor([trained], dtype=torch.float32),
        threshold,
        only_violating=only_violating,
        adv_B_T=torch.tensor([adv]),
    )
    kept = [bool(k) for k in kept_B_T[0].tolist()]
    assert kept == expected

    # properties, stated directly: within the bound ...
    kept_candidates = [m2[i] for i in range(len(m2)) if candidate[i] and kept[i]]
    if kept_candidates:
        assert math.fsum(kept_candidates) / len(kept_candidates) <= threshold + 1e-6
    # ... never keeps an untrained token, never drops a non-candidate ...
    assert all(candidate[i] or kept[i] == trained[i] for i in range(len(m2)))
    # ... and minimal: putting back the smallest dropped value breaks the bound
    dropped = [m2[i] for i in range(len(m2)) if candidate[i] and not kept[i]]
    if dropped:
        restored = kept_candidates + [min(dropped)]
        assert math.fsum(restored) / len(restored) > threshold


# --------------------------------------------------------------------------- configs


def test_configs_defaults_and_names():
    grpo, m2po = GRPO(), M2PO()
    assert isinstance(grpo, Algorithm) and isinstance(m2po, Algorithm)
    assert (grpo.name, m2po.name) == ("grpo", "m2po")
    assert (grpo.clip_low, grpo.clip_high, grpo.normalize_std, grpo.filter_groups) == (
        0.2,
        0.2,
        True,
        True,
    )
    assert (m2po.threshold, m2po.only_violating) == (0.04, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo.clip_low = 0.3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Algorithm()  # type: ignore[abstract]


def test_configs_delegate_to_the_pure_functions():
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _ppo_example()
    loss, metrics = GRPO().loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    assert num(loss) == pytest.approx(0.525, abs=1e-6) and metrics["clip_frac"] == 0.5
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T = _m2po_example()
    loss, metrics = M2PO().loss(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, num_tokens=8)
    assert num(loss) == pytest.approx(-0.2130630, abs=1e-6)
    # advantages: [1, 0, 0, 1] -> +-1 (std 0.5), or +-0.5 without the std
    rewards_G_N = t([[1.0, 0.0, 0.0, 1.0]])
    expected = t([[1.0, -1, -1, 1]])
    torch.testing.assert_close(GRPO().advantages(rewards_G_N), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        M2PO(normalize_std=False).advantages(rewards_G_N), t([[0.5, -0.5, -0.5, 0.5]])
    )


@pytest.mark.parametrize("field", ["clip_low", "clip_high"])
@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_grpo_rejects_clip_outside_unit_interval(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be in \(0, 1\).*{field}=0.2"):
        GRPO(**{field: value})


@pytest.mark.parametrize("value", [0.0, -0.04, float("inf"), float("nan")])
def test_m2po_rejects_bad_threshold(value):
    with pytest.raises(ValueError, match=r"threshold must be a finite number > 0.*threshold=0.04"):
        M2PO(threshold=value)


def test_configs_reject_wrong_types():
    with pytest.raises(TypeError, match="threshold must be a number"):
        M2PO(threshold="0.04")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clip_low must be a number"):
        GRPO(clip_low=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="normalize_std must be True or False"):
        GRPO(normalize_std="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only_violating must be True or False"):
        M2PO(only_violating=1)  # type: ignore[arg-type]
    assert M2PO(threshold=1).threshold == 1  # ints are fine
