"""astranb: asynchronous, multi-policy reinforcement learning of LLM agents, from a notebook.

    import astranb as ab

    session = ab.Session("runs/arith")
    policy = session.policy("solver", model=ab.models.tiny(), algorithm=ab.M2PO())
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    run = session.train(steps=200, batch_size=64, group_size=8, max_staleness=4)
    await run            # or run.wait() in scripts and papermill
    run.metrics          # one row per (policy, step)

This module is the only import users need, and `__all__` (also what `dir(astranb)` shows) is the
public API: the names README's "API at a glance" lists. Everything else stays importable by its
full path (`astranb.dataflow.buffer`, `astranb.session.recorder`, ...). The layers below run
downward (see docs/architecture.md): plain data and contracts, the pure parts, the HTTP client
side, the run layer (`astranb.session`), then the service apps and the notebook UI
(`astranb.notebook`, loaded only when something is shown).
"""

from . import chat, data, environments, models, weights
from .algorithms import CISPO, DAPO, GRPO, GSPO, M2PO, RLOO, Algorithm, DrGRPO, ReinforcePP
from .contracts import Engine, Publisher, Trainer
from .data import DataSource
from .dataflow.config import RunConfig
from .environments import Environment, EpisodeContext, play_episode
from .environments.conversation import ChatMessage, ToolOutcome
from .errors import (
    AstranbError,
    EpisodesKeepFailing,
    EpisodeTruncated,
    FolderNotWritable,
    NoTrainableTokens,
    ReplayError,
    SamplesRanOut,
    ServiceError,
    ServiceUnavailable,
    SessionClosed,
    TrainerRolledBack,
)
from .evaluation import RoleEvaluation
from .session import trackers
from .session.history import compare, runs
from .session.policy import Policy
from .session.recorder import Episode
from .session.run import Run, RunRecord, open_run
from .session.session import Session
from .training.local import AdamWConfig, LocalTrainer
from .training.lora import LoRA
from .training.reference import Reference
from .types import (
    Generation,
    GenerationRequest,
    SamplingParams,
    ToolCall,
    Trajectory,
    Turn,
    WeightUpdate,
)
from .weights import WeightTransferError

__version__ = "0.2.0"

__all__ = [
    # sessions and runs
    "Session", "Policy", "Run", "RunConfig", "RunRecord", "open_run", "runs", "compare",
    "Episode", "RoleEvaluation",
    # environments and episodes
    "Environment", "EpisodeContext", "play_episode", "ChatMessage", "ToolOutcome", "DataSource",
    "SamplingParams", "GenerationRequest", "Generation", "Turn", "ToolCall", "Trajectory",
    # algorithms, training and the contracts
    "GRPO", "M2PO", "DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP", "Algorithm",
    "AdamWConfig", "Reference", "LoRA", "LocalTrainer", "Trainer", "Engine", "Publisher",
    "WeightUpdate", "External", "TrainerLink",
    # debugging (the notebook UI, imported on first use)
    "debug", "EpisodeDebugger",
    # errors
    "AstranbError", "EpisodesKeepFailing", "EpisodeTruncated", "NoTrainableTokens",
    "SamplesRanOut", "SessionClosed", "FolderNotWritable", "ReplayError", "ServiceError",
    "ServiceUnavailable", "TrainerRolledBack", "WeightTransferError", "TrainerLinkError",
    "OutOfSync",
    # modules
    "models", "environments", "chat", "data", "weights", "trackers",
    "__version__",
]

# The step-through debugger lives in the notebook UI package; it is imported on first use so
# that `import astranb` never loads display code.
# An external trainer's choice and link live on the HTTP side (remote/), which the facade's
# eager imports never reach (tests/test_layers.py): they are bound on first use too.
_LAZY = {"debug": "astranb.notebook.debug", "EpisodeDebugger": "astranb.notebook.debugger",
         "External": "astranb.remote.external", "TrainerLink": "astranb.remote.trainer_link",
         "TrainerLinkError": "astranb.remote.trainer_link",
         "OutOfSync": "astranb.remote.trainer_link"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'astranb' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API only: importing a submodule (`astranb.dataflow`, ...) binds its name on
    this module too, and those are internals."""
    return sorted(__all__)
