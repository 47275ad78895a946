"""Weight pulls over real HTTP: the body read straight into one buffer (`get_octets`), the trainer's
answer sent in slices, a receiver that hashes a payload once, and the faster delta decoding; every
corrupted or cut payload is refused and the receiver keeps its weights."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager, suppress

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from astranb.errors import ServiceError, ServiceUnavailable
from astranb.remote.client import TrainerClient, get_octets
from astranb.services import rollout_app, rollout_bodies, trainer_app
from astranb.services.http import ServiceConfig, install, octets
from astranb.weights import CorruptPayload, Mirror, _sections, checksum, codec, peek
from astranb.weights.store import WeightStore
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(300, 70, generator=g), "b": torch.randn(33, generator=g)}
    for t in w.values():  # a scattered few percent of the weights move each version
        mask = torch.rand(t.shape, generator=torch.Generator().manual_seed(step)) < 0.05
        t += mask * 0.01 * step
    return {k: v.to(torch.bfloat16) for k, v in w.items()}


def flipped(payload: bytes, at: int) -> bytes:
    data = bytearray(payload)
    data[at] ^= 0x10
    return bytes(data)


@contextmanager
def serving(app):
    """`app` on a real uvicorn server on loopback, in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, ws="none", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 30, "uvicorn to start")
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def trainer_with(store: WeightStore, token: str | None = None):
    """The real trainer app serving `store` as policy "p" (no model, no training)."""
    app = trainer_app.create_app(trainer_app.TrainerConfig(service=ServiceConfig(token=token)))
    app.state.service.policies["p"] = trainer_app._Policy("p", {}, store)
    return app


def published_store() -> WeightStore:
    store = WeightStore("p", full_every=0)
    store.publish(0, weights(0))
    store.publish(1, weights(1))
    return store


@contextmanager
def raw_server(answer: bytes, hold: threading.Event | None = None):
    """A socket server that reads one request head and answers `answer`, then closes (once
    `hold` is set, when given)."""
    server = socket.create_server(("127.0.0.1", 0))

    def run():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                conn.sendall(answer)
                if hold is not None:
                    hold.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        if hold is not None:
            hold.set()
        with suppress(OSError):  # wakes the thread's accept(): close alone does not
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)
        assert not thread.is_alive(), "the raw server's thread did not end"


# -- the client: get_octets and TrainerClient.weights ---------------------------------------------

def counting(monkeypatch, where: str) -> list[str]:
    """Record the URLs `get_octets` is called with, as imported by module `where`."""
    calls: list[str] = []

    async def counted(url, *args, **kwargs):
        calls.append(url)
        return await get_octets(url, *args, **kwargs)

    monkeypatch.setattr(f"{where}.get_octets", counted)
    return calls


def test_pulls_over_real_http_are_the_stores_bytes_and_apply_bit_exactly(monkeypatch):
    calls = counting(monkeypatch, "astranb.remote.client")
    store = published_store()
    v0 = checksum(weights(0))
    with serving(trainer_with(store)) as url:
        async def pull():
            client = TrainerClient(url)
            try:
                return (await client.weights("p"), await client.weights("p", 0, v0),
                        await get_octets(f"{url}/v1/weights/p"))
            finally:
                await client.close()

        full, delta, (status, kind, raw) = asyncio.run(pull())
    assert full == store.pull_full() == raw and (status, kind) == (200, "application/octet-stream")
    assert len(calls) == 2  # TrainerClient.weights read both through get_octets, not httpx
    assert delta == store.pull(0, v0) and peek(delta).kind == "delta"
    mirror = Mirror()
    mirror.apply(codec.encode_full(weights(0), policy="p", version=0))
    mirror.apply(delta, policy="p", version=1)
    assert mirror.checksum == checksum(mirror.tensors) == store.checksum == checksum(weights(1))


def test_a_payload_larger_than_a_slice_arrives_whole(monkeypatch):
    monkeypatch.setattr("astranb.services.http.SLICE", 1000)  # many slices, one odd-sized tail
    store = published_store()
    with serving(trainer_with(store)) as url:
        got = asyncio.run(get_octets(f"{url}/v1/weights/p"))
    assert got is not None and got[2] == store.pull_full()


def test_errors_and_tokens_answer_as_the_httpx_path_does():
    store = published_store()
    with serving(trainer_with(store, token="s3cret")) as url:
        async def calls():
            anonymous, member = TrainerClient(url), TrainerClient(url, token="s3cret")
            try:
                with pytest.raises(ServiceError) as no_token:
                    await anonymous.weights("p")
                with pytest.raises(ServiceError) as unknown:
                    await member.weights("nobody")
                return no_token.value, unknown.value, await member.weights("p")
            finally:
                await anonymous.close()
                await member.close()

        no_token, unknown, full = asyncio.run(calls())
    assert no_token.status == 401 and "bearer token" in str(no_token)
    assert unknown.status == 404 and "no policy 'nobody'" in str(unknown)
    assert full == store.pull_full()


def test_a_dead_or_cut_off_trainer_is_unavailable():
    async def pull(url):
        client = TrainerClient(url)
        try:
            return await client.weights("p")
        finally:
            await client.close()

    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ServiceUnavailable):
        asyncio.run(pull(dead))
    cut = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
           b"content-length: 1000\r\n\r\n")
    with raw_server(cut + b"x" * 400) as url:
        with pytest.raises(ServiceUnavailable, match="closed before the whole answer"):
            asyncio.run(pull(url))


def test_a_trainer_that_stops_sending_times_out():
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
            b"content-length: 1000\r\n\r\n")
    with raw_server(head + b"x" * 10, hold=threading.Event()) as url:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no bytes from"):
            asyncio.run(get_octets(url, timeout=0.3))
        assert time.monotonic() - started < 5


def test_answers_it_does_not_read_are_left_to_httpx():
    chunked = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    with raw_server(chunked) as url:
        assert asyncio.run(get_octets(url)) is None

        async def through_client():
            client = TrainerClient(url)
            try:
                return await client.weights("p")
            finally:
                await client.close()

        assert asyncio.run(through_client()) == b"hello"  # httpx read it instead


def test_requests_it_does_not_make(monkeypatch):
    async def go(url, headers=None):
        return await get_octets(url, headers=headers)

    assert asyncio.run(go("https://127.0.0.1:9/x")) is None  # TLS: httpx's
    assert asyncio.run(go("http://user:pw@127.0.0.1:9/x")) is None  # credentials: httpx's
    assert asyncio.run(go("http://127.0.0.1:9/x", {"authorization": "a\r\nb: c"})) is None
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert asyncio.run(go("http://127.0.0.1:9/x")) is None  # behind a proxy: httpx's


def test_off_asyncio_it_leaves_the_request_to_httpx():
    pytest.importorskip("trio")
    import anyio

    assert anyio.run(get_octets, "http://127.0.0.1:9/x", backend="trio") is None


# -- the rollout service pulling from a trainer over real HTTP ------------------------------------

class FakeTrainer:
    """A trainer's weights route answering chosen bytes for delta and full requests."""

    def __init__(self, delta: bytes, full: bytes):
        self.delta, self.full = delta, full
        self.app = install(FastAPI(), ServiceConfig())

        @self.app.get("/v1/weights/{policy}")
        async def pull(policy: str, have_version: int | None = None):
            return octets(self.full if have_version is None else self.delta)


async def rollout_pull(url: str, initial: bytes, version: int = 1):
    """A rollout service (instant engine) holding `initial`, told that `version` is out: its
    answer (or error) and the engine's (version, checksum) after."""
    service = rollout_app.RolloutService(rollout_app.RolloutConfig(engine="instant"))
    async with service.running():
        model = rollout_bodies.ModelIn(name="tiny", kind="tiny")
        await service.add_policy(rollout_bodies.PolicyIn(name="p", model=model))
        await service.push_weights("p", initial)
        engine = service.slots["p"].engine
        try:
            answer: dict | Exception = await service.sync_weights(
                rollout_bodies.NotifyIn(policy="p", version=version, url=url), None)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            answer = error
        return answer, (engine.version, engine.weights_checksum)


def test_rollout_service_pulls_a_delta_over_real_http(monkeypatch):
    calls = counting(monkeypatch, "astranb.services.rollout_app")
    store = published_store()
    initial = codec.encode_full(weights(0), policy="p", version=0)
    with serving(trainer_with(store)) as url:
        answer, held = asyncio.run(rollout_pull(url, initial))
    assert isinstance(answer, dict) and answer["kind"] == "delta", answer
    assert answer["bytes"] == len(store.pull(0, checksum(weights(0))))
    assert held == (1, store.checksum) and calls == [f"{url}/v1/weights/p"]


def test_a_rollout_service_pull_hands_the_engine_the_hash_taken_as_it_arrived(monkeypatch):
    """The payload read off the wire reaches the engine's Mirror with the read-ahead's work on
    that very buffer, so the Mirror does not hash it again."""
    seen: list[tuple] = []
    real = Mirror.apply

    def recording(self, payload, **kw):
        seen.append((payload, kw.get("prepared")))
        return real(self, payload, **kw)

    monkeypatch.setattr(Mirror, "apply", recording)
    store = published_store()
    initial = codec.encode_full(weights(0), policy="p", version=0)
    with serving(trainer_with(store)) as url:
        answer, held = asyncio.run(rollout_pull(url, initial))
    assert isinstance(answer, dict) and answer["kind"] == "delta", answer
    assert held == (1, store.checksum)
    (pushed, none), (pulled, prepared) = seen  # the initial push, then the pull
    assert none is None and prepared is not None and prepared.payload is pulled
    delta = store.pull(0, checksum(weights(0)))
    assert bytes(pulled) == delta
    assert prepared.digest == codec.xxhash.xxh3_64_intdigest(delta[: -codec._TRAILER.size])


def test_a_corrupted_delta_is_refused_and_healed_by_the_full_snapshot():
    store = published_store()
    initial = codec.encode_full(weights(0), policy="p", version=0)
    delta = store.pull(0, checksum(weights(0)))
    fake = FakeTrainer(flipped(delta, len(delta) // 2), store.pull_full())
    with serving(fake.app) as url:
        answer, held = asyncio.run(rollout_pull(url, initial))
    assert isinstance(answer, dict) and answer["kind"] == "full", answer
    assert held == (1, store.checksum)


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_receiver_offered_only_bad_payloads_keeps_its_weights(damage):
    store = published_store()
    initial = codec.encode_full(weights(0), policy="p", version=0)
    delta, full = store.pull(0, checksum(weights(0))), store.pull_full()
    if damage == "flip":
        fake = FakeTrainer(flipped(delta, 40), flipped(full, len(full) - 3))
        with serving(fake.app) as url:
            answer, held = asyncio.run(rollout_pull(url, initial))
        assert isinstance(answer, CorruptPayload), answer
    else:  # the connection closes after half the body
        head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                f"content-length: {len(delta)}\r\n\r\n").encode()
        with raw_server(head + delta[: len(delta) // 2]) as url:
            answer, held = asyncio.run(rollout_pull(url, initial))
        assert getattr(answer, "status_code", None) == 502, answer  # retryable
    assert held == (0, checksum(weights(0)))


# -- one hash per payload -------------------------------------------------------------------------

def test_a_mirror_hashes_a_payload_once_and_refuses_a_corrupted_one_untouched(monkeypatch):
    store = published_store()
    full0 = codec.encode_full(weights(0), policy="p", version=0)
    delta = store.pull(0, checksum(weights(0)))
    hashed: list[int] = []
    real = codec.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(codec.xxhash, "xxh3_64_intdigest",
                        lambda data: hashed.append(len(data)) or real(data))
    mirror = Mirror()
    mirror.apply(full0, policy="p", version=0)
    assert len(hashed) == 1
    before = {k: v.clone() for k, v in mirror.tensors.items()}
    with pytest.raises(CorruptPayload, match="hash mismatch"):
        mirror.apply(flipped(delta, len(delta) // 2), policy="p", version=1)
    assert mirror.checksum == checksum(weights(0))  # still known: nothing was written
    assert all(torch.equal(before[k], mirror.tensors[k]) for k in before)
    hashed.clear()
    mirror.apply(delta, policy="p", version=1)
    assert len(hashed) == 1 and mirror.checksum == store.checksum


def test_peek_without_verifying_reads_the_header_of_a_payload_it_does_not_hash():
    full = codec.encode_full(weights(0), policy="p", version=7)
    bad = flipped(full, len(full) - 20)  # in the body: the header still reads
    with pytest.raises(CorruptPayload):
        peek(bad)
    assert peek(bad, verify=False).version == 7
    with pytest.raises(CorruptPayload):
        codec.decode(None, bad)


# -- the faster delta decoding --------------------------------------------------------------------

@pytest.mark.parametrize("k", range(1, 41))
def test_fixed_width_fields_match_bit_by_bit_unpacking(k):
    rng = np.random.default_rng(k)
    for n in (1, 7, 8, 9, 1000 + k):
        values = rng.integers(0, 1 << k, size=n, dtype=np.int64)
        shifts = np.arange(k - 1, -1, -1, dtype=np.int64)
        packed = np.packbits(((values[:, None] >> shifts) & 1).astype(np.uint8)).tobytes()
        assert np.array_equal(_sections._fixed_width(memoryview(packed), n, k), values)
        with pytest.raises(CorruptPayload):
            _sections._fixed_width(memoryview(packed[:-1]), n + 8, k)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 23, 33, 40])
def test_rice_positions_round_trip_for_every_parameter(k, monkeypatch):
    rng = np.random.default_rng(k)
    gaps = rng.geometric(1 / max(2.0, 1.5 * 2.0 ** min(k, 20)), size=5000) - 1
    positions = np.cumsum(gaps + 1) - 1
    monkeypatch.setattr(_sections, "_rice_parameter", lambda g: k)
    unary, remainders = _sections._rice_encode(positions)
    assert unary[0] == k
    decoded = _sections._rice_decode(memoryview(unary), memoryview(remainders), positions.size)
    assert np.array_equal(decoded, positions)
    with pytest.raises(CorruptPayload):
        _sections._rice_decode(memoryview(unary), memoryview(remainders), positions.size + 1)
    assert _sections._rice_decode(memoryview(unary), memoryview(remainders), 0).size == 0


def test_a_payload_decoded_on_several_threads_is_bit_exact_and_fails_as_on_one(monkeypatch):
    monkeypatch.setattr(_sections, "_cpus", lambda: 4)
    monkeypatch.setattr(_sections, "_PARALLEL_WORK", 1)
    store = published_store()
    full, delta = store.pull_full(), store.pull(0, checksum(weights(0)))
    tensors = codec.decode(None, full)
    assert checksum(tensors) == store.checksum
    base = {k: v.clone() for k, v in weights(0).items()}
    codec.apply(base, delta)
    assert checksum(base) == store.checksum
    # a section that does not decompress (hash made valid again: a sender bug, not transit)
    header, body = codec._open(delta)
    start = len(delta) - len(body) - 8 + header.tensors[0]["positions"] + 1
    broken = bytearray(delta)
    broken[start : start + 4] = b"\xff\xff\xff\xff"
    broken[-8:] = codec._TRAILER.pack(codec.xxhash.xxh3_64_intdigest(bytes(broken[:-8])))
    with pytest.raises(CorruptPayload, match="does not decompress"):
        codec.apply({k: v.clone() for k, v in weights(0).items()}, bytes(broken))
