"""A rollout service on the sglang engine, in-process, attached to the fake SGLang server on a
loopback port: episodes carry the fake's tokens, logprobs and versions, and weights pushed to the
service reach the server."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
import uvicorn

from astranb import models, weights
from astranb.remote.client import RolloutClient, ServiceError
from astranb.remote.serialize import spec_to_wire
from astranb.services import rollout_app
from astranb.weights.codec import encode_full
from tests.fake_sglang import FakeSGLang, expected
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)
EPISODES = 8


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """A local model directory (SGLang loads a directory; a tiny spec has none)."""
    return models.local(models.tiny().save(tmp_path_factory.mktemp("m") / "m"))


@pytest.fixture
def fake_server():
    """(fake, url): a FakeSGLang served by uvicorn on a free loopback port, in a thread.

    The service builds its engine from a URL, so the fake must listen on a real port."""
    fake = FakeSGLang()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=0, log_level="warning",
                            lifespan="off", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fake-sglang", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 10, "fake SGLang to start")
    assert server.started, "fake SGLang did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def make_app(url: str | None = None):
    config = rollout_app.RolloutConfig(engine="sglang", sglang_url=url,
                                       environments={"CountA": "tests.envs:CountA"})
    return rollout_app.create_app(config)


async def play(client: RolloutClient, env_id: str, prefix: str) -> list[dict]:
    """Submit EPISODES episodes and pull (and acknowledge) them all."""
    ids = [f"{prefix}{i}" for i in range(EPISODES)]
    await client.submit([{"id": i, "env_id": env_id, "sample": {"prompt": "ab="}} for i in ids])
    results: list[dict] = []
    while len(results) < EPISODES:
        results += (await client.pull([r["id"] for r in results], wait=1))["results"]
    await client.pull([r["id"] for r in results])
    assert sorted(r["id"] for r in results) == sorted(ids)
    return results


def check_generations(results: list[dict], prompt_ids: list[int], loads: int) -> None:
    """Each episode is one 8-token CountA turn, as the fake generates it after `loads` loads."""
    tokens, logprobs = expected(prompt_ids, 8, loads=loads)
    for result in results:
        assert result["error"] is None and len(result["turns"]) == 1
        gen = result["turns"][0]["generation"]
        assert gen["prompt_ids"] == prompt_ids and gen["completion_ids"] == tokens
        assert gen["logprobs"] == pytest.approx(logprobs)
        assert gen["versions"] == [loads] * 8 and gen["finish_reason"] == "length"


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_episodes_and_pushed_weights_through_the_sglang_engine(spec, fake_server):
    fake, url = fake_server
    app = make_app(url)
    prompt_ids = spec.tokenizer().encode("ab=")

    async def check():
        async with app.state.service.running():
            client = RolloutClient("http://s", transport=httpx.ASGITransport(app))
            added = await client.add_policy("p", spec_to_wire(spec))
            assert added["version"] == 0 and added["checksum"] is None
            env_id = await client.register("CountA", {"solver": "p"})
            check_generations(await play(client, env_id, "before"), prompt_ids, loads=0)
            assert len(fake.bodies) == EPISODES and fake.loads == 0

            state = {k: v.bfloat16() for k, v in spec.build().state_dict().items()}
            payload = encode_full(state, policy="p", version=1)
            pushed = await client.push_weights("p", payload)
            checksum = weights.peek(payload).checksum
            assert pushed["kind"] == "full" and pushed["version"] == 1
            assert fake.loaded_checksum == checksum == pushed["checksum"]
            assert fake.weight_version == "1" and fake.pauses == fake.continues == 1

            check_generations(await play(client, env_id, "after"), prompt_ids, loads=1)
            await client.close()

    anyio.run(check)


def test_a_tiny_spec_without_a_directory_is_refused_with_the_fix():
    app = make_app()

    async def check():
        async with app.state.service.running():
            client = RolloutClient("http://s", transport=httpx.ASGITransport(app))
            with pytest.raises(ServiceError,
                               match=r"spec\.save\(dir\).*models\.local\(dir\)") as info:
                await client.add_policy("p", spec_to_wire(models.tiny()))
            assert info.value.status == 422
            await client.close()

    anyio.run(check)
