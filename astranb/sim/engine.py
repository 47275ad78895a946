"""Simulated rollout engines: a pool of GPUs decoding continuous batches on the virtual clock.

Every GPU holds a batch of sequences from any policy and decodes them in lock-step (cost model
in costs.py). A request goes to the GPU with the fewest sequences (running + queued) and joins
its batch at the next step boundary, or queues while the batch is full. The simulation is event
driven: a GPU runs a "chunk" of steps until its next sequence finishes; an arrival or a weight
update cuts the chunk after the step in progress and the GPU re-plans. So a run costs a few
events per request, not one per token.

Weight updates are in flight, as in AstraFlow (SGLang aborts and re-issues) and the hf engine:
the policy's sequences stop at the next step boundary, the pool waits `update_seconds`, then
each in-flight sequence re-prefills its prompt and tokens so far and goes on under the new
version. Each token carries the version of the step that produced it.
"""

from __future__ import annotations

import math
import random
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import anyio
import anyio.abc

from ..engines.base import settle
from ..types import Generation, GenerationRequest, WeightUpdate
from .costs import Lengths, RolloutCosts

__all__ = ["GpuPool", "SimEngine"]

_COMPLETION_ID = 4  # every simulated token has this id; only lengths and versions matter


@dataclass(eq=False)
class _Sequence:
    policy: str
    prompt: int
    """Prompt length in simulated tokens."""
    remaining: int
    """Tokens still to generate."""
    prefill: int
    """Tokens to prefill before the next decode step (the prompt, or a re-prefill)."""
    generated: int = 0
    versions: list[int] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(eq=False)
class _Chunk:
    """Decode steps a GPU is running: until its first sequence ends, or cut short."""

    running: list[_Sequence]
    versions: dict[str, int]
    """Each policy's weights version during the chunk (its tokens carry it)."""
    start: float
    prefill: float
    """Seconds of prefill paid in the first step."""
    dt: float
    """Seconds of one step."""
    steps: int

    @property
    def end(self) -> float:
        return self.start + self.prefill + self.steps * self.dt if self.steps else self.start

    def cut(self, now: float) -> None:
        """Stop after the step in progress at `now` (none if nothing has run yet)."""
        elapsed = now - self.start
        done = 0 if elapsed <= 0 else max(1, math.ceil((elapsed - self.prefill) / self.dt - 1e-9))
        self.steps = min(self.steps, done)


class _Gpu:
    """One GPU's continuous batch (stepped by the pool's loop)."""

    def __init__(self, pool: GpuPool):
        self.pool = pool
        self.active: list[_Sequence] = []
        self.queue: deque[_Sequence] = deque()
        self.chunk: _Chunk | None = None
        self.dirty = False
        """Something changed (an arrival, a pause): cut the chunk and re-plan."""
        self.busy_seconds = 0.0

    @property
    def load(self) -> int:
        return len(self.active) + len(self.queue)

    def busy_with(self, policy: str) -> bool:
        return self.chunk is not None and policy in self.chunk.versions

    def tick(self, now: float) -> None:
        """Bring the GPU up to `now`: end or cut its chunk, start the next one."""
        if self.chunk is not None and self.dirty:
            self.chunk.cut(now)
        self.dirty = False
        if self.chunk is not None and self.chunk.end <= now:
            self._finish(self.chunk)
            self.chunk = None
        if self.chunk is None:
            self.chunk = self._plan(now)

    def _plan(self, now: float) -> _Chunk | None:
        pool = self.pool
        while self.queue and len(self.active) < pool.costs.max_batch:
            self.active.append(self.queue.popleft())
        running = [s for s in self.active if s.policy not in pool.paused]
        if not running:
            return None
        scale = pool.token_scale
        prefill = sum(s.prefill for s in running) * scale * pool.costs.prefill_per_token
        dt = pool.costs.step_seconds(len(running)) * scale
        versions = {s.policy: pool.versions[s.policy] for s in running}
        return _Chunk(running, versions, now, prefill, dt, min(s.remaining for s in running))

    def _finish(self, chunk: _Chunk) -> None:
        if not chunk.steps:
            return
        self.busy_seconds += chunk.prefill + chunk.steps * chunk.dt
        for s in chunk.running:
            s.prefill = 0
            s.remaining -= chunk.steps
            s.generated += chunk.steps
            s.versions.extend([chunk.versions[s.policy]] * chunk.steps)
            if s.remaining == 0 and s in self.active:  # (a cancelled request is gone already)
                self.active.remove(s)
                s.done.set()


class GpuPool:
    """The rollout GPUs every SimEngine of a run decodes on.

    One task steps every GPU (in index order), so GPUs whose steps end at the same virtual
    instant are handled in a fixed order and a seed gives the same run.

    Args:
        costs: GPU count, batch size and step costs.
        token_scale: real tokens per simulated token.
    """

    def __init__(self, costs: RolloutCosts, token_scale: int = 1):
        self.costs = costs
        self.token_scale = token_scale
        self.gpus = [_Gpu(self) for _ in range(costs.gpus)]
        self.versions: dict[str, int] = {}
        self.paused: set[str] = set()
        self._wake = anyio.Event()
        self._ticked = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self) -> None:
        """Decode until cancelled (run it in the simulation's task group)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:
                self._wake = anyio.Event()
                now = anyio.current_time()
                for gpu in self.gpus:
                    gpu.tick(now)
                self._ticked.set()
                self._ticked = anyio.Event()
                ends = [g.chunk.end for g in self.gpus if g.chunk is not None]
                with anyio.move_on_after(min(ends) - now if ends else math.inf):
                    await self._wake.wait()

    @property
    def busy_seconds(self) -> float:
        """GPU-seconds spent decoding and prefilling so far."""
        return sum(g.busy_seconds for g in self.gpus)

    async def decode(self, policy: str, prompt: int, tokens: int) -> list[int]:
        """Generate `tokens` simulated tokens after a `prompt`; returns each token's version."""
        seq = _Sequence(policy, prompt, remaining=tokens, prefill=prompt)
        gpu = min(self.gpus, key=lambda g: g.load)
        gpu.queue.append(seq)
        self._touch([gpu])
        try:
            await seq.done.wait()
        finally:  # cancelled: drop the request
            if seq in gpu.queue:
                gpu.queue.remove(seq)
            elif seq in gpu.active:
                gpu.active.remove(seq)
        return seq.versions

    async def update(self, policy: str, version: int) -> None:
        """Load new weights for `policy` in flight (see module docstring)."""
        self.pause(policy)
        while any(g.busy_with(policy) for g in self.gpus):
            await self._ticked.wait()
        await anyio.sleep(self.costs.update_seconds)
        self.versions[policy] = version
        for gpu in self.gpus:
            for s in gpu.active:
                if s.policy == policy and s.prefill == 0:
                    s.prefill = s.prompt + s.generated  # the KV cache is stale: rebuild it
        self.resume(policy)

    def pause(self, policy: str) -> None:
        """Stop decoding `policy`'s sequences after the step in progress."""
        self.paused.add(policy)
        self._touch(self.gpus)

    def resume(self, policy: str) -> None:
        self.paused.discard(policy)
        self._touch(self.gpus)

    def availability(self, policy: str) -> int:
        """Sequences that could join a batch now (0 while the policy's weights load)."""
        if policy in self.paused:
            return 0
        return sum(max(0, self.costs.max_batch - g.load) for g in self.gpus)

    def _touch(self, gpus) -> None:
        for gpu in gpus:
            gpu.dirty = True
        self._wake.set()


class SimEngine:
    """A RolloutEngine for one policy on a shared GpuPool, on the virtual clock.

    Args:
        name: the policy's name.
        pool: the GPUs it decodes on.
        lengths: how long its generations are.
        seed: seed of its length draws.
    """

    def __init__(self, name: str, pool: GpuPool, lengths: Lengths, seed: int = 0):
        self.name, self.pool, self.lengths = name, pool, lengths
        self._rng = random.Random(f"{name}:{seed}")
        pool.versions.setdefault(name, 0)

    @property
    def version(self) -> int:
        return self.pool.versions[self.name]

    @property
    def weights_checksum(self) -> None:
        return None

    def submit(self, request: GenerationRequest) -> Future:
        raise RuntimeError("a SimEngine runs on the simulator's virtual clock; "
                           "call `await engine.generate(request)` from inside the simulation")

    async def generate(self, request: GenerationRequest) -> Generation:
        scale = self.pool.token_scale
        cap = min(self.lengths.cap, request.sampling.max_new_tokens * scale)
        real = min(cap, self.lengths.draw(self._rng))
        n = -(-real // scale)
        versions = await self.pool.decode(self.name, len(request.prompt_ids), n)
        finish = "length" if real >= cap else "stop"
        return Generation(request.prompt_ids, (_COMPLETION_ID,) * n, (-1.0,) * n,
                          tuple(versions), finish)

    async def apply_weights(self, version: int) -> None:
        """Load weights `version`; returns once the engine samples from them."""
        await self.pool.update(self.name, version)

    def update_weights(self, update: WeightUpdate) -> Future:
        """The protocol's form, for a caller on the simulation's loop: the Future resolves once
        the weights are in use (a Future cannot be awaited under trio: use apply_weights)."""
        if self.pool._tg is None:
            raise RuntimeError("update_weights needs a running GpuPool; "
                               "await engine.apply_weights(version) inside the simulation")
        future: Future = Future()
        self.pool.pause(self.name)  # from now on: no new steps, availability 0

        async def apply() -> None:
            await self.apply_weights(update.version)
            settle(future, result={"kind": "simulated",
                                   "apply_seconds": self.pool.costs.update_seconds})

        self.pool._tg.start_soon(apply)
        return future

    def pause(self) -> None:
        self.pool.pause(self.name)

    def resume(self) -> None:
        self.pool.resume(self.name)

    def availability(self) -> int:
        return self.pool.availability(self.name)

    def close(self) -> None:
        pass
