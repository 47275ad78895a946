"""Model specs beyond tiny(): the tiny chat model, models.hf on local directories and on the
Hugging Face cache (offline, never the hub), dtypes, and every kind through the wire."""

from __future__ import annotations

import json

import msgpack
import pytest
import torch
from transformers import Qwen3ForCausalLM

from astranb import models
from astranb.models import ModelSpec, dtype_for
from astranb.remote.serialize import spec_from_wire, spec_to_wire

CHAT = models.tiny_chat(hidden_size=32, num_heads=2)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def logits(model, tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}],
                                  add_generation_prompt=True, tokenize=False)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tok.encode(ids)])).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return CHAT.save(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_tiny_chat_is_a_seeded_qwen3_over_its_tokenizer():
    spec = models.tiny_chat()
    a, b = spec.build(), spec.build()
    assert isinstance(a, Qwen3ForCausalLM) and spec.kind == "tiny_chat"
    assert all(x.equal(y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                          strict=True))
    other = models.tiny_chat(seed=1).build()
    assert not other.model.embed_tokens.weight.equal(a.model.embed_tokens.weight)
    tok = spec.tokenizer()
    config = a.config
    assert config.vocab_size == len(tok) and config.max_position_embeddings == 1024
    assert config.tie_word_embeddings and a.lm_head.weight is a.model.embed_tokens.weight
    assert config._attn_implementation == "sdpa"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 4)
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    parameters = sum(p.numel() for p in a.parameters())
    assert abs(models.tiny_parameters(spec.config, "tiny_chat") - parameters) < 0.01 * parameters


def test_hf_on_a_saved_directory_matches_the_in_memory_model(saved, offline):
    spec = models.hf(saved)
    assert spec.kind == "local" and spec.path == str(saved) and spec.dtype is None
    tok, reference = spec.tokenizer(), CHAT.tokenizer()
    text = "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<tool_call>{}</tool_call>"
    assert tok.encode(text) == reference.encode(text)
    assert tok.chat_template == reference.chat_template
    assert torch.equal(logits(spec.build(), tok), logits(CHAT.build(), reference))


def test_hf_with_a_dtype(saved, offline):
    spec = models.hf(saved, dtype=torch.bfloat16)
    assert spec.dtype == "bfloat16" and spec.torch_dtype is torch.bfloat16
    assert spec.build().dtype == torch.bfloat16
    assert spec.build(dtype=torch.float32).dtype == torch.float32  # the caller's choice wins
    assert dtype_for("cpu", spec) is torch.bfloat16 and dtype_for("cpu") is torch.float32
    assert dtype_for("cpu", models.hf(saved, dtype="auto")) is torch.float32
    assert models.hf(saved, dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="is not one a model runs in; use torch.bfloat16"):
        models.hf(saved, dtype="int8")


def test_hf_refuses_a_revision_for_a_directory_and_a_name_that_is_neither(saved, tmp_path):
    with pytest.raises(ValueError, match="applies to hub names only"):
        models.hf(saved, revision="main")
    with pytest.raises(ValueError, match="neither an existing directory nor a hub model name"):
        models.hf(tmp_path / "missing" / "model")


def test_a_hub_name_not_in_the_cache_fails_offline_with_the_fix(offline):
    with pytest.raises(FileNotFoundError) as error:
        models.hf("astranb-tests/no-such-model-0x5f3759df")
    assert str(error.value) == (
        "'astranb-tests/no-such-model-0x5f3759df' is not in the Hugging Face cache and the hub "
        "cannot be reached (HF_HUB_OFFLINE is set): run once online, or pass a local directory "
        "written by save_pretrained")


@pytest.fixture
def cache(saved, tmp_path, monkeypatch, offline):
    """A Hugging Face cache holding the saved tiny chat model as "astranb-tests/tiny-chat"."""
    from huggingface_hub import constants

    repo = tmp_path / "models--astranb-tests--tiny-chat"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_a_hub_name_in_the_cache_loads_offline(cache):
    spec = models.hf("astranb-tests/tiny-chat")
    assert (spec.kind, spec.repo, spec.revision, spec.path) == ("hf", "astranb-tests/tiny-chat",
                                                                 None, None)
    tok = spec.tokenizer()
    assert torch.equal(logits(spec.build(), tok), logits(CHAT.build(), CHAT.tokenizer()))
    pinned = models.hf("astranb-tests/tiny-chat", revision=COMMIT, dtype="bfloat16")
    assert pinned.name == f"astranb-tests/tiny-chat@{COMMIT}"
    assert pinned.build().dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="at revision 'v2' is not in the Hugging Face"):
        models.hf("astranb-tests/tiny-chat", revision="v2")


SPECS = [
    models.tiny(hidden_size=32, num_heads=2, initializer_range=0.3),
    models.tiny_chat(seed=3, rope_theta=1000.0),
    ModelSpec(name="m", path="/models/m", dtype="bfloat16"),
    ModelSpec(name="Qwen/Qwen3-0.6B@abc", kind="hf", repo="Qwen/Qwen3-0.6B", revision="abc",
              dtype="float16"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_every_kind_round_trips_through_json_and_msgpack(spec):
    wire = spec_to_wire(spec)
    assert spec_from_wire(json.loads(json.dumps(wire))) == spec
    assert spec_from_wire(msgpack.unpackb(msgpack.packb(wire))) == spec
    assert ModelSpec(**wire) == spec  # what torchrun workers do


def test_an_old_wire_body_without_kind_is_tiny_or_local():
    assert spec_from_wire({"name": "t", "config": {"hidden_size": 32}}).kind == "tiny"
    assert spec_from_wire({"name": "l", "path": "/m"}) == models.ModelSpec(name="l", path="/m")
    assert models.ModelSpec(name="l", path="/m").kind == "local"


@pytest.mark.parametrize("body, message", [
    ({"name": "x", "kind": "gguf"}, "model kind 'gguf' is unknown"),
    ({"name": "x", "kind": "local"}, "'local' model spec needs path"),
    ({"name": "x", "kind": "hf"}, "only an 'hf' model spec names a hub repo"),
    ({"name": "x", "kind": "tiny", "repo": "a/b"}, "only an 'hf' model spec names a hub repo"),
    ({"name": "x", "kind": "hf", "repo": "a/b", "revision": 3}, "'revision' must be a string"),
    ({"name": "x", "dtype": "int4"}, "dtype 'int4' is not one a model runs in"),
    ({"kind": "tiny"}, "model spec lacks 'name'"),
    ({"name": "x", "kind": "tiny_chat", "config": {"hidden_size": 65536, "num_hidden_layers": 64,
                                                  "intermediate_size": 262144}},
     "more than this service builds"),
])
def test_bad_wire_specs_are_refused_with_the_reason(body, message):
    with pytest.raises(ValueError, match=message):
        spec_from_wire(body)
