"""Prefix reuse across turns in the hf engine: a finished request's keys/values are kept, and a
later prompt that extends them prefills only its new tokens.

Conversations here are token-in/token-out by construction: turn t + 1's prompt is turn t's prompt
+ completion + an observation of random tokens. Every completion runs to `max_new_tokens`
(no stop tokens), so prompt lengths, and hence prefill counts, are known in advance.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from astranb import models
from astranb.engines import HFEngine
from astranb.engines._prefix import BLOCK, PrefixCache
from astranb.types import Generation, GenerationRequest, SamplingParams, WeightUpdate

SPEC = models.tiny_chat()
NEW = 12  # tokens per completion
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW)
TOLERANCE = 1e-4  # logprobs: kept keys came from decode steps, fresh ones from one prefill


def engine(reuse: bool, **kwargs) -> HFEngine:
    return HFEngine(SPEC, max_batch_size=kwargs.pop("max_batch_size", 8),
                    prefix_cache_bytes=None if reuse else 0, **kwargs)


def tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 900) for _ in range(n))


def play(eng: HFEngine, prompts: list[tuple[int, ...]], turns: int, observation: int = 10,
         seed: int = 1) -> list[list[Generation]]:
    """`turns` turns of each conversation, all conversations of a turn submitted together."""
    rng = random.Random(seed)
    played = []
    for _ in range(turns):
        gens = eng.generate_many(GenerationRequest(p, GREEDY) for p in prompts)
        played.append(gens)
        prompts = [g.prompt_ids + g.completion_ids + tokens(rng, observation) for g in gens]
    return played


def assert_same(a: list[list[Generation]], b: list[list[Generation]]) -> None:
    for turn_a, turn_b in zip(a, b, strict=True):
        for x, y in zip(turn_a, turn_b, strict=True):
            assert x.prompt_ids == y.prompt_ids
            assert x.completion_ids == y.completion_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=TOLERANCE)


def test_same_tokens_and_logprobs_over_four_turns_and_reuse_happens():
    rng = random.Random(0)
    prompts = [tokens(rng, 40), tokens(rng, 40)]
    with engine(reuse=False) as off, engine(reuse=True) as on:
        played_off, played_on = play(off, prompts, turns=4), play(on, prompts, turns=4)
        stats_off, stats_on = off.stats(), on.stats()
    assert_same(played_off, played_on)
    # Prompt lengths per turn: 40, 40+12+10 = 62, 84, 106 (each conversation).
    assert stats_off.prefill_tokens == 2 * (40 + 62 + 84 + 106)  # 584
    # With reuse, turn t+1 keeps turn t's prompt + completion but its last token (never fed to
    # the model): 51, 73, 95 tokens; it prefills 62-51 = 84-73 = 106-95 = 11 tokens.
    assert stats_on.prefill_tokens == 2 * (40 + 11 + 11 + 11)  # 146
    assert stats_on.prefix_reused_tokens == 2 * (51 + 73 + 95)
    assert (stats_on.prefix_hits, stats_on.prefix_misses) == (6, 2)
    assert stats_off.prefix_hits == stats_off.prefix_bytes == 0
    # One entry per conversation (each turn's entry supersedes the last): 117 tokens each.
    per_token = 2 * 2 * 4 * 32 * 4  # k and v, 2 layers, 4 heads, head_dim 32, fp32
    assert stats_on.prefix_bytes == 2 * 117 * per_token


def test_a_shared_prefix_is_reused_up_to_the_first_different_token():
    rng = random.Random(2)
    first = tokens(rng, 40)
    other = first[:35] + tokens(rng, 15)  # another conversation with the same 35-token opening
    assert other[35] != first[35]
    with engine(reuse=False) as off, engine(reuse=True) as on:
        results = []
        for eng in (off, on):
            a = eng.generate_many([GenerationRequest(first, GREEDY)])
            b = eng.generate_many([GenerationRequest(other, GREEDY)])
            results.append([a, b])
        stats = on.stats()
    assert_same(*results)
    assert stats.prefix_reused_tokens == 35
    assert stats.prefill_tokens == 40 + 15


def test_a_conversation_sharing_an_opening_leaves_the_other_conversations_entry():
    """B's prompt shares A's first 35 tokens; keeping B must not drop A's entry, so A's second
    turn still reuses all 51 of its tokens."""
    rng = random.Random(10)
    a = tokens(rng, 40)
    b = a[:35] + tokens(rng, 15)
    with engine(reuse=True) as eng:
        first_a = eng.generate_many([GenerationRequest(a, GREEDY)])[0]
        eng.generate_many([GenerationRequest(b, GREEDY)])
        before = eng.stats().prefix_reused_tokens
        eng.generate_many([GenerationRequest(a + first_a.completion_ids + tokens(rng, 10),
                                             GREEDY)])
        assert eng.stats().prefix_reused_tokens - before == 51


def test_eviction_under_a_small_budget_keeps_outputs_exact():
    rng = random.Random(3)
    prompts = [tokens(rng, 40), tokens(rng, 40)]
    per_token = 2 * 2 * 4 * 32 * 4
    budget = 60 * per_token  # one 51-token turn-1 sequence fits, two do not
    with engine(reuse=False) as off, \
            HFEngine(SPEC, max_batch_size=8, prefix_cache_bytes=budget) as on:
        played_off, played_on = play(off, prompts, turns=2), play(on, prompts, turns=2)
        stats = on.stats()
    assert_same(played_off, played_on)
    # Both turn-1 rows finish in one step; keeping the second evicts the first, so at turn 2
    # one conversation reuses 51 tokens and prefills 11, the other prefills all 62.
    assert stats.prefix_evictions >= 1
    assert (stats.prefix_hits, stats.prefix_misses) == (1, 3)
    assert stats.prefill_tokens == 2 * 40 + 11 + 62
    assert stats.prefix_bytes <= budget


def test_lru_order_and_budget():
    kv = torch.zeros(4, 1, BLOCK, 1)  # 64 floats, 256 bytes per entry
    cache = PrefixCache(budget_bytes=2 * kv.numel() * 4)
    a, b, c = (tuple(range(s, s + BLOCK)) for s in (0, 100, 200))
    cache.keep(a, kv)
    cache.keep(b, kv)
    assert cache.lookup(a + (7,), BLOCK)[1] is not None  # refreshes a: b is now the oldest
    cache.keep(c, kv)
    assert cache.evictions == 1 and len(cache) == 2
    assert cache.lookup(b + (7,), BLOCK) == (0, None)
    assert cache.lookup(c + (7,), BLOCK)[0] == BLOCK
    assert cache.lookup(a[:-1] + (999, 7), BLOCK) == (0, None)  # shorter than a block: a miss
    too_big = torch.zeros(4, 1, 3 * BLOCK, 1)
    cache.keep(tuple(range(300, 300 + 3 * BLOCK)), too_big)  # over the whole budget: not kept
    assert len(cache) == 2 and cache.bytes == 2 * kv.numel() * 4


def perturbed(eng: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator)
            for name, t in sorted(eng.state_dict().items())}


def test_a_weight_update_drops_every_kept_prefix():
    rng = random.Random(4)
    prompts = [tokens(rng, 40), tokens(rng, 40)]
    runs = []
    for reuse in (False, True):
        with engine(reuse) as eng:
            state = perturbed(eng, seed=0)
            first = play(eng, prompts, turns=1)
            assert eng.stats().prefix_bytes == (2 * 51 * 2048 if reuse else 0)
            eng.update_weights(WeightUpdate("policy", version=1, state=state)).result()
            after = eng.stats()
            obs = random.Random(5)
            nxt = [g.prompt_ids + g.completion_ids + tokens(obs, 10) for g in first[0]]
            later = play(eng, nxt, turns=2, seed=6)
            runs.append((first + later, after, eng.stats()))
    (played_off, _, _), (played_on, after, final) = runs
    # Kept keys from version 0 would shift the version-1 logprobs by far more than the tolerance.
    assert_same(played_off, played_on)
    assert all(v == 1 for g in played_on[1] for v in g.versions)
    assert (after.prefix_bytes, after.prefix_invalidated) == (0, 2)
    # Turn 2 (after the update) prefills in full; turn 3 reuses turn 2's version-1 entries.
    assert final.prefix_hits == 2 and final.prefix_reused_tokens == 2 * 73
    assert final.prefill_tokens == 2 * (40 + 62 + 11)


def test_a_failed_update_keeps_the_kept_prefixes():
    rng = random.Random(7)
    with engine(reuse=True) as eng:
        play(eng, [tokens(rng, 40)], turns=1)
        bad = WeightUpdate("policy", version=1, state={"no.such.weight": torch.zeros(1)})
        with pytest.raises(ValueError):
            eng.update_weights(bad).result()
        stats = eng.stats()
    assert stats.prefix_bytes == 51 * 2048 and stats.prefix_invalidated == 0


def test_many_conversations_in_one_batch():
    """24 conversations of 3 turns played as concurrent tasks over 8 slots: rows join while others
    decode, with prefixes of many lengths, and a group of 4 identical opening prompts."""
    rng = random.Random(8)
    opening = tokens(rng, 30)
    prompts = [opening] * 4 + [tokens(rng, rng.randrange(20, 70)) for _ in range(20)]
    observations = [[tokens(rng, rng.randrange(1, 25)) for _ in range(2)] for _ in prompts]

    async def conversation(eng: HFEngine, i: int) -> list[Generation]:
        prompt, made = prompts[i], []
        for turn in range(3):
            gen = await eng.generate(GenerationRequest(prompt, GREEDY))
            made.append(gen)
            if turn < 2:
                prompt = gen.prompt_ids + gen.completion_ids + observations[i][turn]
        return made

    async def everyone(eng: HFEngine) -> list[list[Generation]]:
        return list(await asyncio.gather(*(conversation(eng, i) for i in range(len(prompts)))))

    results = []
    for reuse in (False, True):
        with engine(reuse) as eng:
            results.append(asyncio.run(everyone(eng)))
            stats = eng.stats()
    assert_same(*results)
    assert stats.prefix_hits == 2 * len(prompts)  # every second and third turn
    assert stats.prefix_reused_tokens >= 2 * len(prompts) * 20


def test_without_the_lean_forward_reuse_goes_through_the_model():
    rng = random.Random(9)
    prompts = [tokens(rng, 40), tokens(rng, 25)]
    with engine(reuse=False, fast_forward=False) as off, \
            engine(reuse=True, fast_forward=False) as on:
        played_off, played_on = play(off, prompts, turns=3), play(on, prompts, turns=3)
        stats = on.stats()
    assert_same(played_off, played_on)
    assert stats.prefix_hits == 4 and stats.prefill_tokens == 40 + 25 + 4 * 11


def test_budget_must_not_be_negative():
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        HFEngine(SPEC, prefix_cache_bytes=-1)


def test_a_row_that_lived_through_an_update_is_kept_under_the_new_weights_only():
    """An update lands while a request decodes: its cache is re-prefilled under version 1, so the
    entry kept when it finishes, and the next turn built on it, match an engine that only ever
    had version 1's weights."""
    rng = random.Random(11)
    prompt = tokens(rng, 40)
    long = SamplingParams(temperature=0.0, max_new_tokens=200)
    with engine(reuse=True) as eng:
        state = perturbed(eng, seed=1)
        future = eng.submit(GenerationRequest(prompt, long))
        while eng.stats().tokens_generated < 3:
            time.sleep(0.001)
        eng.pause()
        assert not future.done()
        eng.update_weights(WeightUpdate("policy", version=1, state=state)).result()
        eng.resume()
        first = future.result()
        assert first.versions[0] == 0 and first.versions[-1] == 1
        nxt = first.prompt_ids + first.completion_ids + tokens(rng, 10)
        second = eng.generate_many([GenerationRequest(nxt, GREEDY)])[0]
        stats = eng.stats()
    assert stats.prefix_reused_tokens == 40 + 200 - 1
    with engine(reuse=False) as fresh:
        fresh.update_weights(WeightUpdate("policy", version=1, state=state)).result()
        expected = fresh.generate_many([GenerationRequest(nxt, GREEDY)])[0]
    assert second.completion_ids == expected.completion_ids
    assert second.logprobs == pytest.approx(expected.logprobs, abs=TOLERANCE)
