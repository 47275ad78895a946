"""HFEngine: continuous batching, sampling logprobs, in-flight weight updates, cancellation, errors.

Models are tiny Qwen3s with a wide initialisation (initializer_range=0.3) so that greedy decoding
produces varied text instead of one repeated character; that makes token-level bugs visible.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from astranb import models
from astranb.engines import HFEngine, RolloutEngine, _kvbatch
from astranb.engines._kvbatch import SlotKV
from astranb.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.waiting import wait_until, wait_until_async

SPEC = models.tiny(hidden_size=64, num_layers=2, initializer_range=0.3)
ATOL = 1e-4


def _request(prompt_len: int, max_new: int, *, temperature=0.0, top_p=1.0, stop=(), offset=3):
    prompt = tuple(3 + (offset + 7 * i) % 50 for i in range(prompt_len))
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=max_new, stop_token_ids=stop
    )
    return GenerationRequest(prompt_ids=prompt, sampling=sampling)


def _assert_close(actual, expected) -> None:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


class _StepPauser:
    """Makes the worker pause itself right after a chosen decode step, so tests act mid-run
    deterministically instead of racing the decode loop."""

    def __init__(self, engine: HFEngine, monkeypatch) -> None:
        self.engine, self.at = engine, None
        decode = SlotKV.decode

        def hooked(kv, *args, **kwargs):
            # Set during the forward of step `at`: the worker finishes that step, then holds.
            if self.at is not None and engine.stats().steps >= self.at - 1:
                self.at = None
                engine.pause(wait=False)
            return decode(kv, *args, **kwargs)

        monkeypatch.setattr(SlotKV, "decode", hooked)

    def run_until(self, step: int) -> None:
        """Resume, and return once the engine has paused itself after `step` decode steps."""
        self.at = step
        self.engine.resume()
        wait_until(lambda: self.engine.stats().paused, 20, "the engine to pause itself",
                   interval=0.002)
        self.engine.pause()  # returns once the worker holds
        assert self.engine.stats().steps == step


def _reference_logprobs(model, gen, temperature: float, top_p: float) -> torch.Tensor:
    """Recompute each completion token's logprob with one full forward (no cache)."""
    ids = torch.tensor([list(gen.prompt_ids) + list(gen.completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(gen.prompt_ids)
    steps = logits[p - 1 : p - 1 + len(gen.completion_ids)]
    out = []
    for row, token in zip(steps, gen.completion_ids, strict=True):
        if temperature > 0:
            row = _nucleus(row / temperature, top_p)
        out.append(torch.log_softmax(row, -1)[token])
    return torch.stack(out)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Independent top-p: keep the most likely tokens until their mass reaches top_p."""
    if top_p >= 1:
        return logits
    probs = logits.softmax(-1)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    mass = 0.0
    for idx in probs.argsort(descending=True).tolist():
        keep[idx] = True
        mass += probs[idx].item()
        if mass >= top_p:
            break
    return logits.masked_fill(~keep, float("-inf"))


def test_continuous_batching_matches_running_alone(monkeypatch):
    specs = [(5, 12), (17, 4), (1, 9), (24, 20), (3, 6), (11, 15), (8, 3)]
    requests = [_request(p, m, offset=i) for i, (p, m) in enumerate(specs)]
    with HFEngine(SPEC, max_batch_size=1) as solo:
        alone = [solo.generate_many([r])[0] for r in requests]
    with HFEngine(SPEC, max_batch_size=3) as engine:
        pauser = _StepPauser(engine, monkeypatch)
        engine.pause()
        futures = [engine.submit(r) for r in requests[:2]]
        pauser.run_until(3)
        futures += [engine.submit(r) for r in requests[2:5]]  # one joins now, two queue
        pauser.run_until(10)  # request 1 left after 4 tokens, a queued one took its slot
        futures += [engine.submit(r) for r in requests[5:]]
        engine.resume()
        batched = [f.result(timeout=30) for f in futures]
        assert engine.stats().steps < sum(m for _, m in specs)  # really decoded together
    model = SPEC.build()
    for b, a in zip(batched, alone, strict=True):
        assert b.completion_ids == a.completion_ids
        assert b.finish_reason == "length"
        _assert_close(b.logprobs, a.logprobs)
        _assert_close(b.logprobs, _reference_logprobs(model, b, 0.0, 1.0))
    assert len({b.completion_ids for b in batched}) > 1
    assert [len(b.completion_ids) for b in batched] == [m for _, m in specs]


def test_long_mixed_batch_matches_full_forward():
    """Long rows outgrow the KV buffer (relayout) while short sampled rows join and leave."""
    settings = [
        (30, 150, 0.0), (2, 5, 0.9), (40, 20, 0.9), (1, 90, 0.0), (9, 3, 0.0), (17, 60, 0.9)
    ]  # (prompt length, max_new_tokens, temperature)
    requests = [
        _request(p, m, temperature=t, top_p=0.8 if t else 1.0, offset=i)
        for i, (p, m, t) in enumerate(settings)
    ]
    with HFEngine(SPEC, max_batch_size=3, seed=5) as engine:
        gens = engine.generate_many(requests)
    model = SPEC.build()
    for gen, request in zip(gens, requests, strict=True):
        s = request.sampling
        assert len(gen.completion_ids) == s.max_new_tokens
        _assert_close(gen.logprobs, _reference_logprobs(model, gen, s.temperature, s.top_p))


def test_stop_tokens_max_new_tokens_and_versions():
    with HFEngine(SPEC, max_batch_size=4, version=3) as engine:
        free = engine.generate_many([_request(6, 12)])[0]
        stop = free.completion_ids[4]
        first = free.completion_ids.index(stop)
        gens = engine.generate_many([_request(6, 12, stop=(stop,)), _request(9, 5), _request(2, 1)])
        assert engine.version == 3
    stopped, short, single = gens
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == free.completion_ids[: first + 1]  # stop token kept
    assert (short.finish_reason, len(short.completion_ids)) == ("length", 5)
    assert (single.finish_reason, len(single.completion_ids)) == ("length", 1)
    for g in (free, *gens):
        assert g.versions == (3,) * len(g.completion_ids)
        assert len(g.logprobs) == len(g.completion_ids)
        assert g.text == engine.tokenizer.decode(list(g.completion_ids), skip_special_tokens=True)


def test_sampled_logprobs_match_recomputation():
    settings = [(0.7, 0.9), (0.7, 0.9), (1.3, 1.0), (0.0, 0.9), (0.5, 0.5)]
    requests = [
        _request(4 + 3 * i, 16, temperature=t, top_p=p, offset=i)
        for i, (t, p) in enumerate(settings)
    ]
    with HFEngine(SPEC, max_batch_size=4, seed=123) as engine:
        gens = engine.generate_many(requests)
    model = SPEC.build()
    for gen, (t, p) in zip(gens, settings, strict=True):
        _assert_close(gen.logprobs, _reference_logprobs(model, gen, t, p))
        assert all(lp <= 0 for lp in gen.logprobs)
    assert len(set(gens[0].completion_ids)) > 3  # really sampled, not a repeated token


def test_inflight_weight_update_switches_version_mid_generation(monkeypatch):
    torch.manual_seed(0)
    old = SPEC.build().state_dict()
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied weights stay tied
    temperature = 0.8
    with HFEngine(SPEC, max_batch_size=4, seed=7) as engine:
        pauser = _StepPauser(engine, monkeypatch)
        engine.pause()
        long_req = _request(7, 40, temperature=temperature)
        other_req = _request(3, 25, temperature=temperature, offset=5)
        futures = [engine.submit(long_req), engine.submit(other_req)]
        # admission samples each first token from the prefill, then 6 decode steps: both
        # requests have 7 tokens of version 0
        pauser.run_until(6)
        applied = engine.update_weights(WeightUpdate(policy="policy", version=1, state=new))
        applied.result(timeout=30)  # updates apply while paused
        assert engine.version == 1 and engine.stats().tokens_generated == 14
        engine.resume()
        gens = [f.result(timeout=30) for f in futures]
        for name, tensor in engine.state_dict().items():
            torch.testing.assert_close(tensor, new[name], atol=0, rtol=0)
    by_version = {0: SPEC.build(), 1: SPEC.build()}
    by_version[1].load_state_dict(new)
    for gen in gens:
        assert gen.versions[:7] == (0,) * 7 and set(gen.versions[7:]) == {1}
        assert list(gen.versions) == sorted(gen.versions)
        refs = {v: _reference_logprobs(m, gen, temperature, 1.0) for v, m in by_version.items()}
        expected = torch.stack([refs[v][i] for i, v in enumerate(gen.versions)])
        _assert_close(gen.logprobs, expected)
        # The perturbation must matter, or the test proves nothing.
        after = [i for i, v in enumerate(gen.versions) if v == 1]
        assert (refs[0][after] - refs[1][after]).abs().max() > 1e-2


def test_cancelling_generate_frees_the_slot():
    async def main():
        async with HFEngine(SPEC, max_batch_size=2) as engine:
            running = asyncio.create_task(engine.generate(_request(5, 400)))
            others = [asyncio.create_task(engine.generate(_request(4, 400))) for _ in range(2)]
            await wait_until_async(lambda: engine.stats().active >= 2, 20,
                                   "one of the others decoding, one queued")
            assert engine.availability() == 0
            for task in (running, *others):
                task.cancel()
            results = await asyncio.gather(running, *others, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results)
            await wait_until_async(
                lambda: engine.availability() >= 2 and not engine.stats().active, 10,
                lambda: f"both slots free ({engine.stats()})")
            steps = engine.stats().steps
            assert steps < 400
            gen = await engine.generate(_request(3, 4))
            assert len(gen.completion_ids) == 4

    asyncio.run(main())


def test_bad_update_fails_clearly_and_engine_keeps_serving():
    good = SPEC.build().state_dict()
    with HFEngine(SPEC, max_batch_size=2) as engine:
        before = engine.generate_many([_request(5, 8)])[0]
        wrong_shape = dict(good, **{"model.norm.weight": torch.ones(3)})
        with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight'"):
            engine.update_weights(WeightUpdate("policy", 1, wrong_shape)).result(timeout=30)
        with pytest.raises(ValueError, match="does not"):
            extra = dict(good, extra=torch.ones(1))
            engine.update_weights(WeightUpdate("policy", 1, extra)).result(timeout=30)
        partial = {k: v for k, v in good.items() if k != "model.norm.weight"}
        with pytest.raises(ValueError, match="missing"):
            engine.update_weights(WeightUpdate("policy", 1, partial)).result(timeout=30)
        with pytest.raises(ValueError, match="policy"):
            engine.update_weights(WeightUpdate("critic", 1, good)).result(timeout=30)
        assert engine.version == 0
        after = engine.generate_many([_request(5, 8)])[0]
        assert after.completion_ids == before.completion_ids
        # Tied weights: sending only one of the two aliases is a complete update.
        untied = {k: v for k, v in good.items() if k != "lm_head.weight"}
        engine.update_weights(WeightUpdate("policy", 2, untied)).result(timeout=30)
        assert engine.generate_many([_request(5, 8)])[0].versions == (2,) * 8


def test_worker_errors_fail_requests_and_engine_recovers(monkeypatch):
    with HFEngine(SPEC, max_batch_size=2) as engine:
        engine.generate_many([_request(3, 2)])  # worker running
        real_prefill = _kvbatch._prefill
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return real_prefill(*args, **kwargs)

        monkeypatch.setattr(_kvbatch, "_prefill", flaky)
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate_many([_request(3, 5)])
        assert len(engine.generate_many([_request(3, 5)])[0].completion_ids) == 5


def test_lifecycle_close_fails_pending_and_rejects_new_work():
    engine = HFEngine(SPEC, max_batch_size=1)
    assert isinstance(engine, RolloutEngine)
    engine.pause()  # nothing may start: the future stays pending until close()
    pending = engine.submit(_request(3, 5))
    assert engine.availability() == 0
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pending.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(_request(3, 5))
    with HFEngine(SPEC) as fresh:
        with pytest.raises(ValueError, match="empty"):
            fresh.submit(GenerationRequest(prompt_ids=()))
        with pytest.raises(ValueError, match="ints in"):
            fresh.submit(GenerationRequest(prompt_ids=(1, 10_000)))


def test_payload_updates_full_then_delta_and_errors():
    from astranb import weights

    v0 = {k: v.to(torch.bfloat16) for k, v in SPEC.build().state_dict().items()}
    v1 = {k: (v.float() + 0.01 * (torch.arange(v.numel()).reshape(v.shape) % 7 == 0))
          .to(torch.bfloat16)
          for k, v in v0.items()}
    delta = weights.encode(v0, v1, policy="policy", base_version=0, version=1)
    with HFEngine(SPEC) as engine:
        # a delta before any full snapshot has no base to apply to
        with pytest.raises(weights.BaseMismatch, match="no published weights"):
            engine.update_weights(WeightUpdate("policy", 1, payload=delta)).result(timeout=30)
        full = weights.encode_full(v0, policy="policy", version=0)
        result = engine.update_weights(WeightUpdate("policy", 0, payload=full)).result(timeout=30)
        assert result["kind"] == "full" and engine.weights_checksum == weights.checksum(v0)
        result = engine.update_weights(WeightUpdate("policy", 1, payload=delta)).result(timeout=30)
        assert result["kind"] == "delta" and engine.version == 1
        assert engine.published_checksum() == weights.checksum(v1)  # recomputed from the model
        # a payload for another policy, or a version the update does not claim, is refused
        other = weights.encode_full(v1, policy="critic", version=1)
        with pytest.raises(ValueError, match="for policy 'critic'"):
            engine.update_weights(WeightUpdate("policy", 1, payload=other)).result(timeout=30)
        # a plain state update leaves the mirror stale: the next delta must be refused
        state = dict(SPEC.build().state_dict())
        engine.update_weights(WeightUpdate("policy", 2, state)).result(timeout=30)
        assert engine.weights_checksum is None
        with pytest.raises(weights.BaseMismatch):
            engine.update_weights(WeightUpdate("policy", 1, payload=delta)).result(timeout=30)
        assert engine.generate_many([_request(3, 4)])[0].versions == (2,) * 4  # still serving


def test_first_token_from_the_prefill_matches_a_decode_step_and_saves_one(monkeypatch):
    """New requests sample their first token from the prefill's logits (one forward less);
    with too many logits for the budget they take it from a decode step instead: same tokens,
    same logprobs, one step more per admission."""
    import astranb.engines._batch as batch_module

    requests = [_request(n, 5, offset=n) for n in (3, 6, 9)] + [_request(4, 1)]

    def run():
        with HFEngine(SPEC, max_batch_size=4) as engine:
            gens = engine.generate_many(requests)
            return gens, engine.stats()

    fast, fast_stats = run()
    monkeypatch.setattr(batch_module, "PREFILL_LOGITS_BUDGET", 0)
    slow, slow_stats = run()
    for a, b in zip(fast, slow, strict=True):
        assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
        _assert_close(a.logprobs, torch.tensor(b.logprobs))
    assert fast[-1].completion_ids and len(fast[-1].completion_ids) == 1  # done at admission
    assert fast_stats.tokens_generated == slow_stats.tokens_generated == 3 * 5 + 1
    assert fast_stats.steps < slow_stats.steps


@pytest.mark.parametrize("spec", [models.tiny(), models.tiny_chat()], ids=["tiny", "tiny_chat"])
def test_completion_text_is_what_the_tokenizers_decode_gives(spec):
    """The engine's cached, backend-direct decode against transformers' own `decode`, over
    random ids with special tokens mixed in, each asked twice (the second from the cache)."""
    from astranb.engines._text import TextCache

    tokenizer = spec.tokenizer()
    texts = TextCache(tokenizer, limit=50)
    assert texts._backend is not None  # the fast path is the one tested
    generator = torch.Generator().manual_seed(0)
    special = list(tokenizer.all_special_ids)
    for n in range(120):
        ids = torch.randint(0, len(tokenizer), (1 + n % 7,), generator=generator).tolist()
        ids = tuple(ids + special[: n % 3])
        expected = tokenizer.decode(list(ids), skip_special_tokens=True)
        assert texts(ids) == expected and texts(ids) == expected
    assert len(texts._texts) <= 50

    class Cleaning(type(tokenizer)):  # a subclass with its own decode takes the slow path
        def _decode(self, *args, **kwargs):
            return "cleaned " + super()._decode(*args, **kwargs)

    tokenizer.__class__ = Cleaning
    try:
        assert TextCache(tokenizer)((special[0],) if special else (1,)).startswith("cleaned")
    finally:
        tokenizer.__class__ = Cleaning.__mro__[1]


def test_a_bad_prompt_is_refused_even_after_good_ones_were_cached():
    engine = HFEngine(SPEC, max_batch_size=4)
    try:
        good = _request(3, 1)
        engine.generate_many([good, good])
        for bad in [(1, 10_000), (1, -1)]:
            with pytest.raises(ValueError, match="prompt_ids must be ints"):
                engine.generate_many([GenerationRequest(prompt_ids=bad, sampling=good.sampling)])
    finally:
        engine.close()
