"""SGLangEngine: a rollout engine that is a client of an SGLang server's native HTTP API.

API followed: SGLang 0.5.x, as read in the sgl-project/sglang sources from v0.5.3 on
(`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`, `tokenizer_manager.py`,
`srt/metrics/collector.py`). Facts relied on:

- `POST /generate` {input_ids, rid, return_logprob, sampling_params: {temperature, top_p,
  max_new_tokens, stop_token_ids, skip_special_tokens}} answers {output_ids, meta_info: {id,
  finish_reason: {type: "stop"|"length"|"abort", ...}, weight_version, output_token_logprobs:
  [[logprob, token_id, text], ...]}}. An aborted request answers what it generated so far with type
  "abort" (older servers answer an HTTP error and lose those tokens: that stretch is redone).
- `POST /pause_generation` {mode: "abort"} aborts running requests and holds new ones until
  `POST /continue_generation`; `POST /abort_request` {rid}; `POST /flush_cache`.
- `POST /update_weights_from_disk` {model_path, weight_version} answers {success, message} (HTTP 400
  on failure); later answers carry that `weight_version` in their meta_info.
- `GET /get_server_info` (server arguments, dp_size among them), `GET /health`, and with
  `--enable-metrics` `GET /metrics`: gauge `sglang:num_queue_reqs`, one series per scheduler.

An in-flight weight update: the payload is applied to a bf16 mirror (a delta in place, a full
snapshot decoded) and written as `model.safetensors` into a copy of the model directory (config and
tokenizer files copied once, only the weights file rewritten) while generation goes on. Then new
requests are held here, `/pause_generation` aborts the running ones, the server loads the file, the
version is bumped and generation continues. Every aborted request is resubmitted as prompt + tokens
so far with the remaining max_new_tokens: its earlier tokens keep their version, later ones carry
the new one. A stretch's version is the server's `meta_info.weight_version` when it is one this
engine set (right even for a request that reached the server while it was paused), else the
version when the stretch was sent.

Cost: each update is a disk round trip of the whole model, a pause (SGLang polls for the aborted
requests once a second) and a re-prefill of every in-flight request. `/update_weights_from_tensor`
(CUDA IPC) and `/update_weights_from_distributed` (NCCL from the trainer's GPUs) are the faster GPU
paths, left for later. The weights directory must be visible to the server (same host or a shared
file system).

Unlike HFEngine, SGLang reports log_softmax(logits / temperature) before top-p filtering (exact
only with top_p=1), and it also stops at the model's own EOS tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx

from .. import weights
from ..models import ModelSpec, resolve
from ..types import Generation, GenerationRequest, WeightUpdate
from ._sglang_server import (
    WEIGHTS_FILE,
    _copy_without_weights,
    _free_port,
    _launch,
    _log_tail,
    _model_dir,
    _read_checksum,
    _require_sglang,
    _save_weights,
    _stop_process,
    _wait_healthy,
)
from ._sglang_wire import (
    SGLangError,
    _answer,
    _body,
    _check_request,
    _finish,
    _gauge_sum,
    _parse_stretch,
    _stretch_version,
)
from .base import MirroredWeights, RolloutEngine, settle

__all__ = ["SGLangEngine", "SGLangError"]

_GENERATE_TIMEOUT = httpx.Timeout(None, connect=10.0)
_CONTROL_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
_UPDATE_TIMEOUT = httpx.Timeout(1800.0, connect=10.0)
SGLangError.__module__ = __name__  # defined with the wire format; its public home is here


class SGLangEngine(MirroredWeights, RolloutEngine):
    """Rollout engine backed by an SGLang server, launched here or attached to by URL.

    Args:
        spec_or_path: model spec or local Hugging Face directory: the tokenizer, and the base of
            the weights directory (a tiny spec is saved into `workdir` first).
        url: attach to the server at this URL instead of launching one.
        launch: start `python -m sglang.launch_server` (default: when no url is given).
        name: policy name; updates for another policy are refused.
        version: weight version of the server's current weights.
        server_args: extra `sglang.launch_server` arguments.
        token: bearer token (a launched server gets it as --api-key).
        transport: httpx async transport (tests: httpx.MockTransport, httpx.ASGITransport).
        workdir: weights directory and server log (default: a temporary directory).
        target_queue: requests to keep waiting per data-parallel rank (drives availability()).
        metrics_interval: seconds between two reads of /metrics.
        launch_timeout: seconds a launched server may take to answer /health.

    Raises:
        SGLangError: the server is unreachable, or a launched one exits or misses launch_timeout.

        engine = SGLangEngine(models.local("/models/qwen3"), server_args=("--tp-size", "2"))
        gen = engine.submit(GenerationRequest(prompt_ids=(1, 5, 6))).result()
        gen.completion_ids, gen.logprobs, gen.versions
        engine.update_weights(WeightUpdate("policy", 1, payload=payload)).result()
        engine.close()
    """

    def __init__(
        self,
        spec_or_path: ModelSpec | str | os.PathLike,
        *,
        url: str | None = None,
        launch: bool | None = None,
        name: str = "policy",
        version: int = 0,
        server_args: Sequence[str] = (),
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        workdir: str | os.PathLike | None = None,
        target_queue: int = 4,
        metrics_interval: float = 0.5,
        launch_timeout: float = 900.0,
    ) -> None:
        launch = url is None if launch is None else launch
        if launch == (url is not None):
            raise ValueError("pass either url= (attach to a running SGLang server) or launch=True")
        self.spec, self.name = resolve(spec_or_path), name
        self.tokenizer = self.spec.tokenizer()
        self.target_queue, self.metrics_interval = target_queue, metrics_interval
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"astranb-sglang-{name}-"))
        self._version, self._known_versions = version, {version}
        self._mirror = weights.Mirror()  # weights as last published (bf16), payload's names
        self._file_lock = threading.Lock()
        self._paused = self._closed = self._server_paused = False
        self._epoch = self._pending_updates = self._inflight = self._dp_size = 0
        self._waiting: float | None = 0.0  # server queue from /metrics; None: no answer
        self._has_metrics = True
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_server = lambda: None  # a launched server's finalizer (also runs at exit)
        self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"astranb-sglang-{name}", daemon=True
        )
        self._thread.start()
        port = _free_port() if launch else 0
        # launch is True exactly when url is None (checked above)
        self.url = f"http://127.0.0.1:{port}" if url is None else url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.url, transport=transport, limits=httpx.Limits(max_connections=None),
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        try:
            if launch:
                self._start_server(port, server_args, token, launch_timeout)
            self._run(self._connect())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Fail pending work, stop the loop and a launched server, drop a temporary workdir."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._shutdown(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            self._loop.close()
            self._stop_server()
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the RolloutEngine protocol ---------------------------------------------------------------

    @property
    def version(self) -> int:
        """Weight version the next stretch sent to the server will carry."""
        return self._version

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request (thread-safe). Returns a Future resolving to its Generation."""
        _check_request(request)
        self._check_open()
        future: Future = Future()
        self._loop.call_soon_threadsafe(self._start_request, request, future)
        return future

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generate one completion; cancelling the awaiting task aborts the request."""
        return await asyncio.wrap_future(self.submit(request))

    def update_weights(self, update: WeightUpdate) -> Future:
        """Queue new weights. The Future resolves to {"kind", "apply_seconds"} once the server
        uses them; in-flight requests resume under them (see the module docstring)."""
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"expected a WeightUpdate, got {type(update).__name__}")
        if update.policy != self.name:
            raise ValueError(f"update is for policy {update.policy!r}, "
                             f"this engine is {self.name!r}")
        self._check_open()
        future: Future = Future()
        self._loop.call_soon_threadsafe(self._start_update, update, future)
        return future

    def pause(self) -> None:
        """Hold new requests and abort running ones; they go on where they were after resume()."""
        self._check_open()
        self._run(self._set_paused(True))

    def resume(self) -> None:
        """Undo pause()."""
        self._check_open()
        self._run(self._set_paused(False))

    def availability(self) -> int:
        """Target queue minus the server's waiting queue (0 while paused or updating, or when
        /metrics does not answer; without --enable-metrics our in-flight requests count)."""
        if self._closed or self._paused or self._pending_updates or self._waiting is None:
            return 0
        waiting = self._waiting if self._has_metrics else self._inflight
        return max(0, self.target_queue * self._dp_size - int(waiting))

    def published_checksum(self) -> int:
        """Checksum of the weights file the server was last told to load, read back (slow)."""
        with self._file_lock:
            return _read_checksum(self.workdir / "weights" / WEIGHTS_FILE)

    def server_log(self, lines: int = 40) -> str:
        """The last lines a launched server wrote ("" when attached)."""
        return _log_tail(self.workdir / "server.log", lines)

    # -- the engine's loop ------------------------------------------------------------------------

    def _run(self, coro, timeout: float | None = None):
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SGLangEngine blocking calls cannot run on the engine's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"SGLangEngine {self.name!r} is closed")

    def _start_request(self, request: GenerationRequest, future: Future) -> None:
        task = self._spawn(self._settle_with(future, lambda: self._generate(request)))

        def on_done(done: Future) -> None:
            if done.cancelled():  # the caller gave up: drop the request on the server too
                self._loop.call_soon_threadsafe(task.cancel)

        future.add_done_callback(on_done)

    def _start_update(self, update: WeightUpdate, future: Future) -> None:
        self._pending_updates += 1
        self._spawn(self._settle_with(future, lambda: self._update(update)))

    async def _settle_with(self, future: Future, work) -> None:
        """Settle `future` with the outcome of `work()` (unless its caller cancelled it)."""
        try:
            settle(future, result=await work())
        except asyncio.CancelledError:
            message = f"SGLangEngine {self.name!r} closed before the work finished"
            settle(future, exc=RuntimeError(message))
            raise
        except Exception as error:
            settle(future, exc=error)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _call(
        self, method: str, path: str, body=None, timeout=_CONTROL_TIMEOUT, as_json=True
    ):
        """One HTTP call; errors name the server, the endpoint and the answer."""
        try:
            response = await self._client.request(method, path, json=body, timeout=timeout)
        except httpx.TransportError as error:
            raise SGLangError(f"cannot reach the SGLang server at {self.url} "
                              f"({type(error).__name__}: {error}); is it running? "
                              "pass launch=True to start one") from error
        return _answer(method, path, response, as_json)

    async def _connect(self) -> None:
        info = await self._call("GET", "/get_server_info")
        self._dp_size = max(1, int(info.get("dp_size") or 1))
        self._gate.set()
        self._spawn(self._watch_metrics())

    async def _watch_metrics(self) -> None:
        """Keep `_waiting` at the server's queue length, re-read every metrics_interval seconds."""
        while True:
            try:
                text = (await self._call("GET", "/metrics", as_json=False)).text
                self._waiting = _gauge_sum(text, "sglang:num_queue_reqs")
            except SGLangError as error:
                if error.status == 404:  # started without --enable-metrics
                    self._has_metrics = False
                    return
                self._waiting = None
            await asyncio.sleep(self.metrics_interval)

    # -- generation -------------------------------------------------------------------------------

    async def _generate(self, request: GenerationRequest) -> Generation:
        """Run a request as stretches: a pause or an update ends one, the next one resumes it."""
        base = uuid.uuid4().hex
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self._inflight += 1
        try:
            for attempt in itertools.count():
                await self._gate.wait()
                epoch, version, rid = self._epoch, self._version, f"{base}-{attempt}"
                body = _body(request, ids, rid)
                try:
                    answer = await self._call("POST", "/generate", body, _GENERATE_TIMEOUT)
                except SGLangError as error:
                    if error.status is None or epoch == self._epoch:
                        raise
                    continue  # our pause aborted it on a server that answers aborts with an error
                except asyncio.CancelledError:
                    if not self._closed:
                        self._spawn(self._abort(rid))
                    raise
                stretch = _parse_stretch(answer)
                ids += stretch.ids
                logprobs += stretch.logprobs
                stretch_version = _stretch_version(stretch, version, self._known_versions)
                versions += [stretch_version] * len(stretch.ids)
                finish = _finish(stretch, ids, request.sampling)
                if finish is not None:
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    return Generation(tuple(request.prompt_ids), tuple(ids), tuple(logprobs),
                                      tuple(versions), finish, text)
                if epoch == self._epoch:
                    reason = stretch.message or "no reason given"
                    raise SGLangError(f"SGLang aborted request {rid}: {reason}")
            raise AssertionError("unreachable: itertools.count() never ends")
        finally:
            self._inflight -= 1

    async def _abort(self, rid: str) -> None:
        try:
            await self._call("POST", "/abort_request", {"rid": rid}, as_json=False)
        except SGLangError:
            pass  # the server is gone or already forgot the request: nothing left to free

    async def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        await (self._preempt() if paused else self._release())

    async def _preempt(self) -> None:
        """Hold new stretches here and abort the server's running ones (they resume on release)."""
        self._epoch += 1
        self._gate.clear()
        self._server_paused = True
        await self._call("POST", "/pause_generation", {"mode": "abort"})

    async def _release(self) -> None:
        """Let stretches go again once nothing holds them (no pause(), no pending update)."""
        if self._paused or self._pending_updates or self._closed or not self._server_paused:
            return
        self._server_paused = False
        try:
            await self._call("POST", "/continue_generation", {}, as_json=False)
        finally:  # if that failed, requests meet the error instead of waiting here forever
            self._gate.set()

    # -- weight updates ---------------------------------------------------------------------------

    async def _update(self, update: WeightUpdate) -> dict:
        try:
            async with self._update_lock:
                start = time.perf_counter()
                kind = await asyncio.to_thread(self._write_weights, update)  # generation goes on
                try:
                    await self._preempt()
                    await self._load(update.version)
                except BaseException:
                    self._mirror.clear()  # the server may hold other weights
                    raise
                return {"kind": kind, "apply_seconds": time.perf_counter() - start}
        finally:
            self._pending_updates -= 1
            await self._release()

    async def _load(self, version: int) -> None:
        body = {"model_path": str(self.workdir / "weights"), "weight_version": str(version)}
        await self._call("POST", "/update_weights_from_disk", body, _UPDATE_TIMEOUT)
        try:  # the server flushes after loading; this covers servers that do not
            await self._call("POST", "/flush_cache", as_json=False)
        except SGLangError as error:
            if error.status is None:
                raise
        self._known_versions.add(version)
        self._version = version

    def _write_weights(self, update: WeightUpdate) -> str:
        """Apply the update to the mirror and rewrite the weights file (worker thread)."""
        if update.payload is None:
            self._mirror.clear()  # the mirror no longer matches
            tensors = {k: v.detach().to("cpu").clone() for k, v in update.state.items()}
            kind = "state"
        else:
            header = self._mirror.apply(update.payload, policy=self.name, version=update.version,
                                        prepared=update.prepared)
            assert self._mirror.tensors is not None  # apply() just set them
            kind, tensors = header.kind, self._mirror.tensors
        directory = self._weights_dir()
        with self._file_lock:
            _save_weights(tensors, directory)
        return kind

    def _weights_dir(self) -> Path:
        """The model directory's copy without its weights (made once)."""
        directory = self.workdir / "weights"
        if not directory.is_dir():
            _copy_without_weights(self._base_dir(), directory)
        return directory

    def _base_dir(self) -> Path:
        return _model_dir(self.spec, self.workdir / "base")

    # -- a launched server ------------------------------------------------------------------------

    def _start_server(self, port: int, server_args: Sequence[str], token: str | None,
                      timeout: float) -> None:
        _require_sglang()
        log = self.workdir / "server.log"
        process = _launch(self._base_dir(), port, server_args, token, self._version, log)
        self._stop_server = weakref.finalize(self, _stop_process, process)
        self._run(_wait_healthy(self._client, process, timeout, log))
