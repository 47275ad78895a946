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
the new one. A stretch's version is the server's `meta_info.weight_version` when it is one this engine
set (right even for a request that reached the server while it was paused), else the version when
the stretch was sent.

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
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from .. import weights
from ..models import ModelSpec, resolve
from ..types import Generation, GenerationRequest, SamplingParams, WeightUpdate

__all__ = ["SGLangEngine", "SGLangError"]

WEIGHTS_FILE = "model.safetensors"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")
_GENERATE_TIMEOUT = httpx.Timeout(None, connect=10.0)
_CONTROL_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
_UPDATE_TIMEOUT = httpx.Timeout(1800.0, connect=10.0)


class SGLangError(RuntimeError):
    """The SGLang server was unreachable, refused a call, or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """HTTP status of a refused call (None when there was no answer)."""


@dataclass(frozen=True)
class _Stretch:
    """One /generate answer: tokens of one uninterrupted stretch of decoding."""

    ids: list[int]
    logprobs: list[float]
    finish: str
    weight_version: Any
    message: str


class SGLangEngine:
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
        self._mirror: dict | None = None  # weights as last published (bf16), payload's names
        self._mirror_checksum: int | None = None
        self._file_lock = threading.Lock()
        self._paused = self._closed = self._server_paused = False
        self._epoch = self._pending_updates = self._inflight = self._dp_size = 0
        self._waiting: float | None = 0.0  # server queue from /metrics; None: no answer
        self._has_metrics, self._tasks = True, set()
        self._stop_server = lambda: None  # a launched server's finalizer (also runs at exit)
        self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"astranb-sglang-{name}", daemon=True
        )
        self._thread.start()
        port = _free_port() if launch else 0
        self.url = f"http://127.0.0.1:{port}" if launch else url.rstrip("/")
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

    def __enter__(self) -> "SGLangEngine":
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
            raise ValueError(f"update is for policy {update.policy!r}, this engine is {self.name!r}")
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

    @property
    def weights_checksum(self) -> int | None:
        """Checksum of the weights last published to this engine (None if none was)."""
        return self._mirror_checksum

    def published_checksum(self) -> int:
        """Checksum of the weights file the server was last told to load, read back (slow)."""
        from safetensors.torch import load_file

        path = self.workdir / "weights" / WEIGHTS_FILE
        with self._file_lock:
            if not path.is_file():
                raise LookupError("no published weights were written for this engine")
            return weights.checksum(load_file(str(path)))

    def server_log(self, lines: int = 40) -> str:
        """The last lines a launched server wrote ("" when attached)."""
        path = self.workdir / "server.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

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
            _settle(future, result=await work())
        except asyncio.CancelledError:
            message = f"SGLangEngine {self.name!r} closed before the work finished"
            _settle(future, exc=RuntimeError(message))
            raise
        except Exception as error:
            _settle(future, exc=error)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def _call(self, method: str, path: str, body=None, timeout=_CONTROL_TIMEOUT, as_json=True):
        """One HTTP call; errors name the server, the endpoint and the answer."""
        try:
            response = await self._client.request(method, path, json=body, timeout=timeout)
        except httpx.TransportError as error:
            raise SGLangError(f"cannot reach the SGLang server at {self.url} "
                              f"({type(error).__name__}: {error}); is it running? "
                              "pass launch=True to start one") from error
        if not response.is_success:
            raise SGLangError(f"SGLang {method} {path} answered HTTP {response.status_code}: "
                              f"{_snippet(response.text)}", status=response.status_code)
        if not as_json:
            return response
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise SGLangError(f"SGLang {method} {path} answered {_snippet(response.text)!r}, "
                              "not a JSON object")
        return data

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
        base, ids, logprobs, versions = uuid.uuid4().hex, [], [], []
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
                versions += [self._stretch_version(stretch, version)] * len(stretch.ids)
                finish = _finish(stretch, ids, request.sampling)
                if finish is not None:
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    return Generation(tuple(request.prompt_ids), tuple(ids), tuple(logprobs),
                                      tuple(versions), finish, text)
                if epoch == self._epoch:
                    reason = stretch.message or "no reason given"
                    raise SGLangError(f"SGLang aborted request {rid}: {reason}")
        finally:
            self._inflight -= 1

    def _stretch_version(self, stretch: _Stretch, sent_version: int) -> int:
        try:
            reported = int(stretch.weight_version)
        except (TypeError, ValueError):  # "default" (never updated) or a server without the field
            return sent_version
        return reported if reported in self._known_versions else sent_version

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
                    self._mirror = self._mirror_checksum = None  # the server may hold other weights
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
        from safetensors.torch import save_file

        if update.payload is None:
            self._mirror = self._mirror_checksum = None  # the mirror no longer matches
            tensors = {k: v.detach().to("cpu").clone() for k, v in update.state.items()}
            kind = "state"
        else:
            kind, tensors = self._apply_payload(update), self._mirror
        directory = self._weights_dir()
        with self._file_lock:  # written aside, then renamed: the server never reads half a file
            save_file(tensors, str(directory / f"{WEIGHTS_FILE}.tmp"), metadata={"format": "pt"})
            os.replace(directory / f"{WEIGHTS_FILE}.tmp", directory / WEIGHTS_FILE)
        return kind

    def _apply_payload(self, update: WeightUpdate) -> str:
        header = weights.peek(update.payload)
        if header.policy != self.name:
            raise ValueError(f"payload is for policy {header.policy!r}, this engine is {self.name!r}")
        if header.version != update.version:
            raise ValueError(f"payload makes version {header.version}, update says {update.version}")
        if header.kind == "full":
            self._mirror = weights.decode(None, update.payload)
        elif self._mirror is None:
            raise weights.BaseMismatch(
                "the engine holds no published weights yet; send a full snapshot first")
        else:
            try:
                weights.apply(self._mirror, update.payload, base_checksum=self._mirror_checksum)
            except weights.CorruptPayload:
                self._mirror_checksum = None  # may be half written: only a full snapshot heals it
                raise
        self._mirror_checksum = header.checksum
        return header.kind

    def _weights_dir(self) -> Path:
        """The model directory's copy without its weights (made once)."""
        directory = self.workdir / "weights"
        if not directory.is_dir():
            directory.mkdir(parents=True)
            for item in self._base_dir().iterdir():
                if item.is_file() and not item.name.endswith(_WEIGHT_FILES):
                    shutil.copy2(item, directory / item.name)
        return directory

    def _base_dir(self) -> Path:
        if self.spec.path is not None:
            return Path(self.spec.path)
        base = self.workdir / "base"
        if not (base / "config.json").is_file():
            self.spec.save(base)
        return base

    # -- a launched server ------------------------------------------------------------------------

    def _start_server(self, port: int, server_args: Sequence[str], token: str | None,
                      timeout: float) -> None:
        if importlib.util.find_spec("sglang") is None:
            raise SGLangError("SGLang is not installed in this Python; on a GPU host run pip "
                              "install 'astranb[sglang]', or pass url= to attach to a running server")
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path",
                   str(self._base_dir()), "--host", "127.0.0.1", "--port", str(port),
                   "--enable-metrics", *server_args]
        if "--weight-version" not in server_args:
            command += ["--weight-version", str(self._version)]
        if token:
            command += ["--api-key", token]
        with open(self.workdir / "server.log", "wb") as log:  # own process group: ended as a whole
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._stop_server = weakref.finalize(self, _stop_process, process)
        self._run(self._wait_healthy(process, timeout))

    async def _wait_healthy(self, process: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (code := process.poll()) is None:
            try:
                if (await self._client.get("/health", timeout=10.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise SGLangError(f"the SGLang server did not answer /health within {timeout:.0f}s "
                                  f"(raise launch_timeout for big models); its last log lines:\n"
                                  f"{self.server_log()}")
            await asyncio.sleep(0.5)
        raise SGLangError(f"the SGLang server exited with code {code} before it was ready; "
                          f"its last log lines:\n{self.server_log()}")


def _stop_process(process: subprocess.Popen) -> None:
    """End a launched server's process group: SIGTERM, and after 30 s SIGKILL to what is left
    (SGLang runs its scheduler and detokenizer as child processes)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # nobody left in the group
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    process.wait()


# -- SGLang's wire format --------------------------------------------------------------------------


def _check_request(request: GenerationRequest) -> None:
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not request.prompt_ids or not all(isinstance(t, int) and t >= 0 for t in request.prompt_ids):
        raise ValueError(f"prompt_ids must be non-empty token ids, got {request.prompt_ids!r}")


def _body(request: GenerationRequest, done: list[int], rid: str) -> dict:
    """A /generate body that continues `request` after the tokens already generated."""
    s = request.sampling
    sampling = {"temperature": s.temperature, "top_p": s.top_p,
                "max_new_tokens": s.max_new_tokens - len(done),
                "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": True}
    return {"input_ids": [*request.prompt_ids, *done], "rid": rid, "return_logprob": True,
            "sampling_params": sampling}


def _parse_stretch(answer: dict) -> _Stretch:
    """Tokens, logprobs and finish reason of a /generate answer; names any missing field."""
    meta = answer.get("meta_info")
    if not isinstance(meta, dict) or "finish_reason" not in meta:
        missing = "meta_info.finish_reason" if isinstance(meta, dict) else "meta_info"
        keys = sorted(meta or answer)
        raise SGLangError(f"SGLang /generate answer has no '{missing}' (keys: {keys})")
    reason = meta["finish_reason"]
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"SGLang /generate answer has an unknown meta_info.finish_reason "
                          f"{reason!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None and kind != "abort":  # an aborted answer may come without them
        raise SGLangError("SGLang /generate answer has no 'meta_info.output_token_logprobs' "
                          "although the engine sent return_logprob=true")
    try:
        logprobs = [float(t[0]) for t in triples or ()]
        logprob_ids = [int(t[1]) for t in triples or ()]
        ids = [int(t) for t in answer.get("output_ids", logprob_ids)]  # old servers: triples only
    except (TypeError, ValueError, IndexError) as error:
        raise SGLangError("SGLang /generate answer has malformed output_ids or meta_info.output_"
                          f"token_logprobs (want [logprob, token_id, text]): {error}") from error
    if ids != logprob_ids:
        if kind != "abort":
            raise SGLangError(f"SGLang /generate answer: output_ids ({len(ids)} tokens) and "
                              f"meta_info.output_token_logprobs ({len(logprob_ids)}) disagree")
        n = next((i for i, (a, b) in enumerate(zip(ids, logprob_ids)) if a != b),
                 min(len(ids), len(logprob_ids)))
        ids, logprobs = ids[:n], logprobs[:n]
    message = str(reason.get("message") or "") if isinstance(reason, dict) else ""
    return _Stretch(ids, logprobs, kind, meta.get("weight_version"), message)


def _finish(stretch: _Stretch, ids: list[int], sampling: SamplingParams) -> str | None:
    """Why the request is done ("stop" first, as in HFEngine), or None when it must resume."""
    if ids and ids[-1] in sampling.stop_token_ids:
        return "stop"
    if len(ids) >= sampling.max_new_tokens:
        return "length"
    return None if stretch.finish == "abort" else stretch.finish  # "stop": the model's own EOS


def _gauge_sum(text: str, name: str) -> float:
    """Sum of a Prometheus gauge over its series (one per scheduler); 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        rest = line[line.rindex("}") + 1:] if "{" in line else line[len(name):]
        try:
            total += float(rest.split()[0])
        except (IndexError, ValueError):
            raise SGLangError(f"SGLang /metrics has a malformed {name} line: {line!r}") from None
    return total


def _snippet(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _settle(future: Future, *, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile: nobody is waiting
        pass
