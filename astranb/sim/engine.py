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

The pool is elastic, for the autoscaler (autoscale.py): `add_gpu` brings one more GPU in (it
gets new requests at once: it has the least load), `drain` stops giving a GPU new requests,
hands the sequences queued on it (not started) to the other GPUs and lets it finish every
sequence it is decoding before it leaves. Nothing is cancelled, so no episode is lost. Each GPU
is billed from when it was asked for (`since`, the start-up delay included) until it leaves:
`gpu_seconds`.

With `shared_queue=True` a request that finds no free batch slot waits in one queue of the pool
instead of on one GPU, and whichever GPU frees a slot first takes the oldest waiting request:
the episodes of a group then start together, however unevenly the GPUs' batches drain. This is
how rollout services that pull their work behave (AstraFlow's services, astranb's RolloutPool
sending work only to members with room); the region simulator uses it (regions.py).
"""

from __future__ import annotations

import math
import random
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import anyio
import anyio.abc

from ..engines.base import RolloutEngine, settle
from ..types import Generation, GenerationRequest, WeightUpdate
from .costs import Lengths, LengthSchedule, RolloutCosts

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
    gpu: _Gpu | None = None
    """The GPU holding it (a draining GPU hands its queued sequences to others)."""


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

    def __init__(self, pool: GpuPool, since: float = 0.0):
        self.pool = pool
        self.active: list[_Sequence] = []
        self.queue: deque[_Sequence] = deque()
        self.chunk: _Chunk | None = None
        self.dirty = False
        """Something changed (an arrival, a pause): cut the chunk and re-plan."""
        self.busy_seconds = 0.0
        self.decoded = 0
        """Real tokens decoded so far (what throughput is measured from)."""
        self.sequence_seconds = 0.0
        """Seconds spent decoding and prefilling, summed over the sequences in the batch."""
        self.since = since
        """Virtual time from which the GPU is billed (asked for, start-up included)."""
        self.left: float | None = None
        """When a drained GPU left the pool (None while it is in it)."""
        self.draining = False
        """Takes no new requests; leaves once it holds none."""
        self.drain_load = 0
        """Sequences it held (running or queued) when it began draining."""

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
        while pool.backlog and len(self.active) < pool.costs.max_batch and not self.draining:
            seq = pool.backlog.popleft()
            seq.gpu = self
            self.active.append(seq)
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
        self.decoded += chunk.steps * len(chunk.running) * self.pool.token_scale
        self.sequence_seconds += (chunk.prefill + chunk.steps * chunk.dt) * len(chunk.running)
        finished = []
        for s in chunk.running:
            s.prefill = 0
            s.remaining -= chunk.steps
            s.generated += chunk.steps
            s.versions.extend([chunk.versions[s.policy]] * chunk.steps)
            if s.remaining == 0:
                finished.append(s)
        if finished:
            active = set(self.active)  # (a cancelled request is gone already)
            done = {id(s) for s in finished if s in active}
            self.active = [s for s in self.active if id(s) not in done]
            for s in finished:
                if id(s) in done:
                    s.done.set()


class GpuPool:
    """The rollout GPUs every SimEngine of a run decodes on.

    One task steps every GPU (in index order), so GPUs whose steps end at the same virtual
    instant are handled in a fixed order and a seed gives the same run.

    Args:
        costs: GPU count, batch size and step costs.
        token_scale: real tokens per simulated token.
        shared_queue: requests that find every batch full wait in one queue of the pool (a
            freed slot on any GPU takes the oldest) rather than on the least loaded GPU.
    """

    def __init__(self, costs: RolloutCosts, token_scale: int = 1, shared_queue: bool = False):
        self.costs = costs
        self.token_scale = token_scale
        self.shared_queue = shared_queue
        self.backlog: deque[_Sequence] = deque()
        """Requests waiting for any free slot (shared_queue=True)."""
        self.gpus = [_Gpu(self) for _ in range(costs.gpus)]
        self.retired: list[_Gpu] = []
        """Drained GPUs that have left (kept for their busy time and bill)."""
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
                self._retire_drained(now)
                self._ticked.set()
                self._ticked = anyio.Event()
                ends = [g.chunk.end for g in self.gpus if g.chunk is not None]
                with anyio.move_on_after(min(ends) - now if ends else math.inf):
                    await self._wake.wait()

    @property
    def busy_seconds(self) -> float:
        """GPU-seconds spent decoding and prefilling so far."""
        return sum(g.busy_seconds for g in self.gpus + self.retired)

    @property
    def decoded_tokens(self) -> int:
        """Real tokens decoded so far, by every GPU that was ever in the pool."""
        return sum(g.decoded for g in self.gpus + self.retired)

    def batch_rate(self) -> float | None:
        """Measured tokens per second one GPU decodes with a full batch: `max_batch` over the
        seconds each sequence has taken per token so far (None before any). Exact when batches
        were full; higher when they were not (a lightly loaded GPU turns tokens out faster per
        sequence), so a router that trusts it sends work to a pool until its batches fill."""
        seconds = sum(g.sequence_seconds for g in self.gpus + self.retired)
        return self.costs.max_batch * self.decoded_tokens / seconds if seconds > 0 else None

    def gpu_seconds(self, now: float) -> float:
        """GPU-seconds billed up to `now`: from each GPU's `since` until it left (or now)."""
        return sum((now if g.left is None else g.left) - g.since
                   for g in self.gpus + self.retired)

    @property
    def serving(self) -> list[_Gpu]:
        """GPUs that take new requests (not draining)."""
        return [g for g in self.gpus if not g.draining]

    @property
    def queued(self) -> int:
        """Sequences waiting for a batch slot (on every GPU, and in the shared queue)."""
        return sum(len(g.queue) for g in self.gpus) + len(self.backlog)

    @property
    def load(self) -> int:
        """Sequences held, running or queued."""
        return sum(g.load for g in self.gpus) + len(self.backlog)

    def add_gpu(self, since: float | None = None) -> None:
        """One more GPU, serving from now on (billed from `since`: when it was asked for)."""
        self.gpus.append(_Gpu(self, anyio.current_time() if since is None else since))
        self._touch(self.gpus[-1:])

    def drain(self) -> bool:
        """Stop giving the least loaded serving GPU new requests and move its queued sequences to
        the others; it leaves once the sequences it is decoding have finished. False when only
        one GPU serves (a pool keeps one)."""
        serving = self.serving
        if len(serving) <= 1:
            return False
        gpu = min(serving, key=lambda g: g.load)
        gpu.draining = True
        # the batch it will run to the end: what is decoding, and what joins at the next step
        while gpu.queue and len(gpu.active) < self.costs.max_batch:
            gpu.active.append(gpu.queue.popleft())
        gpu.drain_load = len(gpu.active)
        moved = list(gpu.queue)
        gpu.queue.clear()
        if self.shared_queue:  # first in line: they have waited longest
            for seq in reversed(moved):
                self.backlog.appendleft(seq)
                seq.gpu = None
        for seq in moved if not self.shared_queue else ():
            target = min(self.serving, key=lambda g: g.load)
            target.queue.append(seq)
            seq.gpu = target
        self._touch(self.gpus)
        return True

    @property
    def drained_sequences(self) -> int:
        """Sequences in flight on GPUs when they began draining, all finished before those GPUs
        left (a draining GPU never drops one)."""
        return sum(g.drain_load for g in self.retired)

    def _retire_drained(self, now: float) -> None:
        for gpu in [g for g in self.gpus if g.draining and g.load == 0 and g.chunk is None]:
            gpu.left = now
            self.gpus.remove(gpu)
            self.retired.append(gpu)

    async def decode(self, policy: str, prompt: int, tokens: int) -> list[int]:
        """Generate `tokens` simulated tokens after a `prompt`; returns each token's version."""
        seq = _Sequence(policy, prompt, remaining=tokens, prefill=prompt)
        gpu: _Gpu | None = min(self.serving, key=lambda g: g.load)
        if self.shared_queue and gpu is not None and gpu.load >= self.costs.max_batch:
            gpu = None  # every batch is full: wait in the pool's queue
            self.backlog.append(seq)
        else:
            assert gpu is not None
            gpu.queue.append(seq)
            self._touch([gpu])
        seq.gpu = gpu
        try:
            await seq.done.wait()
        finally:  # cancelled: drop the request
            holder = seq.gpu  # (moved by a drain, or taken from the shared queue)
            if holder is None:
                if seq in self.backlog:
                    self.backlog.remove(seq)
            elif seq in holder.queue:
                holder.queue.remove(seq)
            elif seq in holder.active:
                holder.active.remove(seq)
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
        return sum(max(0, self.costs.max_batch - g.load) for g in self.serving)

    def _touch(self, gpus) -> None:
        for gpu in gpus:
            gpu.dirty = True
        self._wake.set()


class SimEngine(RolloutEngine):
    """A RolloutEngine for one policy on a shared GpuPool, on the virtual clock.

    Args:
        name: the policy's name.
        pool: the GPUs it decodes on.
        lengths: how long its generations are; a `LengthSchedule` draws from the lengths of the
            version the engine holds when a request arrives (answers that change in training).
        seed: seed of its length draws.
    """

    def __init__(self, name: str, pool: GpuPool, lengths: Lengths | LengthSchedule, seed: int = 0):
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
        lengths = self.lengths
        if isinstance(lengths, LengthSchedule):
            lengths = lengths.at(self.version)
        cap = min(lengths.cap, request.sampling.max_new_tokens * scale)
        real = min(cap, lengths.draw(self._rng))
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

    def published_weights(self) -> None:
        """None: a simulated engine's weights are nothing."""
        return None

    def close(self) -> None:
        pass
