"""SGLangEngine against a fake SGLang server: wire mapping, per-token versions across in-flight
updates, weight files, availability, errors, and a launched server process (a fake one)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from astranb import models, weights
from astranb.engines import RolloutEngine, SGLangEngine, SGLangError
from astranb.types import GenerationRequest, SamplingParams, WeightUpdate
from tests.fake_sglang import FakeSGLang, expected
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
PROMPT = (5, 6, 7)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """A local model directory, as SGLang would load it (config, tokenizer, weights)."""
    tiny = models.tiny(hidden_size=16, num_layers=1, num_heads=2)
    return models.local(tiny.save(tmp_path_factory.mktemp("model")))


@pytest.fixture
def attach(spec):
    """attach(fake, **kwargs): an engine talking to `fake` in-process; closed after the test."""
    engines = []

    def make(fake: FakeSGLang, **kwargs) -> SGLangEngine:
        transport = httpx.ASGITransport(app=fake.app)
        engine = SGLangEngine(spec, url="http://sglang.test", transport=transport,
                              metrics_interval=0.01, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def request(max_new: int = 6, stop=(), prompt=PROMPT, **sampling) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=tuple(stop), **sampling)
    return GenerationRequest(prompt_ids=prompt, sampling=params)


def bf16_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(79, 16, generator=g).bfloat16(),
            "model.norm.weight": torch.randn(16, generator=g).bfloat16()}


def full(w, version: int) -> WeightUpdate:
    payload = weights.encode_full(w, policy="policy", version=version)
    return WeightUpdate("policy", version, payload=payload)


# -- request/answer mapping ------------------------------------------------------------------------


def test_request_and_answer_mapping(attach):
    fake = FakeSGLang()
    engine = attach(fake)
    assert isinstance(engine, RolloutEngine)
    gen = engine.submit(request(6, temperature=0.7, top_p=0.9)).result(timeout=10)
    tokens, logprobs = expected(PROMPT, 6)
    assert gen.prompt_ids == PROMPT and list(gen.completion_ids) == tokens
    assert gen.logprobs == pytest.approx(logprobs) and gen.versions == (0,) * 6
    assert gen.finish_reason == "length"
    assert gen.text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    body = fake.bodies[0]
    assert body["input_ids"] == list(PROMPT) and body["return_logprob"] is True
    assert isinstance(body["rid"], str)
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 6,
                                       "stop_token_ids": [], "skip_special_tokens": True}


def test_generate_awaits_from_another_event_loop(attach):
    engine = attach(FakeSGLang())
    gen = asyncio.run(engine.generate(request(4)))
    assert list(gen.completion_ids) == expected(PROMPT, 4)[0]


def test_stop_token_ends_the_completion_and_is_kept(attach):
    engine = attach(FakeSGLang())
    tokens = expected(PROMPT, 12)[0]
    i = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    gen = engine.submit(request(12, stop=(tokens[i],))).result(timeout=10)
    assert list(gen.completion_ids) == tokens[: i + 1] and gen.finish_reason == "stop"


def answer(ids, reason, *, with_ids=True, version="default"):
    meta = {"id": "r", "finish_reason": reason, "weight_version": version,
            "output_token_logprobs": [[-0.5 * (k + 1), t, None] for k, t in enumerate(ids)]}
    return {"text": "", **({"output_ids": ids} if with_ids else {}), "meta_info": meta}


@pytest.mark.parametrize("reason, max_new, stop, with_ids, finish", [
    ({"type": "length", "length": 2}, 2, (), True, "length"),
    ({"type": "length", "length": 2}, 2, (2,), True, "stop"),  # stop token counts first (HFEngine)
    ({"type": "stop", "matched": 2}, 5, (), True, "stop"),  # the model's own EOS
    ({"type": "stop", "matched": 2}, 5, (2,), False, "stop"),  # old servers: ids only in triples
])
def test_finish_reason_mapping(attach, reason, max_new, stop, with_ids, finish):
    fake = FakeSGLang()
    fake.answer_next = answer([9, 2], reason, with_ids=with_ids)
    gen = attach(fake).submit(request(max_new, stop=stop)).result(timeout=10)
    assert gen.completion_ids == (9, 2) and gen.logprobs == (-0.5, -1.0)
    assert gen.finish_reason == finish


# -- in-flight weight updates ----------------------------------------------------------------------


def test_generation_spanning_an_update_has_old_versions_then_new(attach):
    fake = FakeSGLang(step_delay=0.005)
    engine = attach(fake)
    future = engine.submit(request(60))
    wait_until(lambda: any(len(t) >= 5 for t in fake.running.values()), 10,
               "5 tokens generated", interval=0.002)
    w1 = bf16_weights(1)
    applied = engine.update_weights(full(w1, 1)).result(timeout=10)
    gen = future.result(timeout=10)
    assert applied["kind"] == "full" and applied["apply_seconds"] > 0
    k = gen.versions.count(0)
    assert 5 <= k < 60 and gen.versions == (0,) * k + (1,) * (60 - k)
    old, old_lp = expected(PROMPT, k, loads=0)
    new, new_lp = expected(PROMPT + tuple(old), 60 - k, loads=1)
    assert list(gen.completion_ids) == old + new
    assert gen.logprobs == pytest.approx(old_lp + new_lp)
    resumed = fake.bodies[-1]  # prompt + tokens so far, the remaining budget
    assert resumed["input_ids"] == list(PROMPT) + old
    assert resumed["sampling_params"]["max_new_tokens"] == 60 - k
    assert not fake.updated_while_running and fake.pauses == 1 and fake.continues == 1
    assert engine.version == 1 and fake.weight_version == "1"
    assert fake.loaded_checksum == weights.checksum(w1) == engine.weights_checksum


def test_full_then_delta_writes_the_published_weights(attach, spec):
    fake = FakeSGLang()
    engine = attach(fake)
    w1 = bf16_weights(1)
    w2 = {k: v.clone() for k, v in w1.items()}
    w2["model.norm.weight"][3] += 1.0
    assert engine.update_weights(full(w1, 1)).result(timeout=10)["kind"] == "full"
    delta = weights.encode(w1, w2, policy="policy", base_version=1, version=2)
    applied = engine.update_weights(WeightUpdate("policy", 2, payload=delta)).result(timeout=10)
    assert applied["kind"] == "delta" and engine.version == 2
    assert fake.loaded_checksum == weights.checksum(w2) == engine.weights_checksum
    assert engine.published_checksum() == weights.checksum(w2)
    # the weights directory: the model's config and tokenizer, one weights file, nothing else
    model_files = {p.name for p in Path(spec.path).iterdir()} - {"model.safetensors"}
    assert set(fake.loaded_files) == model_files | {"model.safetensors"}
    written = load_file(str(engine.workdir / "weights" / "model.safetensors"))
    assert all(written[k].equal(w2[k]) for k in w2)
    gen = engine.submit(request(5)).result(timeout=10)  # after two loads, at version 2
    assert gen.versions == (2,) * 5 and list(gen.completion_ids) == expected(PROMPT, 5, loads=2)[0]


def test_delta_without_a_base_is_refused_before_touching_the_server(attach):
    fake = FakeSGLang()
    engine = attach(fake)
    w1 = bf16_weights(1)
    delta = weights.encode(w1, bf16_weights(2), policy="policy", base_version=0, version=1)
    with pytest.raises(weights.BaseMismatch, match="full snapshot"):
        engine.update_weights(WeightUpdate("policy", 1, payload=delta)).result(timeout=10)
    assert engine.version == 0 and fake.loads == 0 and fake.pauses == 0


def test_state_update_writes_the_given_tensors(attach):
    fake = FakeSGLang()
    engine = attach(fake)
    state = {k: v.float() for k, v in bf16_weights(3).items()}
    applied = engine.update_weights(WeightUpdate("policy", 1, state=state)).result(timeout=10)
    assert applied["kind"] == "state" and engine.weights_checksum is None
    assert fake.loaded_checksum == weights.checksum(state)


def test_pause_holds_requests_and_resume_continues_them_unchanged(attach):
    fake = FakeSGLang(step_delay=0.005)
    engine = attach(fake)
    engine.pause()
    held = engine.submit(request(4))
    time.sleep(0.05)
    assert fake.bodies == [] and engine.availability() == 0
    engine.resume()
    assert list(held.result(timeout=10).completion_ids) == expected(PROMPT, 4)[0]
    running = engine.submit(request(40))  # paused mid-generation: aborted, then resumed
    wait_until(lambda: any(len(t) >= 3 for t in fake.running.values()), 10,
               "3 tokens generated", interval=0.002)
    engine.pause()
    engine.resume()
    gen = running.result(timeout=10)
    assert list(gen.completion_ids) == expected(PROMPT, 40)[0] and gen.versions == (0,) * 40
    assert len(fake.bodies) == 3


# -- availability ----------------------------------------------------------------------------------


def test_availability_follows_the_queue_gauge_per_dp_rank(attach):
    fake = FakeSGLang(dp_size=2)
    fake.queue_reqs = [3, 2]
    engine = attach(fake)
    wait_until(lambda: engine.availability() == 4 * 2 - 5, 10, "availability 3", interval=0.002)
    fake.queue_reqs = [9, 0]
    wait_until(lambda: engine.availability() == 0, 10, "availability 0", interval=0.002)
    fake.queue_reqs = [0, 0]
    wait_until(lambda: engine.availability() == 8, 10, "availability 8", interval=0.002)
    seen = []
    fake.on_update = lambda: seen.append(engine.availability())
    engine.update_weights(full(bf16_weights(1), 1)).result(timeout=10)
    assert seen == [0]


def test_availability_without_metrics_counts_own_requests(attach):
    fake = FakeSGLang(metrics=False, step_delay=0.01)
    engine = attach(fake, target_queue=3)
    futures = [engine.submit(request(200)) for _ in range(2)]
    wait_until(lambda: engine.availability() == 1, 10, "availability 1", interval=0.002)
    for f in futures:
        f.cancel()
    wait_until(lambda: engine.availability() == 3, 10, "availability 3", interval=0.002)


def test_gauge_sum_reads_prometheus_text():
    from astranb.engines._sglang_wire import _gauge_sum

    text = ('# HELP sglang:num_queue_reqs x\n# TYPE sglang:num_queue_reqs gauge\n'
            'sglang:num_queue_reqs{model_name="a b",dp_rank="0"} 3.0\n'
            'sglang:num_queue_reqs{model_name="a b",dp_rank="1"} 2 1700000000\n'
            'sglang:num_queue_reqs_total 99\nsglang:num_running_reqs 7\n')
    assert _gauge_sum(text, "sglang:num_queue_reqs") == 5.0
    assert _gauge_sum(text, "sglang:num_running_reqs") == 7.0
    assert _gauge_sum("", "sglang:num_queue_reqs") == 0.0


# -- errors ----------------------------------------------------------------------------------------


def test_http_error_names_status_and_body(attach):
    fake = FakeSGLang()
    fake.fail_next["/generate"] = (500, "internal boom: scheduler died")
    with pytest.raises(SGLangError,
                       match=r"POST /generate answered HTTP 500: internal boom") as info:
        attach(fake).submit(request(3)).result(timeout=10)
    assert info.value.status == 500


@pytest.mark.parametrize("bad, field", [
    ({"text": "hi"}, "'meta_info'"),
    ({"meta_info": {"id": "r"}}, "'meta_info.finish_reason'"),
    ({"meta_info": {"finish_reason": {"type": "length"}}}, "'meta_info.output_token_logprobs'"),
    ({"meta_info": {"finish_reason": {"type": "weird"}}}, "unknown meta_info.finish_reason"),
    (answer([1, 2], {"type": "length"}) | {"output_ids": [1]}, "disagree"),
])
def test_malformed_answers_name_the_field(attach, bad, field):
    fake = FakeSGLang()
    fake.answer_next = bad
    with pytest.raises(SGLangError, match=field):
        attach(fake).submit(request(2)).result(timeout=10)


def test_abort_nobody_asked_for_is_an_error(attach):
    fake = FakeSGLang()
    fake.answer_next = answer([4], {"type": "abort", "message": "Abort: out of memory"})
    with pytest.raises(SGLangError, match="out of memory"):
        attach(fake).submit(request(3)).result(timeout=10)


def test_unreachable_server_is_a_clear_error(spec):
    from astranb.engines._sglang_server import _free_port

    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SGLangError, match=f"cannot reach the SGLang server at {url}"):
        SGLangEngine(spec, url=url)


def test_refused_update_keeps_the_version_and_generation_goes_on(attach):
    fake = FakeSGLang()
    engine = attach(fake)
    fake.fail_next["/update_weights_from_disk"] = (
        400, '{"success": false, "message": "bad shapes"}')
    with pytest.raises(SGLangError, match="HTTP 400.*bad shapes"):
        engine.update_weights(full(bf16_weights(1), 1)).result(timeout=10)
    assert engine.version == 0 and engine.weights_checksum is None and fake.continues == 1
    assert engine.submit(request(3)).result(timeout=10).versions == (0, 0, 0)


def test_caller_errors(attach, spec):
    engine = attach(FakeSGLang())
    with pytest.raises(ValueError, match="policy 'other'"):
        engine.update_weights(WeightUpdate("other", 1, state={}))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.submit(GenerationRequest(prompt_ids=()))
    with pytest.raises(ValueError, match="url="):
        SGLangEngine(spec, url="http://x", launch=True)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(request(2))


def test_cancelling_a_request_aborts_it_on_the_server(attach):
    fake = FakeSGLang(step_delay=0.005)
    engine = attach(fake)
    future = engine.submit(request(500))
    wait_until(lambda: fake.running, 10, "a running request", interval=0.002)
    (rid,) = fake.running
    future.cancel()
    wait_until(lambda: rid in fake.aborted and not fake.running, 10,
               "the request aborted", interval=0.002)


def test_close_fails_pending_requests(attach):
    engine = attach(FakeSGLang())
    engine.pause()
    future = engine.submit(request(3))
    engine.close()
    with pytest.raises(RuntimeError, match="closed before the work finished"):
        future.result(timeout=10)


# -- a launched server process (the fake, behind a fake `sglang.launch_server`) --------------------


@pytest.fixture
def fake_sglang_package(tmp_path, monkeypatch):
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text("from tests.fake_sglang import main\nmain()\n")
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), str(root)]))


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_launch_waits_for_health_and_close_ends_the_server(spec, fake_sglang_package):
    engine = SGLangEngine(spec, launch=True, token="s3cret", launch_timeout=60)
    try:
        assert engine.submit(request(3)).result(timeout=10).completion_ids
        log = engine.server_log()
        for part in ("--host 127.0.0.1", "--enable-metrics", "--weight-version 0",
                     "--api-key s3cret"):
            assert part in log
        pid = int(re.search(r"fake sglang pid (\d+)", log).group(1))
    finally:
        engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_launch_failure_shows_the_server_log(spec, fake_sglang_package):
    with pytest.raises(SGLangError, match=r"exited with code 3(.|\n)*CUDA out of memory"):
        SGLangEngine(spec, launch=True, server_args=("--fake-crash",), launch_timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_launch_without_sglang_says_how_to_install(spec):
    with pytest.raises(SGLangError, match=r"pip install 'astranb\[sglang\]'"):
        SGLangEngine(spec)
    assert sys.modules.get("sglang") is None
