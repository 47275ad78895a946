"""Services in-process: wire formats, security, the remote Session, failover, trainer recovery."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import msgpack
import pytest
import torch

import astranb as ab
from astranb import cli
from astranb.remote.client import RolloutClient, ServiceError, TrainerClient
from astranb.remote.pool import RolloutPool
from astranb.remote.serialize import (
    batch_from_bytes,
    batch_to_bytes,
    spec_to_wire,
    trajectory_from_wire,
    trajectory_to_wire,
)
from astranb.services import rollout_app, trainer_app
from astranb.services.http import InsecureBind, ServiceConfig
from astranb.types import Batch, Generation, SamplingParams, ToolCall, Trajectory, Turn

from .envs import CountA, SlowCountA
from .services import in_process_services
from .waiting import wait_until

TOKEN = "test-token"


# -- wire -----------------------------------------------------------------------------------------

def test_trajectory_round_trip():
    gen = Generation((1, 5), (7, 2), (-0.5, -1.25), (3, 4), "stop", "a")
    turn = Turn("solver", "p", gen, SamplingParams(0.7, 0.9, 4, (2,)))
    calls = (ToolCall("check", {"text": "a", "answer": 7}, False, None, 1),
             ToolCall("run", {"code": "1/0"}, None, "ZeroDivisionError: division by zero", 1))
    traj = Trajectory({"prompt": "ab=", "n": 3}, (turn,), {"solver": 0.5}, 7, None, 3, "x.0.7.1",
                      calls, "CountA")
    assert trajectory_from_wire(msgpack.unpackb(msgpack.packb(trajectory_to_wire(traj)))) == traj
    assert trajectory_from_wire(json.loads(json.dumps(trajectory_to_wire(traj)))) == traj


def _batch(rows=3, width=5) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    loss = torch.zeros(rows, width)
    loss[:, 2:] = 1
    return Batch(ids, mask, loss, -torch.rand(rows, width, generator=g) * loss,
                 torch.randn(rows, 1, generator=g).expand(rows, width) * loss,
                 torch.where(loss > 0, 2, -1), torch.ones(rows), torch.rand(rows, generator=g))


def test_batch_bytes_round_trip_and_errors():
    batch = _batch()
    back = batch_from_bytes(batch_to_bytes(batch, policy="p"))
    for name in Batch.__dataclass_fields__:
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    with pytest.raises(ValueError, match="not a valid safetensors"):
        batch_from_bytes(b"garbage")
    from safetensors.torch import save

    with pytest.raises(ValueError, match="lacks tensor"):
        batch_from_bytes(save({"input_ids_B_T": batch.input_ids_B_T}))


# -- security -------------------------------------------------------------------------------------

def _protected_routes(app):
    for route in app.routes:
        if getattr(route, "methods", None) and route.path not in ("/health",):
            for method in route.methods - {"HEAD"}:
                yield method, route.path.replace("{policy}", "p")


@pytest.mark.parametrize("kind", ["rollout", "trainer"])
def test_token_required_on_every_endpoint_but_health(kind):
    service = ServiceConfig(token=TOKEN)
    app = (rollout_app.create_app(rollout_app.RolloutConfig(service=service)) if kind == "rollout"
           else trainer_app.create_app(trainer_app.TrainerConfig(service=service)))

    async def check():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://s") as c:
            routes = list(_protected_routes(app))
            assert len(routes) >= (12 if kind == "rollout" else 6)
            for method, path in routes:
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                    answer = await c.request(method, path, headers=headers)
                    assert answer.status_code == 401, (method, path, headers)
                    assert "bearer token" in answer.json()["error"]
            assert (await c.get("/health")).status_code == 200
            ok = await c.get("/v1/status", headers={"authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and ok.json()["service"] == kind

    anyio.run(check)


def test_non_loopback_bind_needs_a_token(capsys):
    with pytest.raises(InsecureBind, match="without a token"):
        ServiceConfig(host="0.0.0.0")
    ServiceConfig(host="0.0.0.0", token=TOKEN)  # fine with one
    ServiceConfig(host="::1")  # loopback needs none
    assert cli.main(["serve", "rollout", "--host", "0.0.0.0", "--token", ""]) == 2
    assert "refusing to listen on '0.0.0.0' without a token" in capsys.readouterr().err


def test_bad_requests_get_4xx_naming_the_problem():
    config = rollout_app.RolloutConfig(engine="instant",
                                       service=ServiceConfig(max_body_bytes=4096))
    app = rollout_app.create_app(config)

    async def check():
        async with app.state.service.running():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://s") as c:
                answer = await c.post("/v1/submit", json={"items": [{"env_id": "e", "sample": {}}]})
                assert answer.status_code == 422 and "items.0.id" in answer.json()["error"]
                answer = await c.post("/v1/pull", json={"max": 0})
                assert answer.status_code == 422 and "max" in answer.json()["error"]
                answer = await c.post("/v1/submit", content=b"\xc1\xc1",
                                      headers={"content-type": "application/msgpack"})
                assert answer.status_code == 400 and "msgpack" in answer.json()["error"]
                answer = await c.post("/v1/submit", content=b"x" * 5000,
                                      headers={"content-type": "application/json"})
                assert answer.status_code == 413
                answer = await c.post("/v1/submit", json={"items": [
                    {"id": "a", "env_id": "nope", "sample": {}}]})
                assert (answer.status_code == 404
                        and "register the environment" in answer.json()["error"])
                answer = await c.post("/v1/environments",
                                      json={"name": "nope", "roles": {"solver": "p"}})
                assert answer.status_code == 404 and "POST /v1/policies" in answer.json()["error"]
                answer = await c.post("/v1/weights/p", content=b"junk")
                assert answer.status_code == 404

    anyio.run(check)


def test_msgpack_and_json_bodies_and_answers():
    app = rollout_app.create_app(rollout_app.RolloutConfig(
        engine="instant", environments={"CountA": "tests.envs:CountA"}))

    async def check():
        async with app.state.service.running():
            client = RolloutClient("http://s", transport=httpx.ASGITransport(app))  # msgpack
            await client.add_policy("p", spec_to_wire(ab.models.tiny()))
            env_id = await client.register("CountA", {"solver": "p"})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://s") as c:
                again = await c.post("/v1/environments",
                                     json={"name": "CountA", "roles": {"solver": "p"}})
                assert again.json()["env_id"] == env_id  # JSON and msgpack: same registration
            await client.submit([{"id": f"e{i}", "env_id": env_id, "sample": {"prompt": "ab="}}
                                 for i in range(5)])
            await client.submit([{"id": "e0", "env_id": env_id, "sample": {"prompt": "ab="}}])
            got = []
            while len(got) < 5:
                got += (await client.pull([], wait=1))["results"]
            assert sorted(r["id"] for r in got) == [f"e{i}" for i in range(5)]  # duplicate ignored
            resent = await client.pull([], resend=True)  # not acknowledged: handed out again
            assert len(resent["results"]) == 5
            assert (await client.pull([r["id"] for r in got]))["unacked"] == 0
            await client.close()

    anyio.run(check)


# -- the remote session ----------------------------------------------------------------------------

def test_remote_session_trains_and_every_service_holds_the_trainers_weights(tmp_path):
    session, apps, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw))
    with session:
        policy = session.policy("solver", ab.models.tiny(), optimizer=ab.AdamWConfig(lr=3e-3))
        session.wire(CountA(), solver=policy)
        run = session.train(steps=3, batch_size=16, group_size=4,
                            max_staleness=1).wait(progress=False)
        df = run.metrics
        assert list(df["version"]) == [1, 2, 3]
        for _, row in df.iterrows():
            assert row["rollout_checksums"].split(",") == [str(row["weights_checksum"])] * 2
            assert row["rollout_versions"] == f"{row['version']},{row['version']}"
        trainer = apps["http://t"].state.service.policies["solver"].store
        for url in ("http://r0", "http://r1"):
            engine = apps[url].state.service.slots["solver"].engine
            assert engine.version == 3 and engine.published_checksum() == trainer.checksum
        assert df["staleness_max"].max() <= 1
        books = run.accounting
        assert books["lost"] == 0 and books["trained_twice"] == 0 and books["duplicates"] == 0
        assert books["completed"] >= 3 * 16
        assert set(session.evaluate(n=8)) == {"solver"}


@pytest.mark.slow  # a failover run over several training runs
def test_a_rollout_service_that_goes_silent_loses_no_episode(tmp_path):
    session, apps, transports = in_process_services(
        lambda **kw: ab.Session(tmp_path, failure_timeout=0.3, **kw), trainer=False)
    with session:
        policy = session.policy("solver", ab.models.tiny())
        session.wire(SlowCountA(), solver=policy)  # services build it by name: SlowCountA()
        run = session.train(steps=12, batch_size=16, group_size=4, max_staleness=2)
        r0 = session.context.pool.members["http://r0"]

        def silence_r0_while_it_holds_work() -> bool:  # on the session's loop: no pull between
            if len(run.metrics) >= 2 and r0.inflight:
                transports["http://r0"].down = True  # r0 no longer answers: its work moves to r1
            return transports["http://r0"].down

        # wait for r0 to hold episodes: a slow trainer can leave the staleness gate closed
        deadline = time.monotonic() + 60
        while not session.context.call(silence_r0_while_it_holds_work):
            assert time.monotonic() < deadline, "r0 never held episodes in flight"
            time.sleep(0.01)
        run.wait(progress=False)
        books = run.accounting
        assert books["lost"] == 0 and books["trained_twice"] == 0
        assert books["failovers"] >= 1 and books["resubmitted"] >= 1
        assert session.rollout_services["http://r0"] == "dead"
        transports["http://r0"].down = False  # back: it catches up before getting work
        run = session.train(steps=14, batch_size=16, group_size=4,
                            max_staleness=2).wait(progress=False)
        assert session.rollout_services["http://r0"] == "ready"
        engine = apps["http://r0"].state.service.slots["solver"].engine
        assert engine.version == policy.version == 12 + 14
        assert engine.weights_checksum == policy.weights_checksum
        assert run.accounting["lost"] == 0


def test_duplicate_results_are_counted_once():
    pool = RolloutPool([], None, {})
    ids = pool.episode_ids(0, 1)
    result = trajectory_to_wire(Trajectory({}, (), {"solver": 1.0}, 0, None, 0, ids[0]))

    async def play():
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pool.play(_FakeEnv(), [(ids[0], {}, 0, 0)]))
            await anyio.sleep(0.01)
            pool.dispatch.deliver(result)
            pool.dispatch.deliver(result)  # e.g. a resubmitted copy finished too

    pool._envs[id(_ENV)] = (_ENV, {}, {})
    anyio.run(play)
    assert pool.counts["completed"] == 1 and pool.counts["duplicates"] == 1
    assert pool.accounting()["lost"] == 0


class _FakeEnv(CountA):
    def __new__(cls):
        return _ENV


_ENV = object.__new__(CountA)


# -- the trainer service ---------------------------------------------------------------------------

def _trainer_body(**kw):
    return {"name": "p", "model": spec_to_wire(ab.models.tiny()), "algorithm": {"kind": "grpo"},
            "optimizer": {"lr": 1e-3}, **kw}


def test_trainer_step_is_idempotent_and_checks_the_version(tmp_path):
    app = trainer_app.create_app(trainer_app.TrainerConfig(checkpoint_dir=str(tmp_path)))

    async def check():
        client = TrainerClient("http://t", transport=httpx.ASGITransport(app))
        created = await client.add_policy(_trainer_body())
        assert created["version"] == 0 and not created["recovered"]
        batch = _batch()
        first = await client.step("p", 0, batch)
        again = await client.step("p", 0, batch)  # a retry: same answer, no second step
        assert first == again and first["version"] == 1
        with pytest.raises(ServiceError, match="at version 1, the batch expects 3"):
            await client.step("p", 3, batch)
        full = await client.weights("p")
        delta = await client.weights("p", 0, created["checksum"])
        assert len(delta) < len(full)
        await client.close()
        return first

    first = anyio.run(check)

    restarted = trainer_app.create_app(trainer_app.TrainerConfig(checkpoint_dir=str(tmp_path)))

    async def recover():
        client = TrainerClient("http://t", transport=httpx.ASGITransport(restarted))
        created = await client.add_policy(_trainer_body())
        assert created["recovered"] and created["version"] == 1
        assert created["checksum"] == first["checksum"]  # the same weights, bit for bit
        with pytest.raises(ServiceError, match="other policy settings"):
            other = trainer_app.create_app(trainer_app.TrainerConfig(checkpoint_dir=str(tmp_path)))
            await TrainerClient("http://t", transport=httpx.ASGITransport(other)).add_policy(
                _trainer_body(optimizer={"lr": 5e-3}))
        await client.close()

    anyio.run(recover)


def test_an_environment_the_service_does_not_know_fails_the_run_with_the_reason(tmp_path):
    session, _, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), rollouts=1,
                                        trainer=False)
    with session:
        policy = session.policy("solver", ab.models.tiny())
        env = CountA()
        env.registry_name = "not_installed"
        session.wire(env, solver=policy)
        run = session.train(steps=2, batch_size=8, group_size=4)
        with pytest.raises(ValueError, match="unknown environment 'not_installed'"):
            run.wait(progress=False)


@pytest.mark.slow  # a failover run over several training runs
def test_a_trainer_restart_that_lost_steps_rolls_the_run_back_to_its_checkpoint(tmp_path):
    """checkpoint_every=2; the trainer 'dies' at version 3 and comes back from version 2."""
    session, apps, transports = in_process_services(lambda **kw: ab.Session(tmp_path, **kw))
    checkpoints = tmp_path / "ckpt"
    trainer_config = trainer_app.TrainerConfig(checkpoint_dir=str(checkpoints), checkpoint_every=2)
    transports["http://t"].inner = httpx.ASGITransport(trainer_app.create_app(trainer_config))
    with session:
        policy = session.policy("solver", ab.models.tiny())
        session.wire(CountA(), solver=policy)
        run = session.train(steps=3, batch_size=16, group_size=4,
                            max_staleness=1).wait(progress=False)
        assert policy.version == 3 and (checkpoints / "solver" / "v000002").is_dir()
        trainer, refused = transports["http://t"], []
        reach = trainer.handle_async_request

        async def counted(request):  # the requests that find the trainer gone
            refused.extend([request.url] if trainer.down else [])
            return await reach(request)

        trainer.handle_async_request = counted
        trainer.down = True
        run = session.train(steps=4, batch_size=16, group_size=4, max_staleness=1)
        wait_until(lambda: refused, 60, "the session to find the trainer gone")
        transports["http://t"].inner = httpx.ASGITransport(trainer_app.create_app(trainer_config))
        transports["http://t"].down = False
        run.wait(progress=False)
        assert [e["version"] for e in run.events if e["kind"] == "rollback"] == [2]
        df = run.metrics
        assert list(df["step"]) == [2, 3, 4, 5, 6]  # version 3 was lost: trained again from 2
        assert (df["token_version_max"] <= df["step"]).all()  # nothing from the lost weights
        assert df["staleness_max"].max() <= 1
        assert policy.version == 7 and run.accounting["trained_twice"] == 0
        engine = apps["http://r0"].state.service.slots["solver"].engine
        assert (engine.version, engine.weights_checksum) == (7, policy.weights_checksum)


@pytest.mark.slow  # a failover run over several training runs
def test_rollout_services_join_and_leave_while_a_run_goes_on(tmp_path):
    session, apps, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), rollouts=2,
                                           trainer=False)
    with session:
        session.remove_rollout("http://r1")  # start with r0 only
        policy = session.policy("solver", ab.models.tiny())
        session.wire(SlowCountA(), solver=policy)
        run = session.train(steps=16, batch_size=16, group_size=4, max_staleness=1)
        wait_until(lambda: len(run.metrics) >= 3, 120, "three steps")
        session.add_rollout("http://r1")  # joins mid-run: catches up, then gets work
        wait_until(lambda: apps["http://r1"].state.service.counters["finished"] >= 8, 120,
                   "r1 to finish 8 episodes")
        session.remove_rollout("http://r0")  # leaves mid-run: its in-flight work moves to r1
        run.wait(progress=False)
        books = run.accounting
        assert books["lost"] == 0 and books["trained_twice"] == 0
        assert list(session.rollout_services) == ["http://r1"]
        engine = apps["http://r1"].state.service.slots["solver"].engine
        assert (engine.version, engine.weights_checksum) == (16, policy.weights_checksum)
        with pytest.raises(ValueError, match="is a rollout service of this session already"):
            session.add_rollout("http://r1")


def test_a_policy_must_ask_for_the_engine_its_services_run(tmp_path):
    session, _, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw), rollouts=1,
                                        trainer=False)
    with session:
        with pytest.raises(ValueError, match="asks for engine='sglang' but these rollout services"):
            session.policy("solver", ab.models.tiny(), engine="sglang")
        assert session.policies == {}
        # rollout services always receive payloads: asking for state copies is an error now,
        # not a setting silently ignored
        with pytest.raises(ValueError, match="weight_transfer='state' only applies"):
            session.policy("solver", ab.models.tiny(), weight_transfer="state")
        assert session.policies == {}
        session.policy("solver", ab.models.tiny(), engine="hf")


@pytest.mark.slow  # two environments, two short training runs on the services
def test_the_agent_environments_play_on_rollout_services_by_name(tmp_path):
    """Installed environments are built on the service from their name and JSON arguments: no
    code crosses the wire; episodes (with tool calls and counts) come back and train."""
    from astranb_code import synthetic_tasks

    session, apps, _ = in_process_services(lambda **kw: ab.Session(tmp_path, **kw),
                                           trainer=False)
    with session:
        policy = session.policy("p", ab.models.tiny_chat(),
                                algorithm=ab.GRPO(filter_groups=False))
        few = {"max_new_tokens": 12}
        envs = {
            "textcraft": (ab.environments.load("textcraft", seed=1, targets=1, sampling=few),
                          "crafter"),
            "code": (ab.environments.load("code", data=synthetic_tasks(8), sampling=few),
                     "coder"),
        }
        for name, (env, role) in envs.items():
            session.wire(env, **{role: policy})
            run = session.train(steps=1, batch_size=4, group_size=2).wait(progress=False)
            assert run.accounting["lost"] == 0 and len(run.metrics) == 1
            episodes = [e for e in run.episodes if e.env == env.name]
            assert episodes and all(e.error is None for e in episodes), name
            service = apps["http://r0"].state.service
            assert any(getattr(built, "registry_name", None) == name
                       for built, _ in service.envs.values())
