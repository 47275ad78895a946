"""astranb's M2PO checked step by step against the paper's algorithm, written out here on its own.

The paper (Zheng, Zhao, Chen: "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
Stale Data on LLMs?", arXiv 2510.01161, Algorithm 1 and the M2PO objective) says, for one training
batch with behaviour logprobs old_logp and current logprobs logp:

1. log r = logp - old_logp on every trained token; M2 = mean over the trained tokens of (log r)^2.
2. While the mean (log r)^2 of the tokens still kept exceeds tau (0.04), mask the kept token with
   the largest (log r)^2.
3. J = 1 / (number of trained tokens) * sum over kept tokens of r * A, with r NOT clipped; the
   denominator is every trained token of the batch (masked ones count as 0), the loss is -J.

`_paper_mask` and `_paper_loss` below are that text as a plain Python loop over floats, one token
at a time, with no torch and nothing from astranb; the worked examples are also computed by hand
in the comments. Where the paper says nothing (which of two equal (log r)^2 goes first), the
tests use distinct values. astranb agrees with the paper on every point checked here; its two
choices beyond the paper are the tie order (first in row-major order) and that the mask covers
whatever batch it is given (a micro-batch if the trainer splits one), see algorithms/m2po.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from astranb.algorithms import M2PO, m2po_loss, m2po_mask

TAU = 0.04  # the paper's default bound on the mean second moment


def _paper_mask(log_ratio: list[list[float]], trained: list[list[int]],
                tau: float) -> list[list[int]]:
    """Algorithm 1 as a loop: mask the largest (log r)^2 until the kept tokens' mean is <= tau."""
    kept = [row[:] for row in trained]
    while True:
        kept_m2 = [(log_ratio[b][t] ** 2, b, t) for b, row in enumerate(kept)
                   for t, k in enumerate(row) if k]
        if not kept_m2 or sum(m2 for m2, _, _ in kept_m2) / len(kept_m2) <= tau:
            return kept
        _, b, t = max(kept_m2)  # distinct values in these tests, so the order is the paper's
        kept[b][t] = 0


def _paper_loss(log_ratio, adv, trained, tau) -> tuple[float, list[list[float]], list[list[int]]]:
    """-J and dJ/dlogp by hand: d(-r * A)/dlogp = -r * A on kept tokens, over all trained tokens."""
    kept = _paper_mask(log_ratio, trained, tau)
    num_trained = sum(map(sum, trained))
    grad = [[-math.exp(lr) * adv[b] / num_trained if kept[b][t] else 0.0
             for t, lr in enumerate(row)] for b, row in enumerate(log_ratio)]
    return sum(map(sum, grad)), grad, kept


def _astranb(log_ratio, adv, trained, tau, old_logp=None):
    """astranb's M2PO on the same numbers: (loss, dloss/dlogp, kept mask, metrics)."""
    log_ratio_B_T = torch.tensor(log_ratio, dtype=torch.float64)
    old_B_T = (torch.full_like(log_ratio_B_T, -1.5) if old_logp is None
               else torch.tensor(old_logp, dtype=torch.float64))
    logp_B_T = (old_B_T + log_ratio_B_T).requires_grad_(True)
    mask_B_T = torch.tensor(trained, dtype=torch.float64)
    adv_B_T = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(mask_B_T)
    loss, metrics = M2PO(threshold=tau).loss(logp_B_T, old_B_T, adv_B_T, mask_B_T)
    loss.backward()
    kept = m2po_mask(logp_B_T.detach() - old_B_T, mask_B_T, tau)
    return float(loss.detach()), logp_B_T.grad.tolist(), kept.to(torch.int64).tolist(), metrics


def _assert_matches_paper(log_ratio, adv, trained, tau=TAU, old_logp=None):
    loss, grad, kept, metrics = _astranb(log_ratio, adv, trained, tau, old_logp)
    want_loss, want_grad, want_kept = _paper_loss(log_ratio, adv, trained, tau)
    assert kept == want_kept
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    for row, want_row in zip(grad, want_grad, strict=True):
        assert row == pytest.approx(want_row, rel=1e-12, abs=1e-12)
    num_trained = sum(map(sum, trained))
    dropped = num_trained - sum(map(sum, want_kept))
    assert metrics["m2po_masked_frac"] == pytest.approx(dropped / num_trained)
    return want_kept


def test_worked_example_with_padding_masks_one_token():
    # two rows, A = +1 and -0.5; row 1's last position is padding with a huge log ratio (ignored)
    # (log r)^2 of the 7 trained tokens: .01 .36 .0025 .09 | 0 .04 .01  -> sum .5125, mean .0732
    # .0732 > .04: mask the largest, .36 (row 0, t 1) -> sum .1525 over 6 = .0254 <= .04: stop
    log_ratio = [[0.1, -0.6, 0.05, 0.3], [0.0, 0.2, -0.1, 9.0]]
    trained = [[1, 1, 1, 1], [1, 1, 1, 0]]
    kept = _assert_matches_paper(log_ratio, [1.0, -0.5], trained)
    assert kept == [[1, 0, 1, 1], [1, 1, 1, 0]]
    # -J = -(1 * (e^.1 + e^.05 + e^.3) - 0.5 * (e^0 + e^.2 + e^-.1)) / 7, by hand:
    # -(3.506301 - 0.5 * 3.126240) / 7 = -(3.506301 - 1.563120) / 7 = -0.277597
    loss, grad, _, metrics = _astranb(log_ratio, [1.0, -0.5], trained, TAU)
    assert loss == pytest.approx(-0.277597, abs=1e-6)
    assert grad[0][1] == 0.0 and grad[1][3] == 0.0  # masked token and padding get no gradient
    assert grad[0][3] == pytest.approx(-math.exp(0.3) / 7)  # kept, r = 1.35: not clipped
    assert metrics["m2"] == pytest.approx(0.5125 / 7)
    assert metrics["m2_after"] == pytest.approx(0.1525 / 6)


def test_nothing_masked_when_the_batch_is_within_the_bound():
    # (log r)^2: .09 .0025 .01 | .0225 .0004 -> mean .1254 / 5 = .0251 <= .04: every token kept;
    # r = e^.3 = 1.35 lies outside PPO's [0.8, 1.2] and still gets its full -r * A
    log_ratio = [[0.3, -0.05, 0.1], [-0.15, 0.02, 0.0]]
    trained = [[1, 1, 1], [1, 1, 0]]
    kept = _assert_matches_paper(log_ratio, [2.0, -1.0], trained)
    assert kept == trained
    loss, _, _, _ = _astranb(log_ratio, [2.0, -1.0], trained, TAU)
    plain_pg = -(2 * (math.exp(0.3) + math.exp(-0.05) + math.exp(0.1))
                 - (math.exp(-0.15) + math.exp(0.02))) / 5
    assert loss == pytest.approx(plain_pg)


def test_many_masked_when_the_policy_has_drifted():
    # (log r)^2: 1 .81 .64 .01 0 .0016 -> mean .41; mask 1 -> 1.4616/5 = .29;
    # mask .81 -> .6516/4 = .16; mask .64 -> .0116/3 = .0039 <= .04: three of six masked, the
    # three that moved most
    log_ratio = [[1.0, -0.9, 0.8], [0.1, 0.0, -0.04]]
    trained = [[1, 1, 1], [1, 1, 1]]
    kept = _assert_matches_paper(log_ratio, [1.0, 1.0], trained)
    assert kept == [[0, 0, 0], [1, 1, 1]]
    _, _, _, metrics = _astranb(log_ratio, [1.0, 1.0], trained, TAU)
    assert metrics["m2po_masked_frac"] == pytest.approx(0.5)


def test_masks_every_token_when_all_moved_far():
    # one token with (log r)^2 = .25 > .04 alone: the paper masks it too; J = 0 and no gradient
    _assert_matches_paper([[0.5, 0.0]], [1.0], [[1, 0]])
    loss, grad, kept, _ = _astranb([[0.5, 0.0]], [1.0], [[1, 0]], TAU)
    assert kept == [[0, 0]] and loss == 0.0 and grad == [[0.0, 0.0]]


def test_the_bound_is_inclusive():
    # .25^2 = .0625 exactly in binary; with tau = .0625 the mean equals the bound: nothing masked
    assert _assert_matches_paper([[0.25, -0.25]], [1.0], [[1, 1]], tau=0.0625) == [[1, 1]]


def test_mask_is_global_over_the_batch_not_per_row():
    # row 0 alone has mean (log r)^2 = .09 > .04, but the batch mean is .09 * 2 / 8 = .0225: the
    # paper bounds the batch, so row 0 is kept whole
    log_ratio = [[0.3, -0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    trained = [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert _assert_matches_paper(log_ratio, [1.0, -1.0], trained) == trained


def test_loss_ignores_the_old_logprob_level_only_the_ratio_counts():
    # same log ratios, different behaviour logprobs per token: mask, loss and gradient unchanged
    log_ratio = [[0.4, -0.1, 0.25], [0.05, -0.3, 0.0]]
    old_logp = [[-0.1, -3.0, -0.7], [-2.2, -0.01, -5.0]]
    _assert_matches_paper(log_ratio, [0.7, -1.3], [[1, 1, 1], [1, 1, 0]], old_logp=old_logp)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_match_the_paper_loop(seed):
    # drifts from on-policy (.01) to very stale (1.0): distinct values, random padding per row
    rng = random.Random(seed)
    spread = [0.01, 0.1, 0.3, 1.0][seed % 4]
    rows, width = rng.randint(1, 5), rng.randint(1, 7)
    log_ratio = [[rng.gauss(0.0, spread) for _ in range(width)] for _ in range(rows)]
    lengths = [rng.randint(0, width) for _ in range(rows)]
    trained = [[int(t < n) for t in range(width)] for n in lengths]
    adv = [rng.gauss(0.0, 1.0) for _ in range(rows)]
    if sum(lengths) == 0:
        trained[0][0] = 1
    _assert_matches_paper(log_ratio, adv, trained)


def test_m2po_loss_function_and_config_agree():
    # the pure function and the M2PO config object are the same loss
    log_ratio_B_T = torch.tensor([[0.1, -0.6, 0.05, 0.3]], dtype=torch.float64)
    old_B_T = torch.zeros_like(log_ratio_B_T)
    adv_B_T = torch.full_like(log_ratio_B_T, 0.5)
    mask_B_T = torch.ones_like(log_ratio_B_T)
    a, _ = m2po_loss(old_B_T + log_ratio_B_T, old_B_T, adv_B_T, mask_B_T, threshold=TAU)
    b, _ = M2PO().loss(old_B_T + log_ratio_B_T, old_B_T, adv_B_T, mask_B_T)
    assert float(a) == float(b)
