"""The trainer service: takes batches, steps a policy's trainer, serves its weights by version.

    POST /v1/policies            create a policy's trainer (or recover it from its last checkpoint)
    POST /v1/step/{policy}       one optimizer step on a safetensors batch; `expect_version` makes
                                 a retried step harmless (same answer, no second step)
    POST /v1/logprobs/{policy}   the current weights' logprob of each token of a safetensors batch
                                 (safetensors {"logp_B_T"}): the first half of a step whose loss
                                 the caller computes (astranb.training.caller_loss)
    GET  /v1/weights/{policy}    the latest weights for a receiver holding (have_version,
                                 have_checksum): a delta when it holds exactly the previous
                                 version, else a full snapshot (see astranb.weights.store)
    POST /v1/checkpoint/{policy} write a checkpoint now
    GET  /v1/adapter/{policy}    a LoRA policy's adapters: safetensors with adapter_config.json in
                                 its metadata (astranb.training.lora.write_adapter makes PEFT's
                                 folder of it)
    GET  /v1/trace/{policy}      what the last step asked to be recorded (`record=true` on
                                 /v1/step) trained, token by token: a StepTrace's safetensors
                                 (astranb.training.trace); `?step=N` names the step

A policy may have a frozen reference (`"reference"`, astranb.training.reference) and LoRA
adapters (`"lora"`, astranb.training.lora), as plain values; a reference model given as a
directory must exist on this host.

The trainer itself is a backend: `LocalBackend` (one process) or the FSDP backend that rank 0 of a
torchrun job drives (astranb.training.fsdp). Checkpoints land in `checkpoint_dir/<policy>/` as
safetensors + JSON, written to a temporary folder and renamed, with a `latest.json` pointer
replaced atomically; a restarted service resumes from it.

Code never arrives unasked: an algorithm given by reference ({"kind": "import", "ref":
"module:qualname"}) is imported only by a service started with `--allow-code` (`allow_code`), and
refused with 403 otherwise. A user's own loss trains here either way, computed by the caller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Protocol

import anyio
import torch
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from safetensors.torch import save as st_save

from ..algorithms.config import CodeNotAllowed, algorithm_from_dict
from ..models import ModelSpec, dtype_for
from ..remote.serialize import OCTETS, batch_from_bytes, spec_from_wire
from ..training.local import AdamWConfig, LocalTrainer
from ..training.lora import LoRA, adapter_to_bytes, lora_from_dict
from ..training.reference import Reference, reference_from_dict
from ..weights.store import WeightStore
from .http import ServiceConfig, octets, reply, service_app
from .rollout_bodies import NAME, ModelIn

__all__ = ["TrainerConfig", "TrainerBackend", "LocalBackend", "TrainerService", "create_app"]


class TrainerBackend(Protocol):
    """What the service needs of a trainer (LocalBackend here; FSDPBackend under torchrun)."""

    world_size: int

    def create(self, name: str, spec: ModelSpec, algorithm, optimizer: AdamWConfig,
               micro_batch_size: int = 64, *, reference: Reference | None = None,
               lora: LoRA | None = None) -> int: ...
    def step(self, name: str, batch) -> dict[str, float]: ...
    def logprobs(self, name: str, batch) -> torch.Tensor: ...
    def version(self, name: str) -> int: ...
    def weights(self, name: str) -> dict[str, torch.Tensor]: ...
    def save(self, name: str, directory) -> None: ...
    def load(self, name: str, directory) -> int: ...
    def close(self) -> None: ...


class LocalBackend:
    """Every policy's trainer in this process."""

    world_size = 1

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.trainers: dict[str, LocalTrainer] = {}

    def create(self, name, spec, algorithm, optimizer, micro_batch_size=64, *, reference=None,
               lora=None) -> int:
        self.trainers[name] = LocalTrainer(spec, algorithm, optimizer,
                                           micro_batch_size=micro_batch_size,
                                           device=self.device, dtype=dtype_for(self.device, spec),
                                           reference=reference, lora=lora)
        return 0

    def adapter(self, name) -> bytes:
        """The policy's LoRA adapters (`adapter_to_bytes`); ValueError without LoRA."""
        trainer = self.trainers[name]
        trainer.adapter_weights()  # the error when it trains the full weights
        return adapter_to_bytes(trainer.model)

    def step(self, name, batch):
        return self.trainers[name].step(batch)

    def step_recorded(self, name, batch):
        """`step`, and what it trained token by token (the step inspector's StepTrace)."""
        return self.trainers[name].step_recorded(batch)

    def logprobs(self, name, batch):
        return self.trainers[name].logprobs(batch)

    def version(self, name):
        return self.trainers[name].version

    def weights(self, name):
        return self.trainers[name].weights()

    def save(self, name, directory):
        self.trainers[name].save(directory)

    def load(self, name, directory):
        self.trainers[name].load(directory)
        return self.trainers[name].version

    def close(self):
        self.trainers.clear()


@dataclass(frozen=True)
class TrainerConfig:
    """What a trainer service runs.

    Attributes:
        checkpoint_dir: where checkpoints go (None: no checkpoints, no recovery).
        checkpoint_every: checkpoint after every this many steps (0: only on request).
        service: bind address, port, token, body limit.
        allow_code: import algorithms given by reference (their code runs here).
    """

    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    service: ServiceConfig = field(default_factory=ServiceConfig)
    allow_code: bool = False


class ReferenceIn(BaseModel):
    """`reference_to_dict`'s form (astranb.training.reference.Reference)."""

    model: ModelIn | None = None
    kl_coef: float = Field(default=0.0, ge=0.0, le=1e6)
    estimator: str = Field(default="k3", max_length=8)
    distill: float = Field(default=0.0, ge=0.0, le=1e6)


class LoRAIn(BaseModel):
    """`lora_to_dict`'s form (astranb.training.lora.LoRA)."""

    rank: int = Field(ge=1, le=4096)
    alpha: float = Field(gt=0.0, le=1e6)
    target_modules: str | list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default="all-linear", min_length=1, max_length=200)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    modules_to_save: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default=[], max_length=200)


class TrainerPolicyIn(BaseModel):
    name: str = Field(pattern=NAME)
    model: ModelIn
    algorithm: dict[str, Any] = {"kind": "grpo"}
    optimizer: dict[str, Any] = {}
    micro_batch_size: int = Field(default=64, ge=1, le=4096)
    full_every: int = Field(default=10, ge=0, le=1_000_000)
    reference: ReferenceIn | None = None
    lora: LoRAIn | None = None


@dataclass(eq=False)
class _Policy:
    name: str
    request: dict
    store: WeightStore
    last_step: dict | None = None
    checkpoint_version: int = -1
    last_trace: tuple[int, bytes] | None = None
    """(step, StepTrace bytes) of the last step recorded."""


class TrainerService:
    """The state behind the HTTP app."""

    def __init__(self, config: TrainerConfig, backend: TrainerBackend):
        self.config, self.backend = config, backend
        self.instance_id = uuid.uuid4().hex
        self.policies: dict[str, _Policy] = {}
        self._lock = anyio.Lock()  # one backend call at a time (FSDP collectives are ordered)
        self.on_shutdown = lambda: None

    async def _call(self, fn, *args):
        async with self._lock:
            return await anyio.to_thread.run_sync(fn, *args)

    async def add_policy(self, body: TrainerPolicyIn) -> dict:
        # without a reference or LoRA the request is as before (older checkpoints' policy.json)
        request = {k: v for k, v in body.model_dump().items()
                   if v is not None or k not in ("reference", "lora")}
        existing = self.policies.get(body.name)
        if existing is not None:
            if existing.request != request:
                raise HTTPException(409, f"policy {body.name!r} exists with other settings; "
                                         "restart the trainer service or pick another name")
            return self._status(existing)
        try:
            spec = spec_from_wire(request["model"])
            algorithm = algorithm_from_dict(body.algorithm, allow_import=self.config.allow_code)
            settings: dict[str, Any] = {k: tuple(v) if k == "betas" else v
                                        for k, v in body.optimizer.items()}
            optimizer = AdamWConfig(**settings)
        except CodeNotAllowed as error:
            raise HTTPException(403, str(error)) from error
        except (TypeError, ValueError, KeyError) as error:
            raise HTTPException(422, f"invalid algorithm/optimizer: {error}") from error
        extras = _extras(request)
        try:
            await self._call(partial(self.backend.create, **extras), body.name, spec, algorithm,
                             optimizer, body.micro_batch_size)
        except Exception as error:  # a bad spec from the caller, not a service fault
            raise HTTPException(422, f"could not build the trainer for {spec.name!r}: "
                                     f"{error}") from error
        policy = _Policy(body.name, request, WeightStore(body.name, full_every=body.full_every))
        recovered = self._latest_checkpoint(body.name, request)
        if recovered is not None:
            await self._call(self.backend.load, body.name, str(recovered))
            policy.checkpoint_version = self.backend.version(body.name)
        await self._publish(policy)
        self.policies[body.name] = policy
        return self._status(policy) | {"recovered": recovered is not None}

    async def step(self, name: str, expect_version: int, blob: bytes,
                   record: bool = False) -> dict:
        policy = self._policy(name)
        version = self.backend.version(name)
        if (policy.last_step and version == expect_version + 1
                and policy.last_step["step"] == expect_version):
            return policy.last_step  # a retry of the step we just took
        if version != expect_version:
            raise HTTPException(409, f"policy {name!r} is at version {version}, the batch expects "
                                     f"{expect_version}; re-read /v1/status and rebuild the batch")
        batch = batch_from_bytes(blob)
        started = time.perf_counter()
        recorder = getattr(self.backend, "step_recorded", None)  # not under FSDP: a plain step
        trace = None
        if record and recorder is not None:
            metrics, trace = await self._call(recorder, name, batch)
            policy.last_trace = (expect_version, await anyio.to_thread.run_sync(trace.to_bytes))
        else:
            metrics = await self._call(self.backend.step, name, batch)
        step_seconds = time.perf_counter() - started
        publish = await self._publish(policy)
        checkpoint = await self._maybe_checkpoint(policy)
        policy.last_step = {"step": expect_version, "version": self.backend.version(name),
                            "metrics": metrics, "publish": publish, "checkpoint": checkpoint,
                            "trainer_seconds": step_seconds, "checksum": policy.store.checksum,
                            "recorded": trace is not None}
        return policy.last_step

    def trace(self, name: str, step: int | None) -> bytes:
        """The last recorded step's StepTrace bytes (404 when none, or not step `step`)."""
        found = self._policy(name).last_trace
        if found is None or (step is not None and found[0] != step):
            raise HTTPException(404, f"policy {name!r} has no recorded step "
                                     f"{'' if step is None else step}; ask /v1/step with "
                                     "record=true first (the last one recorded is kept)")
        return found[1]

    async def logprobs(self, name: str, expect_version: int, blob: bytes) -> bytes:
        self._policy(name)
        version = self.backend.version(name)
        if version != expect_version:
            raise HTTPException(409, f"policy {name!r} is at version {version}, the batch expects "
                                     f"{expect_version}; re-read /v1/status and rebuild the batch")
        logp_B_T = await self._call(self.backend.logprobs, name, batch_from_bytes(blob))
        return st_save({"logp_B_T": logp_B_T.contiguous()})

    async def _publish(self, policy: _Policy) -> dict:
        version = self.backend.version(policy.name)

        def publish():
            return policy.store.publish(version, self.backend.weights(policy.name))

        stats = await self._call(publish)
        return dataclasses.asdict(stats)

    async def adapter(self, name: str) -> bytes:
        self._policy(name)
        make = getattr(self.backend, "adapter", None)
        if make is None:
            raise HTTPException(409, f"this trainer service's backend "
                                     f"({type(self.backend).__name__}) does not train adapters")
        try:
            payload: bytes = await self._call(make, name)
        except ValueError as error:  # a policy that trains its full weights
            raise HTTPException(409, f"policy {name!r}: {error}") from error
        return payload

    # checkpoints
    async def _maybe_checkpoint(self, policy: _Policy) -> int | None:
        every = self.config.checkpoint_every
        if self.config.checkpoint_dir and every and self.backend.version(policy.name) % every == 0:
            return await self.checkpoint(policy.name)
        return None

    async def checkpoint(self, name: str) -> int:
        policy = self._policy(name)
        if not self.config.checkpoint_dir:
            raise HTTPException(409, "this trainer service has no --checkpoint-dir")
        root = Path(self.config.checkpoint_dir) / name
        version = self.backend.version(name)
        final = root / f"v{version:06d}"
        tmp = root / f".tmp-{uuid.uuid4().hex}"
        await self._call(self.backend.save, name, str(tmp))
        (tmp / "policy.json").write_text(json.dumps(policy.request))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _atomic_write(root / "latest.json", json.dumps({"version": version, "path": final.name}))
        for old in root.glob("v*"):
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        policy.checkpoint_version = version
        return version

    def _latest_checkpoint(self, name: str, request: dict) -> Path | None:
        if not self.config.checkpoint_dir:
            return None
        pointer = Path(self.config.checkpoint_dir) / name / "latest.json"
        if not pointer.is_file():
            return None
        path = pointer.parent / json.loads(pointer.read_text())["path"]
        saved = json.loads((path / "policy.json").read_text())
        if saved != request:
            raise HTTPException(409, f"the checkpoint in {path} was made with other policy "
                                     "settings; use the same settings, or another "
                                     "--checkpoint-dir")
        return path

    # weights and status
    def weights(self, name: str, have_version: int | None, have_checksum: int | None) -> bytes:
        return self._policy(name).store.pull(have_version, have_checksum)

    def status(self) -> dict:
        return {"service": "trainer", "instance_id": self.instance_id,
                "world_size": self.backend.world_size, "allow_code": self.config.allow_code,
                "policies": {n: self._status(p) for n, p in self.policies.items()}}

    def _status(self, policy: _Policy) -> dict:
        return {"policy": policy.name, "version": policy.store.version,
                "checksum": policy.store.checksum, "checkpoint_version": policy.checkpoint_version}

    def _policy(self, name: str) -> _Policy:
        policy = self.policies.get(name)
        if policy is None:
            raise HTTPException(404, f"no policy {name!r} on this trainer (it has "
                                     f"{sorted(self.policies)}); create it with POST /v1/policies")
        return policy


def _extras(request: dict) -> dict[str, Any]:
    """The create request's reference and LoRA, built and checked (422 naming the field)."""
    extras: dict[str, Any] = {}
    if request.get("reference") is not None:
        try:
            reference = request["reference"]
            model = reference.get("model")
            if model is not None:
                model = dataclasses.asdict(spec_from_wire(model))
            extras["reference"] = reference_from_dict({**reference, "model": model})
        except (TypeError, ValueError, KeyError) as error:
            raise HTTPException(422, f"invalid reference: {error}") from error
        spec = extras["reference"].model
        if spec is not None and spec.path is not None and not Path(spec.path).is_dir():
            raise HTTPException(422, f"invalid reference: reference.model.path {spec.path!r} is "
                                     "not a directory on the trainer service's host; copy the "
                                     "model there and give its path on that host")
    if request.get("lora") is not None:
        try:
            extras["lora"] = lora_from_dict(request["lora"])
        except (TypeError, ValueError, KeyError) as error:
            raise HTTPException(422, f"invalid lora: {error}") from error
    return extras


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def create_app(
    config: TrainerConfig | None = None, backend: TrainerBackend | None = None
) -> FastAPI:
    """The trainer service as an ASGI app over `backend` (default: LocalBackend on CPU)."""
    config = config or TrainerConfig()
    service = TrainerService(config, backend or LocalBackend())

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.backend.close)

    app = service_app("astranb trainer service", service, config.service, lifespan)

    @app.post("/v1/policies")
    async def policies(body: TrainerPolicyIn) -> dict:
        return await service.add_policy(body)

    @app.post("/v1/step/{policy}", response_model=None, openapi_extra={"requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}})
    async def step(policy: str, request: Request, expect_version: int = Query(ge=0),
                   record: bool = False) -> Response:
        return reply(request, await service.step(policy, expect_version, await request.body(),
                                                 record))

    @app.post("/v1/logprobs/{policy}", response_class=Response, openapi_extra={"requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}},
        responses={200: {"content": {OCTETS: {}}, "description": "safetensors logp_B_T"}})
    async def logprobs(policy: str, request: Request,
                       expect_version: int = Query(ge=0)) -> Response:
        return octets(await service.logprobs(policy, expect_version, await request.body()))

    @app.get("/v1/weights/{policy}", response_class=Response,
             responses={200: {"content": {OCTETS: {}}, "description": "weight payload"}})
    async def get_weights(
        policy: str, have_version: int | None = None, have_checksum: int | None = None
    ) -> Response:
        # off the event loop: the first full snapshot after a publish is encoded here
        payload = await anyio.to_thread.run_sync(service.weights, policy, have_version,
                                                 have_checksum)
        return octets(payload)

    @app.get("/v1/trace/{policy}", response_class=Response,
             responses={200: {"content": {OCTETS: {}}, "description": "StepTrace safetensors"}})
    async def trace(policy: str, step: int | None = Query(default=None, ge=0)) -> Response:
        return octets(service.trace(policy, step))

    @app.post("/v1/checkpoint/{policy}")
    async def checkpoint(policy: str) -> dict:
        return {"version": await service.checkpoint(policy)}

    @app.get("/v1/adapter/{policy}", response_class=Response,
             responses={200: {"content": {OCTETS: {}}, "description": "safetensors adapters"}})
    async def adapter(policy: str) -> Response:
        return octets(await service.adapter(policy))

    return app
