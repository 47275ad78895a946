"""A command channel from rank 0 to the other ranks of a torch.distributed job, without pickle.

Data-parallel training is SPMD: every rank must issue the same collectives in the same order. Only
rank 0 talks to the outside world (an HTTP server, a notebook), so it turns each request into a
command, broadcasts it, and every rank, rank 0 included, runs the same handler on it. Ranks > 0
sit in `Collective.follow()` until rank 0 sends "shutdown".

Wire format: no pickle on any wire or file another process reads, so a command is two
broadcasts of plain tensors:

    1. int64[2]   byte lengths of the JSON header and of the tensor blob
    2. uint8[n]   UTF-8 JSON {"name": ..., "args": ...}, then `safetensors.torch.save` bytes

They travel on a group of their own, always gloo (CPU tensors), whatever the training backend:
a follower waiting for work then never spins a GPU, and its wait has its own timeout.

Threads: a rank issues its collectives from one thread, in one order. Rank 0's `call` may come
from any thread, so calls are queued to one worker thread that runs them one at a time. When idle
for a quarter of the timeout, that thread broadcasts a "ping"; a follower that hears nothing for a
whole timeout therefore knows rank 0 died or hung, and raises `RankZeroLost` instead of waiting
forever.

    # on every rank, after torch.distributed.init_process_group:
    channel = Collective({"add": lambda c: c.args["a"] + float(c.tensors["b"].sum())})
    if channel.rank == 0:
        assert channel.call("add", {"a": 1}, {"b": torch.ones(3)}) == 4.0  # every rank ran it
        channel.close()
    else:
        channel.follow()  # returns once rank 0 closes
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..errors import AstranbError

__all__ = ["Command", "Collective", "RankZeroLost", "encode", "decode"]


@dataclass(frozen=True)
class Command:
    """One unit of work that every rank runs."""

    name: str
    """Handler name."""
    args: dict[str, Any] = field(default_factory=dict)
    """JSON-able arguments."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors sent along (moved to CPU and made contiguous on the way)."""
    local: Any = None
    """Rank 0 only, never sent: something rank 0's handler needs that the others must not get
    (e.g. a checkpoint it read, which it then broadcasts shard by shard)."""


Handler = Callable[[Command], Any]


class RankZeroLost(AstranbError, RuntimeError):
    """A follower heard nothing from rank 0 within the timeout, or lost its connection."""


def encode(command: Command) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors that carry `command`: int64[2] sizes and the uint8 payload.

    Raises:
        TypeError: args are not JSON-able (nothing has been sent then).
    """
    header = json.dumps({"name": command.name, "args": command.args}).encode()
    cpu = {k: v.detach().cpu().contiguous() for k, v in command.tensors.items()}
    blob = save_tensors(cpu) if cpu else b""
    sizes = torch.tensor([len(header), len(blob)], dtype=torch.int64)
    # bytearray: frombuffer needs a writable buffer (bytes would warn)
    return sizes, torch.frombuffer(bytearray(header + blob), dtype=torch.uint8)


def decode(sizes: torch.Tensor, payload: torch.Tensor) -> Command:
    """The command `encode` turned into (sizes, payload)."""
    header_len, blob_len = (int(n) for n in sizes.tolist())
    data = payload.numpy().tobytes()
    header = json.loads(data[:header_len])
    tensors = load_tensors(data[header_len:]) if blob_len else {}
    return Command(header["name"], header["args"], tensors)


@dataclass
class _Job:
    command: Command
    sizes: torch.Tensor
    payload: torch.Tensor
    done: Future = field(default_factory=Future)


class Collective:
    """Rank 0 issues commands, every rank runs them.

    Construct it on every rank at the same point (it creates a process group, a collective call).

    Args:
        handlers: command name -> function(Command) -> result; the same on every rank. Rank 0's
            result is what `call` returns; the followers' results are dropped.
        timeout_s: how long a follower waits for rank 0 before giving up, and the timeout of
            every broadcast on the channel's group.
    """

    def __init__(self, handlers: Mapping[str, Handler], *, timeout_s: float = 300.0):
        reserved = {"ping", "shutdown"} & set(handlers)
        if reserved:
            raise ValueError(f"command names {sorted(reserved)} are the channel's own; rename them")
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self._handlers = dict(handlers)
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._broken: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.rank == 0:
            self._thread = threading.Thread(
                target=self._serve, name="astranb-collective", daemon=True
            )
            self._thread.start()

    def call(
        self,
        name: str,
        args: dict[str, Any] | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        local: Any = None,
    ) -> Any:
        """Run command `name` on every rank; return rank 0's result (rank 0 only; any thread).

        Raises:
            RuntimeError: on ranks > 0, after `close`, or once a broadcast has failed (then the
                other ranks are gone and the job must be restarted).
        """
        if self.rank != 0:
            raise RuntimeError("Collective.call is for rank 0; other ranks run follow()")
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"command {name!r} issued from inside a handler would deadlock")
        self._check_usable()
        if name not in self._handlers and name != "shutdown":
            raise KeyError(f"no handler for command {name!r}; known: {sorted(self._handlers)}")
        command = Command(name, dict(args or {}), dict(tensors or {}), local)
        job = _Job(command, *encode(command))  # encode here: a bad argument fails before sending
        self._queue.put(job)
        return job.done.result()

    def follow(self) -> None:
        """Ranks > 0: run every command rank 0 sends until "shutdown".

        Raises:
            RankZeroLost: nothing came from rank 0 within the timeout, or the connection dropped.
            RuntimeError: a handler failed here; this rank's state may now differ from rank 0's,
                so the job cannot go on.
        """
        while True:
            command = self._receive()
            if command.name == "shutdown":
                return
            if command.name == "ping":
                continue
            try:
                self._handlers[command.name](command)
            except Exception as error:
                raise RuntimeError(
                    f"rank {self.rank}: command {command.name!r} failed ({error}); stopping, "
                    "since this rank may no longer match rank 0"
                ) from error

    def close(self) -> None:
        """Rank 0: send "shutdown" (followers return from `follow`) and stop the worker thread."""
        if self.rank != 0 or self._closed:
            return
        try:
            if self._broken is None:
                self.call("shutdown")
        finally:
            self._closed = True
            self._queue.put(None)
            assert self._thread is not None  # rank 0 started it in __init__
            self._thread.join()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Collective is closed; the other ranks have shut down")
        if self._broken is not None:
            raise RuntimeError(
                f"the other ranks are unreachable since a broadcast failed ({self._broken}); "
                "restart the job"
            ) from self._broken

    def _serve(self) -> None:
        heartbeat_s = self.timeout_s / 4
        while True:
            try:
                job = self._queue.get(timeout=heartbeat_s)
            except queue.Empty:
                job = _Job(Command("ping"), *encode(Command("ping")))
            if job is None:
                return
            try:
                job.done.set_result(self._run(job))
            except BaseException as error:  # handed to the caller, who re-raises it
                job.done.set_exception(error)

    def _run(self, job: _Job) -> Any:
        self._check_usable()  # after a failed broadcast, fail queued jobs instead of waiting
        try:
            dist.broadcast(job.sizes, src=0, group=self._group)
            dist.broadcast(job.payload, src=0, group=self._group)
        except Exception as error:
            self._broken = error
            raise
        if job.command.name in ("ping", "shutdown"):
            return None
        return self._handlers[job.command.name](job.command)

    def _receive(self) -> Command:
        sizes = torch.empty(2, dtype=torch.int64)
        try:
            dist.broadcast(sizes, src=0, group=self._group)
            payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self._group)
        except Exception as error:
            # gloo's messages start with "[source path:line] "; the rest is the reason
            line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            reason = re.sub(r"^\[[^\]]*\]\s*", "", line)[:200]
            raise RankZeroLost(
                f"rank {self.rank}: heard nothing from rank 0 for {self.timeout_s:g} s, or lost "
                f"the connection ({reason}); rank 0 has died or hung, so this rank exits rather "
                "than wait forever"
            ) from error
        return decode(sizes, payload)
