"""GPU check: SGLangEngine launching a real SGLang server on a tiny local Qwen3 directory.

Skipped without CUDA or without the `sglang` package (pip install 'astranb[sglang]' on a GPU host).
The model is a freshly initialised tiny Qwen3 (head_dim 64, which every attention backend takes),
saved with transformers; nothing is downloaded. SGLang also stops at the model's own EOS token,
so a sampled completion may end early with finish_reason "stop".
"""

import math

import pytest
import torch

from astranb import models, weights
from astranb.engines import SGLangEngine
from astranb.types import GenerationRequest, SamplingParams, WeightUpdate

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang", reason="needs the sglang package: pip install 'astranb[sglang]'")

SPEC = models.tiny(hidden_size=128, num_layers=2, num_heads=2)
SERVER_ARGS = ("--dtype", "bfloat16", "--mem-fraction-static", "0.2", "--disable-cuda-graph")
PROMPT = (1, 10, 11, 12, 13)
ATOL = 0.1  # bf16 server kernels against a float32 reference
EOS = SPEC.tokenizer().eos_token_id


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = SPEC.save(tmp_path_factory.mktemp("tiny-qwen3"))
    with SGLangEngine(models.local(directory), server_args=SERVER_ARGS,
                      launch_timeout=900) as engine:
        yield engine


def bf16_state(seed: int | None = None) -> dict[str, torch.Tensor]:
    """The tiny model's weights in bf16, optionally moved by a seeded perturbation."""
    state = {k: v.to(torch.bfloat16) for k, v in SPEC.build().state_dict().items()}
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        noise = {k: 0.2 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        state = {k: (v.float() + noise[k]).bfloat16() for k, v in state.items()}
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    return state


def reference_logprobs(state, gen) -> list[float]:
    """Each completion token's logprob under `state` (temperature 1), one float32 forward."""
    model = SPEC.build()
    model.load_state_dict({k: v.float() for k, v in state.items()})
    ids = torch.tensor([list(gen.prompt_ids) + list(gen.completion_ids)])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    p = len(gen.prompt_ids)
    return [logp[p - 1 + i, t].item() for i, t in enumerate(gen.completion_ids)]


def assert_ended(gen, max_new: int) -> None:
    """max_new tokens, or fewer ending on the model's EOS (SGLang always stops there)."""
    n = len(gen.completion_ids)
    assert (n == max_new and gen.finish_reason == "length") or (
        gen.finish_reason == "stop" and gen.completion_ids[-1] == EOS and n <= max_new)


def request(max_new: int, stop=(), temperature=1.0) -> GenerationRequest:
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new, stop_token_ids=stop)
    return GenerationRequest(prompt_ids=PROMPT, sampling=sampling)


def full(state, version: int) -> WeightUpdate:
    payload = weights.encode_full(state, policy="policy", version=version)
    return WeightUpdate("policy", version, payload=payload)


def test_generate_matches_the_model_and_stops_on_stop_tokens(engine):
    gen = engine.submit(request(24)).result(timeout=120)
    assert_ended(gen, 24)
    assert set(gen.versions) == {0} and all(math.isfinite(x) and x <= 0 for x in gen.logprobs)
    assert gen.logprobs == pytest.approx(reference_logprobs(bf16_state(), gen), abs=ATOL)
    first = engine.submit(request(8, temperature=0.0)).result(timeout=120).completion_ids[0]
    stopped = engine.submit(request(8, stop=(first,), temperature=0.0)).result(timeout=120)
    assert stopped.completion_ids == (first,) and stopped.finish_reason == "stop"


def test_full_and_delta_updates_reach_the_server(engine):
    state1, state2 = bf16_state(seed=1), bf16_state(seed=1)
    state2["model.norm.weight"][:4] += 1.0
    assert engine.update_weights(full(state1, 1)).result(timeout=300)["kind"] == "full"
    gen = engine.submit(request(24)).result(timeout=120)
    assert_ended(gen, 24)
    assert set(gen.versions) == {1}
    assert gen.logprobs == pytest.approx(reference_logprobs(state1, gen), abs=ATOL)
    delta = weights.encode(state1, state2, policy="policy", base_version=1, version=2)
    applied = engine.update_weights(WeightUpdate("policy", 2, payload=delta)).result(timeout=300)
    assert applied["kind"] == "delta" and engine.version == 2
    assert engine.published_checksum() == weights.checksum(state2) == engine.weights_checksum
    gen = engine.submit(request(24)).result(timeout=120)
    assert gen.logprobs == pytest.approx(reference_logprobs(state2, gen), abs=ATOL)


def test_update_during_a_long_generation_keeps_versions_in_order(engine):
    before = engine.version
    future = engine.submit(request(400))  # prompt + 400 stays under the 512 positions
    engine.update_weights(full(bf16_state(seed=3), before + 1)).result(timeout=300)
    gen = future.result(timeout=300)
    assert_ended(gen, 400)
    assert list(gen.versions) == sorted(gen.versions)
    assert set(gen.versions) <= {before, before + 1}
