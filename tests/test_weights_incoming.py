"""weights.Incoming: a payload hashed and its zstd sections inflated as its bytes arrive, then
applied by a Mirror with that work (and without it: the same bits, the same errors)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import xxhash

from astranb.remote.client import get_octets
from astranb.weights import CorruptPayload, Incoming, Mirror, _sections, checksum, codec
from astranb.weights.codec import _PREFIX, _TRAILER, _open

from .test_weights_pull import published_store, serving, trainer_with, weights

pytestmark = pytest.mark.timeout(60)


def tensors_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Old and new bf16 weights whose delta uses every scheme: bitmap, rice, dense, same."""
    g = torch.Generator().manual_seed(3)
    old = {name: torch.randn(shape, generator=g).to(torch.bfloat16)
           for name, shape in [("bitmap", (256, 96)), ("rice", (40_000,)), ("dense", (64, 64)),
                               ("same", (10, 10))]}
    new = {}
    for (name, t), share in zip(old.items(), [0.4, 0.01, 0.95, 0.0], strict=True):
        bits = t.view(torch.int16).clone()
        moved = torch.rand(t.shape, generator=g) < share
        if name == "bitmap":  # every third element: a bitmap zstd packs to almost nothing
            moved = (torch.arange(t.numel()) % 3 == 0).reshape(t.shape)
        bits[moved] += torch.randint(-3, 4, t.shape, generator=g, dtype=torch.int16)[moved] | 1
        new[name] = bits.view(torch.bfloat16)
    return old, new


def fed(payload: bytes, chunk: int, **options) -> tuple[bytearray, object]:
    """`payload` landing in a buffer `chunk` bytes at a time, watched by an Incoming; the
    buffer and what `finish` hands over, once everything the bytes allow is done (as on a slow
    link, where the last byte comes long after the rest)."""
    incoming = Incoming(**{"min_bytes": 0, **options})
    buffer = bytearray(len(payload))
    incoming.open(buffer)
    for start in range(0, len(payload), chunk):
        stop = min(len(payload), start + chunk)
        buffer[start:stop] = payload[start:stop]
        incoming.arrived(stop)
    assert incoming.wait_idle(30)
    return buffer, incoming.finish(buffer)


def held(tensors: dict[str, torch.Tensor]) -> Mirror:
    mirror = Mirror()
    mirror.set(tensors)
    return mirror


def zstd_sections(payload: bytes) -> int:
    header, _ = _open(payload)
    return sum(len(_sections._zstd_sections(e)) for e in header.tensors)


@pytest.mark.parametrize("chunk", [1, 997, 1 << 30])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_ahead_gives_the_same_bits_and_inflates_nothing_twice(chunk, threads, monkeypatch):
    old, new = tensors_pair()
    payload = codec.encode(old, new, policy="p")
    schemes = {e["name"]: e["scheme"] for e in codec.peek(payload).tensors}
    assert schemes == {"bitmap": "bitmap", "rice": "rice", "dense": "dense", "same": "same"}
    buffer, prepared = fed(payload, chunk, threads=threads)  # chunk 1: everything in pieces
    assert prepared.digest == xxhash.xxh3_64_intdigest(payload[: -_TRAILER.size])
    assert len(prepared.ready) == zstd_sections(payload) == 4
    inflated: list[int] = []
    real = _sections._unzstd
    monkeypatch.setattr(_sections, "_unzstd",
                        lambda data, limit: inflated.append(limit) or real(data, limit))
    mirror = held(old)
    mirror.apply(buffer, policy="p", prepared=prepared)
    assert inflated == [] and mirror.checksum == checksum(new)
    assert all(torch.equal(mirror.tensors[k].view(torch.int16), new[k].view(torch.int16))
               for k in new)


def test_sections_not_begun_when_the_last_byte_lands_are_left_to_apply():
    old, new = tensors_pair()
    payload = codec.encode(old, new)
    incoming = Incoming(min_bytes=0)
    buffer = bytearray(len(payload))
    incoming.open(buffer)
    _, body = _open(payload)
    first_section_end = len(payload) - _TRAILER.size - len(body) + 1  # no section is all in
    buffer[:first_section_end] = payload[:first_section_end]
    incoming.arrived(first_section_end)
    assert incoming.wait_idle(30)
    buffer[:] = payload
    incoming.arrived(len(payload))
    prepared = incoming.finish(buffer)  # at once: the read-ahead stops where it is
    assert prepared.digest == xxhash.xxh3_64_intdigest(payload[: -_TRAILER.size])
    assert len(prepared.ready) <= 1  # at most the one a worker began before finish came
    mirror = held(old)
    mirror.apply(buffer, prepared=prepared)
    assert mirror.checksum == checksum(new)


def test_a_full_snapshot_is_hashed_as_it_arrives_and_not_again(monkeypatch):
    full = codec.encode_full(weights(3), policy="p", version=3)
    buffer, prepared = fed(full, 4096)
    hashed: list[int] = []
    real = codec.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(codec.xxhash, "xxh3_64_intdigest",
                        lambda data: hashed.append(len(data)) or real(data))
    mirror = Mirror()
    mirror.apply(buffer, policy="p", version=3, prepared=prepared)
    assert hashed == [] and prepared.ready == {} and mirror.checksum == checksum(weights(3))


def test_a_damaged_byte_fails_the_hash_before_anything_is_written():
    old, new = tensors_pair()
    payload = bytearray(codec.encode(old, new))
    payload[len(payload) // 2] ^= 0x04  # inside a section: it may still inflate, to wrong bytes
    buffer, prepared = fed(bytes(payload), 1000)
    mirror = held(old)
    before = {k: v.clone() for k, v in mirror.tensors.items()}
    with pytest.raises(CorruptPayload, match="hash mismatch"):
        mirror.apply(buffer, prepared=prepared)
    assert mirror.checksum == checksum(old)  # known still: nothing was written
    assert all(torch.equal(before[k], mirror.tensors[k]) for k in before)


def test_a_section_that_does_not_inflate_fails_as_it_does_without_read_ahead():
    """A sender's bug (the hash is right, a zstd frame is not): the same error either way."""
    old, new = tensors_pair()
    payload = bytearray(codec.encode(old, new))
    header, body = _open(bytes(payload))
    entry = next(e for e in header.tensors if e["scheme"] == "rice")
    start = len(payload) - _TRAILER.size - len(body)
    for e in header.tensors:
        if e is entry:
            break
        start += sum(e["sections"])
    values = start + sum(entry["sections"][:-1])
    payload[values + 1 : values + 5] = b"XXXX"  # the zstd magic after the mode byte
    payload[-_TRAILER.size:] = _TRAILER.pack(xxhash.xxh3_64_intdigest(payload[: -_TRAILER.size]))
    errors = []
    for prepared in (None, fed(bytes(payload), 512)):
        buffer = bytes(payload) if prepared is None else prepared[0]
        with pytest.raises(CorruptPayload) as caught:
            held(old).apply(buffer, prepared=None if prepared is None else prepared[1])
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "does not decompress" in errors[0]


def test_the_budget_bounds_what_is_inflated_ahead():
    old, new = tensors_pair()
    payload = codec.encode(old, new)
    _, everything = fed(payload, 1 << 30)
    sizes = {offset: len(section.data) for offset, section in everything.ready.items()}
    smallest = min(sizes.values())
    buffer, prepared = fed(payload, 1 << 30, budget=smallest)
    assert len(prepared.ready) == 1  # only the section that fits; the rest are apply's
    assert sum(len(s.data) for s in prepared.ready.values()) <= smallest
    mirror = held(old)
    mirror.apply(buffer, prepared=prepared)
    assert mirror.checksum == checksum(new)


@pytest.mark.parametrize("junk", [b"", b"short", b"NOPE" + bytes(100),
                                  _PREFIX.pack(b"ANBW", 1, 1, 64, 1 << 30) + bytes(44)])
def test_what_is_not_a_payload_is_left_to_apply_to_refuse(junk):
    buffer, prepared = fed(junk, 7)  # finishes: no header to read, nothing inflated
    assert prepared.ready == {}
    with pytest.raises(CorruptPayload):
        Mirror().apply(buffer, prepared=prepared)


def test_work_for_another_buffer_is_not_used_and_abandoning_stops_the_threads():
    old, new = tensors_pair()
    payload = codec.encode(old, new)
    incoming = Incoming(threads=2, min_bytes=0)
    buffer = bytearray(len(payload))
    incoming.open(buffer)
    incoming.arrived(10)
    assert incoming.finish(bytearray(len(payload))) is None  # not the buffer it watched
    for worker in incoming._workers:
        worker.join(5)
        assert not worker.is_alive()
    # a Prepared offered with another (equal) payload is ignored: that payload is hashed
    copy, prepared = fed(payload, 1 << 30)
    mirror = held(old)
    mirror.apply(bytes(copy), prepared=prepared)
    assert mirror.checksum == checksum(new)


def test_get_octets_lets_a_watcher_work_on_the_body_as_it_lands():
    store = published_store()
    v0 = checksum(weights(0))
    with serving(trainer_with(store)) as url:
        async def pull():
            with Incoming(min_bytes=0) as incoming:
                got = await get_octets(f"{url}/v1/weights/p", {"have_version": 0,
                                                              "have_checksum": v0},
                                       watch=incoming)
                assert got is not None
                return got[2], incoming.finish(got[2])

        payload, prepared = asyncio.run(pull())
    assert isinstance(payload, bytearray) and payload == store.pull(0, v0)
    assert prepared is not None and prepared.payload is payload
    assert prepared.digest == xxhash.xxh3_64_intdigest(bytes(payload[: -_TRAILER.size]))
    mirror = held(weights(0))
    mirror.apply(payload, policy="p", version=1, prepared=prepared)
    assert mirror.checksum == store.checksum


def test_a_failing_read_ahead_hands_over_nothing_and_apply_does_it_all(monkeypatch):
    old, new = tensors_pair()
    payload = codec.encode(old, new)

    def broken(*args, **kwargs):
        raise MemoryError("no scratch")

    monkeypatch.setattr("astranb.weights.incoming._unzstd", broken)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the worker's error, expected
    buffer, prepared = fed(payload, 1 << 30)  # the first inflate fails: all stops
    assert prepared.digest is None and prepared.ready == {}
    mirror = held(old)
    mirror.apply(buffer, prepared=prepared)  # hashed and inflated by apply itself
    assert mirror.checksum == checksum(new)


def test_a_small_payload_starts_no_thread_and_is_hashed_by_finish():
    old, new = tensors_pair()
    payload = codec.encode(old, new)
    assert len(payload) < 1 << 20
    incoming = Incoming()
    buffer = bytearray(payload)
    incoming.open(buffer)
    incoming.arrived(len(buffer))
    assert incoming._workers == []
    prepared = incoming.finish(buffer)
    assert prepared.digest == xxhash.xxh3_64_intdigest(payload[: -_TRAILER.size])
    assert prepared.ready == {}
    mirror = held(old)
    mirror.apply(buffer, prepared=prepared)
    assert mirror.checksum == checksum(new)
