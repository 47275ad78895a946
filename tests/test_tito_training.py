"""Training on multi-turn episodes: merged sequences, per-call rows, and the sampling distribution.

A conversation whose every turn extends the previous turn's tokens trains as one row; otherwise
each call is a row. Both must give the same loss and gradients. The trainer's logprobs must be
those of the distribution the engine sampled from, top-p truncation included.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import astranb as ab
from astranb import models
from astranb.dataflow.batcher import build_batch, chains
from astranb.dataflow.buffer import Group
from astranb.engines import HFEngine
from astranb.training.local import LocalTrainer, backward_micro_batches, token_logprobs
from astranb.types import Generation, GenerationRequest, SamplingParams, Trajectory, Turn

SPEC = models.tiny(hidden_size=64, num_layers=2, initializer_range=0.3)


def _turn(prompt, completion, logprobs=None, version=0, temperature=1.0, top_p=1.0):
    logprobs = logprobs or [-0.1 * (i + 1) for i in range(len(completion))]
    gen = Generation(tuple(prompt), tuple(completion), tuple(logprobs),
                     (version,) * len(completion), "stop")
    return Turn("solver", "p", gen, SamplingParams(temperature=temperature, top_p=top_p))


def _conversation(offset: int) -> list[Turn]:
    """Three turns: each prompt = the previous prompt + completion + observation tokens."""
    p1, c1 = [3, 4 + offset, 5, 6], [7, 8 + offset]
    p2 = p1 + c1 + [9, 10]  # observation tokens (a tool result), not sampled
    c2 = [11 + offset, 12, 13]
    p3 = p2 + c2 + [14]
    c3 = [15, 16 + offset]
    return [_turn(p1, c1), _turn(p2, c2), _turn(p3, c3)]


def _group() -> Group:
    trajs = [Trajectory({}, tuple(_conversation(i)), {"solver": float(i == 0)}, 0)
             for i in range(2)]
    return Group(0, tuple(trajs), 0)


def test_chains_merge_only_turns_that_extend_the_previous_tokens():
    a, b, c = _conversation(0)
    assert chains([a, b, c]) == [[a, b, c]]
    rewritten = _turn([3, 99, 5, 6, 7, 8, 9], [20])  # history changed: not an extension
    assert chains([a, rewritten]) == [[a], [rewritten]]
    other_temperature = _turn(b.generation.prompt_ids, [21], temperature=0.5)
    assert chains([a, other_temperature]) == [[a], [other_temperature]]
    # two conversations interleaved in one episode: each turn finds its own chain
    x, y, z = _conversation(1)
    assert chains([a, x, b, y]) == [[a, b], [x, y]]


def test_merged_row_masks_exactly_the_sampled_tokens():
    batch = build_batch([_group()], "p", ab.GRPO(), pad_id=0)
    assert batch.size == 2  # one row per episode
    turns = _conversation(0)
    expected = torch.zeros(batch.input_ids_B_T.shape[1])
    for turn in turns:
        p, c = len(turn.generation.prompt_ids), len(turn.generation.completion_ids)
        expected[p:p + c] = 1
    assert torch.equal(batch.loss_mask_B_T[0], expected)
    last = turns[-1].generation
    assert batch.input_ids_B_T[0, :len(last.prompt_ids) + 2].tolist() == list(
        last.prompt_ids + last.completion_ids)
    sampled = [lp for t in turns for lp in t.generation.logprobs]
    assert batch.old_logp_B_T[0][expected.bool()].tolist() == pytest.approx(sampled)


def test_merged_and_per_call_rows_give_the_same_loss_and_gradients():
    # Loss normalisation (the token mean): L = (1/N) * sum over every sampled token t of every
    # turn of every episode of loss_t, N = the number of sampled tokens in the batch (2 episodes
    # x (2 + 3 + 2) = 14). Merging changes the rows (2 vs 6), not the terms or N.
    merged = build_batch([_group()], "p", ab.GRPO(), pad_id=0, merge=True)
    per_call = build_batch([_group()], "p", ab.GRPO(), pad_id=0, merge=False)
    assert (merged.size, per_call.size) == (2, 6)
    assert merged.num_tokens == per_call.num_tokens == 14
    results = []
    for batch in (merged, per_call):
        trainer = LocalTrainer(SPEC, ab.GRPO())
        totals = backward_micro_batches(trainer.model, trainer.algorithm, batch,
                                        [slice(0, batch.size)], batch.num_tokens)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                 if p.grad is not None}
        results.append((totals["loss"], grads))
    (loss_m, grads_m), (loss_p, grads_p) = results
    assert loss_m == pytest.approx(loss_p, abs=1e-5)
    assert loss_m != 0.0  # the advantages are not zero: the comparison is not vacuous
    assert grads_m.keys() == grads_p.keys()
    for name in grads_m:
        torch.testing.assert_close(grads_m[name], grads_p[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_trainer_logprobs_are_those_of_the_sampling_distribution(top_p):
    trainer = LocalTrainer(SPEC, ab.GRPO())
    requests = [GenerationRequest(tuple(3 + (5 * i + j) % 40 for j in range(6)),
                                  SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=6))
                for i in range(4)]

    async def sample():
        with HFEngine(SPEC, max_batch_size=4, seed=3) as engine:
            return await asyncio.gather(*(engine.generate(r) for r in requests))

    generations = asyncio.run(sample())
    turns = [Turn("solver", "p", g, r.sampling) for g, r in zip(generations, requests, strict=True)]
    group = Group(0, tuple(Trajectory({}, (t,), {"solver": float(i % 2)}, 0)
                      for i, t in enumerate(turns)), 0)
    batch = build_batch([group], "p", ab.GRPO(), pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, batch, slice(0, batch.size))
    mask = batch.loss_mask_B_T.bool()
    torch.testing.assert_close(logp[mask], batch.old_logp_B_T[mask], atol=1e-5, rtol=0)
    if top_p < 1:  # the same tokens under the untruncated distribution: not what was sampled
        from dataclasses import replace

        untruncated = replace(batch, top_p_B=torch.ones(batch.size))
        with torch.no_grad():
            full, _ = token_logprobs(trainer.model, untruncated, slice(0, batch.size))
        assert (full[mask] - batch.old_logp_B_T[mask]).abs().max() > 1e-3


def test_a_token_outside_the_current_nucleus_gets_a_finite_floor_and_no_nan():
    trainer = LocalTrainer(SPEC, ab.GRPO())
    prompt = (3, 4, 5, 6)
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    unlikely = int(logits.argmin())  # surely outside a 0.5 nucleus
    turn = _turn(prompt, [unlikely], [-3.0], top_p=0.5)
    group = Group(0, tuple(Trajectory({}, (turn,), {"solver": r}, 0) for r in (1.0, 0.0)), 0)
    batch = build_batch([group], "p", ab.GRPO(), pad_id=0)
    totals = backward_micro_batches(trainer.model, trainer.algorithm, batch,
                                    [slice(0, batch.size)], batch.num_tokens)
    assert all(torch.isfinite(torch.tensor(v)) for v in totals.values())
    for p in trainer.model.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
