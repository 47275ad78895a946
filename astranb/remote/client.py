"""The Session's side of the services: small async httpx clients, one per service.

Every call carries the bearer token, speaks msgpack, and turns failures into two errors a caller
can act on: `ServiceUnavailable` (nothing answered: dead, restarting, network) and `ServiceError`
(it answered with an error; the message is the service's own, which says what was wrong).
Clients take an injectable httpx transport, so tests can drive an app in-process.

Weight payloads (tens to thousands of MB) are read by `get_octets`, which puts the body straight
into one buffer, instead of httpx's 64 KB chunks joined at the end (2-3x the time on loopback).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import torch
from safetensors.torch import load as st_load

from ..errors import ServiceError, ServiceUnavailable
from ..types import Batch
from .serialize import JSON, MSGPACK, OCTETS, batch_to_bytes, pack, unpack

__all__ = ["ServiceError", "ServiceUnavailable", "RolloutClient", "TrainerClient", "get_octets"]

_HEAD_LIMIT = 1 << 16  # bytes of status line and headers accepted
_BODY_LIMIT = 1 << 38  # a body claiming more (256 GiB) is refused before allocating


class _Answer(asyncio.BufferedProtocol):
    """One HTTP/1.1 answer read off its own connection: the head into a small buffer, then a body
    of Content-Length bytes straight into one buffer of that size."""

    def __init__(self, done: asyncio.Future[None], watch: Any = None) -> None:
        self.done = done
        self.watch = watch  # told of the body's buffer and of every byte landing in it
        self.scratch = memoryview(bytearray(1 << 16))
        self.head = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: bytearray | None = None
        self.view = memoryview(b"")
        self.got = 0
        self.odd = False  # an answer get_octets leaves to httpx (no Content-Length, chunked)
        self.progress = False  # bytes arrived since the caller last looked

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None and self.got < len(self.view):
            return self.view[self.got:]
        return self.scratch  # the head, or bytes past the body (ignored)

    def buffer_updated(self, nbytes: int) -> None:
        self.progress = True
        if self.done.done():
            return
        if self.body is not None:
            self.got += nbytes
            if self.watch is not None:
                self.watch.arrived(self.got)
            if self.got >= len(self.view):
                self.done.set_result(None)
            return
        self.head += self.scratch[:nbytes]
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > _HEAD_LIMIT:
                self.done.set_exception(ConnectionError("the answer's head is too long"))
            return
        try:
            lines = self.head[:end].decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
            length = int(self.headers["content-length"])
        except (ValueError, IndexError, KeyError):
            length = -1
        if length > _BODY_LIMIT:
            self.done.set_exception(ConnectionError(
                f"the answer claims {length} bytes, more than the {_BODY_LIMIT} accepted"))
            return
        if length < 0 or "transfer-encoding" in self.headers:
            self.odd = True
            self.done.set_result(None)
            return
        rest = self.head[end + 4 : end + 4 + length]
        self.body = bytearray(length)
        self.view = memoryview(self.body)
        self.view[: len(rest)] = rest
        self.got = len(rest)
        if self.watch is not None:
            self.watch.open(self.body)
            self.watch.arrived(self.got)
        if self.got >= length:
            self.done.set_result(None)

    def eof_received(self) -> bool:
        self.connection_lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError(
                "the connection closed before the whole answer arrived"))


async def get_octets(url: str, params: Mapping[str, Any] | None = None,
                     headers: Mapping[str, str] | None = None, *,
                     timeout: float = 600.0,
                     watch: Any = None) -> tuple[int, str, bytes | bytearray] | None:
    """GET `url` on a connection of its own, reading a Content-Length body into one buffer.

    Returns (status, content type, body), or None where this path does not apply and the caller
    should use httpx: not on an asyncio loop, not plain http, a proxy configured for the host,
    credentials in the URL, header values httpx would refuse, or an answer without a
    Content-Length. The body is that buffer itself, not a copy. Raises OSError when nothing (or
    not all) came back, TimeoutError when connecting, or a wait for the next bytes, took longer
    than `timeout` seconds (as httpx's).

    `watch` (a weights.Incoming) is given the body's buffer (`open`) and each count of bytes in
    it (`arrived`), on the loop's thread, so that it can work on a payload as it lands.
    """
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or not host or parts.username is not None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio, or no loop
        return None
    proxies = urllib.request.getproxies()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return None
    fields = dict(headers or {})
    if any(c in f"{k}{v}" for k, v in fields.items() for c in "\r\n\0"):
        return None
    query = "&".join(q for q in (parts.query, urlencode(params or {})) if q)
    target = (parts.path or "/") + (f"?{query}" if query else "")
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{parts.port}"
    fields = {"host": authority, "accept": OCTETS, **fields, "connection": "close"}
    request = f"GET {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    done: asyncio.Future[None] = loop.create_future()
    async with asyncio.timeout(timeout):
        transport, answer = await loop.create_connection(lambda: _Answer(done, watch), host,
                                                         parts.port or 80)
    try:
        transport.write((request + "\r\n").encode("latin-1"))
        while not done.done():
            answer.progress = False
            await asyncio.wait([done], timeout=timeout)
            if not done.done() and not answer.progress:
                raise TimeoutError(f"no bytes from {url} for {timeout} s")
        done.result()
    finally:
        if not done.done():  # timed out or cancelled: the closing connection reports to nobody
            done.cancel()
        transport.close()
    if answer.odd or answer.body is None:
        return None
    kind = answer.headers.get("content-type", JSON).split(";")[0].strip()
    return answer.status, kind, answer.body


class _Client:
    def __init__(self, url: str, token: str | None = None, *, timeout: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"accept": f"{MSGPACK}, {JSON}"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers, self._timeout, self._transport = headers, timeout, transport
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout,
                                       transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                      params: dict | None = None, timeout: float | None = None) -> Any:
        """One call; returns the decoded body (bytes for octet-stream answers)."""
        headers, content = {}, None
        if raw is not None:
            headers["content-type"], content = OCTETS, raw
        elif body is not None:
            headers["content-type"], content = MSGPACK, pack(body)
        extra: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        try:
            answer = await self._http.request(method, path, content=content, headers=headers,
                                              params=params, **extra)
        except (httpx.TransportError, OSError) as error:
            raise ServiceUnavailable(f"{self.url}{path}: {type(error).__name__}: {error}") from None
        kind = answer.headers.get("content-type", JSON).split(";")[0]
        return self._answer(path, answer.status_code, kind, answer.content, answer.text)

    async def get_payload(self, path: str, params: dict | None = None, watch: Any = None) -> Any:
        """A GET whose answer is large (weights): read by `get_octets` (which tells `watch` of
        its bytes) unless a test transport is injected or that path does not apply; answered as
        `request` answers."""
        if self._transport is None:
            try:
                got = await get_octets(f"{self.url}{path}", params, self._headers,
                                       timeout=self._timeout, watch=watch)
            except (OSError, TimeoutError) as error:
                raise ServiceUnavailable(
                    f"{self.url}{path}: {type(error).__name__}: {error}") from None
            if got is not None:
                status, kind, content = got
                return self._answer(path, status, kind, content,
                                    content.decode("utf-8", "replace") if status >= 400 else "")
        return await self.request("GET", path, params=params)

    def _answer(self, path: str, status: int, kind: str, content: bytes | bytearray,
                text: str) -> Any:
        if status >= 400:
            try:
                message = unpack(content, kind).get("error") or text
            except (ValueError, AttributeError):
                message = text[:500]
            raise ServiceError(f"{self.url}{path}", status, str(message))
        return content if kind == OCTETS else unpack(content, kind)

    async def health(self, timeout: float = 2.0) -> bool:
        try:
            await self.request("GET", "/health", timeout=timeout)
            return True
        except (ServiceUnavailable, ServiceError):
            return False

    async def status(self, timeout: float | None = 10.0) -> dict:
        return await self.request("GET", "/v1/status", timeout=timeout)

    async def shutdown(self) -> None:
        await self.request("POST", "/v1/shutdown")


class RolloutClient(_Client):
    """Client of a rollout service (see astranb.services.rollout_app)."""

    async def add_policy(self, name: str, model: dict, *, max_batch_size: int = 64,
                         seed: int = 0) -> dict:
        return await self.request("POST", "/v1/policies", {"name": name, "model": model,
                                                           "max_batch_size": max_batch_size,
                                                           "seed": seed})

    async def register(self, name: str, roles: dict[str, str], kwargs: dict | None = None) -> str:
        answer = await self.request("POST", "/v1/environments",
                                    {"name": name, "roles": roles, "kwargs": kwargs or {}})
        return answer["env_id"]

    async def availability(self) -> int:
        return int((await self.request("GET", "/v1/availability", timeout=10))["availability"])

    async def submit(self, items: list[dict], lane: str = "train") -> dict:
        return await self.request("POST", "/v1/submit", {"items": items, "lane": lane}, timeout=60)

    async def pull(self, ack: list[str], *, max_items: int = 512, wait: float = 0.5,
                   resend: bool = False, lane: str = "train") -> dict:
        body = {"ack": ack, "max": max_items, "wait": wait, "resend": resend, "lane": lane}
        return await self.request("POST", "/v1/pull", body, timeout=wait + 30)

    async def notify_version(self, policy: str, version: int, trainer_url: str,
                             checksum: int | None = None, relay: str | None = None,
                             share: bool = False) -> dict:
        """Make the service pull `version` (from `relay` if given, else the trainer); with
        `share` it keeps what it pulled for the rest of its region."""
        return await self.request("POST", "/v1/notify_version", {
            "policy": policy, "version": version, "url": trainer_url, "checksum": checksum,
            "relay": relay, "share": share})

    async def push_weights(self, policy: str, payload: bytes) -> dict:
        return await self.request("POST", f"/v1/weights/{policy}", raw=payload)


class TrainerClient(_Client):
    """Client of a trainer service (see astranb.services.trainer_app)."""

    async def add_policy(self, body: dict) -> dict:
        return await self.request("POST", "/v1/policies", body)

    async def step(self, policy: str, expect_version: int, batch: Batch, *,
                   record: bool = False) -> dict:
        """One step; with `record`, the service keeps what it trained (`trace`)."""
        blob = batch_to_bytes(batch, policy=policy)
        params: dict[str, Any] = {"expect_version": expect_version}
        if record:
            params["record"] = "true"
        return await self.request("POST", f"/v1/step/{policy}", raw=blob, params=params)

    async def trace(self, policy: str, step: int) -> bytes:
        """The StepTrace bytes of recorded step `step`."""
        return bytes(await self.request("GET", f"/v1/trace/{policy}", params={"step": step}))

    async def logprobs(self, policy: str, expect_version: int, batch: Batch) -> torch.Tensor:
        """The trainer's logprob of each of the batch's tokens at version `expect_version`."""
        blob = batch_to_bytes(batch, policy=policy)
        found = await self.request("POST", f"/v1/logprobs/{policy}", raw=blob,
                                   params={"expect_version": expect_version})
        return st_load(bytes(found))["logp_B_T"]

    async def weights(self, policy: str, have_version: int | None = None,
                      have_checksum: int | None = None, *, watch: Any = None) -> bytes | bytearray:
        """The payload that brings a receiver holding (have_version, have_checksum) up to date.
        `watch`: a weights.Incoming to work on it as it arrives (then `watch.finish(payload)`)."""
        pairs = (("have_version", have_version), ("have_checksum", have_checksum))
        params = {k: v for k, v in pairs if v is not None}
        payload: bytes | bytearray = await self.get_payload(f"/v1/weights/{policy}", params, watch)
        return payload

    async def checkpoint(self, policy: str) -> int:
        return int((await self.request("POST", f"/v1/checkpoint/{policy}"))["version"])

    async def adapter(self, policy: str) -> bytes:
        """A LoRA policy's adapters: safetensors with adapter_config.json in its metadata
        (astranb.training.lora.write_adapter writes PEFT's folder of it)."""
        payload: bytes | bytearray = await self.get_payload(f"/v1/adapter/{policy}")
        return bytes(payload)
