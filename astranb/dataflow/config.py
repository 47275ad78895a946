"""What a run is asked for, validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import DEFAULT_MAX_GEN_BATCHES, SAMPLERS
from .stall import STALL_SECONDS

INSPECT_EVERY = 10
"""The default `RunConfig.inspect_every`: one step in ten recorded for the step inspector."""

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    """What `session.train` was asked for, validated."""

    steps: int
    """Train steps per policy."""
    batch_size: int
    """Episodes per train step (a multiple of group_size)."""
    group_size: int
    """Episodes per sample; advantages are normalised within a group."""
    max_staleness: int
    """Largest allowed `trainer version - oldest token version` of a trained sample."""
    order: str = "edf"
    """Buffer order: "edf" (oldest tokens first) or "fifo"."""
    seed: int = 0
    """Seed of the sample stream."""
    mode: str = "independent"
    """"independent": each policy steps when its batch is ready; "barrier": versions advance
    together (no policy starts step v+1 before every policy has published v+1)."""
    stall_seconds: float = STALL_SECONDS
    """Seconds without a published step or a group reaching a buffer before the run records a
    "stalled" event saying what it waits for (see `astranb.dataflow.stall`)."""
    max_gen_batches: int | None = DEFAULT_MAX_GEN_BATCHES
    """Batches' worth of groups a step waits for at most: once `(max_gen_batches - 1) x
    groups_per_batch` groups were dropped by filter_groups since a policy's last step, the step
    takes the groups it has and trains those with a signal (see `astranb.dataflow.sampling`);
    None: no bound."""
    stop_when_learned: bool = False
    """End a policy's training at its "learned" event (its last groups all tied, some at its
    best reward) instead of going on."""
    sampler: str = "stream"
    """"stream": every sample is played, in stream order; "open": samples whose recent groups
    all tied are skipped most of the time (see `astranb.dataflow.sampling.OpenSamples`)."""
    inspect_every: int = INSPECT_EVERY
    """Steps between two the step inspector records (`run.steps`): step 0 and every
    inspect_every-th after it, and the run's first step (a resumed run, or one after a manual
    step); 0: none."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size={self.group_size}: group-relative advantages need at least 2 "
                "episodes per sample; use group_size >= 2 (8 is a good default)"
            )
        if self.batch_size % self.group_size:
            lower = self.batch_size - self.batch_size % self.group_size
            raise ValueError(
                f"batch_size={self.batch_size} is not a multiple of group_size={self.group_size}; "
                f"use batch_size={max(lower, self.group_size)} or "
                f"{lower + self.group_size}"
            )
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(
                f"max_staleness must be an integer >= 0, got {self.max_staleness!r}: 0 trains "
                "synchronously on fresh samples only, >= 1 lets rollouts run ahead of training"
            )
        if self.order not in ("edf", "fifo"):
            raise ValueError(f"order must be 'edf' or 'fifo', got {self.order!r}")
        if self.mode not in ("independent", "barrier"):
            raise ValueError(f"mode must be 'independent' or 'barrier', got {self.mode!r}")
        if (isinstance(self.stall_seconds, bool)
                or not isinstance(self.stall_seconds, (int, float)) or not self.stall_seconds > 0):
            raise ValueError(f"stall_seconds must be a number of seconds > 0, got "
                             f"{self.stall_seconds!r} (default {STALL_SECONDS:g})")

        if self.max_gen_batches is not None and (
                isinstance(self.max_gen_batches, bool) or not isinstance(self.max_gen_batches, int)
                or self.max_gen_batches < 1):
            raise ValueError(
                f"max_gen_batches must be an integer >= 1 or None, got {self.max_gen_batches!r}: "
                "the batches' worth of groups played for one step at most (default "
                f"{DEFAULT_MAX_GEN_BATCHES}); None lets filter_groups drop without a bound")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got "
                             f"{self.sampler!r}")
        if (isinstance(self.inspect_every, bool) or not isinstance(self.inspect_every, int)
                or self.inspect_every < 0):
            raise ValueError(f"inspect_every must be an integer >= 0 (0: no step recorded), "
                             f"got {self.inspect_every!r}")
        if not isinstance(self.stop_when_learned, bool):
            raise ValueError(f"stop_when_learned must be True or False, got "
                             f"{self.stop_when_learned!r}")

    @property
    def groups_per_batch(self) -> int:
        return self.batch_size // self.group_size
