"""The versioned weight store: who gets a delta, who gets a full snapshot, and healing."""

from __future__ import annotations

import pytest
import torch

from astranb.weights import BaseMismatch, CorruptPayload, apply, checksum, decode, peek
from astranb.weights.store import WeightStore


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(10, generator=g)}
    w["a"][: step * 3] += 0.05 * step  # a few rows move each version
    return w


def published(step: int) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in weights(step).items()}


def test_receiver_at_previous_version_gets_a_delta_others_a_full_snapshot():
    store = WeightStore("p", full_every=0)
    store.publish(0, weights(0))
    v0 = checksum(published(0))
    stats = store.publish(1, weights(1))
    assert 0 < stats.changed_fraction < 1 and stats.delta_bytes > 0
    assert stats.full_bytes == (64 * 32 + 10) * 2  # bf16
    assert peek(store.pull(0, v0)).kind == "delta"
    assert peek(store.pull(None, None)).kind == "full"  # unknown receiver
    assert peek(store.pull(0, v0 ^ 1)).kind == "full"  # same version number, other weights
    store.publish(2, weights(2))
    assert peek(store.pull(0, v0)).kind == "full"  # two versions behind
    assert store.version == 2 and store.checksum == checksum(published(2))


def test_full_snapshot_is_forced_every_full_every_versions():
    store = WeightStore("p", full_every=3)
    kinds = []
    receiver_version, receiver_sum = None, None
    for v in range(7):
        store.publish(v, weights(v))
        payload = store.pull(receiver_version, receiver_sum)
        header = peek(payload)
        kinds.append(header.kind)
        receiver_version, receiver_sum = header.version, header.checksum
    # v0: nothing to delta from; v3 and v6: forced
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_chain_of_pulls_reproduces_every_version_bit_exactly():
    store = WeightStore("p", full_every=4)
    store.publish(0, weights(0))
    receiver = decode(None, store.pull_full())
    for v in range(1, 9):
        store.publish(v, weights(v))
        header = apply(receiver, store.pull(v - 1, checksum(receiver)))
        assert header.version == v
        assert checksum(receiver) == checksum(published(v)) == store.checksum


def test_failed_delta_is_healed_by_a_full_snapshot():
    store = WeightStore("p", full_every=0)
    store.publish(0, weights(0))
    receiver = decode(None, store.pull_full())
    receiver["b"][0] += 1  # the receiver drifted: its base is not what the store thinks
    store.publish(1, weights(1))
    delta = store.pull(0, checksum(published(0)))  # it claims the right base
    with pytest.raises(BaseMismatch):
        apply(receiver, delta)
    corrupt = delta[:-1] + bytes([delta[-1] ^ 0x80])
    with pytest.raises(CorruptPayload):
        apply(receiver, corrupt)
    apply(receiver, store.pull_full())
    assert checksum(receiver) == store.checksum


def test_pull_before_publish_and_bad_settings():
    with pytest.raises(LookupError, match="nothing published"):
        WeightStore("p").pull()
    with pytest.raises(ValueError, match="full_every must be >= 0"):
        WeightStore("p", full_every=-1)


def test_a_store_without_deltas_measures_the_changed_bits_itself():
    from astranb.weights.codec import changed_fraction

    old = {"a": torch.tensor([1.0, 2.0, 0.0, 4.0]), "b": torch.zeros(4)}
    new = {"a": torch.tensor([1.0, 2.5, -0.0, 4.0]), "b": torch.zeros(4)}
    # 2.0 -> 2.5 and 0.0 -> -0.0 (other bits, same value): 2 of 8 elements
    assert changed_fraction(old, new) == 2 / 8
    store = WeightStore("p", deltas=False)
    store.publish(0, old)
    base = store.checksum
    stats = store.publish(1, new)
    assert stats.delta_bytes == 0 and stats.changed_fraction == 2 / 8
    assert peek(store.pull(0, base)).kind == "full"  # the receiver holds exactly version 0
