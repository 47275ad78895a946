"""The engine's lean forward (astranb/engines/_fastlm.py) against the model's own forward, for
every architecture it claims, and the engine with it against the engine without it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from astranb import models
from astranb.engines import HFEngine, _fastlm
from astranb.engines._fastlm import FastLM, why_unsupported
from astranb.engines._kvbatch import SlotKV
from astranb.types import GenerationRequest, SamplingParams

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=40, max_position_embeddings=256,
             tie_word_embeddings=False)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=24),  # q/k norms, odd head_dim
}


def _model(config, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # random biases and norm weights, so each term is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_equals_the_models_forward_to_the_bit(family):
    model = _model(FAMILIES[family]())
    assert why_unsupported(model) is None
    fast = FastLM(model)
    ids = torch.randint(0, 40, (3, 7))
    positions = torch.arange(7).expand(3, -1)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ref = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=0).logits
        # the last column alone, as generate() asks for it: the same [K, 1, H] @ lm_head as
        # FastLM's (a GEMM over 21 rows may round differently from one over 3 on some CPUs)
        ref_last = model(input_ids=ids, position_ids=positions, logits_to_keep=1).logits
        kv, logits = fast.prefill(ids, positions, all_logits=True)
        _, last = fast.prefill(ids, positions, all_logits=False)
    assert torch.equal(logits, ref)
    assert torch.equal(last, ref_last)
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


@pytest.mark.parametrize("attention", ["broadcast", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_matches_the_models_forward_over_a_padded_window(family, dtype, attention,
                                                                monkeypatch):
    """Rows of different lengths in one right-aligned KV buffer (the engine's layout), with
    small windows' broadcast attention and with the fused kernel that long windows get."""
    if attention == "fused":
        monkeypatch.setattr(_fastlm, "_BROADCAST_BUDGET", 0)
    model = _model(FAMILIES[family](), dtype=dtype)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
    with torch.inference_mode():
        kv_hf = SlotKV(model, 4, torch.device("cpu"), fast=False)
        kv_fast = SlotKV(model, 4, torch.device("cpu"))
        assert kv_fast.fast is not None and kv_hf.fast is None
        kv_hf.admit(prompts)
        kv_fast.admit(prompts)
        ids = torch.tensor([[13], [14], [15]])
        for _ in range(3):
            ref, got = kv_hf.decode(ids), kv_fast.decode(ids)
            kv_hf.advance()
            kv_fast.advance()
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            ids = ref.argmax(-1, keepdim=True)
        for a, b in zip(kv_hf.keys, kv_fast.keys, strict=True):
            torch.testing.assert_close(a[:3, :, kv_hf.start : kv_hf.end],
                                       b[:3, :, kv_fast.start : kv_fast.end], atol=tol, rtol=tol)


def test_models_it_cannot_run_are_left_to_their_own_forward():
    scaled = transformers.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0})
    sliding = transformers.MistralConfig(**SHAPE, sliding_window=16)
    gelu = transformers.Qwen3Config(**SHAPE, hidden_act="gelu")
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=40)
    reasons = {name: why_unsupported(_model(c)) for name, c in
               [("scaled", scaled), ("sliding", sliding), ("gelu", gelu), ("gpt2", gpt2)]}
    assert "rope type 'linear'" in reasons["scaled"]
    assert "sliding" in reasons["sliding"]
    assert "hidden_act 'gelu'" in reasons["gelu"]
    assert "model_type 'gpt2'" in reasons["gpt2"]
    assert FastLM.build(_model(scaled)) is None
    assert SlotKV(_model(scaled), 2, torch.device("cpu")).fast is None


def test_identical_rows_are_prefilled_once_and_placed_like_distinct_ones():
    """A group's samples share one prompt: it is run once, and every row gets its keys/values
    and first-token logits as if it had been run alone."""
    model = _model(FAMILIES["qwen3"]())
    group = [[1, 2, 3]] * 4 + [[4, 5]] * 3 + [[6, 7, 8, 9]]
    with torch.inference_mode():
        shared = SlotKV(model, 8, torch.device("cpu"))
        logits = shared.admit(group, last_logits=True)
        assert shared.computed == 3 + 2 + 4
    for i, row in enumerate(group):
        with torch.inference_mode():
            solo = model(input_ids=torch.tensor([row])).logits[0, -1]
        torch.testing.assert_close(logits[i], solo, atol=1e-5, rtol=1e-5)
    assert shared.starts == [shared.end - len(r) for r in group]
    for layer in range(len(shared.keys)):
        window = shared.keys[layer][:8, :, shared.start : shared.end]
        assert torch.equal(window[0], window[3]) and torch.equal(window[4], window[6])
        assert not torch.equal(window[0], window[4])


def _requests(n, temperature):
    sampling = SamplingParams(temperature=temperature, max_new_tokens=12)
    return [GenerationRequest(prompt_ids=tuple(range(3 + i % 4, 9 + i % 5)), sampling=sampling)
            for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_samples_the_same_with_and_without_the_lean_forward(temperature):
    spec = models.tiny(hidden_size=64, num_layers=2, initializer_range=0.3)
    out = {}
    for fast in (True, False):
        with HFEngine(spec, max_batch_size=5, seed=3, fast_forward=fast) as engine:
            out[fast] = engine.generate_many(_requests(9, temperature))
    for a, b in zip(out[True], out[False], strict=True):
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=1e-4)
    assert len({a.completion_ids for a in out[True]}) > 1


def test_the_trainers_forward_takes_the_lean_path_only_for_right_padded_rows(monkeypatch):
    """Same logprobs and entropies as the model's forward with its attention mask, and the model
    itself for a left-padded batch, which causal attention alone would get wrong."""
    from astranb.training import local
    from astranb.types import Batch

    model = _model(FAMILIES["qwen3"]())
    ids = torch.randint(0, 40, (4, 6))
    right = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 2 + [0] * 4])
    zeros = torch.zeros(4, 6)

    def batch(mask):
        return Batch(ids, mask, zeros, zeros, zeros, torch.full((4, 6), -1),
                     torch.tensor([1.0, 0.7, 1.0, 1.3]), torch.zeros(4), torch.ones(4))

    calls = []
    logits = FastLM.logits
    monkeypatch.setattr(FastLM, "logits", lambda self, x: calls.append(x) or logits(self, x))
    fast_logp, fast_entropy = local.token_logprobs(model, batch(right), slice(0, 4))
    assert len(calls) == 1 and fast_logp.requires_grad
    with torch.no_grad():
        monkeypatch.setattr(local.FastLM, "of", staticmethod(lambda m: None))
        ref_logp, ref_entropy = local.token_logprobs(model, batch(right), slice(0, 4))
    real = right.bool()
    torch.testing.assert_close(fast_logp[real], ref_logp[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fast_entropy[real], ref_entropy[real], atol=1e-6, rtol=1e-6)
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(FastLM, "logits", lambda self, x: calls.append(x) or logits(self, x))
    local.token_logprobs(model, batch(right.flip(1)), slice(0, 4))  # left padded
    assert calls == []


def test_hooked_or_dropout_models_keep_their_own_forward():
    model = _model(FAMILIES["llama"]())
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooked" in why_unsupported(model)
    dropout = transformers.Qwen3Config(**SHAPE, attention_dropout=0.1)
    assert why_unsupported(_model(dropout)) == "attention dropout"
