"""Rollout engines: GenerationRequests in, Generations (tokens, logprobs, versions) out.

`FastLM` (the lean forward) and `top_p_filter` (the nucleus the engine samples from) are public
for the trainer, which must compute logprobs exactly as the engine sampled them; `hf` loads both
already, so naming them here costs no import.
"""

from ._fastlm import FastLM
from ._sampling import top_p_filter
from .base import RolloutEngine
from .hf import EngineStats, HFEngine
from .sglang import SGLangEngine, SGLangError
from .vllm import VLLMEngine, VLLMError

__all__ = ["RolloutEngine", "HFEngine", "EngineStats", "SGLangEngine", "SGLangError", "VLLMEngine",
           "VLLMError", "FastLM", "top_p_filter"]
