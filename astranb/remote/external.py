"""A trainer of the researcher's own: a training loop in another process (or on another host)
trains a policy's batches and sends its weights back.

    session.policy("solver", model, trainer="external")      # or trainer=ab.External(...)
    # anywhere else, with any training code (astranb.remote.trainer_link is the other end):
    link = ab.TrainerLink.from_file("runs/x/external/solver.json")
    model.load_state_dict(link.weights())
    for batch in link.batches():
        ...                                                  # the loop's own loss and update
        link.publish(model.state_dict(), metrics={"loss": loss.item()})

To the train loop this is a trainer and a publisher like the others: `step(batch)` lends the
batch out and returns when the next version has come back, so the staleness gate, the episode
accounting and the engine's weight updates are the loop's own, unchanged.

The wire (HTTP on 127.0.0.1 by default; a bearer token on every request):

    POST /v1/register           {"name"} -> policy, version, checksum, model spec, algorithm (when
                                astranb's own), the batch's tensor names
    GET  /v1/weights            a full snapshot (the weight codec's bf16 payload) of the current
                                version: where a trainer starts, or starts again after a crash
    GET  /v1/batch?wait=S       the batch to train at the current version (safetensors, written
                                by remote.serialize; X-Astranb-Version says which version);
                                204 when none was out within S s, 410 once the session closed
    POST /v1/publish?version=N  version N's weights: a delta against N-1 or a full snapshot (a
                                codec payload), the step's metrics in X-Astranb-Metrics (JSON)
    GET  /v1/status             version, whether a batch is out, the trainers registered

The loan: a batch stays out until the version after it comes back.

    loop: step(batch) at version v        trainer A          trainer B
      loan(v) ---- GET /v1/batch ------->  trains ... killed
              ---- GET /v1/batch ----------------------------> trains
              <--- POST /v1/publish?version=v+1 -------------- (checked, applied)
      step returns A's nothing, B's metrics; the engine gets v+1

A trainer that dies holding the loan lends nothing away: the next trainer that asks gets the same
bytes at the same version, so no episode is lost; once v+1 is in, another v+1 is refused (409),
so none is trained twice. Weights are checked before they count: a delta must apply to version
v's bits (the codec's base checksum) and every payload must hash to its header's checksum, with
the policy's tensor names, shapes and dtypes. A payload that does not is refused (409 asks for a
full snapshot; 400/413/422 say what is malformed) and the loan stays out.

The server runs on the session's own event loop (uvicorn over a socket bound here), so the loan's
state has one owner and needs no lock.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from ..algorithms.config import algorithm_to_dict, travels_as_config
from ..contracts import Publisher
from ..errors import AstranbError
from ..loopback import is_loopback
from ..models import ModelSpec
from ..types import Batch, WeightUpdate
from ..weights.codec import Header, checksum, decode, encode_full, layout_mismatch, peek
from ..weights.errors import BaseMismatch, WeightTransferError
from ..weights.publish import apply_to_engine, deliver, transfer_metrics
from ..weights.store import PublishStats
from .serialize import BATCH_FIELDS, batch_to_bytes, spec_to_wire

__all__ = ["External", "ExternalTrainer", "ExternalPublisher", "create_app", "serve",
           "METRICS_HEADER", "VERSION_HEADER"]

METRICS_HEADER = "X-Astranb-Metrics"
VERSION_HEADER = "X-Astranb-Version"
WAIT_LIMIT = 60.0
"""Longest a GET /v1/batch may wait (seconds): a client asks again after it."""
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_/.\-]{0,63}")
_RESERVED = re.compile(r"(policy|step|version|time|reward.*|episodes.*|staleness.*|token_version.*"
                       r"|trained.*|dropped.*|filtered.*|flags|buffer_size|live_groups|"
                       r"transfer_.*|weights_checksum|wait_seconds|step_seconds)")
_MAX_METRICS = 64


# -- the choice ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class External:
    """Train a policy with a training loop of one's own, anywhere: `session.policy(...,
    trainer=ab.External())` (or `trainer="external"`). The session serves the policy's batches
    and takes its weights back on `host:port`; `ab.TrainerLink` is the loop's end of it.

    Args:
        host: address to listen on; loopback by default. Another address is reachable from other
            hosts: pass `token=` then (a secret the other host is given).
        port: port to listen on; 0 lets the OS pick a free one.
        token: the bearer token every request must carry; None: a random one, written with the
            URL into the session folder's `external/<policy>.json` (readable by its owner only).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0 (any free port) or 1-65535, got {self.port!r}")
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"External(host={self.host!r}) listens beyond this machine: give it "
                             "token='<a secret>' too, and the same token to the TrainerLink")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise ValueError("token must be a string of at least 16 characters (e.g. "
                             "secrets.token_urlsafe(24))")


class Refused(AstranbError, ValueError):
    """A request the loan cannot take; `status` is its HTTP status."""

    def __init__(self, message: str, status: int, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


class _Closed(Exception):
    """The session closed: no batch will come."""


# -- the trainer the loop sees ------------------------------------------------------------------

@dataclass
class _Loan:
    version: int
    """The version the batch is trained at (the weights it must start from)."""
    blob: bytes
    done: asyncio.Future[dict[str, float]]
    lent: int = 0
    """How many times it was handed out (more than once: a trainer died holding it)."""


@dataclass
class _Arrived:
    version: int
    payload: bytes
    header: Header


@dataclass
class _Registered:
    name: str
    seen: float
    """When it last registered or asked for a batch (time.monotonic())."""


class ExternalTrainer:
    """The Trainer contract for a policy trained elsewhere: a step lends its batch out and
    resolves when the next version's weights come back (see the module docstring).

    Args:
        name: the policy's name.
        spec: its model (the starting weights are built from it, as every trainer's are).
        algorithm: its algorithm (advantages and filtering happen here; a trainer that wants
            its loss settings reads them from the registration).
    """

    def __init__(self, name: str, spec: ModelSpec, algorithm: Any):
        self.name, self.spec, self.algorithm = name, spec, algorithm
        model = spec.build(dtype=torch.float32, device="cpu")
        self._weights = {k: v.detach().to("cpu", torch.bfloat16, copy=True).contiguous()
                         for k, v in model.state_dict().items()}
        del model
        self.checksum: int = checksum(self._weights)
        self.version = 0
        self.url = ""
        self.token = ""
        self._loan: _Loan | None = None
        self._arrived: _Arrived | None = None
        self._changed: asyncio.Event | None = None
        self._closed = False
        self.trainers: dict[str, _Registered] = {}
        self.lent_again = 0
        """Batches handed out again because the trainer holding them went quiet (died)."""
        self.refused = 0
        """Publishes refused (stale version, wrong base, malformed, too large)."""

    # -- the train loop's side -------------------------------------------------------------------
    async def step(self, batch: Batch) -> dict[str, float]:
        """Lend `batch` out at the current version; its metrics once the next version is in."""
        version = self.version
        blob = await anyio.to_thread.run_sync(
            lambda: batch_to_bytes(batch, policy=self.name, version=str(version)))
        loan = _Loan(version, blob, asyncio.get_running_loop().create_future())
        self._loan = loan
        self._wake()
        try:
            metrics = await loan.done
        finally:
            if self._loan is loan:  # cancelled (the run stopped): nothing stays out
                self._loan = None
                self._wake()
        return {**metrics, "external_lent": float(loan.lent)}

    async def prepare(self, batch: Batch) -> None:
        return None

    def weights(self) -> dict[str, torch.Tensor]:
        """The current version's weights (bf16, as they came back; copies)."""
        return {k: v.clone() for k, v in self._weights.items()}

    @property
    def weight_bytes(self) -> int:
        """Size of the weights as they travel (bf16)."""
        return sum(t.numel() * t.element_size() for t in self._weights.values())

    @property
    def arrived(self) -> _Arrived | None:
        """The payload the latest version came in (None at version 0)."""
        return self._arrived

    def close(self) -> None:
        """No more batches: waiting trainers are told the session closed (410)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _changed_or(self, deadline: float) -> bool:
        """Wait until the loan changes or the deadline passes; False at the deadline."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await event.wait()
            return True
        return False

    # -- the wire's side -------------------------------------------------------------------------
    def register(self, name: str) -> dict[str, Any]:
        now = time.monotonic()
        self.trainers.setdefault(name, _Registered(name, now)).seen = now
        return {"policy": self.name, "version": self.version, "checksum": self.checksum,
                "model": spec_to_wire(self.spec),
                "algorithm": (algorithm_to_dict(self.algorithm)
                              if travels_as_config(self.algorithm) else None),
                "batch_fields": list(BATCH_FIELDS),
                "weight_names": sorted(self._weights)}

    def snapshot(self) -> tuple[int, bytes]:
        return self.version, encode_full(self._weights, policy=self.name, version=self.version)

    async def take(self, wait: float, who: str | None = None) -> _Loan | None:
        """The batch out on loan, waiting up to `wait` seconds for one; None if none came."""
        deadline = time.monotonic() + max(0.0, min(wait, WAIT_LIMIT))
        if who in self.trainers:
            self.trainers[who].seen = time.monotonic()
        while True:
            if self._closed:
                raise _Closed
            loan = self._loan
            if loan is not None and not loan.done.done():
                loan.lent += 1
                if loan.lent > 1:
                    self.lent_again += 1
                return loan
            if not await self._changed_or(deadline):
                return None

    async def receive(self, version: int, payload: bytes, metrics: dict[str, float]
                      ) -> dict[str, Any]:
        """Take version `version`'s weights for the loan out at `version - 1`.

        Raises:
            Refused: 409 (no loan at version-1, or a delta on other base weights: `send` full),
                422 (another policy's or another model's weights), 400 (not a payload).
        """
        loan = self._loan
        if loan is None or loan.done.done() or loan.version != version - 1:
            now = self.version
            raise Refused(
                f"version {version} is not awaited: the policy is at version {now} and "
                + (f"its batch for version {now + 1} is out; train it (GET /v1/batch) from "
                   f"version {now}'s weights (GET /v1/weights)" if loan is not None and
                   not loan.done.done() else "no batch is out; ask for the next one "
                   "(GET /v1/batch)"), 409, version=now)
        # hashing and decoding a whole model's payload: off the session's loop
        header, new = await anyio.to_thread.run_sync(self._checked, version, payload)
        if self._loan is not loan or loan.done.done():  # another publish won meanwhile
            raise Refused(f"version {version} came in from another trainer meanwhile", 409,
                          version=self.version)
        self._weights, self.checksum, self.version = new, header.checksum, version
        self._arrived = _Arrived(version, payload, header)
        loan.done.set_result(metrics)
        return {"version": version, "checksum": header.checksum, "kind": header.kind}

    def _checked(self, version: int, payload: bytes) -> tuple[Header, dict[str, torch.Tensor]]:
        """The payload's header and the weights it makes from the current ones, checked
        (`receive`'s Refused when they are not version `version` of this policy's model)."""
        try:
            header = peek(payload)
        except WeightTransferError as error:
            raise Refused(f"not a weight payload: {error}", 400) from None
        if header.policy != self.name or header.version != version:
            raise Refused(f"the payload is policy {header.policy!r} version {header.version}; "
                          f"this is policy {self.name!r}, publishing version {version}", 422)
        try:
            new = decode(self._weights, payload)
        except BaseMismatch as error:
            raise Refused(f"the delta does not apply to version {version - 1}'s weights "
                          f"({error}); send a full snapshot", 409, send="full") from None
        except WeightTransferError as error:
            raise Refused(f"the payload does not decode: {error}; send a full snapshot", 409,
                          send="full") from None
        wrong = layout_mismatch(self._weights, new)
        if wrong:
            raise Refused(f"the weights are not this policy's model: {wrong}", 422)
        return header, new

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        loan = self._loan
        return {"policy": self.name, "version": self.version, "checksum": self.checksum,
                "batch_out": loan is not None and not loan.done.done(),
                "lent_again": self.lent_again, "refused": self.refused,
                "trainers": {t.name: {"seconds_since_seen": round(now - t.seen, 3)}
                             for t in self.trainers.values()}}

    def __repr__(self) -> str:
        return f"ExternalTrainer({self.name!r}, version={self.version}, url={self.url!r})"


class ExternalPublisher(Publisher):
    """Brings an engine in this process to the version an external trainer sent: the payload as
    it came when the engine holds its base, else a full snapshot of the checked weights."""

    where = "this process"
    overlaps_next_step = True  # the weights are here when publish starts

    def __init__(self, engine: Any, trainer: ExternalTrainer):
        self.engine, self.trainer = engine, trainer

    @property
    def checksum(self) -> int | None:
        return self.trainer.checksum

    def publish_initial(self) -> None:
        version, payload = self.trainer.snapshot()
        self.engine.update_weights(WeightUpdate(self.trainer.name, version,
                                                payload=payload)).result()

    async def publish(self) -> dict[str, Any]:
        trainer, engine = self.trainer, self.engine
        version, arrived = trainer.version, trainer.arrived
        if arrived is not None and arrived.version != version:
            arrived = None
        if arrived is None:
            stats = PublishStats(version, 1.0, 0, trainer.weight_bytes, 0.0)
        else:
            header = arrived.header
            stats = PublishStats(version, header.changed / max(header.elements, 1),
                                 len(arrived.payload) if header.kind == "delta" else 0,
                                 trainer.weight_bytes, 0.0)

        async def fetch(full: bool) -> bytes:
            if not full and arrived is not None and (
                    arrived.header.kind == "full"
                    or (engine.version == arrived.header.base_version
                        and engine.weights_checksum == arrived.header.base_checksum)):
                return arrived.payload
            return (await anyio.to_thread.run_sync(trainer.snapshot))[1]

        async def apply(payload: bytes) -> dict[str, Any]:
            return await apply_to_engine(engine, trainer.name, version, payload)

        payload, applied, fallback = await deliver(fetch, apply)
        return transfer_metrics(payload, applied, fallback, stats, trainer.checksum)


# -- the server ----------------------------------------------------------------------------------

def _metrics(raw: str | None) -> dict[str, float]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise Refused(f"{METRICS_HEADER} is not JSON: {raw[:80]!r}", 400) from None
    if not isinstance(value, dict) or len(value) > _MAX_METRICS:
        raise Refused(f"{METRICS_HEADER} must be a JSON object of at most {_MAX_METRICS} "
                      'names to numbers, e.g. {"loss": 0.12}', 400)
    out = {}
    for name, number in value.items():
        if not _METRIC_NAME.fullmatch(name):
            raise Refused(f"metric name {name[:80]!r}: use letters, digits and _/.- (at most "
                          "64 characters)", 400)
        if _RESERVED.fullmatch(name):
            raise Refused(f"metric name {name!r} is the run's own (the session fills it in); "
                          "call it something else, e.g. 'trainer/" + name + "'", 400)
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(
                number):
            raise Refused(f"metric {name!r} must be a finite number, got {number!r}", 400)
        out[name] = float(number)
    return out


def create_app(trainer: ExternalTrainer, token: str, *, loopback_only: bool = True,
               max_body: int | None = None) -> Any:
    """The endpoint as an ASGI app (`serve` runs it; tests drive it in-process).

    Args:
        trainer: the policy's ExternalTrainer.
        token: the bearer token every request must carry.
        loopback_only: refuse clients not on loopback (403).
        max_body: largest payload taken (413 above); default twice the bf16 weights + 1 MiB.
    """
    limit = 2 * trainer.weight_bytes + (1 << 20) if max_body is None else max_body
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def error(message: str, status: int, **extra: Any) -> Response:
        return JSONResponse({"error": message, **extra}, status_code=status)

    def refused_why(request: Request) -> Response | None:
        client = request.client.host if request.client else ""
        if loopback_only and not is_loopback(client):
            return error("this trainer endpoint serves loopback only", 403)
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error("missing or wrong token: send 'Authorization: Bearer <token>' (the "
                         "token is in the session folder's external/<policy>.json)", 401)
        return None

    def guarded(handler: Any) -> Any:
        async def route(request: Request) -> Response:
            refused = refused_why(request)
            if refused is not None:
                return refused
            try:
                return await handler(request)
            except Refused as why:
                return error(str(why), why.status, **why.extra)
            except _Closed:
                return error("the session closed: no batch will come", 410)
        return route

    async def register(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise Refused("the body must be JSON, e.g. {\"name\": \"my-trainer\"}", 400) from None
        name = body.get("name", "") if isinstance(body, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise Refused("'name' must be a string of 1-128 characters naming the trainer", 400)
        return JSONResponse(trainer.register(name))

    async def weights(request: Request) -> Response:
        version, payload = await anyio.to_thread.run_sync(trainer.snapshot)
        return Response(payload, media_type="application/octet-stream",
                        headers={VERSION_HEADER: str(version)})

    async def batch(request: Request) -> Response:
        try:
            wait = float(request.query_params.get("wait", "30"))
        except ValueError:
            raise Refused("wait must be a number of seconds", 400) from None
        if not math.isfinite(wait) or wait < 0:
            raise Refused("wait must be a number of seconds >= 0", 400)
        loan = await trainer.take(wait, request.headers.get("x-astranb-trainer"))
        if loan is None:
            return Response(status_code=204, headers={VERSION_HEADER: str(trainer.version)})
        return Response(loan.blob, media_type="application/octet-stream",
                        headers={VERSION_HEADER: str(loan.version)})

    async def publish(request: Request) -> Response:
        try:
            return await take(request)
        except Refused:
            trainer.refused += 1
            raise

    async def take(request: Request) -> Response:
        try:
            version = int(request.query_params["version"])
        except (KeyError, ValueError):
            raise Refused("publish needs ?version=N, the version these weights are", 400) from None
        metrics = _metrics(request.headers.get(METRICS_HEADER))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise Refused(f"a payload of {length} bytes is more than this policy's weights can "
                          f"take ({limit})", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Refused(f"the payload is more than this policy's weights can take "
                              f"({limit} bytes)", 413)
        return JSONResponse(await trainer.receive(version, bytes(body), metrics))

    async def status(request: Request) -> Response:
        return JSONResponse(trainer.status())

    return Starlette(routes=[
        Route("/v1/register", guarded(register), methods=["POST"]),
        Route("/v1/weights", guarded(weights), methods=["GET"]),
        Route("/v1/batch", guarded(batch), methods=["GET"]),
        Route("/v1/publish", guarded(publish), methods=["POST"]),
        Route("/v1/status", guarded(status), methods=["GET"]),
    ])


@dataclass
class _Server:
    server: Any
    task: Any
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        with anyio.move_on_after(10):
            while not self.task.done():
                await anyio.sleep(0.02)


async def serve(trainer: ExternalTrainer, choice: External, folder: Path) -> _Server:
    """Start the trainer's endpoint on the running (session's) event loop; write
    `folder/<policy>.json` ({"url", "token", "policy"}, owner-only) for the trainer to read.

    Returns the server (its `stop()` ends it); the trainer learns its url and token."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in choice.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((choice.host, choice.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(64)
    port = sock.getsockname()[1]
    token = choice.token or secrets.token_urlsafe(24)
    app = create_app(trainer, token, loopback_only=is_loopback(choice.host))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 30
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the external trainer endpoint did not start on "
                               f"{choice.host}:{port}")
        await anyio.sleep(0.01)
    host = f"[{choice.host}]" if ":" in choice.host else choice.host
    trainer.url, trainer.token = f"http://{host}:{port}", token
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{trainer.name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"url": trainer.url, "token": token, "policy": trainer.name}, out)
    return _Server(server, task, trainer.url)
