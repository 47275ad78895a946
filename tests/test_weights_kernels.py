"""The compiled delta loops (astranb/weights/_kernels.py, numba) against the numpy decoder.

The numpy path in _sections.py is the reference: both must give the same bits for every scheme,
value mode and element size, refuse the same malformed payloads before writing anything, and
never write outside a tensor whatever positions a (hash-valid) payload claims.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from astranb.weights import (
    CorruptPayload,
    Mirror,
    _kernels,
    _sections,
    codec,
    decode,
    encode,
    peek,
)
from tests.waiting import wait_until


@pytest.fixture(autouse=True)
def compiled_for_every_size(monkeypatch):
    """The compiled loops for every payload here, however few its changes (_sections.py sends only
    payloads of >= _COMPILED_WORK changes through them), loaded before each test, which may call
    them directly: run alone (or first on its worker) it would otherwise find them not loaded."""
    monkeypatch.setattr(_sections, "_COMPILED_WORK", 0)
    assert _kernels.available(), "numba is a dependency: `make setup` installs it"


def test_numba_is_installed_and_the_compiled_loops_are_in_use():
    assert _kernels.available(), "numba is a dependency: `make setup` installs it"

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(_INT[t.element_size()]).reshape(-1).numpy().view(
        _UINT[t.element_size()])


@pytest.fixture
def numpy_path(monkeypatch):
    """Decode with _sections.py's numpy path (the compiled loops switched off)."""
    monkeypatch.setattr(_kernels, "available", lambda: False)


def _pair(dtype: torch.dtype, size: int, density: float, mode: str, seed: int):
    """Old and new tensors differing at `density` of the elements: by a few units of the bit
    pattern (the value stream holds differences, "d") or by random bits ("r")."""
    rng = np.random.default_rng(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    uint = _UINT[itemsize]
    old = rng.integers(0, np.iinfo(uint).max, size, dtype=uint, endpoint=True)
    new = old.copy()
    where = rng.random(size) < density
    if mode == "d":
        step = rng.integers(1, 4, size).astype(uint) * np.where(rng.random(size) < 0.5, 1, -1
                                                                 ).astype(np.int64).astype(uint)
        new[where] = old[where] + step[where]  # wraps around: the codec's arithmetic is mod 2^n
    else:  # a few distinct new values: the raw bits compress better than random differences
        new[where] = rng.choice(np.array([1, 7, 200], dtype=uint), int(where.sum()))
    as_t = lambda a: torch.from_numpy(a.view(_UINT[itemsize])).view(_INT[itemsize]).view(dtype)  # noqa: E731
    return as_t(old), as_t(new)


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.001, 0.03, 0.25])  # rice, rice or bitmap, bitmap
@pytest.mark.parametrize("mode", ["d", "r"])
def test_compiled_and_numpy_paths_give_the_same_bits(dtype, density, mode, monkeypatch):
    old, new = {}, {}
    for i, size in enumerate([5_003, 64, 1, 300_001]):  # word-unaligned sizes and a single element
        old[f"t{i}"], new[f"t{i}"] = _pair(dtype, size, density, mode, seed=i)
    payload = encode(old, new)
    schemes = {e["scheme"] for e in peek(payload).tensors}
    assert schemes & {"rice", "bitmap"}, schemes
    compiled = decode(old, payload)
    monkeypatch.setattr(_kernels, "available", lambda: False)
    reference = decode(old, payload)
    for name in new:
        assert np.array_equal(_bits(compiled[name]), _bits(new[name])), name
        assert np.array_equal(_bits(reference[name]), _bits(new[name])), name


def test_both_schemes_and_both_value_modes_are_exercised():
    seen = set()
    for density in (0.001, 0.25):
        for mode in ("d", "r"):
            old, new = _pair(torch.bfloat16, 300_001, density, mode, seed=1)
            payload = encode({"w": old}, {"w": new})
            header, body = codec._open(payload)
            (entry,) = header.tensors
            value_mode = bytes(body[sum(entry["sections"][:-1]):][:1]).decode()
            seen.add((entry["scheme"], value_mode))
    assert seen == {("rice", "d"), ("rice", "r"), ("bitmap", "d"), ("bitmap", "r")}


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 23, 33, 40])
def test_the_rice_loops_agree_with_the_numpy_decoder(k, monkeypatch):
    """apply_rice writes exactly at the numpy decoder's positions, and refuses (writing nothing)
    a tensor one element short or one code more than the stream holds."""
    rng = np.random.default_rng(k)
    gaps = rng.geometric(1 / max(2.0, 1.5 * 2.0 ** min(k, 20)), size=3001) - 1
    positions = np.cumsum(gaps + 1) - 1
    monkeypatch.setattr(_sections, "_rice_parameter", lambda g: k)
    unary_part, remainders = _sections._rice_encode(positions)
    unary, rem = np.frombuffer(unary_part[1:], np.uint8), np.frombuffer(remainders, np.uint8)
    last, n = int(positions[-1]), positions.size
    assert np.array_equal(_sections._rice_decode(memoryview(unary_part), memoryview(remainders),
                                                 n), positions)
    if last < 20_000_000:
        bits = np.zeros(last + 1, np.uint16)
        planes = np.stack([np.arange(n) % 251 + 1, np.zeros(n)]).astype(np.uint8)
        assert _kernels.apply_rice(unary, rem, k, planes, bits, False) == n
        expected = np.zeros(last + 1, np.uint16)
        expected[positions] = planes[0]
        assert np.array_equal(bits, expected)
        assert _kernels.apply_rice(unary, rem, k, planes, bits[:-1], False) == -1
        assert np.array_equal(bits, expected)  # refused whole: nothing written
        more = np.concatenate([planes, planes[:, :1]], axis=1)  # one value more than codes
        assert _kernels.apply_rice(unary, rem, k, more, np.zeros(last + 1, np.uint16), False) == -1
    else:  # too far apart to allocate: a tensor too short by one is still refused
        planes = np.ones((2, n), np.uint8)
        assert _kernels.apply_rice(unary, rem, k, planes, np.zeros(1000, np.uint16), False) == -1


# -- hostile payloads: a valid hash around positions that do not fit ------------------------------
def _forged(size: int, scheme: str, positions_part: list[bytes], n: int) -> bytes:
    """A one-tensor bf16 delta from a zero tensor with these position sections and n values of
    +1 unit, framed with a valid hash (a buggy or hostile sender)."""
    old = np.zeros(n, np.uint16)
    values = _sections._values_encode(old, old + 1)
    entry = {"name": "w", "dtype": "torch.bfloat16", "shape": [size], "itemsize": 2,
             "scheme": scheme, "changed": n, "positions": sum(map(len, positions_part)),
             "values": len(values), "sections": [*map(len, positions_part), len(values)]}
    zero = {"w": torch.zeros(size, dtype=torch.bfloat16)}
    meta = {"policy": "", "base_version": 0, "version": 1, "base_checksum": codec.checksum(zero),
            "checksum": 0}
    return codec._frame(codec.KIND_DELTA, meta, [entry], [*positions_part, values])


def _bitmap(size_bits: int, set_at: list[int]) -> list[bytes]:
    mask = np.zeros(size_bits, bool)
    mask[set_at] = True
    return [_sections._zstd(np.packbits(mask).tobytes())]


def _wrapping_rice() -> list[bytes]:
    """Three Rice codes (k = 40) at positions 0, 2^63 + 1 and 2^64 + 2: in int64 the second
    wraps to a negative number and the third back to 2, so the first and last look fine."""
    unary = np.zeros(2 * (1 << 23) + 3, np.uint8)
    unary[[0, (1 << 23) + 1, 2 * (1 << 23) + 2]] = 1
    return [bytes([40]) + np.packbits(unary).tobytes(), bytes(15)]


@pytest.mark.parametrize("case,message", [
    ("bit past the end", "positions do not decode"),
    ("fewer bits than values", "positions do not decode"),
    ("more bits than values", "positions do not decode"),
    ("rice past the end", "positions do not decode"),
    ("rice fewer codes than values", "positions do not decode|position stream holds 1 codes"),
    ("rice positions wrap around", "positions do not decode"),
    ("rice k too large", "Rice parameter 41 is out of range"),
    ("rice remainders cut", "remainder stream too short"),
])
@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_positions_that_do_not_fit_are_refused_before_anything_is_written(case, message, path,
                                                                           monkeypatch):
    if path == "numpy":
        monkeypatch.setattr(_kernels, "available", lambda: False)
    size = 61
    payload = {
        "bit past the end": lambda: _forged(size, "bitmap", _bitmap(64, [3, 62]), 2),
        "fewer bits than values": lambda: _forged(size, "bitmap", _bitmap(64, [3]), 2),
        "more bits than values": lambda: _forged(size, "bitmap", _bitmap(64, [3, 4, 5]), 2),
        "rice past the end": lambda: _forged(
            size, "rice", _sections._rice_encode(np.array([3, 90])), 2),
        "rice fewer codes than values": lambda: _forged(
            size, "rice", _sections._rice_encode(np.array([3])), 2),
        "rice positions wrap around": lambda: _forged(size, "rice", _wrapping_rice(), 3),
        "rice k too large": lambda: _forged(size, "rice", [bytes([41, 0xFF]), bytes(16)], 2),
        "rice remainders cut": lambda: _forged(size, "rice", [bytes([8, 0xC0]), b"\x01"], 2),
    }[case]()
    target = {"w": torch.zeros(size, dtype=torch.bfloat16)}
    before = target["w"].clone()
    with pytest.raises(CorruptPayload, match=message):
        codec.apply(target, payload)
    assert torch.equal(target["w"].view(torch.int16), before.view(torch.int16))


def test_the_loops_never_write_outside_the_tensor():
    """Called directly (past codec's checks), a position out of range stops the loop with -1
    before that position is written; the guard canary after the tensor is never touched."""
    buffer = np.zeros(80, np.uint16)
    bits = buffer[:70]
    planes = np.ones((2, 3), np.uint8)  # zig-zag 0x0101: a difference of -129
    words = _kernels.big_endian_words(np.packbits(np.isin(np.arange(80), [1, 2, 75])))
    assert _kernels.apply_bitmap(words, planes, bits, True) == -1
    assert buffer[70:].tolist() == [0] * 10
    assert bits[1] == bits[2] == np.uint16(-129 % 65536)  # before the bad one: applied
    # a Rice stream to 4, 6 and 75: refused before any of them is written
    unary_part, remainders = _sections._rice_encode(np.array([4, 6, 75]))
    unary, rem = np.frombuffer(unary_part[1:], np.uint8), np.frombuffer(remainders, np.uint8)
    bits[:] = 0
    assert _kernels.apply_rice(unary, rem, unary_part[0], planes, bits, False) == -1
    assert not bits.any() and buffer[70:].tolist() == [0] * 10


# -- warm-up and the switch ------------------------------------------------------------------------
def test_a_mirror_warms_the_loops_when_it_takes_its_first_full_snapshot(monkeypatch):
    from astranb.weights import mirror as mirror_module

    monkeypatch.setattr(mirror_module, "_WARM_ELEMENTS", 3)
    key = (np.dtype(np.uint32),)  # a dtype nothing else in this file warms
    _kernels._warmed.discard(key)
    mirror = Mirror()
    mirror.apply(codec.encode_full({"w": torch.zeros(3, dtype=torch.float32)}))
    wait_until(lambda: key in _kernels._warmed, 60, "the kernels to be warmed in the background")


@pytest.mark.slow  # fresh interpreters
def test_astranb_no_numba_selects_the_numpy_path_with_the_same_result():
    script = (
        "import torch, numpy as np\n"
        "from astranb.weights import _kernels, _sections, encode, decode\n"
        "_sections._COMPILED_WORK = 0\n"
        "old = {'w': torch.zeros(1000, dtype=torch.bfloat16)}\n"
        "new = {'w': torch.linspace(0, 1, 1000).bfloat16()}\n"
        "out = decode(old, encode(old, new))\n"
        "assert torch.equal(out['w'], new['w'])\n"
        "print(_kernels.available())\n"
    )
    env = {**os.environ, "ASTRANB_NO_NUMBA": "1"}  # the other way round: the test below
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow  # fresh interpreters
def test_small_deltas_and_small_models_never_load_numba():
    """A process that only sees payloads under the threshold (a tiny model) does not import
    numba at all; the first payload over it does."""
    script = (
        "import sys, torch\n"
        "from astranb.weights import Mirror, codec, encode, encode_full\n"
        "def model(scale):  # a third of 1.2M elements moved (a bitmap delta)\n"
        "    w = torch.linspace(1, 2, 1_200_000)\n"
        "    w[::3] *= scale\n"
        "    return {'w': w.bfloat16()}\n"
        "small = {'w': torch.zeros(1000, dtype=torch.bfloat16)}\n"
        "m = Mirror(); m.apply(encode_full(small))\n"
        "m.apply(encode(small, {'w': torch.ones(1000, dtype=torch.bfloat16)}))\n"
        "print('numba' in sys.modules)\n"
        "big = Mirror(); big.set(model(1.0))\n"
        "big.apply(encode(model(1.0), model(1.05)))\n"
        "print('numba' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ASTRANB_NO_NUMBA": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
