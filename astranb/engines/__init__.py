"""Rollout engines: GenerationRequests in, Generations (tokens, logprobs, versions) out."""

from .base import RolloutEngine
from .hf import EngineStats, HFEngine
from .sglang import SGLangEngine, SGLangError

__all__ = ["RolloutEngine", "HFEngine", "EngineStats", "SGLangEngine", "SGLangError"]
