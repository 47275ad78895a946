"""Real service processes on loopback: rollout services (hf engine) and an FSDP trainer (2 gloo
processes under torchrun), driven by a Session; kill -9 and restarts; a schema-driven fuzz run."""

from __future__ import annotations

import pytest

import astranb as ab

from .envs import CountA, SlowCountA
from .services import processes, rollout_process, status, trainer_process, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_two_rollout_services_and_an_fsdp_trainer_stay_in_sync(tmp_path):
    r0, r1 = rollout_process(tmp_path, "r0"), rollout_process(tmp_path, "r1")
    trainer = trainer_process(tmp_path, 2)
    with processes(r0, r1, trainer):
        assert status(trainer.url)["world_size"] == 2
        with ab.Session(tmp_path / "runs", rollout=[r0.url, r1.url],
                        trainer=trainer.url) as session:
            policy = session.policy("solver", ab.models.tiny(), optimizer=ab.AdamWConfig(lr=3e-3))
            session.wire(CountA(), solver=policy)
            run = session.train(steps=3, batch_size=16, group_size=4, max_staleness=1)
            run.wait(progress=False)
            df = run.metrics
            assert list(df["version"]) == [1, 2, 3]
            for _, row in df.iterrows():  # at every version both services hold the trainer's bits
                assert row["rollout_checksums"].split(",") == [str(row["weights_checksum"])] * 2
            expected = status(trainer.url)["policies"]["solver"]
            assert expected["version"] == 3
            for service in (r0, r1):
                held = status(service.url)["policies"]["solver"]
                assert (held["version"], held["checksum"]) == (3, expected["checksum"])
            assert set(df["transfer_kind"]) <= {"delta", "full"}
            assert run.accounting["lost"] == 0 and run.accounting["trained_twice"] == 0


def test_kill_9_a_rollout_service_then_restart_it(tmp_path):
    r0, r1 = rollout_process(tmp_path, "r0"), rollout_process(tmp_path, "r1")
    with processes(r0, r1):
        with ab.Session(tmp_path / "runs", rollout=[r0.url, r1.url],
                        failure_timeout=1.0) as session:
            policy = session.policy("solver", ab.models.tiny())
            env = SlowCountA()
            env.registry_kwargs = {"delay": 0.4}  # the services build it with these
            session.wire(env, solver=policy)
            run = session.train(steps=40, batch_size=16, group_size=4, max_staleness=1)
            wait_for(lambda: len(run.metrics) >= 2, 120, "two steps")
            r0.kill()  # SIGKILL: in-flight episodes on r0 are gone
            wait_for(lambda: session.rollout_services[r0.url] == "dead", 30, "r0 declared dead")
            r0.start()  # same port, new instance: it must catch up before it gets work
            wait_for(lambda: session.rollout_services[r0.url] == "ready" or run.done, 120,
                      "rejoin")
            assert not run.done, "the run ended before r0 came back; lengthen it"
            run.wait(progress=False)
            books = run.accounting
            assert books["lost"] == 0 and books["trained_twice"] == 0
            assert books["resubmitted"] >= 1 and books["rejoins"] >= 1
            held = status(r0.url)["policies"]["solver"]
            assert (held["version"], held["checksum"]) == (policy.version, policy.weights_checksum)
            assert run.metrics["staleness_max"].max() <= 1


def test_kill_9_the_trainer_then_restart_it_from_its_checkpoint(tmp_path):
    rollout = rollout_process(tmp_path, "r0")
    checkpoints = tmp_path / "ckpt"
    trainer = trainer_process(tmp_path, 2, None, "--checkpoint-dir", str(checkpoints),
                              "--checkpoint-every", "2")
    with processes(rollout, trainer):
        with ab.Session(tmp_path / "runs", rollout=[rollout.url], trainer=trainer.url) as session:
            policy = session.policy("solver", ab.models.tiny())
            session.wire(CountA(), solver=policy)
            run = session.train(steps=8, batch_size=16, group_size=4, max_staleness=1)
            wait_for(lambda: len(run.metrics) >= 3, 180, "three steps")
            trainer.kill()
            killed_at = policy.version
            trainer.start()  # same port and checkpoint dir: recovers the last checkpoint
            run.wait(progress=False)
            df = run.metrics
            recovered = [e["version"] for e in run.events if e["kind"] == "rollback"]
            restarts = df.get("trainer_restarts", 0)
            assert recovered or (restarts > 0).any(), "the session never noticed the restart"
            for version in recovered:  # rolled back to the last even version (checkpoint_every 2)
                assert version % 2 == 0 and version <= killed_at + 1
            assert policy.version == 8  # the run trains on to its target after the restart
            assert df["staleness_max"].max() <= 1  # the bound held across the restart
            assert (df["token_version_max"] <= df["step"]).all()  # no token from lost weights
            expected = status(trainer.url)["policies"]["solver"]
            held = status(rollout.url)["policies"]["solver"]
            assert expected["version"] == policy.version == held["version"]
            assert expected["checksum"] == held["checksum"]
