"""The Session's side of the services: small async httpx clients, one per service.

Every call carries the bearer token, speaks msgpack, and turns failures into two errors a caller
can act on: `ServiceUnavailable` (nothing answered: dead, restarting, network) and `ServiceError`
(it answered with an error; the message is the service's own, which says what was wrong).
Clients take an injectable httpx transport, so tests can drive an app in-process.
"""

from __future__ import annotations

from typing import Any

import httpx

from ..errors import ServiceError, ServiceUnavailable
from ..types import Batch
from .serialize import JSON, MSGPACK, OCTETS, batch_to_bytes, pack, unpack

__all__ = ["ServiceError", "ServiceUnavailable", "RolloutClient", "TrainerClient"]


class _Client:
    def __init__(self, url: str, token: str | None = None, *, timeout: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"accept": f"{MSGPACK}, {JSON}"}
        if token:
            headers["authorization"] = f"Bearer {token}"
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
        if answer.status_code >= 400:
            try:
                message = unpack(answer.content, kind).get("error") or answer.text
            except (ValueError, AttributeError):
                message = answer.text[:500]
            raise ServiceError(f"{self.url}{path}", answer.status_code, str(message))
        return answer.content if kind == OCTETS else unpack(answer.content, kind)

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
                             checksum: int | None = None) -> dict:
        return await self.request("POST", "/v1/notify_version", {
            "policy": policy, "version": version, "url": trainer_url, "checksum": checksum})

    async def push_weights(self, policy: str, payload: bytes) -> dict:
        return await self.request("POST", f"/v1/weights/{policy}", raw=payload)


class TrainerClient(_Client):
    """Client of a trainer service (see astranb.services.trainer_app)."""

    async def add_policy(self, body: dict) -> dict:
        return await self.request("POST", "/v1/policies", body)

    async def step(self, policy: str, expect_version: int, batch: Batch) -> dict:
        blob = batch_to_bytes(batch, policy=policy)
        return await self.request("POST", f"/v1/step/{policy}", raw=blob,
                                  params={"expect_version": expect_version})

    async def weights(self, policy: str, have_version: int | None = None,
                      have_checksum: int | None = None) -> bytes:
        pairs = (("have_version", have_version), ("have_checksum", have_checksum))
        params = {k: v for k, v in pairs if v is not None}
        return await self.request("GET", f"/v1/weights/{policy}", params=params)

    async def checkpoint(self, policy: str) -> int:
        return int((await self.request("POST", f"/v1/checkpoint/{policy}"))["version"])
