"""The rollout service: plays episodes of registered environments on its engines, over HTTP.

A Session (or anyone with the token) drives it in four moves, as AstraFlow's rollout service:

1. `POST /v1/policies`     build an engine for a policy from a model spec (hf, sglang, vllm or
                           instant);
2. `POST /v1/environments` register an environment by its installed name, with role -> policy;
3. `POST /v1/submit`       queue episodes (id, environment, sample); `GET /v1/availability` says
                           how many more it takes now;
4. `POST /v1/pull`         collect finished episodes (long-poll with `wait`), acknowledging the
                           ones already received so they are forgotten.

Weights reach an engine in two ways: `POST /v1/notify_version` makes the service pull the new
version from the trainer service (a delta when its own weights are exactly the previous version,
else a full snapshot), and `POST /v1/weights/{policy}` pushes a payload in the body.

Regions: a service started with `--region NAME` says so in its status. In a region, the session
makes one service the relay (`share`: it keeps what it pulled, astranb.weights.relay) and tells
the others to pull from it (`relay`: its URL), so each version crosses the link to the trainer
once. `GET /v1/weights/{policy}` is the relay's side; a receiver whose relay fails or lags pulls
from the trainer instead. `--trainer-url` is how this service reaches the trainer, when that
differs from the session's URL for it (a gateway or tunnel between regions).

Results are kept until acknowledged, so a lost response loses nothing; a duplicate submit (the
same id) is ignored. Environments are never shipped over the wire: the service builds them from
the installed registry (entry points) or from the operator's `--environment NAME=module:Class`.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import Response

from .. import environments, weights
from ..engines.base import RolloutEngine
from ..environments.base import Environment
from ..environments.play import play_episode
from ..models import dtype_for
from ..remote.client import get_octets
from ..remote.serialize import (
    OCTETS,
    generation_to_wire,
    sampling_from_wire,
    spec_from_wire,
    trajectory_to_wire,
)
from ..types import GenerationRequest, WeightUpdate
from ..weights.publish import deliver
from ..weights.relay import NotHeld, RelayCache
from .http import ServiceConfig, octets, reply, service_app
from .rollout_bodies import (
    EnvironmentIn,
    EpisodeIn,
    GenerateIn,
    NotifyIn,
    PolicyIn,
    PullIn,
    SubmitIn,
)

__all__ = ["RolloutConfig", "RolloutService", "create_app"]

LINGER = 0.01  # seconds a woken long-poll waits for more results before answering
FETCH_TIMEOUT = 600.0  # seconds a call to the trainer may take


@dataclass(frozen=True)
class RolloutConfig:
    """What a rollout service runs.

    Attributes:
        engine: "hf" (torch continuous batching), "sglang" (an SGLang server), "vllm" (a vLLM
            server) or "instant" (no model; for benchmarks of the service path).
        device: torch device of hf engines.
        max_inflight: episodes played at once; availability() is what is left of it.
        environments: extra environments the operator allows, name -> "module:Class".
        sglang_url: attach sglang engines to this server instead of launching one.
        service: bind address, port, token, body limit.
        region: where the service runs ("" for none); the services of one region share a relay.
        trainer_url: how this service reaches the trainer (None: the URL the session sends).
        vllm_url: attach vllm engines to this server instead of launching one.
    """

    engine: Literal["hf", "sglang", "vllm", "instant"] = "hf"
    device: str = "cpu"
    max_inflight: int = 512
    environments: dict[str, str] = field(default_factory=dict)
    sglang_url: str | None = None
    service: ServiceConfig = field(default_factory=ServiceConfig)
    region: str = ""
    trainer_url: str | None = None
    vllm_url: str | None = None


# -- the service ----------------------------------------------------------------------------------

@dataclass(eq=False)
class Slot:
    """One policy's engine on this service (what EpisodeContext needs of a policy)."""

    name: str
    engine: RolloutEngine
    tokenizer: Any
    spec: dict
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    updating: bool = False
    relay: RelayCache | None = None  # set while this service relays the policy to its region


class RolloutService:
    """The state behind the HTTP app (usable in-process, e.g. in tests)."""

    def __init__(self, config: RolloutConfig):
        self.config = config
        self.instance_id = uuid.uuid4().hex
        self.started = time.time()
        self.slots: dict[str, Slot] = {}
        self.envs: dict[str, tuple[Environment, dict[str, Slot]]] = {}
        self._lanes = {lane: _Lane() for lane in ("train", "eval")}
        self._running = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._http: httpx.AsyncClient | None = None
        self.on_shutdown = lambda: None
        self.transport: httpx.AsyncBaseTransport | None = None  # for calls to the trainer (tests)
        self.counters = {"submitted": 0, "duplicates": 0, "finished": 0, "failed": 0}

    # lifecycle
    @asynccontextmanager
    async def running(self):
        """Own the episode tasks and the HTTP client; close every engine on the way out."""
        timeout = httpx.Timeout(FETCH_TIMEOUT, connect=10)
        async with httpx.AsyncClient(timeout=timeout, transport=self.transport) as http:
            self._http = http
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        yield self
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    for slot in self.slots.values():
                        await anyio.to_thread.run_sync(slot.engine.close)

    # policies and environments
    async def add_policy(self, body: PolicyIn) -> dict:
        spec = body.model.model_dump()
        slot = self.slots.get(body.name)
        if slot is not None:
            if slot.spec != spec:
                raise HTTPException(409, f"policy {body.name!r} exists with another model; "
                                         "restart the service or pick another policy name")
            return self._policy_status(slot)
        try:
            engine, tokenizer = await anyio.to_thread.run_sync(self._build_engine, body)
        except Exception as error:  # a bad spec from the caller, not a service fault
            raise HTTPException(422, f"could not build the {self.config.engine} engine for "
                                     f"{body.model.name!r}: {error}") from error
        self.slots[body.name] = Slot(body.name, engine, tokenizer, spec)
        return self._policy_status(self.slots[body.name])

    def _build_engine(self, body: PolicyIn):
        spec = spec_from_wire(body.model.model_dump())
        kind = self.config.engine
        if kind == "instant":
            from ..engines.instant import InstantEngine

            tok = spec.tokenizer()
            return InstantEngine(body.name, vocab_size=len(tok), seed=body.seed, tokenizer=tok), tok
        if kind == "sglang":
            from ..engines.sglang import SGLangEngine

            if spec.path is None:  # the server loads, and each update rewrites, a model directory
                raise ValueError(f"the sglang engine needs a model directory and {spec.name!r} "
                                 "has none; save it with spec.save(dir) and use models.local(dir)")
            engine = SGLangEngine(spec, url=self.config.sglang_url, name=body.name)
            return engine, engine.tokenizer
        if kind == "vllm":
            from ..engines.vllm import VLLMEngine

            dtype = str(dtype_for(self.config.device, spec)).removeprefix("torch.")
            vllm = VLLMEngine(spec, url=self.config.vllm_url, name=body.name, seed=body.seed,
                              dtype=dtype, device=self.config.device.split(":")[0],
                              max_inflight=body.max_batch_size)
            return vllm, vllm.tokenizer
        from ..engines import HFEngine

        hf = HFEngine(spec, device=self.config.device, dtype=dtype_for(self.config.device, spec),
                      max_batch_size=body.max_batch_size, seed=body.seed, name=body.name)
        return hf.start(), hf.tokenizer

    def register(self, body: EnvironmentIn) -> dict:
        unknown = sorted(set(body.roles.values()) - set(self.slots))
        if unknown:
            raise HTTPException(404, f"no policy {unknown} on this service; create it with "
                                     f"POST /v1/policies first (it has {sorted(self.slots)})")
        env_id = f"{body.name}:{_stable_hash(body.model_dump())}"
        if env_id not in self.envs:
            env = self._load_env(body.name, body.kwargs)
            missing = sorted(set(env.roles) - set(body.roles))
            extra = sorted(set(body.roles) - set(env.roles))
            if missing or extra:
                raise HTTPException(422, f"roles must be exactly {list(env.roles)}: "
                                         f"missing {missing}, unknown {extra}")
            self.envs[env_id] = (env, {r: self.slots[p] for r, p in body.roles.items()})
        return {"env_id": env_id, "roles": list(self.envs[env_id][0].roles)}

    def _load_env(self, name: str, kwargs: dict) -> Environment:
        target = self.config.environments.get(name)
        try:
            if target is None:
                return environments.load(name, **kwargs)
            module, _, attr = target.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as error:
                raise HTTPException(500, f"the service's --environment {name}={target} does not "
                                         f"import: {error!r}; "
                                         "fix the service's command line") from error
            env = cls(**kwargs)
        except TypeError as error:
            raise HTTPException(422, f"environment {name!r} rejected kwargs {kwargs}: "
                                     f"{error}") from error
        except ValueError as error:
            extra = ", ".join(sorted(self.config.environments))
            also = f" Also allowed here: {extra}." if extra else ""
            raise HTTPException(404, f"{error}{also}") from error
        if not isinstance(env, Environment):
            raise HTTPException(500, f"{target} did not build an astranb Environment")
        return env

    # episodes
    def _updating(self) -> bool:
        return any(slot.updating for slot in self.slots.values())

    def availability(self) -> int:
        """Episodes it takes now: max_inflight minus those queued or playing; 0 while weights
        are being applied (AstraFlow's rule: no new work during an update)."""
        if self._updating():
            return 0
        queued = sum(len(lane.pending) for lane in self._lanes.values())
        return max(0, self.config.max_inflight - queued)

    def submit(self, body: SubmitIn) -> dict:
        lane = self._lanes[body.lane]
        unknown = sorted({i.env_id for i in body.items} - set(self.envs))
        if unknown:
            raise HTTPException(404, f"unknown env_id {unknown[:3]}; register the environment "
                                     "with POST /v1/environments (after a restart, register again)")
        tg = self._tg
        if tg is None:
            raise RuntimeError("the rollout service is not running (use `async with "
                               "service.running()`)")
        accepted = 0
        for item in body.items:
            if item.id in lane.known:
                self.counters["duplicates"] += 1
                continue
            lane.known.add(item.id)
            lane.pending.add(item.id)
            tg.start_soon(self._play, item, lane)
            accepted += 1
        self.counters["submitted"] += accepted
        return {"accepted": accepted, "duplicates": len(body.items) - accepted}

    async def _play(self, item: EpisodeIn, lane: _Lane) -> None:
        env, wiring = self.envs[item.env_id]
        traj = await play_episode(env, wiring, item.sample, group=item.group,
                                  started_version=item.started_version, id=item.id)
        if not traj.ok:
            self.counters["failed"] += 1
        lane.finish(item.id, trajectory_to_wire(traj))
        self.counters["finished"] += 1

    async def pull(self, body: PullIn) -> dict:
        lane = self._lanes[body.lane]
        lane.forget(body.ack)
        if body.wait and not lane.done and not (body.resend and lane.sent):
            with anyio.move_on_after(body.wait):
                await lane.changed.wait()
                # episodes finish in bursts: linger a moment so one answer carries many
                await anyio.sleep(min(LINGER, body.wait))
        results = lane.take(body.max, body.resend)
        return {"results": results, "pending": len(lane.pending), "unacked": len(lane.sent),
                "instance_id": self.instance_id, "availability": self.availability(),
                "capacity": self.config.max_inflight, "updating": self._updating()}

    # weights
    async def sync_weights(self, body: NotifyIn, authorization: str | None) -> dict:
        slot = self._slot(body.policy)
        async with slot.lock:
            engine = slot.engine
            slot.relay = (slot.relay or RelayCache()) if body.share else None
            if engine.version >= body.version and (body.checksum is None
                                                   or body.checksum == engine.weights_checksum):
                if slot.relay is not None and slot.relay.version != engine.version:
                    slot.relay.holds(engine.version, engine.weights_checksum)  # a new relay
                none = {"kind": "none", "bytes": 0, "source": "none"}
                return self._policy_status(slot) | none
            headers = {"authorization": authorization} if authorization else {}
            have = {"have_version": engine.version, "have_checksum": engine.weights_checksum}
            started = time.perf_counter()
            got, source, relay_error = None, "trainer", ""
            if body.relay:
                got, relay_error = await self._pull_from_relay(slot, body, have, headers)
                source = "relay" if got is not None else "trainer"
            if got is None:
                trainer = self.config.trainer_url or body.url
                url = f"{trainer.rstrip('/')}/v1/weights/{body.policy}"
                got = await deliver(
                    lambda full: self._fetch(url, {} if full else have, headers),
                    lambda fetched: self._apply(slot, fetched.payload, fetched))
            fetched, applied, _ = got
            seconds = time.perf_counter() - started
        return self._policy_status(slot) | {"kind": applied["kind"],
                                            "bytes": len(fetched.payload),
                                            "seconds": seconds, "source": source,
                                            "relay_error": relay_error}

    async def _pull_from_relay(self, slot: Slot, body: NotifyIn, have: dict,
                               headers: dict) -> tuple[tuple | None, str]:
        """Bring `slot` to body.version from the region's relay; (None, why) when it cannot
        (down, lagging, or both payloads it sent were bad), and the trainer is asked instead."""
        assert body.relay is not None
        url = f"{body.relay.rstrip('/')}/v1/weights/{body.policy}"

        async def apply(fetched: weights.Prepared) -> dict:
            made = weights.peek(fetched.payload, verify=False).version
            if made != body.version:
                raise HTTPException(409, f"the relay sent version {made}, not {body.version}")
            return await self._apply(slot, fetched.payload, fetched)

        try:
            got = await deliver(
                lambda full: self._fetch(url, ({} if full else have) | {"version": body.version},
                                         headers, what="relay"), apply)
        except (HTTPException, weights.WeightTransferError) as error:
            return None, str(getattr(error, "detail", error))
        return got, ""

    async def relay_weights(self, policy: str, version: int, have_version: int | None,
                            have_checksum: int | None) -> bytes | bytearray:
        """What this service, as its region's relay, sends a receiver (see `RelayCache.serve`)."""
        slot = self._slot(policy)
        if slot.relay is None:
            raise HTTPException(409, f"this service does not relay {policy!r} (the session "
                                     "picks a relay per region); pull from the trainer")
        async with slot.lock:
            relay = slot.relay
            if relay is None:
                raise HTTPException(409, f"this service stopped relaying {policy!r}")
            held = slot.engine.published_weights
            try:  # off the loop: a full snapshot may have to be encoded
                return await anyio.to_thread.run_sync(relay.serve, version, have_version,
                                                      have_checksum, held, policy)
            except NotHeld as error:
                raise HTTPException(409, f"{error}; pull from the trainer") from None

    async def _fetch(self, url: str, params: dict, headers: dict,
                     what: str = "trainer") -> weights.Prepared:
        """The payload at `url` (`.payload`), hashed and its sections inflated as it arrived
        (weights.Incoming; nothing done ahead when httpx read it)."""
        params = {k: v for k, v in params.items() if v is not None}
        http = self._http
        if http is None:
            raise RuntimeError("the rollout service is not running (use `async with "
                               "service.running()`)")
        with weights.Incoming() as incoming:
            try:
                # the body straight into one buffer (httpx's 64 KB chunks cost 2-3x the time),
                # unless a test injected a transport or the trainer is behind a proxy, https, ...
                got = None if self.transport is not None else await get_octets(
                    url, params, headers, timeout=FETCH_TIMEOUT, watch=incoming)
                if got is None:
                    answer = await http.get(url, params=params, headers=headers)
                    got = answer.status_code, "", answer.content
            except (httpx.HTTPError, OSError, TimeoutError) as error:
                # 502: the trainer is down or restarting, which the pool waits out and retries
                raise HTTPException(502, f"could not reach the {what} at {url}: "
                                         f"{error!r}") from error
            status, _, content = got
            prepared = None
            if status == 200:
                # the rest of the read-ahead (the last sections, the hash's tail) off the loop
                prepared = await anyio.to_thread.run_sync(incoming.finish, content)
        if status != 200:
            # a trainer that refuses (4xx) is a setup error (424); one that fails (5xx) may recover
            text = content[:300].decode("utf-8", "replace")
            code = 502 if status >= 500 else 424
            raise HTTPException(code, f"{what} answered {status} for {url}: {text}")
        return prepared or weights.Prepared(content, None)

    async def push_weights(self, policy: str, payload: bytes) -> dict:
        slot = self._slot(policy)
        async with slot.lock:
            try:
                applied = await self._apply(slot, payload)
            except weights.WeightTransferError as error:
                raise HTTPException(409, f"{type(error).__name__}: {error}; "
                                         "send a full snapshot") from error
        return self._policy_status(slot) | {"kind": applied["kind"], "bytes": len(payload)}

    async def _apply(self, slot: Slot, payload: bytes | bytearray,
                     prepared: weights.Prepared | None = None) -> dict:
        # the version only: the engine checks the payload's hash before it changes anything
        header = weights.peek(payload, verify=False)
        slot.updating = True
        try:
            update = WeightUpdate(slot.name, header.version, payload=payload, prepared=prepared)
            applied = await asyncio.wrap_future(slot.engine.update_weights(update))
        finally:
            slot.updating = False
        if slot.relay is not None:  # the engine verified it: keep it for the region
            slot.relay.received(payload, header)
        return applied

    async def generate(self, body: GenerateIn) -> dict:
        slot = self._slot(body.policy)
        sampling = sampling_from_wire(body.sampling.model_dump())
        generation = await slot.engine.generate(GenerationRequest(tuple(body.prompt_ids), sampling))
        return generation_to_wire(generation)

    # status
    def status(self) -> dict:
        return {
            "service": "rollout", "instance_id": self.instance_id, "engine": self.config.engine,
            "region": self.config.region,
            "uptime": time.time() - self.started, "availability": self.availability(),
            "capacity": self.config.max_inflight,
            "policies": {name: self._policy_status(s) for name, s in self.slots.items()},
            "environments": sorted(self.envs),
            "lanes": {name: lane.summary() for name, lane in self._lanes.items()},
            "counters": dict(self.counters),
        }

    def _policy_status(self, slot: Slot) -> dict:
        return {"policy": slot.name, "version": slot.engine.version,
                "checksum": slot.engine.weights_checksum, "model": slot.spec["name"],
                "relayed": dict(slot.relay.served) if slot.relay is not None else None}

    def _slot(self, policy: str) -> Slot:
        slot = self.slots.get(policy)
        if slot is None:
            raise HTTPException(404, f"no policy {policy!r} on this service (it has "
                                     f"{sorted(self.slots)}); create it with POST /v1/policies")
        return slot


class _Lane:
    """Episodes of one lane (train or eval): pending, finished, handed out but not acknowledged."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.pending: set[str] = set()
        self.done: OrderedDict[str, dict] = OrderedDict()
        self.sent: OrderedDict[str, dict] = OrderedDict()
        self.changed = anyio.Event()

    def finish(self, item_id: str, result: dict) -> None:
        self.pending.discard(item_id)
        if item_id in self.known:  # not dropped by eval/end meanwhile
            self.done[item_id] = result
        self.changed.set()
        self.changed = anyio.Event()

    def take(self, n: int, resend: bool) -> list[dict]:
        out = list(self.sent.values())[:n] if resend else []
        while self.done and len(out) < n:
            item_id, result = self.done.popitem(last=False)
            self.sent[item_id] = result
            out.append(result)
        return out

    def forget(self, ids) -> None:
        for item_id in ids:
            self.sent.pop(item_id, None)
            self.done.pop(item_id, None)
            self.known.discard(item_id)

    def summary(self) -> dict:
        return {"pending": len(self.pending), "done": len(self.done), "unacked": len(self.sent)}


def _stable_hash(data: Any) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


# -- the app --------------------------------------------------------------------------------------

def create_app(config: RolloutConfig | None = None) -> FastAPI:
    """The rollout service as an ASGI app (serve it with uvicorn, or test it in-process)."""
    config = config or RolloutConfig()
    service = RolloutService(config)

    @asynccontextmanager
    async def lifespan(app):
        async with service.running():
            yield

    app = service_app("astranb rollout service", service, config.service, lifespan)

    @app.get("/v1/availability")
    async def availability() -> dict:
        return {"availability": service.availability()}

    @app.post("/v1/policies")
    async def policies(body: PolicyIn) -> dict:
        return await service.add_policy(body)

    @app.post("/v1/environments")
    async def register(body: EnvironmentIn) -> dict:
        return service.register(body)

    @app.post("/v1/submit")
    async def submit(body: SubmitIn) -> dict:
        return service.submit(body)

    @app.post("/v1/pull", response_model=None,
              responses={200: {"description": "finished episodes"}})
    async def pull(body: PullIn, request: Request) -> Response:
        return reply(request, await service.pull(body))

    @app.post("/v1/notify_version")
    async def notify_version(body: NotifyIn, request: Request) -> dict:
        return await service.sync_weights(body, request.headers.get("authorization"))

    @app.post("/v1/weights/{policy}", openapi_extra={"requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}})
    async def push_weights(policy: str, request: Request) -> dict:
        return await service.push_weights(policy, await request.body())

    @app.get("/v1/weights/{policy}", response_class=Response,
             responses={200: {"content": {OCTETS: {}}, "description": "weight payload"}})
    async def relay_weights(
        policy: str, version: int = Query(ge=0), have_version: int | None = None,
        have_checksum: int | None = None,
    ) -> Response:
        payload = await service.relay_weights(policy, version, have_version, have_checksum)
        return octets(payload)

    @app.post("/v1/generate")
    async def generate(body: GenerateIn) -> dict:
        return await service.generate(body)

    return app
