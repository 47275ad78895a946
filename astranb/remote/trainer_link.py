"""The training loop's end of an external trainer (remote/external.py is the session's end).

A training loop written with anything (plain PyTorch, another framework), in another process or
on another host, trains a session's policy through a `TrainerLink`:

    link = TrainerLink.from_file("runs/x/external/solver.json")   # or TrainerLink(url, token)
    model = build_the_model(link.spec)          # the policy's model; batches() loads its weights
    for batch in link.batches(model):                             # ends when the session closes
        loss = my_loss(model, batch)                              # tokens, masks, advantages,
        loss.backward(); optimizer.step(); optimizer.zero_grad()  # old logprobs, versions
        link.publish(model.state_dict(), metrics={"loss": loss.item()})

`publish` sends the new version as a delta against the previous one (bf16 bits, astranb's weight
codec), or a full snapshot when the session asks for one. A loop that starts again after a crash
calls `weights()` first: it gets the version the session is at and the batch still out for it.
Synchronous on purpose (httpx's blocking client): a training loop is.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

from ..errors import AstranbError, ServiceUnavailable
from ..models import ModelSpec
from ..types import Batch
from ..weights.codec import decode, peek
from ..weights.store import WeightStore
from .external import METRICS_HEADER, VERSION_HEADER
from .serialize import batch_from_bytes, spec_from_wire

__all__ = ["TrainerLink", "TrainerLinkError", "OutOfSync"]


class TrainerLinkError(AstranbError, RuntimeError):
    """The session refused a request; the message is its own (it says what to do)."""

    def __init__(self, message: str, status: int, answer: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.answer = dict(answer or {})
        """The session's answer (e.g. {"send": "full"}, {"version": 7})."""


class OutOfSync(TrainerLinkError):
    """The link's weights are not the version the session's batch is for: call `weights()`,
    load them into the model, and train the batch from there."""


class TrainerLink:
    """A training loop's connection to one policy of a session (`trainer="external"`).

    Args:
        url: the endpoint (`external/<policy>.json` in the session folder has it).
        token: its bearer token (same file).
        name: what the session calls this trainer (default: host:pid).
        patience: seconds to keep retrying while the session does not answer at all.
        timeout: seconds one request may take.
    """

    def __init__(self, url: str, token: str, *, name: str | None = None,
                 patience: float = 30.0, timeout: float = 120.0):
        self.url, self.patience = url.rstrip("/"), patience
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers={
            "Authorization": f"Bearer {token}", "X-Astranb-Trainer": self.name})
        self.info: dict[str, Any] = self._call("POST", "/v1/register",
                                               json={"name": self.name}).json()
        self.policy: str = self.info["policy"]
        self.version: int = int(self.info["version"])
        """The version of the weights this link last received or published."""
        self._store = WeightStore(self.policy, full_every=0)
        self._names: list[str] = list(self.info["weight_names"])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **options: Any) -> TrainerLink:
        """A link from the `external/<policy>.json` a session wrote."""
        try:
            found = json.loads(Path(path).read_text())
            url, token = found["url"], found["token"]
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"{path}: not an external trainer's file ({error!r}); the session "
                             "writes <session folder>/external/<policy>.json when a policy is "
                             "created with trainer='external'") from None
        return cls(url, token, **options)

    @property
    def spec(self) -> ModelSpec:
        """The policy's model (`spec.build()` makes it; its weights come from `weights()`)."""
        return spec_from_wire(self.info["model"])

    @property
    def algorithm(self) -> dict[str, Any] | None:
        """The policy's algorithm settings (astranb's own algorithms; None for others): what a
        loop of its own may read its clip range or entropy coefficient from."""
        algorithm: dict[str, Any] | None = self.info.get("algorithm")
        return algorithm

    # -- weights ---------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The session's current weights (bf16, by parameter name) and version (`self.version`).
        `model.load_state_dict(link.weights())` converts them to the model's dtype."""
        answer = self._call("GET", "/v1/weights")
        payload = answer.content
        header = peek(payload)
        tensors = decode(None, payload)
        self.version = header.version
        self._store = WeightStore(self.policy, full_every=0)
        self._store.publish(self.version, tensors)
        return tensors

    def publish(self, weights: Mapping[str, torch.Tensor],
                metrics: Mapping[str, float] | None = None) -> int | None:
        """Send the weights after training the current batch: they become version
        `self.version + 1`, which is returned. `weights` may hold more than the policy's
        tensors (a state_dict's extras are left out); `metrics` go into the run's metrics row.

        Returns None when the session did not take them because the batch is no longer out
        (the run stopped, or another trainer published this version first): the link is then
        out of sync, and the next batch needs the session's weights loaded again
        (`batches(model)` does that itself).

        Raises:
            ValueError: a weight the policy has is missing.
            TrainerLinkError: the session refused the weights themselves (its message says
                why: malformed, another model's).
        """
        if self._store.checksum is None:
            raise OutOfSync("publish needs the weights it trained from: call weights() first", 409)
        missing = [n for n in self._names if n not in weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} of the policy's tensors, e.g. "
                             f"{missing[:3]}; publish the whole model's state_dict()")
        base_version, base_checksum = self.version, self._store.checksum
        version = base_version + 1
        self._store.publish(version, {n: weights[n] for n in self._names})
        headers = {METRICS_HEADER: json.dumps(dict(metrics or {})),
                   "Content-Type": "application/octet-stream"}
        payload = self._store.pull(base_version, base_checksum)
        try:
            try:
                self._call("POST", "/v1/publish", params={"version": version}, content=payload,
                           headers=headers)
            except TrainerLinkError as error:
                if error.answer.get("send") != "full":
                    raise
                self._call("POST", "/v1/publish", params={"version": version},
                           content=self._store.pull_full(), headers=headers)
        except TrainerLinkError as error:
            self._store = WeightStore(self.policy, full_every=0)  # its base is unknown now
            if error.status == 409 and "version" in error.answer:  # not awaited: out of sync
                self.version = -1
                return None
            raise
        self.version = version
        return version

    # -- batches ---------------------------------------------------------------------------------
    def next_batch(self, wait: float = 30.0) -> Batch | None:
        """The batch to train at `self.version` (waiting for one as long as it takes, asking
        every `wait` seconds); None once the session has closed.

        Raises:
            OutOfSync: the session's batch is for another version than this link's weights
                (another trainer published meanwhile): call `weights()` and train it from them.
        """
        while True:
            answer = self._call("GET", "/v1/batch", params={"wait": wait}, gone_ok=True)
            if answer.status_code == 410:
                return None
            if answer.status_code == 204:
                continue
            version = int(answer.headers[VERSION_HEADER])
            if version != self.version or self._store.checksum is None:
                raise OutOfSync(f"the session's batch is for version {version}, this link holds "
                                f"version {self.version}: call weights(), load them, and train "
                                "the batch from there", 409)
            return batch_from_bytes(answer.content)

    def batches(self, model: torch.nn.Module | None = None, *, wait: float = 30.0
                ) -> Iterator[Batch]:
        """Every batch the session lends, one after another, until it closes. Publish each
        before asking for the next (the next batch is for the version it makes).

        With `model`, the link keeps it on the session's weights: they are loaded into it
        first and again whenever the link is out of sync (a publish the session did not take,
        another trainer's version), with a line saying so. Without, `OutOfSync` is raised."""
        if model is not None and self._store.checksum is None:
            model.load_state_dict(self.weights())
        while True:
            try:
                batch = self.next_batch(wait)
            except OutOfSync:
                if model is None:
                    raise
                stale = self.version
                model.load_state_dict(self.weights())
                print(f"TrainerLink {self.policy}: the session is at version {self.version} "
                      f"(this loop had {stale if stale >= 0 else 'weights it did not take'}); "
                      "its weights are loaded, training goes on from them", flush=True)
                continue
            if batch is None:
                return
            yield batch

    def status(self) -> dict[str, Any]:
        """The session's view: version, whether a batch is out, the trainers registered."""
        found: dict[str, Any] = self._call("GET", "/v1/status").json()
        return found

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TrainerLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, gone_ok: bool = False, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.patience
        while True:
            try:
                answer = self._http.request(method, path, **kw)
            except httpx.TransportError as error:
                if time.monotonic() > deadline:
                    if gone_ok:  # the session went away while a loop waited: its end
                        return httpx.Response(410)
                    raise ServiceUnavailable(f"{self.url}{path}: no answer for "
                                             f"{self.patience:.0f} s ({error!r})") from None
                time.sleep(0.2)
                continue
            if answer.status_code < 400 or (gone_ok and answer.status_code == 410):
                return answer
            try:
                body = answer.json()
            except ValueError:
                body = {}
            body = body if isinstance(body, dict) else {}
            message = body.get("error") or answer.text
            raise TrainerLinkError(f"{method} {path}: {answer.status_code}: {message}",
                                   answer.status_code, body)
