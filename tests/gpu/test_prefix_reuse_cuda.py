"""GPU check: the hf engine's prefix reuse on CUDA gives what a full prefill gives (the same
greedy tokens, logprobs within float tolerance) and prefills only the new tokens. Skipped
without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from astranb import models
from astranb.engines import HFEngine
from astranb.types import GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW, OBSERVATION, TURNS, CONVERSATIONS = 16, 12, 4, 16


def conversations(device: str) -> tuple[list, list, object, object]:
    """Four turns of 16 conversations with reuse off, then on; (played off, on, stats off, on)."""
    spec = models.tiny_chat(hidden_size=256, num_layers=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    played, stats = [], []
    for budget in (0, None):  # 0: no reuse; None: the engine's default budget
        rng = random.Random(0)
        prompts = [tuple(rng.randrange(3, 900) for _ in range(48)) for _ in range(CONVERSATIONS)]
        turns = []
        with HFEngine(spec, device=device, dtype=torch.float32, max_batch_size=CONVERSATIONS,
                      prefix_cache_bytes=budget) as engine:
            for _ in range(TURNS):
                gens = engine.generate_many(GenerationRequest(p, greedy) for p in prompts)
                turns.append(gens)
                prompts = [g.prompt_ids + g.completion_ids
                           + tuple(rng.randrange(3, 900) for _ in range(OBSERVATION))
                           for g in gens]
            stats.append(engine.stats())
        played.append(turns)
    return played[0], played[1], stats[0], stats[1]


def test_prefix_reuse_on_cuda_matches_a_full_prefill():
    off, on, stats_off, stats_on = conversations("cuda")
    for turn_off, turn_on in zip(off, on, strict=True):
        for a, b in zip(turn_off, turn_on, strict=True):
            assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    # every later turn prefills the observation and the last sampled token only
    later = CONVERSATIONS * (TURNS - 1) * (OBSERVATION + 1)
    assert stats_on.prefill_tokens == CONVERSATIONS * 48 + later
    assert stats_on.prefix_hits == CONVERSATIONS * (TURNS - 1)
    assert stats_off.prefill_tokens > 2 * stats_on.prefill_tokens
