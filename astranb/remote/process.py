"""A policy's trainer in a child process, so training and rollouts really run at the same time.

In one process the engine thread, the event loop and the trainer thread share one interpreter
lock. With a small model every torch call is short, so the trainer keeps handing the lock over and
waiting to get it back: on 2 cores a train step took 3x longer beside running rollouts than alone,
and asynchrony bought almost nothing. Here the trainer (`LocalTrainer`) and its weight store live
in a child process with their own interpreter and torch threads; the notebook's process keeps the
engine and the episodes.

    notebook process                                  child: python -m astranb.remote._trainer_child
    ────────────────                                  ──────────────────────────────────────
    TrainLoop ── step(batch) ──► ProcessTrainer ═pipe═► LocalTrainer.step
    ProcessPublisher ── pull(have version, checksum) ═► WeightStore.publish + pull (delta/full)
        └─► engine.update_weights(payload)   (the same payloads, checks and healing as in-process)

The wire is the child's stdin/stdout: each message is a frame

    u32 header length | u64 body length | header (JSON) | body (bytes: safetensors or a payload)

No pickle: batches travel as safetensors (`remote.serialize.batch_to_bytes`), weights as the
codec's hash-checked payloads. The child writes its log (and anything a library prints) to a file
whose tail is shown if it dies. Calls are serialised by a lock; each blocks its calling thread,
never the event loop (the train loop calls from a worker thread).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import anyio
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..algorithms.config import Algorithm, algorithm_from_dict, algorithm_to_dict
from ..contracts import Checkpointable, Publisher, RecordingTrainer, SupervisedTrainer, Trainer
from ..errors import AstranbError
from ..lifeline import follow_parent, shielded
from ..models import ModelSpec
from ..training.caller_loss import gradient_batch, merged_metrics, runs_in_caller, trainer_algorithm
from ..training.lora import LoRA, lora_from_dict, lora_to_dict
from ..training.reference import Reference, reference_from_dict, reference_to_dict
from ..training.trace import StepRecorder, StepTrace, caller_trace
from ..types import Batch, WeightUpdate
from ..weights.publish import apply_to_engine, deliver, transfer_metrics
from ..weights.store import PublishStats
from .serialize import batch_from_bytes, batch_to_bytes, spec_from_wire, spec_to_wire

__all__ = ["ProcessTrainer", "ProcessPublisher", "TrainerProcessError", "default_trainer"]

_FRAME = struct.Struct("<IQ")


class TrainerProcessError(AstranbError, RuntimeError):
    """The trainer's child process failed a call or died."""


# -- framing --------------------------------------------------------------------------------------

def _write(stream: IO[bytes], header: Mapping[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header).encode()
    for part in (_FRAME.pack(len(head), len(body)), head, body):
        _all(stream, part)
    stream.flush()


def _all(stream: IO[bytes], data: bytes) -> None:
    """Write every byte. The streams are unbuffered, and a pipe write interrupted by a signal
    (a debugger attaching, Ctrl-C in the notebook) may take only part of a large body: the rest
    would be lost and the reader left waiting for it."""
    view, done = memoryview(data), 0
    while done < len(data):
        wrote = stream.write(view[done:])
        done += wrote or 0


def _read(stream: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at end of stream."""
    prefix = _exactly(stream, _FRAME.size)
    if prefix is None:
        return None
    head_len, body_len = _FRAME.unpack(prefix)
    head = _exactly(stream, head_len)
    body = _exactly(stream, body_len)
    if head is None or body is None:
        return None
    return json.loads(head), body


def _exactly(stream: IO[bytes], n: int) -> bytes | None:
    """n bytes from the stream (a pipe may hand them over in pieces), or None at its end."""
    if n == 0:
        return b""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        chunk = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not chunk:
            return None
        got += chunk
    return bytes(buffer)


# -- the notebook side ----------------------------------------------------------------------------

class ProcessTrainer(StepRecorder, Trainer, Checkpointable, SupervisedTrainer,
                     RecordingTrainer):
    """Trains one policy in a child process (the `Trainer` contract, plus `pull` for publishing).

    Args:
        name: policy name.
        spec: the model recipe (the child builds the model from it).
        algorithm, optimizer: as for LocalTrainer. An algorithm that does not travel as JSON
            (a loss written in a notebook cell) runs its loss here, on the logprobs the child
            sends; only its gradient goes to the child (training/caller_loss.py).
        threads: torch threads of the child.
        device, dtype: where and in what the child trains.
        full_every: versions between forced full snapshots of the child's weight store.
        log: file the child's output goes to.
    """

    def __init__(self, name: str, spec: ModelSpec, algorithm: Algorithm, optimizer: Any, *,
                 threads: int = 1, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 full_every: int = 10, log: str | os.PathLike | None = None,
                 reference: Reference | None = None, lora: LoRA | None = None):
        self.name = name
        self.algorithm = algorithm
        self.log = Path(log) if log is not None else None
        self._lock = threading.Lock()
        self._closed = False
        self._prepared: tuple[Batch, bytes] | None = None  # (batch, its encoding): `prepare`
        out: Any = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        # a session of its own: the kernel's stop button and Ctrl-C do not reach it; it ends
        # when this process does (astranb/lifeline.py)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "astranb.remote._trainer_child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=out, bufsize=0,
            **shielded({**os.environ, "OMP_NUM_THREADS": str(threads)}))
        if out is not subprocess.DEVNULL:
            out.close()
        header = {"op": "create", "name": name, "spec": spec_to_wire(spec),
                  "algorithm": algorithm_to_dict(trainer_algorithm(algorithm)),
                  "optimizer": dataclasses.asdict(optimizer), "threads": threads,
                  "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                  "full_every": full_every,
                  "reference": None if reference is None else reference_to_dict(reference),
                  "lora": None if lora is None else lora_to_dict(lora)}
        answer, _ = self._call(header)
        self.version: int = int(answer["version"])
        self.checksum: int | None = answer["checksum"]
        self.snapshot: tuple[int, bytes, PublishStats] | None = None
        """(version, full snapshot payload, publish stats) sent with the last step's reply."""

    # -- Trainer ----------------------------------------------------------------------------------


    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` in the child; its metrics (plus `trainer_seconds`).

        The reply also brings the new weights as a full snapshot (`snapshot`), so publishing
        them needs no further call: the next step may start at once."""
        record, self._record_next = self._record_next, False
        metrics, trace = self._step(batch, record=record)
        if trace is not None:
            self._recording = trace
        return metrics

    def _step(self, batch: Batch, *, record: bool) -> tuple[dict[str, float], StepTrace | None]:
        start = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        body = prepared[1] if prepared is not None and prepared[0] is batch else None
        caller: dict[str, float] | None = None
        original, logp_B_T = batch, None
        if runs_in_caller(self.algorithm):  # logprobs there, the loss here, its gradient there
            _, found = self._call({"op": "logprobs"}, body or batch_to_bytes(batch))
            logp_B_T = st_load(found)["logp_B_T"]
            batch, caller = gradient_batch(self.algorithm, batch, logp_B_T)
            body = None
        answer, payload = self._call({"op": "step", "record": record},
                                     body or batch_to_bytes(batch))
        traced = int(answer.get("trace_bytes", 0))
        trace = StepTrace.from_bytes(payload[:traced]) if record else None
        if trace is not None and logp_B_T is not None:  # the caller's loss: its own marks
            trace = caller_trace(trace, self.algorithm, original, logp_B_T)
        payload = payload[traced:]
        self.version = int(answer["version"])
        self.checksum = answer["checksum"]
        self.snapshot = (self.version, payload, PublishStats(**answer["stats"]))
        metrics = dict(answer["metrics"])
        if caller is not None:
            metrics = merged_metrics(caller, metrics, self.algorithm)
        metrics["trainer_seconds"] = answer["seconds"]
        metrics["trainer_call_seconds"] = time.perf_counter() - start
        return metrics, trace

    def forward_backward(self, batch: Batch, algorithm: Algorithm | None = None
                         ) -> dict[str, float]:
        """`LocalTrainer.forward_backward` in the child: the loss and its gradient, added to
        the child's gradients; the weights do not change (a manual loop's first block). A loss
        that runs here (an algorithm of a notebook cell) is taken here, on the child's
        logprobs, as in `step`."""
        algorithm = algorithm or self.algorithm
        caller: dict[str, float] | None = None
        if runs_in_caller(algorithm):
            _, found = self._call({"op": "logprobs"}, batch_to_bytes(batch))
            batch, caller = gradient_batch(algorithm, batch, st_load(found)["logp_B_T"])
        header = {"op": "forward_backward",
                  "algorithm": algorithm_to_dict(trainer_algorithm(algorithm))}
        answer, _ = self._call(header, batch_to_bytes(batch))
        metrics = dict(answer["metrics"])
        return metrics if caller is None else merged_metrics(caller, metrics, algorithm)

    def optim_step(self) -> dict[str, float]:
        """`LocalTrainer.optim_step` in the child: apply the gradients, version += 1 (the
        publisher then pulls the new weights)."""
        answer, _ = self._call({"op": "optim_step"})
        self.version = int(answer["version"])
        self.snapshot = None
        return dict(answer["metrics"])

    async def prepare(self, batch: Batch) -> None:
        """Encode `batch` for the pipe now, in a worker thread (the train loop calls this while
        the previous step trains); the `step` that gets this very batch sends it as it is."""
        self._prepared = (batch, await anyio.to_thread.run_sync(batch_to_bytes, batch))

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """One supervised step in the child (see LocalTrainer.sft_step), on every core: nothing
        else runs during a warm start."""
        header = {"op": "sft_step", "lr": lr, "threads": os.cpu_count() or 1}
        answer, _ = self._call(header, batch_to_bytes(batch))
        self.version = int(answer["version"])
        return dict(answer["metrics"])

    def weights(self) -> dict[str, torch.Tensor]:
        """The child's current weights (full precision), by parameter name."""
        _, body = self._call({"op": "weights"})
        return dict(st_load(body))

    def pull(self, have_version: int | None, have_checksum: int | None,
             full: bool = False) -> tuple[bytes, PublishStats]:
        """The payload that brings a receiver holding (version, checksum) to the child's current
        weights (published into its store first), and the publish stats."""
        header = {"op": "pull", "have_version": have_version, "have_checksum": have_checksum,
                  "full": full}
        answer, body = self._call(header)
        self.checksum = answer["checksum"]
        return body, PublishStats(**answer["stats"])

    def save_adapter(self, directory: str | os.PathLike) -> Path:
        """Write the child's LoRA adapters as PEFT's folder (`LocalTrainer.save_adapter`)."""
        self._call({"op": "save_adapter", "directory": str(Path(directory).resolve())})
        return Path(directory)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write weights, optimizer state and version (LocalTrainer's format)."""
        self._call({"op": "save", "directory": str(Path(directory).resolve())})
        return Path(directory)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what `save` wrote."""
        answer, _ = self._call({"op": "load", "directory": str(Path(directory).resolve())})
        self.version = int(answer["version"])

    def close(self) -> None:
        """Stop the child (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                assert self._proc.stdin is not None
                _write(self._proc.stdin, {"op": "close"})
            except (BrokenPipeError, OSError, ValueError):
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # a dead child's stdin may refuse the final flush
                    pass

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, header: Mapping[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        with self._lock:
            if self._closed:
                raise TrainerProcessError(f"the trainer process of {self.name!r} is closed")
            stdin, stdout = self._proc.stdin, self._proc.stdout
            assert stdin is not None and stdout is not None
            try:
                _write(stdin, header, body)
                reply = _read(stdout)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                raise self._died(str(header.get("op")))
        answer, payload = reply
        if not answer.get("ok"):
            raise TrainerProcessError(
                f"the trainer process of {self.name!r} failed {header.get('op')!r}:\n"
                f"{answer.get('error')}")
        return answer, payload

    def _died(self, op: str) -> TrainerProcessError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = ""
        if self.log is not None and self.log.exists():
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        self._closed = True
        self._close_pipes()
        return TrainerProcessError(
            f"the trainer process of {self.name!r} died during {op!r} (exit code {code}); "
            f"the steps it took since the last save are lost. Its log "
            f"({self.log or 'not kept'}) ends with:\n{tail}")


class ProcessPublisher(Publisher):
    """Publishes a ProcessTrainer's weights to an engine in this process: the child sends a full
    bf16 snapshot with each step's reply; the engine applies and checks it.

    `overlaps_next_step`: the weights of a version are already in this process when `publish`
    starts, so the train loop may send the next step to the child while the engine applies them.

    Args:
        engine: the policy's engine.
        trainer: the policy's trainer (its name is the policy's).
    """

    where = "this process"
    overlaps_next_step = True

    def __init__(self, engine: Any, trainer: ProcessTrainer):
        self.engine, self.trainer = engine, trainer

    @property
    def checksum(self) -> int | None:
        return self.trainer.checksum

    def publish_initial(self) -> None:
        """Version 0 as a full snapshot from the child's store (blocking)."""
        payload, _ = self.trainer.pull(None, None, full=True)
        self.engine.update_weights(WeightUpdate(self.trainer.name, self.trainer.version,
                                                payload=payload)).result()

    async def publish(self) -> dict[str, Any]:
        name, engine, version = self.trainer.name, self.engine, self.trainer.version
        snapshot = self.trainer.snapshot
        if snapshot is not None and snapshot[0] != version:
            snapshot = None  # the trainer moved on (a load): ask for the current weights
        found: list[PublishStats] = []

        async def fetch(full: bool) -> bytes:
            if snapshot is not None and not full:
                found.append(snapshot[2])
                return snapshot[1]
            payload, stats = await anyio.to_thread.run_sync(
                self.trainer.pull, engine.version, engine.weights_checksum, full)
            found.append(stats)
            return payload

        async def apply(payload: bytes) -> dict[str, Any]:
            return await apply_to_engine(engine, name, version, payload)

        payload, applied, fallback = await deliver(fetch, apply)
        return transfer_metrics(payload, applied, fallback, found[-1], self.trainer.checksum)


# -- the child ------------------------------------------------------------------------------------

class _Child:
    """The child's state: one LocalTrainer and the WeightStore its weights are published into."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.store: Any = None
        self.stats: dict[str, Any] = {}

    def create(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        from ..training.local import AdamWConfig, LocalTrainer
        from ..weights.store import WeightStore

        torch.set_num_threads(int(header["threads"]))
        optimizer = dict(header["optimizer"])
        optimizer["betas"] = tuple(optimizer.get("betas", (0.9, 0.999)))
        self.trainer = LocalTrainer(
            spec_from_wire(header["spec"]), algorithm_from_dict(header["algorithm"]),
            AdamWConfig(**optimizer), device=header["device"],
            dtype=getattr(torch, header["dtype"]),
            reference=(None if header.get("reference") is None
                       else reference_from_dict(header["reference"])),
            lora=None if header.get("lora") is None else lora_from_dict(header["lora"]))
        # the engine is on this machine: full snapshots (a copy and a hash) cost less than
        # encoding deltas (measured 1 ms against 20 ms for a 300K-parameter model)
        self.store = WeightStore(header["name"], full_every=int(header["full_every"]),
                                 deltas=bool(header.get("deltas", False)))
        self._publish()
        # what exists now lives as long as this process: full GC passes need not walk it
        # (see astranb/_heap.py; here for the process's life, nothing to give back)
        gc.collect()
        gc.freeze()
        return {"version": self.trainer.version, "checksum": self.store.checksum}, b""

    def step(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        start = time.perf_counter()
        trace = b""
        if header.get("record"):
            self.trainer.record_next_step()
        metrics = self.trainer.step(batch_from_bytes(body))
        recorded = self.trainer.take_recording()
        if recorded is not None:
            trace = recorded.to_bytes()
        seconds = time.perf_counter() - start
        self._publish()
        return {"metrics": metrics, "version": self.trainer.version, "seconds": seconds,
                "checksum": self.store.checksum, "stats": self.stats,
                "trace_bytes": len(trace)}, trace + self.store.pull_full()

    def forward_backward(self, header: dict[str, Any], body: bytes
                         ) -> tuple[dict[str, Any], bytes]:
        algorithm = algorithm_from_dict(header["algorithm"])
        return {"metrics": self.trainer.forward_backward(batch_from_bytes(body), algorithm)}, b""

    def optim_step(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        metrics = self.trainer.optim_step()
        return {"metrics": metrics, "version": self.trainer.version}, b""

    def logprobs(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        logp_B_T = self.trainer.logprobs(batch_from_bytes(body))
        return {}, st_save({"logp_B_T": logp_B_T.contiguous()})

    def sft_step(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        threads = torch.get_num_threads()
        torch.set_num_threads(int(header.get("threads") or threads))
        try:
            metrics = self.trainer.sft_step(batch_from_bytes(body), lr=header.get("lr"))
        finally:
            torch.set_num_threads(threads)
        return {"metrics": metrics, "version": self.trainer.version}, b""

    def pull(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        if self.store.version != self.trainer.version:
            self._publish()
        if header.get("full"):
            payload = self.store.pull_full()
        else:
            payload = self.store.pull(header.get("have_version"), header.get("have_checksum"))
        return {"checksum": self.store.checksum, "stats": self.stats}, payload

    def weights(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {}, st_save({k: v.contiguous() for k, v in self.trainer.weights().items()})

    def save(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.trainer.save(header["directory"])
        return {}, b""

    def save_adapter(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.trainer.save_adapter(header["directory"])
        return {}, b""

    def load(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.trainer.load(header["directory"])
        return {"version": self.trainer.version}, b""

    def _publish(self) -> None:
        self.stats = dataclasses.asdict(
            self.store.publish(self.trainer.version, self.trainer.weights()))


def main() -> int:
    """Serve one ProcessTrainer over stdin/stdout until "close" or end of input (or until the
    process that started it is gone, even mid-step)."""
    follow_parent()
    # the frames own stdout: anything a library prints goes to stderr (the log) instead
    wire_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    wire_in = sys.stdin.buffer
    child = _Child()
    ops: dict[str, Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]] = {
        "create": child.create, "step": child.step, "logprobs": child.logprobs,
        "sft_step": child.sft_step,
        "pull": child.pull, "weights": child.weights, "save": child.save, "load": child.load,
        "save_adapter": child.save_adapter, "forward_backward": child.forward_backward,
        "optim_step": child.optim_step,
    }
    while (frame := _read(wire_in)) is not None:
        header, body = frame
        op = header.get("op")
        if op == "close":
            break
        try:
            handler = ops.get(str(op))
            if handler is None:
                raise ValueError(f"unknown operation {op!r}")
            answer, payload = handler(header, body)
            answer["ok"] = True
        except Exception:
            answer, payload = {"ok": False, "error": traceback.format_exc()}, b""
        _write(wire_out, answer, payload)
    return 0


def default_trainer(device: str) -> str:
    """Session's `trainer=` when not given: $ASTRANB_TRAINER, else "process" on a CPU with at
    least 2 cores (see the module docstring) and "thread" otherwise."""
    chosen = os.environ.get("ASTRANB_TRAINER")
    if chosen:
        if chosen not in ("thread", "process"):
            raise ValueError(f"ASTRANB_TRAINER={chosen!r}: use 'thread' or 'process'")
        return chosen
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "process" if str(device) == "cpu" and (cores or 1) >= 2 else "thread"
