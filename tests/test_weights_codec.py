"""Weight payload codec: bit-exact round trips, self-checking frames, compact sparse deltas.

Every comparison of weights here is on raw bits (a NaN payload, the sign of a zero and a
subnormal must all survive), never on float values.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from astranb.weights import (
    BaseMismatch,
    CorruptPayload,
    Header,
    WeightTransferError,
    apply,
    checksum,
    decode,
    encode,
    encode_full,
    peek,
)

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Bit patterns that float arithmetic would not carry through unchanged.
EDGES = {
    torch.bfloat16: [
        0x0000, 0x8000,  # +0.0, -0.0
        0x7F80, 0xFF80,  # +inf, -inf
        0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0xFFC0,  # quiet NaNs with payloads, a signalling NaN
        0x0001, 0x8001, 0x007F, 0x807F,  # subnormals
        0x0080, 0x7F7F, 0xFF7F,  # smallest normal, largest finite
    ],
    torch.float16: [
        0x0000, 0x8000,
        0x7C00, 0xFC00,
        0x7E00, 0x7E01, 0xFFFF, 0x7C01, 0xFE00,
        0x0001, 0x8001, 0x03FF, 0x83FF,
        0x0400, 0x7BFF, 0xFBFF,
    ],
    torch.float32: [
        0x00000000, 0x80000000,
        0x7F800000, 0xFF800000,
        0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0xFFC00000,
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
    ],
}

CORRUPT = re.compile(
    r"hash mismatch|truncated or padded|too short|not an astranb weight payload|payload format"
)


# -- helpers -----------------------------------------------------------------------------------
def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a signed int tensor of the same shape (a view, any strides)."""
    return t.view(_TORCH_INT[t.element_size()])


def from_bits(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `dtype` holding exactly these unsigned bit patterns."""
    size = _size(dtype)
    signed = np.array(bits, dtype=_NP_UINT[size], order="C").view(_NP_INT[size])  # keeps 0-d
    return torch.from_numpy(signed).clone().view(dtype)


def to_bits(t: torch.Tensor) -> np.ndarray:
    return raw(t).contiguous().numpy().view(_NP_UINT[t.element_size()])


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        if not torch.equal(raw(g), raw(w)):
            differ = np.flatnonzero(to_bits(g).reshape(-1) != to_bits(w).reshape(-1))
            raise AssertionError(f"{name}: {differ.size} elements differ, first {differ[:5]}")


def present(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same logical tensor, laid out as a transposed or strided (sliced) view."""
    x = raw(t)
    if layout == "transposed" and x.dim() >= 2:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "sliced" and x.dim() >= 1:
        big = torch.zeros(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype)
        big[..., ::2] = x
        x = big[..., ::2]
    return x.view(t.dtype)


def changed_bits(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    return sum(int(np.count_nonzero(to_bits(old[k]) != to_bits(new[k]))) for k in new)


def flip(payload: bytes, bit: int) -> bytes:
    out = bytearray(payload)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def weightlike(rng: np.random.Generator, dtype: torch.dtype, n: int) -> np.ndarray:
    """Bit patterns of small normally distributed weights."""
    x = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if dtype == torch.float32:
        return x.view(np.uint32)
    if dtype == torch.float16:
        return x.astype(np.float16).view(np.uint16)
    return (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16: the high half of fp32


def changes(rng: np.random.Generator, old: np.ndarray, dtype: torch.dtype, mode: str) -> np.ndarray:
    """Candidate new bit patterns for every element of `old` (flat)."""
    nbits = _size(dtype) * 8
    utype = _NP_UINT[_size(dtype)]
    n = old.size
    if mode == "mixed":
        modes = ["ulps", "random", "edges", "sign"]
        which = rng.integers(0, len(modes), n)
        out = old.copy()
        for i, m in enumerate(modes):
            out[which == i] = changes(rng, old, dtype, m)[which == i]
        return out
    if mode == "ulps":  # a few units in the last place up or down (wrapping, as bits)
        delta = rng.integers(1, 4, n) * rng.choice(np.array([-1, 1]), n)
        return ((old.astype(np.int64) + delta) % (1 << nbits)).astype(utype)
    if mode == "random":
        return rng.integers(0, 1 << nbits, n, dtype=np.int64).astype(utype)
    if mode == "edges":
        return np.asarray(EDGES[dtype], dtype=utype)[rng.integers(0, len(EDGES[dtype]), n)]
    assert mode == "sign"  # +0.0 <-> -0.0, NaN sign, ...
    return old ^ utype(1 << (nbits - 1))


# -- strategies --------------------------------------------------------------------------------
SHAPES = st.one_of(
    st.sampled_from([(), (0,), (3, 0), (0, 4, 2)]),
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=8),
    st.integers(600, 4000).map(lambda n: (n,)),
)
DENSITIES = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))
MODES = st.sampled_from(["ulps", "random", "edges", "sign", "mixed"])
LAYOUTS = st.sampled_from(["contiguous", "transposed", "sliced"])
NAMES = st.lists(
    st.from_regex(r"[a-z][a-z0-9_.]{0,10}", fullmatch=True), min_size=1, max_size=4, unique=True
)


def bit_patterns(dtype: torch.dtype):
    return st.one_of(st.sampled_from(EDGES[dtype]), st.integers(0, (1 << (_size(dtype) * 8)) - 1))


@st.composite
def tensor_pair(draw):
    """(old, new, old_layout, new_layout): new is old with a random subset of elements changed."""
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(SHAPES)
    numel = math.prod(shape)
    utype = _NP_UINT[_size(dtype)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if numel <= 512:
        old = draw(hnp.arrays(utype, shape, elements=bit_patterns(dtype))).reshape(-1)
    else:  # long tensors: weight-like bits with edge values sprinkled in
        old = weightlike(rng, dtype, numel)
        edges = rng.random(numel) < 0.05
        pick = rng.integers(0, len(EDGES[dtype]), int(edges.sum()))
        old[edges] = np.asarray(EDGES[dtype], dtype=utype)[pick]
    density = draw(DENSITIES)
    if draw(st.booleans()):  # independently placed changes; density 0: none, 1: all
        mask = rng.random(numel) < density
    else:  # one run of changed elements
        length = round(density * numel)
        start = int(rng.integers(0, numel - length + 1))
        mask = np.zeros(numel, dtype=bool)
        mask[start : start + length] = True
    new = np.where(mask, changes(rng, old, dtype, draw(MODES)), old).astype(utype)
    old_t, new_t = from_bits(old.reshape(shape), dtype), from_bits(new.reshape(shape), dtype)
    return present(old_t, draw(LAYOUTS)), present(new_t, draw(LAYOUTS))


@st.composite
def models(draw):
    pairs = {name: draw(tensor_pair()) for name in draw(NAMES)}
    return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}


VERSIONS = st.integers(0, 2**53)


# -- round trips -------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(
    model=models(), policy=st.text(max_size=12), base_version=VERSIONS, version=st.none() | VERSIONS
)
@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_delta_round_trip_is_bit_exact(model, policy, base_version, version):
    old, new = model
    old_before = snapshot(old)
    payload = encode(old, new, policy=policy, base_version=base_version, version=version)

    header = peek(payload)
    assert isinstance(header, Header)
    assert header.kind == "delta"
    assert header.policy == policy
    assert header.base_version == base_version
    assert header.version == (base_version + 1 if version is None else version)
    assert header.changed == changed_bits(old, new)
    assert header.base_checksum == checksum(old)
    assert header.checksum == checksum(new)
    assert header.total_bytes == len(payload)
    assert sorted(t["name"] for t in header.tensors) == sorted(new)
    assert header.elements == sum(t.numel() for t in new.values())
    assert header.model_bytes == sum(t.numel() * t.element_size() for t in new.values())

    out = decode(old, payload)
    assert_bits_equal(out, new)
    assert checksum(out) == checksum(new)
    assert_bits_equal(old, old_before)  # decode does not touch its input
    assert all(out[k].data_ptr() != old[k].data_ptr() or old[k].numel() == 0 for k in old)

    receiver = snapshot(old)
    assert apply(receiver, payload) == header
    assert_bits_equal(receiver, new)

    receiver = snapshot(old)
    apply(receiver, payload, base_checksum=checksum(old))  # cached checksum: same result
    assert_bits_equal(receiver, new)


@settings(max_examples=100, deadline=None)
@given(model=models(), policy=st.text(max_size=12), version=VERSIONS)
def test_full_snapshot_round_trip_is_bit_exact(model, policy, version):
    old, new = model
    payload = encode_full(new, policy=policy, version=version)

    header = peek(payload)
    assert header.kind == "full"
    assert (header.policy, header.version) == (policy, version)
    assert header.base_version is None and header.base_checksum is None
    assert header.checksum == checksum(new)
    assert header.total_bytes == len(payload)
    assert header.elements == sum(t.numel() for t in new.values())

    out = decode(None, payload)
    assert_bits_equal(out, new)
    assert checksum(out) == checksum(new)
    assert all(t.is_contiguous() for t in out.values())

    receiver = snapshot(old)  # any weights of the same layout are overwritten
    assert apply(receiver, payload) == header
    assert_bits_equal(receiver, new)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_edge_values_and_changes_between_them_round_trip(dtype):
    edges = np.asarray(EDGES[dtype], dtype=_NP_UINT[_size(dtype)])
    # every edge value as old, and as new: each edge turned into every other edge
    old_bits = np.repeat(edges, edges.size)
    new_bits = np.tile(edges, edges.size)
    old = {"w": from_bits(old_bits, dtype), "kept": from_bits(edges, dtype)}
    new = {"w": from_bits(new_bits, dtype), "kept": from_bits(edges, dtype)}
    payload = encode(old, new)
    assert peek(payload).changed == edges.size * (edges.size - 1)
    assert_bits_equal(decode(old, payload), new)
    receiver = snapshot(old)
    apply(receiver, payload)
    assert_bits_equal(receiver, new)
    assert_bits_equal(decode(None, encode_full(new)), new)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_positive_to_negative_zero_is_a_change(dtype):
    old = {"z": torch.zeros(5, dtype=dtype)}
    new = {"z": old["z"].clone()}
    raw(new["z"])[2] = raw(-torch.zeros((), dtype=dtype))  # -0.0 == +0.0 as floats, not as bits
    assert torch.equal(old["z"], new["z"])  # float comparison cannot see it...
    assert checksum(old) != checksum(new)  # ...the checksum can
    payload = encode(old, new)
    assert peek(payload).changed == 1
    out = decode(old, payload)
    assert_bits_equal(out, new)
    assert math.copysign(1.0, float(out["z"][2])) == -1.0
    assert math.copysign(1.0, float(out["z"][1])) == 1.0


@pytest.mark.parametrize(
    "dtype, patterns",
    [
        (torch.float64, [0, 1 << 63, 0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001]),
        (torch.int64, [0, (1 << 63), (1 << 63) - 1, 1, 0xFFFFFFFFFFFFFFFF]),
        (torch.int8, [0, 0x80, 0x7F, 0xFF, 1]),
        (torch.uint8, [0, 0x80, 0x7F, 0xFF, 1]),
    ],
    ids=["float64", "int64", "int8", "uint8"],
)
def test_other_itemsizes_round_trip(dtype, patterns):
    rng = np.random.default_rng(3)
    utype = _NP_UINT[_size(dtype)]
    old_bits = np.asarray(patterns, dtype=utype)[rng.integers(0, len(patterns), 2000)]
    new_bits = old_bits.copy()
    where = rng.choice(2000, 50, replace=False)
    new_bits[where] = np.asarray(patterns, dtype=utype)[rng.integers(0, len(patterns), 50)]
    old, new = {"t": from_bits(old_bits, dtype)}, {"t": from_bits(new_bits, dtype)}
    payload = encode(old, new)
    assert peek(payload).changed == int(np.count_nonzero(old_bits != new_bits))
    assert_bits_equal(decode(old, payload), new)
    assert_bits_equal(decode(None, encode_full(new)), new)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(11)
    base = from_bits(weightlike(rng, torch.bfloat16, 48 * 64).reshape(48, 64), torch.bfloat16)
    bits = to_bits(base).copy()
    bits.reshape(-1)[rng.choice(bits.size, 100, replace=False)] += 1
    changed = from_bits(bits, torch.bfloat16)
    for old_layout in ("contiguous", "transposed", "sliced"):
        for new_layout in ("contiguous", "transposed", "sliced"):
            old = {"w": present(base, old_layout)}
            new = {"w": present(changed, new_layout)}
            assert old["w"].is_contiguous() == (old_layout == "contiguous")
            assert new["w"].is_contiguous() == (new_layout == "contiguous")
            payload = encode(old, new)
            assert peek(payload).changed == 100
            assert_bits_equal(decode(old, payload), {"w": changed})
            receiver = snapshot(old)
            apply(receiver, payload)
            assert_bits_equal(receiver, {"w": changed})
            assert_bits_equal(decode(None, encode_full(new)), {"w": changed})


def test_checksum_sees_bits_names_dtypes_and_shapes_not_layout():
    rng = np.random.default_rng(5)
    w = from_bits(weightlike(rng, torch.float32, 6 * 7).reshape(6, 7), torch.float32)
    ref = checksum({"w": w})
    assert checksum({"w": present(w, "transposed")}) == ref
    assert checksum({"w": present(w, "sliced")}) == ref
    assert checksum({"v": w}) != ref
    assert checksum({"w": w.reshape(7, 6)}) != ref
    assert checksum({"w": w.view(torch.int32)}) != ref
    one_bit = w.clone()
    raw(one_bit)[3, 4] ^= 1
    assert checksum({"w": one_bit}) != ref


def test_apply_needs_contiguous_receiver():
    old = {"w": torch.zeros(4, 6)}
    new = {"w": torch.ones(4, 6)}
    receiver = {"w": torch.zeros(6, 4).t()}
    with pytest.raises(ValueError, match="contiguous"):
        apply(receiver, encode(old, new))


# -- a fixed sample that exercises every scheme ------------------------------------------------
def _sample() -> tuple[dict, dict]:
    rng = np.random.default_rng(7)
    old, new = {}, {}

    def add(name, dtype, old_bits, new_bits):
        old[name], new[name] = from_bits(old_bits, dtype), from_bits(new_bits, dtype)

    a = weightlike(rng, torch.bfloat16, 4000)  # a few scattered ulp changes: Rice-coded positions
    b = a.copy()
    b[rng.choice(4000, 20, replace=False)] += 1
    add("layers.0.sparse", torch.bfloat16, a, b)
    a = weightlike(rng, torch.float16, 4000)  # one changed block: a bitmap
    b = a.copy()
    b[1000:2200] += 2
    add("layers.0.block", torch.float16, a, b)
    a = weightlike(rng, torch.float32, 1200).reshape(30, 40)  # nearly everything by ulps: dense
    b = np.where(rng.random((30, 40)) < 0.95, a + rng.integers(1, 4, (30, 40)), a).astype(np.uint32)
    add("layers.1.dense", torch.float32, a, b)
    a = weightlike(rng, torch.bfloat16, 8)
    add("norm.same", torch.bfloat16, a, a)
    add("scalar", torch.float32, np.array(0, np.uint32), np.array(0x80000000, np.uint32))
    add("empty", torch.bfloat16, np.zeros((3, 0), np.uint16), np.zeros((3, 0), np.uint16))
    return old, new


OLD, NEW = _sample()
PAYLOADS = {
    "delta": encode(OLD, NEW, policy="pi", base_version=4),
    "full": encode_full(NEW, policy="pi", version=5),
}


def test_sample_round_trips_through_every_scheme():
    schemes = {t["name"]: t["scheme"] for t in peek(PAYLOADS["delta"]).tensors}
    assert schemes["layers.0.sparse"] == "rice"
    assert schemes["layers.0.block"] == "bitmap"
    assert schemes["layers.1.dense"] == "dense"
    assert schemes["norm.same"] == "same"
    assert_bits_equal(decode(OLD, PAYLOADS["delta"]), NEW)
    assert_bits_equal(decode(None, PAYLOADS["full"]), NEW)
    assert {t["scheme"] for t in peek(PAYLOADS["full"]).tensors} == {"raw"}


# -- errors --------------------------------------------------------------------------------------
def test_error_hierarchy():
    assert issubclass(CorruptPayload, WeightTransferError)
    assert issubclass(BaseMismatch, WeightTransferError)
    assert issubclass(WeightTransferError, ValueError)


@pytest.mark.parametrize("where", ["unchanged tensor", "changed tensor", "sign of a zero"])
def test_delta_onto_other_base_weights_is_refused(where):
    payload = PAYLOADS["delta"]
    other = snapshot(OLD)
    if where == "unchanged tensor":
        raw(other["norm.same"])[3] ^= 1
    elif where == "changed tensor":
        raw(other["layers.0.sparse"])[17] += 5
    else:
        raw(other["scalar"])[()] ^= raw(torch.tensor(-0.0))  # base holds -0.0 where +0.0 was
    assert checksum(other) != checksum(OLD)

    with pytest.raises(BaseMismatch, match=r"4->5 of 'pi'.*other weights.*base checksum differs"):
        decode(other, payload)

    receiver, before = snapshot(other), snapshot(other)
    with pytest.raises(BaseMismatch, match="base checksum differs"):
        apply(receiver, payload)
    assert_bits_equal(receiver, before)


def test_delta_replayed_onto_its_own_result_is_refused():
    receiver = snapshot(OLD)
    apply(receiver, PAYLOADS["delta"])
    with pytest.raises(BaseMismatch, match="base checksum differs"):
        apply(receiver, PAYLOADS["delta"])
    assert_bits_equal(receiver, NEW)


def test_wrong_cached_base_checksum_is_refused_without_writing():
    receiver = snapshot(OLD)
    with pytest.raises(BaseMismatch, match="base checksum differs"):
        apply(receiver, PAYLOADS["delta"], base_checksum=checksum(OLD) ^ 1)
    assert_bits_equal(receiver, OLD)


def test_delta_without_base_is_refused():
    with pytest.raises(BaseMismatch, match="needs the base weights"):
        decode(None, PAYLOADS["delta"])


def _corrupt_bits_everywhere_are_detected(kind: str, bits) -> None:
    payload = PAYLOADS[kind]
    base = OLD if kind == "delta" else None
    for bit in bits:
        bad = flip(payload, bit)
        with pytest.raises(CorruptPayload, match=CORRUPT):
            decode(base, bad)
        with pytest.raises(CorruptPayload, match=CORRUPT):
            peek(bad)


@pytest.mark.parametrize("kind", ["delta", pytest.param("full", marks=pytest.mark.slow)])
def test_every_single_bit_flip_is_detected(kind):
    _corrupt_bits_everywhere_are_detected(kind, range(len(PAYLOADS[kind]) * 8))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["delta", "full"]))
def test_flipped_bit_is_detected_before_anything_is_written(data, kind):
    payload = PAYLOADS[kind]
    bit = data.draw(st.integers(0, len(payload) * 8 - 1), label="bit")
    bad = flip(payload, bit)
    with pytest.raises(CorruptPayload, match=CORRUPT):
        decode(OLD if kind == "delta" else None, bad)
    receiver = snapshot(OLD)
    with pytest.raises(CorruptPayload, match=CORRUPT):
        apply(receiver, bad)
    assert_bits_equal(receiver, OLD)


_CUTS = st.sampled_from(["delta", "full"]).flatmap(
    lambda kind: st.tuples(st.just(kind), st.integers(0, len(PAYLOADS[kind]) - 1))
)


@settings(max_examples=100, deadline=None)
@given(cut=_CUTS)
@example(cut=("delta", 0))
@example(cut=("delta", len(PAYLOADS["delta"]) - 1))
@example(cut=("full", 0))
@example(cut=("full", len(PAYLOADS["full"]) - 1))
def test_truncated_payload_is_detected(cut):
    kind, length = cut
    short = PAYLOADS[kind][:length]
    with pytest.raises(CorruptPayload, match=r"too short|truncated"):
        decode(OLD if kind == "delta" else None, short)
    with pytest.raises(CorruptPayload, match=r"too short|truncated"):
        peek(short)
    receiver = snapshot(OLD)
    with pytest.raises(CorruptPayload):
        apply(receiver, short)
    assert_bits_equal(receiver, OLD)


@pytest.mark.parametrize("extra", [b"\0", b"trailing bytes"], ids=["one byte", "text"])
def test_padded_payload_is_detected(extra):
    with pytest.raises(CorruptPayload, match="truncated or padded"):
        decode(OLD, PAYLOADS["delta"] + extra)


def test_not_a_payload_is_detected():
    with pytest.raises(CorruptPayload, match="not an astranb weight payload"):
        peek(b"PK\x03\x04" + bytes(60))


@pytest.mark.parametrize("kind", ["delta", "full"])
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: {**t, "layers.0.block": torch.zeros(3999, dtype=torch.float16)},
         r"'layers\.0\.block'.*torch\.float16\(4000,\).*torch\.float16\(3999,\)"),
        (lambda t: {**t, "layers.1.dense": torch.zeros(40, 30)},
         r"'layers\.1\.dense'.*\(30, 40\).*\(40, 30\)"),
        (lambda t: {**t, "layers.0.sparse": t["layers.0.sparse"].view(torch.float16)},
         r"'layers\.0\.sparse'.*torch\.bfloat16\(4000,\).*torch\.float16\(4000,\)"),
        (lambda t: {k: v for k, v in t.items() if k != "scalar"},
         r"'scalar'.*receiver has nothing"),
    ],
    ids=["shape", "transposed shape", "dtype", "missing"],
)
def test_apply_onto_other_layout_is_refused_without_writing(kind, change, message):
    receiver = change(snapshot(OLD))
    before = snapshot(receiver)
    with pytest.raises(BaseMismatch, match=message):
        apply(receiver, PAYLOADS[kind])
    assert_bits_equal(receiver, before)


def test_decode_onto_other_layout_is_refused():
    other = {**OLD, "layers.1.dense": OLD["layers.1.dense"].reshape(40, 30)}
    with pytest.raises(BaseMismatch, match="base checksum differs"):
        decode(other, PAYLOADS["delta"])


def test_encode_needs_the_same_layout():
    with pytest.raises(ValueError, match=r"only old: \['scalar'\].*only new: \['renamed'\]"):
        encode(OLD, {("renamed" if k == "scalar" else k): v for k, v in NEW.items()})
    with pytest.raises(ValueError, match=r"layers\.1\.dense.*\(30, 40\).*\(40, 30\).*encode_full"):
        encode(OLD, {**NEW, "layers.1.dense": NEW["layers.1.dense"].reshape(40, 30)})
    with pytest.raises(ValueError, match=r"layers\.0\.sparse.*bfloat16.*float16"):
        encode(OLD, {**NEW, "layers.0.sparse": NEW["layers.0.sparse"].view(torch.float16)})


# -- compactness ---------------------------------------------------------------------------------
N = 1_000_000


def _entropy(p: float) -> float:
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


@pytest.fixture(scope="module")
def big_bf16():
    rng = np.random.default_rng(1234)
    return rng, weightlike(rng, torch.bfloat16, N)


def test_sparse_ulp_delta_is_compact(big_bf16):
    rng, old_bits = big_bf16
    where = rng.choice(N, N // 100, replace=False)  # exactly 1%, uniformly placed
    new_bits = old_bits.copy()
    delta = rng.integers(1, 4, where.size) * rng.choice(np.array([-1, 1]), where.size)
    new_bits[where] = ((new_bits[where].astype(np.int64) + delta) % (1 << 16)).astype(np.uint16)
    old = {"w": from_bits(old_bits, torch.bfloat16)}
    new = {"w": from_bits(new_bits, torch.bfloat16)}
    payload = encode(old, new)
    header = peek(payload)
    changed = header.changed
    assert changed == N // 100
    assert len(payload) <= 0.3 * (16 + 6 * changed)  # vs. AstraFlow: 6 bytes a change + 16
    p = changed / N
    assert header.section_bytes("positions") <= 1.15 * N * _entropy(p) / 8
    assert_bits_equal(decode(old, payload), new)


@pytest.mark.parametrize("mode", ["random", "ulps"])
def test_dense_delta_is_no_larger_than_a_full_snapshot(big_bf16, mode):
    rng, old_bits = big_bf16
    mask = np.zeros(N, dtype=bool)
    mask[rng.choice(N, N * 9 // 10, replace=False)] = True  # 90% of the elements
    candidates = changes(rng, old_bits, torch.bfloat16, mode)
    new_bits = np.where(mask, candidates, old_bits).astype(np.uint16)
    old = {"w": from_bits(old_bits, torch.bfloat16)}
    new = {"w": from_bits(new_bits, torch.bfloat16)}
    payload = encode(old, new)
    full = encode_full(new)
    assert peek(payload).changed == int(np.count_nonzero(old_bits != new_bits))
    assert len(payload) <= 1.01 * len(full)
    if mode == "ulps":  # small differences compress well below the raw weights
        assert len(payload) < 0.5 * len(full)
    assert_bits_equal(decode(old, payload), new)


def _reframe(payload: bytes, header: bytes) -> bytes:
    """Rebuild a frame around another header, with a valid hash (a buggy or forged sender)."""
    import struct

    import xxhash

    magic, fmt, kind, total, header_len = struct.unpack_from("<4sHBxQI", payload)
    body = payload[20 + header_len : total - 8]
    head = struct.pack("<4sHBxQI", magic, fmt, kind, 20 + len(header) + len(body) + 8, len(header))
    framed = head + header + body
    return framed + struct.pack("<Q", xxhash.xxh3_64_intdigest(framed))


@pytest.mark.parametrize(
    "header", [b"not zstd", b"json", b'{"policy": 1}', b'{"tensors": [{"x": 1}]}'])
def test_malformed_header_with_valid_hash_is_corrupt_payload(header):
    import zstandard

    old = {"w": torch.zeros(8)}
    payload = encode(old, {"w": torch.ones(8)})
    forged = _reframe(payload, header if header == b"not zstd" else zstandard.compress(header))
    with pytest.raises(CorruptPayload, match="header is malformed|does not decompress"):
        decode(old, forged)


def test_section_claiming_a_huge_size_is_refused_before_allocating():
    import zstandard

    from astranb.weights._sections import _unzstd

    big = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    with pytest.raises(CorruptPayload, match="claims 1048576 bytes, at most 1000"):
        _unzstd(big, 1000)
