"""astranb: asynchronous, multi-policy reinforcement learning of LLM agents, from a notebook.

    import astranb as ab

    session = ab.Session("runs/arith")
    policy = session.policy("solver", model=ab.models.tiny(), algorithm=ab.M2PO())
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=200, batch_size=64, group_size=8, max_staleness=4)
    await run            # or run.wait() in scripts and papermill
    run.metrics          # one row per (policy, step)
"""

from . import environments, models, weights
from .algorithms import GRPO, M2PO, Algorithm
from .debugger import EpisodeDebugger, debug
from .environment import Environment, EpisodeContext
from .policy import Policy
from .recorder import Episode
from .run import Run, RunConfig
from .session import Session
from .training.local import AdamW, LocalTrainer
from .types import (Generation, GenerationRequest, SamplingParams, ToolCall, Trajectory, Turn,
                    WeightUpdate)

Trainer = LocalTrainer
"""The trainer contract's in-process implementation (step, weights, save, load)."""

__version__ = "0.1.0"

__all__ = [
    "Session",
    "Policy",
    "Environment",
    "EpisodeContext",
    "Trainer",
    "LocalTrainer",
    "Run",
    "RunConfig",
    "Episode",
    "EpisodeDebugger",
    "debug",
    "GRPO",
    "M2PO",
    "Algorithm",
    "AdamW",
    "SamplingParams",
    "GenerationRequest",
    "Generation",
    "Turn",
    "ToolCall",
    "Trajectory",
    "WeightUpdate",
    "models",
    "environments",
    "weights",
    "__version__",
]
