"""Rollout engines: GenerationRequests in, Generations (tokens, logprobs, versions) out."""

from .base import RolloutEngine
from .hf import EngineStats, HFEngine

__all__ = ["RolloutEngine", "HFEngine", "EngineStats"]
