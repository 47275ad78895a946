"""What one weight version costs on the wire, from the real codec's measured cost per change.

A rollout region far from the trainer is only as fresh as its link lets it be, so the simulator
needs the bytes of each pull, and the honest source for them is `astranb.weights.codec` itself:

- A full snapshot is every element in bf16: `elements x 2` bytes (`codec.encode_full` adds a
  header of a few hundred bytes per tensor, nothing at this scale).
- A delta is `changed_fraction x elements x bytes_per_change`. `bytes_per_change` is measured,
  not assumed: `measured_bytes_per_change(density)` encodes a real delta with `codec.encode` on
  a random bf16 tensor (N(0, 0.02), like weights) in which `density` of the elements moved by
  +-1..4 ulps at independent uniform positions (as an optimizer step moves them), and divides
  the payload's size, less that of a delta with no change (the frame and header), by the number
  of changes. The cost per change falls as density rises (gaps between changes get shorter to
  code): ~1.9 bytes at 0.1%, ~1.5 at 1%, ~1.1 at 10% (bench/delta.py measures the same on a
  112M-element layout; deltas of a real training trace cost a little less per change).

Between two RL steps of a pretrained model ~1% of the bf16 weights change (AstraFlow's figure,
and what bench/delta.py's trace shows at lr 1e-6), hence the default `changed_fraction`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..weights import codec

__all__ = ["ModelWeights", "measured_bytes_per_change", "QWEN3_14B", "QWEN3_8B"]


@functools.lru_cache(maxsize=64)
def measured_bytes_per_change(density: float, elements: int = 1 << 21, seed: int = 0) -> float:
    """Delta bytes per changed element, measured by encoding a real delta (module docstring).

    Args:
        density: fraction of the elements that change (0 < density <= 1).
        elements: size of the random bf16 tensor (2M: a few ms to encode, and large enough
            that the per-tensor overhead is spread thin).
        seed: of the tensor and the changes.
    """
    if not 0 < density <= 1:
        raise ValueError(f"density is the fraction of elements changed, in (0, 1]; got "
                         f"{density!r} (1% is 0.01)")
    if elements < 1000:
        raise ValueError(f"measure on at least 1000 elements, got {elements}")
    rng = np.random.default_rng(seed)
    old = torch.from_numpy(rng.normal(0.0, 0.02, elements).astype(np.float32)).to(torch.bfloat16)
    new = old.clone()
    changed = max(1, round(density * elements))
    positions = rng.choice(elements, size=changed, replace=False)
    steps = rng.integers(1, 5, size=changed).astype(np.int16)
    signs = np.where(rng.random(changed) < 0.5, -1, 1).astype(np.int16)
    bits = new.view(torch.int16).numpy()  # shares memory with `new`
    bits[positions] += steps * signs
    payload = len(codec.encode({"w": old}, {"w": new}))
    frame = len(codec.encode({"w": old}, {"w": old}))  # the same frame with nothing changed
    return (payload - frame) / changed


@dataclass(frozen=True)
class ModelWeights:
    """A policy's weights as the wire sees them.

    Args (fields):
        params: elements (parameters) of the model.
        changed_fraction: elements whose bf16 bits change in one RL step.
        bytes_per_change: delta bytes per changed element; None: measured with the real codec at
            `changed_fraction` (`measured_bytes_per_change`).
        dtype_bytes: bytes per element of a full snapshot (2: bf16).
    """

    params: float
    changed_fraction: float = 0.01
    bytes_per_change: float | None = None
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if not self.params >= 1:
            raise ValueError(f"params must be >= 1, got {self.params!r} (Qwen3-14B: 14.8e9)")
        if not 0 < self.changed_fraction <= 1:
            raise ValueError(f"changed_fraction must be in (0, 1], got {self.changed_fraction!r} "
                             "(~0.01 for RL steps on a pretrained model)")
        if self.bytes_per_change is not None and not self.bytes_per_change > 0:
            raise ValueError(f"bytes_per_change must be > 0 or None (measured), got "
                             f"{self.bytes_per_change!r}")

    @property
    def per_change(self) -> float:
        """Delta bytes per changed element (measured unless given)."""
        if self.bytes_per_change is not None:
            return self.bytes_per_change
        return measured_bytes_per_change(self.changed_fraction)

    @property
    def full_bytes(self) -> float:
        """A full snapshot."""
        return self.params * self.dtype_bytes

    @property
    def delta_bytes(self) -> float:
        """A delta from the version before."""
        return min(self.full_bytes, self.changed_fraction * self.params * self.per_change)


QWEN3_14B = ModelWeights(14.8e9)
"""Qwen3-14B: 14.8B parameters, 29.6 GB in bf16; ~1% changed per step."""
QWEN3_8B = ModelWeights(8.2e9)
"""Qwen3-8B: 8.2B parameters, 16.4 GB in bf16."""
