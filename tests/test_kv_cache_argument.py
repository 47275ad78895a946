"""The keyword a model's forward takes its KV cache by differs across transformers 5.x releases
(`past_key_values`, later `cache`); passing the wrong one is silently swallowed by `**kwargs`
and leaves the cache empty (seen on a GPU host's transformers 5.17)."""

from __future__ import annotations

from typing import Any

import torch

from astranb import models
from astranb.engines._kvbatch import cache_argument

CACHE: Any = object()


class Newer:
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...


class Older:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...


class Wrapper:  # PEFT-like: the forward takes only **kwargs, the model is behind get_base_model
    def __init__(self, inner):
        self.inner = inner

    def forward(self, *args, **kwargs): ...

    def get_base_model(self):
        return self.inner


def test_the_keyword_follows_the_forward_signature():
    assert cache_argument(Newer(), CACHE) == {"cache": CACHE}
    assert cache_argument(Older(), CACHE) == {"past_key_values": CACHE}
    assert cache_argument(Wrapper(Older()), CACHE) == {"past_key_values": CACHE}
    assert cache_argument(Wrapper(Newer()), CACHE) == {"cache": CACHE}


def test_the_installed_transformers_fills_the_cache_through_it():
    from transformers.cache_utils import DynamicCache

    model = models.tiny().build()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=True,
              **cache_argument(model, cache))
    assert cache.get_seq_length() == 3
