"""What every astranb service shares: bind rules, bearer-token auth, body limits, body encodings.

A service listens on loopback unless told otherwise, and refuses to listen anywhere else without a
token. With a token, every endpoint but the liveness probe `/health` wants
`Authorization: Bearer <token>`. Bodies above `max_body_bytes` are refused with 413 before they are
read. Request bodies may be JSON or msgpack (msgpack is turned into JSON before FastAPI validates
it, so one schema serves both); the hot endpoints answer in the encoding the client accepts.
Malformed requests get a 4xx whose message names the bad field.
"""

from __future__ import annotations

import hmac
import json
import socket
from dataclasses import dataclass

import msgpack
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..errors import AstranbError
from ..loopback import is_loopback
from ..remote.serialize import JSON, MSGPACK, OCTETS, pack

__all__ = ["ServiceConfig", "InsecureBind", "service_app", "install", "reply", "octets",
           "free_port", "is_loopback"]

PUBLIC_PATHS = frozenset({"/health"})


class InsecureBind(AstranbError, ValueError):
    """A service was asked to listen beyond loopback without a token."""


@dataclass(frozen=True)
class ServiceConfig:
    """Where and how a service listens.

    Attributes:
        host: bind address; loopback by default.
        port: TCP port (0 picks a free one).
        token: bearer token every request must carry (required for non-loopback binds).
        max_body_bytes: largest request body accepted.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    max_body_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.token:
            raise InsecureBind(
                f"refusing to listen on {self.host!r} without a token: anyone who can reach the "
                "port could drive the service. Pass --token (or ASTRANB_TOKEN) or bind 127.0.0.1."
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")


def service_app(title: str, service, config: ServiceConfig, lifespan) -> FastAPI:
    """A service's FastAPI app with what every service has: the guard middleware, field-naming
    errors, `/health` (no token), `/v1/status` (service.status()) and `/v1/shutdown`
    (service.on_shutdown())."""
    app = install(FastAPI(title=title, version="1", lifespan=lifespan), config)
    app.state.service = service

    @app.get("/health")
    async def health() -> dict:
        """Liveness probe (no token needed)."""
        return {"ok": True}

    @app.get("/v1/status")
    async def status() -> dict:
        return service.status()

    @app.post("/v1/shutdown")
    async def shutdown() -> dict:
        service.on_shutdown()
        return {"ok": True}

    return app


def install(app: FastAPI, config: ServiceConfig) -> FastAPI:
    """Add auth, the body limit, msgpack bodies and field-naming validation errors to `app`."""
    app.add_middleware(_Guard, token=config.token, limit=config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in error.errors()
        ]
        return JSONResponse({"error": "invalid request: " + "; ".join(problems)}, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        return JSONResponse({"error": str(error.detail)}, status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, error: ValueError):
        return JSONResponse({"error": str(error)}, status_code=400)

    return app


def reply(request: Request, data, status_code: int = 200) -> Response:
    """Answer `data` in msgpack when the client accepts it, else JSON."""
    kind = MSGPACK if MSGPACK in request.headers.get("accept", "") else JSON
    return Response(pack(data, kind), status_code=status_code, media_type=kind)


SLICE = 1 << 20  # bytes of a large body handed to the transport at a time


class _Octets(Response):
    """A binary body sent in slices of `SLICE` bytes, with its Content-Length.

    Handed over whole, a body the socket cannot take at once is copied twice by asyncio's socket
    transport (the unsent tail sliced off, then appended to its buffer): for a 134 MB weight
    snapshot that was two fresh 134 MB copies, most of what the server spent on a pull. In
    slices, at most one slice waits in the transport's buffer, and uvicorn's flow control holds
    the next one until the socket drains.
    """

    media_type = OCTETS

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        view, size = memoryview(self.body), len(self.body)
        if not size:
            await send({"type": "http.response.body", "body": b""})
        for start in range(0, size, SLICE):  # each slice a small warm copy (ASGI wants bytes)
            await send({"type": "http.response.body", "body": bytes(view[start:start + SLICE]),
                        "more_body": start + SLICE < size})


def octets(payload: bytes | bytearray) -> Response:
    """A binary answer (application/octet-stream) for large bodies: sent in slices, no copy of
    the whole body."""
    return _Octets(memoryview(payload))  # a received bytearray too (Starlette takes no bytearray)


class _Guard:
    """Pure ASGI middleware: token check, body limit, msgpack request bodies to JSON."""

    def __init__(self, app, token: str | None, limit: int):
        self.app, self.limit = app, limit
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and scope["path"] not in PUBLIC_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send_error(send, 401, "missing or wrong bearer token; send "
                                         "'Authorization: Bearer <token>' (the service's --token)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, 413, f"request body larger than {self.limit} bytes")
        # collected as a list and joined once: `body += chunk` copied the whole body so far for
        # every chunk the server read (quadratic: a 64 MB push took 5.5 s)
        chunks = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if chunk:
                chunks.append(chunk)
                size += len(chunk)
            more = message.get("more_body", False)
            if size > self.limit:
                return await _send_error(send, 413, f"request body larger than {self.limit} bytes")
        body = b"".join(chunks)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip()
        if kind in (MSGPACK.encode(), b"application/x-msgpack"):
            try:
                body = json.dumps(msgpack.unpackb(body, raw=False), separators=(",", ":")).encode()
            except (ValueError, TypeError, msgpack.UnpackException) as error:
                return await _send_error(send, 400, f"body is not valid msgpack: {error}")
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k not in (b"content-type", b"content-length")]
                         + [(b"content-type", JSON.encode()),
                            (b"content-length", str(len(body)).encode())])
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for tests and `--port 0` reporting)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
