"""HFEngine: a continuous-batching rollout engine over any Hugging Face causal LM, in one thread.

The engine owns one worker thread that runs the decode loop; callers (notebook cells, asyncio
tasks, scripts) only enqueue work and wait on futures, so heavy torch work never runs on their
thread or event loop. Between two decode steps the worker:

1. applies queued weight updates (in place), bumps the version and re-prefills every in-flight
   request under the new weights, so each later token is a function of the new weights only; for
   the same reason it drops every kept prefix (below): all of them were computed under the old
   weights;
2. drops requests whose future was cancelled (an asyncio task awaiting `generate` was cancelled);
3. admits queued requests into free slots (FIFO), prefilling them together;
4. runs one decode step for the whole batch, samples, and finishes requests that stopped.

    engine = HFEngine(models.tiny(), max_batch_size=8)
    gen = await engine.generate(GenerationRequest(prompt_ids=(1, 5, 6)))  # or engine.submit(...)
    gen.completion_ids, gen.logprobs, gen.versions
    engine.update_weights(WeightUpdate("policy", version=1, state=trainer_state)).result()
    engine.close()

Prefix reuse across turns: when a request finishes, its keys/values (prompt + completion) are
kept, up to `prefix_cache_bytes` with LRU eviction; a later request whose prompt starts with a kept
sequence (the next turn of a multi-turn episode: token-in/token-out makes it extend the last
prompt and completion exactly) copies those keys/values and prefills only the new tokens. Which
kept entries a weight update drops, and why: every entry (and only at an update that was
applied), since each was computed under the weights before it, and reusing one would make the
next turn's tokens depend on the old weights while carrying the new version, which is exactly
what the re-prefill of in-flight rows rules out. An update that fails changes no weight and
drops nothing; pause/resume drop nothing.

The running batch lives in `_batch`, its KV cache in `_kvbatch`, kept prefixes in `_prefix`,
sampling in `_sampling`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .. import weights
from ..models import ModelSpec
from ..types import Generation, GenerationRequest, WeightUpdate
from ._batch import DecodeBatch, Row
from ._kvbatch import SlotKV
from ._outbox import LoopFuture, Outbox
from ._prefix import PrefixCache
from ._text import Bounded, TextCache
from .base import MirroredWeights, RolloutEngine, settle

__all__ = ["HFEngine", "EngineStats"]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters."""

    version: int
    """Weight version the next token will be sampled with."""
    steps: int
    """Decode steps run so far."""
    tokens_generated: int
    """Tokens sampled so far (all requests)."""
    prefill_tokens: int
    """Tokens run through prefill so far (joins and re-prefills after updates; requests that join
    together with the same tokens count once; tokens whose keys/values came from a kept prefix
    are left out, see `prefix_reused_tokens`)."""
    active: int
    """Requests in the running batch."""
    queued: int
    """Requests waiting for a slot."""
    paused: bool
    """Whether pause() is in effect."""
    busy_seconds: float = 0.0
    """Wall-clock seconds the worker spent working (applying updates, prefilling, decoding)."""
    prefix_hits: int = 0
    """Joining requests admitted from a kept prefix (prefix reuse; identical prompts joining
    together count once)."""
    prefix_misses: int = 0
    """Joining requests that found no kept prefix of at least one block (16 tokens)."""
    prefix_reused_tokens: int = 0
    """Prompt tokens whose keys/values came from kept prefixes instead of prefill (they are not
    in `prefill_tokens`)."""
    prefix_evictions: int = 0
    """Kept sequences evicted (least recently used first) to stay within the byte budget."""
    prefix_invalidated: int = 0
    """Kept sequences dropped because a weight update was applied."""
    prefix_bytes: int = 0
    """Bytes of keys/values kept now."""


class HFEngine(MirroredWeights, RolloutEngine):
    """Continuous-batching rollout engine with in-flight weight updates.

    Args:
        spec: model recipe; the engine builds its own copy.
        device: torch device for the model and KV cache.
        dtype: model dtype.
        max_batch_size: most requests decoded together; the rest queue FIFO.
        seed: seed of the engine's sampling generator.
        version: weight version of the initial weights.
        name: policy name; weight updates for another policy are rejected.
        fast_forward: run Llama-family models (llama, mistral, qwen2, qwen3) through the engine's
            own lean forward (engines/_fastlm.py: the same arithmetic, logits equal to the
            model's to the bit in tests, far less Python per call). False always calls the model.
        prefix_cache_bytes: most bytes of finished requests' keys/values kept for prompts that
            extend them (prefix reuse across turns); 0 turns reuse off. None: room for
            4 x max_batch_size sequences of the model's context (at most 2,048 tokens), capped
            at 1 GiB on a CPU and a quarter of the free memory on an accelerator.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        seed: int = 0,
        version: int = 0,
        name: str = "policy",
        fast_forward: bool = True,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.spec, self.name, self.seed = spec, name, seed
        self.device, self.dtype = torch.device(device), dtype
        self.max_batch_size = max_batch_size
        self.fast_forward = fast_forward
        if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        self.prefix_cache_bytes = prefix_cache_bytes
        """Byte budget of kept prefixes (None until the worker picks the default)."""
        self._prefix: PrefixCache | None = None  # built by the worker thread
        self._invalidated = 0
        self.tokenizer = spec.tokenizer()
        self._decode = TextCache(self.tokenizer)  # worker thread only
        self._valid_prompts: Bounded[tuple[int, ...], bool] = Bounded()  # checked already
        self._model = _build_model(spec, dtype, self.device)
        self.max_context: int | None = getattr(self._model.config, "max_position_embeddings", None)
        """The model's context in tokens (episodes are truncated before they pass it)."""
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        # Detached aliases of every parameter/buffer: copy_ into them updates the model in place.
        self._targets = self._model.state_dict()
        self._alias_groups = _alias_groups(self._targets)
        self._version = version
        self._mirror = weights.Mirror()  # the weights exactly as published (bf16)
        self._weights_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[Row] = deque()
        self._joining: list[Row] = []  # left the queue, being prefilled
        self._batch: DecodeBatch | None = None  # built by the worker thread
        self._updates: deque[tuple[WeightUpdate, Future]] = deque()
        self._updating = self._paused = self._held = self._prune = False
        self._closing = self._closed = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._steps = self._tokens = 0
        self._busy = 0.0
        self._outbox = Outbox()  # worker thread only
        self._sleeping = False  # the worker waits on _cv for work (read and set under _cv)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> HFEngine:
        """Start the worker thread (idempotent). Returns self."""
        with self._cv:
            self._check_open()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"astranb-hf-{self.name}", daemon=True
                )
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop after the current step and join the worker (idempotent).

        Requests and updates still pending fail with RuntimeError.
        """
        with self._cv:
            if self._closed:
                return
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            self._closed = True

    def __enter__(self) -> HFEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> HFEngine:
        return self.start()

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.close)

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request (thread-safe). Returns a Future resolving to its Generation."""
        future: Future = Future()
        future.add_done_callback(self._on_done)
        self._enqueue(request, future)
        return future

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generate one completion; cancelling the awaiting task drops the request.

        Awaited on an event loop, the request is answered through that loop directly: the worker
        hands every request finished in one decode step to the loop in a single callback
        (`Outbox`), instead of a thread-safe Future and a loop wake-up per request.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(self._on_done)
        self._enqueue(request, LoopFuture(future, self._outbox))
        return await future

    def _enqueue(self, request: GenerationRequest, future: Any) -> None:
        self._check_request(request)
        with self._cv:
            self._check_open()
            self._queue.append(Row(request, future, list(request.prompt_ids)))
            if self._sleeping:  # a busy worker finds the request between two steps anyway
                self._cv.notify_all()
        if self._thread is None:
            self.start()

    def generate_many(self, requests: Iterable[GenerationRequest]) -> list[Generation]:
        """Submit every request, wait for all (blocking convenience for scripts and benchmarks)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    # -- weights ----------------------------------------------------------------------------------

    def update_weights(self, update: WeightUpdate) -> Future:
        """Queue a weight update, applied between decode steps. Returns a Future[None].

        In-flight requests continue under the new weights (their caches are rebuilt), so every
        token sampled after the update carries `update.version`.
        """
        future: Future = Future()
        with self._cv:
            self._check_open()
            self._updates.append((update, future))
            self._cv.notify_all()
        self.start()
        return future

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the engine's current weights."""
        with self._weights_lock:
            return {k: v.detach().clone() for k, v in self._model.state_dict().items()}

    @property
    def version(self) -> int:
        """Weight version the next sampled token will carry."""
        return self._version

    # -- flow control -----------------------------------------------------------------------------

    def pause(self, wait: bool = True) -> None:
        """Hold decoding after the current step; queued requests wait, updates still apply.

        Args:
            wait: block until the worker has finished its current step.
        """
        with self._cv:
            self._paused, self._held = True, False
            self._cv.notify_all()
            thread = self._thread  # set once by start(), never unset
            if wait and thread is not None and thread is not threading.current_thread():
                self._cv.wait_for(lambda: self._held or not thread.is_alive())

    def resume(self) -> None:
        """Undo pause()."""
        with self._cv:
            self._paused = self._held = False
            self._cv.notify_all()

    def availability(self) -> int:
        """Free slots: requests that would start decoding now (0 while paused or updating)."""
        with self._cv:
            if self._paused or self._updates or self._updating or self._closing or self._dead:
                return 0
            waiting = (*self._live(), *self._joining, *self._queue)
            busy = sum(not row.future.cancelled() for row in waiting)
            return max(0, self.max_batch_size - busy)

    def stats(self) -> EngineStats:
        """Counters, e.g. to wait until some tokens have been generated."""
        with self._cv:
            prefix = self._prefix
            return EngineStats(
                version=self._version,
                steps=self._steps,
                tokens_generated=self._tokens,
                prefill_tokens=self._batch.prefill_tokens if self._batch else 0,
                active=len(self._live()),
                queued=len(self._queue) + len(self._joining),
                paused=self._paused,
                busy_seconds=self._busy,
                **(_prefix_stats(prefix) if prefix is not None else {}),
                prefix_invalidated=self._invalidated,
            )

    # -- caller-side checks -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._dead is not None:
            message = f"HFEngine {self.name!r} worker died: {self._dead!r}"
            raise RuntimeError(message) from self._dead
        if self._closing or self._closed:
            raise RuntimeError(f"HFEngine {self.name!r} is closed")

    def _check_request(self, request: GenerationRequest) -> None:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        ids = request.prompt_ids
        if type(ids) is tuple and ids in self._valid_prompts:  # environments repeat prompts
            return
        if not ids:
            raise ValueError("prompt_ids must not be empty")
        if not all(isinstance(t, int) and 0 <= t < self._vocab_size for t in ids):
            raise ValueError(f"prompt_ids must be ints in [0, {self._vocab_size}), got {ids!r}")
        if type(ids) is tuple and all(type(t) is int for t in ids):
            self._valid_prompts.keep(ids, True)

    def _live(self) -> tuple[Row, ...]:
        return self._batch.rows if self._batch is not None else ()

    def _on_done(self, future: Future | asyncio.Future) -> None:
        # Runs on whichever thread cancelled the future (or on its event loop): wake the worker
        # so it frees the slot.
        if future.cancelled():
            with self._cv:
                self._prune = True
                self._cv.notify_all()

    # -- worker thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                batch = DecodeBatch(self._model, self.max_batch_size, self.device, self.seed,
                                    fast=self.fast_forward)
                if self.prefix_cache_bytes is None:
                    self.prefix_cache_bytes = _default_prefix_bytes(batch.kv, self.max_context,
                                                                    self.device)
                if self.prefix_cache_bytes:
                    batch.prefix = self._prefix = PrefixCache(self.prefix_cache_bytes)
                self._batch = batch
                while self._wait_for_work():
                    start = time.perf_counter()
                    self._tick()
                    self._outbox.flush()
                    self._busy += time.perf_counter() - start
        except BaseException as exc:  # the loop died: nobody may be left waiting
            self._shutdown(exc, died=True)
            return
        closed = RuntimeError(f"HFEngine {self.name!r} closed before the work finished")
        self._shutdown(closed, died=False)

    def _worker_batch(self) -> DecodeBatch:
        """The running batch (worker thread: `_run` builds it before doing any work)."""
        batch = self._batch
        assert batch is not None
        return batch

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False once close() was called."""
        batch = self._worker_batch()
        with self._cv:
            while True:
                if self._closing:
                    return False
                self._held = self._paused
                self._cv.notify_all()  # pause() may be waiting for _held
                runnable = not self._paused and (batch.rows or self._queue)
                if self._updates or self._prune or runnable:
                    return True
                self._sleeping = True
                try:
                    self._cv.wait()
                finally:
                    self._sleeping = False

    def _tick(self) -> None:
        """Everything the worker does between two decode steps, then one step."""
        batch = self._worker_batch()
        with self._cv:
            updates = list(self._updates)
            self._updates.clear()
            self._updating = bool(updates)
            paused, prune, self._prune = self._paused, self._prune, False
        for update, future in updates:
            self._apply_update(update, future)
        with self._cv:
            self._updating = False
        if prune:
            self._drop_cancelled()
        if paused:
            return
        self._admit()
        if batch.rows:
            try:
                finished = batch.step(self._version)
            except Exception as exc:
                self._fail_rows(batch.clear(), exc)
                return
            self._steps += 1
            self._tokens += len(batch.rows) + len(finished)
            for row, reason in finished:
                settle(row.future, result=self._generation(row, reason))

    def _admit(self) -> None:
        """Move queued requests into free slots (FIFO) and prefill them together."""
        batch = self._worker_batch()
        with self._cv:
            while self._queue and len(self._joining) < batch.free:
                row = self._queue.popleft()
                if not row.future.cancelled():
                    self._joining.append(row)
            joiners = self._joining
        if not joiners:
            return
        try:
            finished = batch.admit(joiners, version=self._version)
        except Exception as exc:
            self._fail_rows(joiners, exc)
            finished = []
        finally:
            with self._cv:
                self._joining = []
        self._tokens += sum(1 for row in joiners if row.logprobs)  # first tokens sampled here
        for row, reason in finished:
            settle(row.future, result=self._generation(row, reason))

    def _generation(self, row: Row, finish_reason: str) -> Generation:
        completion = tuple(row.completion)
        return Generation(
            prompt_ids=tuple(row.request.prompt_ids),
            completion_ids=completion,
            logprobs=tuple(row.logprobs),
            versions=tuple(row.versions),
            finish_reason=finish_reason,
            text=self._decode(completion),
        )

    def _drop_cancelled(self) -> None:
        with self._cv:
            self._queue = deque(r for r in self._queue if not r.future.cancelled())
        batch = self._worker_batch()
        batch.remove(row for row in batch.rows if row.future.cancelled())

    @staticmethod
    def _fail_rows(rows, exc: BaseException) -> None:
        """A batched forward failed: every row in it shares the failure; the engine goes on."""
        for row in rows:
            settle(row.future, exc=exc)

    # -- weight updates (worker side) -------------------------------------------------------------

    def _apply_update(self, update: WeightUpdate, future: Future) -> None:
        start = time.perf_counter()
        try:
            if update.payload is not None:
                kind = self._apply_payload(update)
            else:
                self._check_update(update)
                with self._weights_lock, torch.no_grad():
                    for name, tensor in update.state.items():
                        self._targets[name].copy_(tensor)
                self._mirror.clear()  # the mirror no longer matches
                kind = "state"
        except Exception as exc:
            settle(future, exc=exc)
            return
        self._version = update.version
        if self._prefix is not None:  # computed under the old weights (module docstring)
            self._invalidated += self._prefix.clear()
        seconds = time.perf_counter() - start
        # Rebuild every in-flight cache, so no later token depends on the old weights.
        batch = self._worker_batch()
        rows = batch.rows
        try:
            batch.rebuild()
        except Exception as exc:
            self._fail_rows(rows, exc)
        settle(future, result={"kind": kind, "apply_seconds": seconds})

    def _apply_payload(self, update: WeightUpdate) -> str:
        """Apply a full snapshot or delta to the published-dtype mirror, then to the model.

        The mirror (`weights.Mirror`) holds the weights exactly as published (bf16) and checks
        each payload against the sender's checksum; its tensors are then copied into the model
        (a cast when the model runs in another dtype). A full snapshot's names and shapes are
        checked against the model before the mirror takes it, so a bad one changes nothing.
        """
        payload = update.payload
        assert payload is not None  # _apply_update comes here only for a payload
        try:
            header = weights.peek(payload, verify=False)  # Mirror.apply checks the hash, once
        except weights.WeightTransferError:
            header = weights.peek(payload)  # a damaged header: the hash says what happened
        if header.kind == "full":
            shapes = {e["name"]: torch.empty(e["shape"], device="meta") for e in header.tensors}
            self._check_update(WeightUpdate(self.name, update.version, shapes))
        self._mirror.apply(payload, policy=self.name, version=update.version,
                           prepared=update.prepared)
        tensors = self._mirror.tensors
        assert tensors is not None  # apply() just set them
        with self._weights_lock, torch.no_grad():
            for name, tensor in tensors.items():
                self._targets[name].copy_(tensor)
        return header.kind

    def published_checksum(self) -> int:
        """Recompute the checksum from the model itself, cast to the published dtype (slow)."""
        if self._mirror.tensors is None:
            raise LookupError("no published weights were applied to this engine")
        dtypes = {name: t.dtype for name, t in self._mirror.tensors.items()}
        with self._weights_lock:
            current = {name: self._targets[name].detach().to("cpu", dtypes[name])
                       for name in dtypes}
        return weights.checksum(current)

    def _check_update(self, update: WeightUpdate) -> None:
        """Validate names and shapes before touching the model, so a bad update changes nothing."""
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"expected a WeightUpdate, got {type(update).__name__}")
        if update.policy != self.name:
            raise ValueError(
                f"update is for policy {update.policy!r}, this engine serves {self.name!r}"
            )
        unknown = sorted(set(update.state) - set(self._targets))
        if unknown:
            raise ValueError(f"weight update has names the model does not: {unknown[:5]}")
        missing = [g[0] for g in self._alias_groups if not any(n in update.state for n in g)]
        if missing:
            raise ValueError(f"weight update is missing model weights: {missing[:5]}")
        for name, tensor in update.state.items():
            if not isinstance(tensor, torch.Tensor):
                kind = type(tensor).__name__
                raise ValueError(f"weight update entry {name!r} is not a tensor: {kind}")
            expected, got = tuple(self._targets[name].shape), tuple(tensor.shape)
            if got != expected:
                raise ValueError(
                    f"weight update shape mismatch for {name!r}: expected {expected}, got {got}"
                )

    # -- shutdown ---------------------------------------------------------------------------------

    def _shutdown(self, exc: BaseException, *, died: bool) -> None:
        """Fail everything still pending (the worker is exiting)."""
        with self._cv:
            if died:
                self._dead = exc
            pending = [r.future for r in (*self._live(), *self._joining, *self._queue)]
            pending += [f for _, f in self._updates]
            if self._batch is not None:
                self._batch.rows = ()
            self._joining, self._queue = [], deque()
            self._updates.clear()
            self._held = True
            self._cv.notify_all()
        for future in pending:
            settle(future, exc=exc)
        self._outbox.flush()


def _build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device):
    model = spec.build(dtype=dtype, device=device)
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        model.set_attn_implementation("flash_attention_2")  # untested here (no CUDA in CI)
    return model.requires_grad_(False)


def _prefix_stats(prefix: PrefixCache) -> dict[str, int]:
    return dict(prefix_hits=prefix.hits, prefix_misses=prefix.misses,
                prefix_reused_tokens=prefix.reused_tokens, prefix_evictions=prefix.evictions,
                prefix_bytes=prefix.bytes)


def _default_prefix_bytes(kv: SlotKV, max_context: int | None, device: torch.device) -> int:
    """Room for 4 x max_rows sequences of the context (at most 2,048 tokens), capped at 1 GiB on
    a CPU and a quarter of the free memory on CUDA."""
    per_token = sum(2 * heads * dim * torch.empty((), dtype=dtype).element_size()
                    for heads, dim, dtype in kv.shapes)
    wanted = 4 * kv.max_rows * min(max_context or 2048, 2048) * per_token
    cap = 1 << 30
    if device.type == "cuda":
        cap = torch.cuda.mem_get_info(device)[0] // 4
    return min(wanted, cap)


def _alias_groups(targets: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the storage they share (tied weights count once)."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in targets.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    return list(groups.values())
