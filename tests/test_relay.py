"""Regions and relays: a region's services pull each version across the link to the trainer once.

The pure part (what a relay serves) is checked against the codec; the live part runs a trainer
and three rollout services in a "remote" region as real processes, the services reaching the
trainer only through a bandwidth-limited proxy written here, which counts the bytes crossing it.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

import astranb as ab
from astranb import weights
from astranb.weights.relay import NotHeld, RelayCache
from astranb.weights.store import WeightStore
from tests.envs import CountA
from tests.services import processes, rollout_process, trainer_process, wait_for

# -- what a relay serves (pure) -------------------------------------------------------------------


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g).bfloat16(),
            "b": torch.randn(100, generator=g).bfloat16()}


def _nudged(base: dict[str, torch.Tensor], every: int) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in base.items()}
    out["a"].view(-1)[::every] += 1.0
    return out


def _store_at_v1() -> tuple[WeightStore, dict, dict]:
    v0, store = _weights(0), WeightStore("p")
    store.publish(0, v0)
    v1 = _nudged(v0, 7)
    store.publish(1, v1)
    return store, v0, v1


def test_a_relay_sends_the_delta_it_received_to_a_receiver_at_its_base():
    store, v0, v1 = _store_at_v1()
    delta = store.pull(0, weights.checksum(v0))
    assert weights.peek(delta).kind == "delta"
    relay = RelayCache()
    relay.received(delta, weights.peek(delta))
    sent = relay.serve(1, 0, weights.checksum(v0), lambda: None, "p")
    assert sent == delta  # the very bytes the trainer sent: nothing re-encoded
    out = {k: v.clone() for k, v in v0.items()}
    weights.apply(out, sent)
    assert weights.checksum(out) == weights.checksum(v1)
    assert relay.served == {"delta": 1, "full": 0, "bytes": len(delta)}


def test_a_receiver_on_another_base_gets_a_full_snapshot_encoded_from_the_held_weights():
    store, v0, v1 = _store_at_v1()
    delta = store.pull(0, weights.checksum(v0))
    relay = RelayCache()
    relay.received(delta, weights.peek(delta))
    for have in [(None, None), (0, 12345), (5, weights.checksum(v0))]:
        sent = relay.serve(1, *have, lambda: v1, "p")
        header = weights.peek(sent)
        assert (header.kind, header.version, header.checksum) == ("full", 1, weights.checksum(v1))
        assert all(torch.equal(weights.decode(None, sent)[k], v1[k]) for k in v1)
    assert sent == weights.encode_full(v1, policy="p", version=1)
    assert relay.served["full"] == 3


def test_a_relay_sends_the_full_snapshot_it_received_as_it_is():
    store, _, v1 = _store_at_v1()
    full = store.pull_full()
    relay = RelayCache()
    relay.received(full, weights.peek(full))
    assert relay.serve(1, 0, 1, lambda: pytest.fail("nothing to encode"), "p") == full


def test_a_relay_never_serves_another_version_than_the_one_asked_for():
    store, v0, _ = _store_at_v1()
    delta = store.pull(0, weights.checksum(v0))
    relay = RelayCache()
    with pytest.raises(NotHeld, match="holds version None of 'p', not 1"):
        relay.serve(1, None, None, lambda: None, "p")
    relay.received(delta, weights.peek(delta))
    with pytest.raises(NotHeld, match="holds version 1 of 'p', not 2"):
        relay.serve(2, 1, weights.peek(delta).checksum, lambda: None, "p")
    with pytest.raises(NotHeld, match="no weights"):
        relay.serve(1, None, None, lambda: None, "p")  # a full snapshot with nothing held
    relay.forget()
    with pytest.raises(NotHeld):
        relay.serve(1, 0, weights.checksum(v0), lambda: None, "p")


# -- the link: a proxy with a bandwidth limit that counts what crosses it -------------------------

class Link:
    """A TCP proxy on loopback standing in for a cross-region link: the trainer's answers cross it
    at `rate` bytes/s (and after `rtt` s); `bytes_down` counts them."""

    def __init__(self, target_port: int, rate: float = 4e6, rtt: float = 0.02):
        self.target_port, self.rate, self.rtt = target_port, rate, rtt
        self.bytes_down = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _client(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, down=False),
                             self._pipe(up_reader, writer, down=True), return_exceptions=True)

    async def _pipe(self, reader, writer, down: bool) -> None:
        try:
            await asyncio.sleep(self.rtt / 2)
            while chunk := await reader.read(65536):
                if down:
                    self.bytes_down += len(chunk)
                    await asyncio.sleep(len(chunk) / self.rate)
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _full_size(trainer_url: str) -> int:
    return len(httpx.get(f"{trainer_url}/v1/weights/solver", timeout=30).content)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_remote_region_pulls_each_version_across_the_link_once_and_survives_its_relay(tmp_path):
    steps, kill_after = 8, 3
    trainer = trainer_process(tmp_path, 1)
    trainer.start()
    link = Link(trainer.port)
    remote = ["--region", "remote", "--trainer-url", link.url]
    services = [rollout_process(tmp_path, f"r{i}", None, *remote) for i in range(3)]
    try:
        with processes(*services):
            urls = [s.url for s in services]
            with ab.Session(tmp_path / "runs", rollout=urls, trainer=trainer.url,
                            failure_timeout=2.0) as session:
                policy = session.policy("solver", ab.models.tiny())
                session.wire(CountA(), solver=policy)
                at_start = link.bytes_down  # v0 crossed once: one service pulled, two relayed
                assert _full_size(trainer.url) <= at_start <= 1.1 * _full_size(trainer.url)
                first_relay = session.relays["remote"]
                run = session.train(steps=steps, batch_size=16, group_size=4, max_staleness=1)
                wait_for(lambda: len(run.metrics) >= kill_after or run.done, 300, "four steps")
                before_kill = len(run.metrics)
                next(s for s in services if s.url == first_relay).kill()  # kill -9 the relay
                run.wait(progress=False)
                df = run.metrics
                assert len(df) == steps and list(df["step"]) == list(range(steps))
                assert run.status == "finished", run.error
                books = run.accounting
                assert books["lost"] == 0 and books["trained_twice"] == 0
                assert session.relays["remote"] != first_relay  # a new relay was chosen

                pulled = df["transfer_bytes"] - df["transfer_bytes_relayed"]  # from the trainer
                # over the link: v0 plus each version once, as one service pulls it (+ headers)
                one_service = at_start + pulled.sum()
                print(f"over the link: {link.bytes_down} B; one service's pulls: {one_service} B; "
                      f"relayed in the region: {df['transfer_bytes_relayed'].sum()} B")
                assert link.bytes_down <= 1.1 * one_service, (link.bytes_down, one_service)
                whole = df.iloc[:before_kill - 1]  # all three alive: two got the relay's bytes
                assert (whole["transfer_bytes_relayed"] == 2 * (
                    whole["transfer_bytes"] - whole["transfer_bytes_relayed"])).all()
                late = df.iloc[before_kill + 1:]  # after the kill: the new relay and one more
                for _, row in late.iterrows():
                    sums = row["rollout_checksums"].split(",")
                    assert sums == [str(row["weights_checksum"])] * 2, row
                    assert row["transfer_bytes_relayed"] > 0
                status = httpx.get(f"{session.relays['remote']}/v1/status", timeout=10).json()
                assert status["region"] == "remote"
                assert status["policies"]["solver"]["relayed"]["bytes"] > 0
    finally:
        link.close()
        trainer.kill()
