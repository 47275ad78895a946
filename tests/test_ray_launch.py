"""launch_ray on a local Ray cluster (CPU only): real `astranb serve` processes placed and
supervised by Ray, driven by a Session over HTTP with a token; a killed actor restarted by Ray;
the launcher's errors. One cluster for the module (Ray takes a while to start on 2 cores); its
custom resources region:a and region:b stand for two regions."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

import astranb as ab  # noqa: E402
from astranb.services import launch_ray  # noqa: E402
from astranb.services.http import free_port  # noqa: E402
from astranb.services.ray_launch import (  # noqa: E402
    ROLLOUT_KEYS,
    NoRayCluster,
    RayLaunchError,
    RayServices,
    RaySpecError,
    _import_ray,
)

from .envs import CountA, SlowCountA  # noqa: E402
from .services import ROOT, TEST_ENVS, status, wait_for  # noqa: E402

# the services import the test environments from this checkout
ENV_ARGS = [a for name, target in TEST_ENVS.items() for a in ("--environment", f"{name}={target}")]
SERVICE = {"engine": "hf", "args": ENV_ARGS, "env": {"PYTHONPATH": str(ROOT)}}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             resources={"region:a": 100, "region:b": 100})
    try:
        yield ray
    finally:
        ray.shutdown()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# -- errors (no service starts) --------------------------------------------------------------------
def test_unknown_keys_are_named_with_the_valid_ones():
    with pytest.raises(RaySpecError, match="unknown key.*'engin'.*valid keys: engine, count"):
        launch_ray(rollout=[{"engin": "hf"}])
    with pytest.raises(RaySpecError, match="trainer spec: unknown key.*'gpus'.*gpus_per_proc"):
        launch_ray(rollout=[{}], trainer={"gpus": 1})
    with pytest.raises(RaySpecError, match="'count' must be a whole number"):
        launch_ray(rollout=[{"count": 0}])
    with pytest.raises(RaySpecError, match="--port.*the spec's 'port'"):
        launch_ray(rollout=[{"args": ["--port=8100"]}])
    assert list(ROLLOUT_KEYS)[:2] == ["engine", "count"]


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    with pytest.raises(ImportError, match=r"pip install 'astranb\[ray\]'"):
        _import_ray()


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_no_cluster_at_the_address():
    port = free_port()  # nothing listens there
    code = ("from astranb.services import launch_ray\n"
            f"launch_ray(address='127.0.0.1:{port}')")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "NoRayCluster: no Ray cluster at '127.0.0.1:" in done.stderr
    assert "ray start --head" in done.stderr
    assert time.monotonic() - started < 60  # said at once, not after Ray's own long retries
    assert issubclass(NoRayCluster, ConnectionError)


@pytest.mark.slow  # starts a local Ray cluster (module fixture)
def test_specs_larger_than_the_cluster_are_refused(cluster):
    with pytest.raises(RaySpecError, match="needs 1 CPUs and 2 GPUs on one node.*0 GPUs"):
        launch_ray(rollout=[{"gpus": 2}])
    with pytest.raises(RaySpecError, match="needs 8 CPUs.*largest node has 4 CPUs"):
        launch_ray(rollout=[{}], trainer={"nproc": 4, "cpus_per_proc": 2})
    with pytest.raises(RaySpecError, match=r"need 6 CPUs in all \(rollout-0 1, .*cluster has 4"):
        launch_ray(rollout=[{"count": 5}], trainer=True)
    with pytest.raises(RaySpecError, match="region 'mars'.*regions: a, b.*region:mars"):
        launch_ray(rollout=[{"region": "mars"}])
    assert ray.available_resources().get("CPU") == 4  # nothing was placed


# -- services on the cluster -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rollout_services_and_a_trainer_on_ray_stay_in_sync(cluster, tmp_path):
    specs = [{**SERVICE, "region": "a"}, {**SERVICE, "region": "b"}]
    with launch_ray(rollout=specs, trainer={"nproc": 1}, timeout=180) as services:
        assert len(services.rollout_urls) == 2 and services.trainer_url
        assert len(services.token) >= 32  # generated: every service requires it
        assert httpx.get(f"{services.trainer_url}/v1/status", timeout=10).status_code == 401
        infos = services.info()
        for info in infos:  # the supervisor watches a process without importing astranb/torch
            maps = Path(f"/proc/{_parent(info['pid'])}/maps").read_text()
            assert "libtorch" not in maps, info
        trainer_info = [i for i in infos if i["kind"] == "trainer"][0]
        assert trainer_info["checkpoint_dir"]
        with ab.Session(tmp_path / "runs", rollout=services.rollout_urls,
                        trainer=services.trainer_url, token=services.token) as session:
            policy = session.policy("solver", ab.models.tiny(), optimizer=ab.AdamWConfig(lr=3e-3))
            session.wire(CountA(), solver=policy)
            run = session.train(steps=3, batch_size=16, group_size=4, max_staleness=1)
            run.wait(progress=False)
            df = run.metrics
            assert list(df["version"]) == [1, 2, 3]
            for _, row in df.iterrows():  # at every version both services hold the trainer's bits
                assert row["rollout_checksums"].split(",") == [str(row["weights_checksum"])] * 2
            expected = status(services.trainer_url, services.token)["policies"]["solver"]
            assert expected["version"] == 3
            for url in services.rollout_urls:
                held = status(url, services.token)["policies"]["solver"]
                assert (held["version"], held["checksum"]) == (3, expected["checksum"])
            assert run.accounting["lost"] == 0 and run.accounting["trained_twice"] == 0
        checkpoints = Path(trainer_info["checkpoint_dir"])
        assert any(checkpoints.rglob("latest.json"))  # the trainer kept its checkpoints
        # capacity on demand (what an autoscaler calls): one more like the first, then removed
        assert ray.available_resources().get("CPU") == 1
        url = services.add_rollout()
        assert services.rollout_urls[2] == url and _answers(url)
        assert status(url, services.token)["region"] == "a"  # the first spec's --region
        assert [i["name"] for i in services.info()] == ["rollout-0", "rollout-1", "rollout-2",
                                                         "trainer"]
        gone = services.rollout_urls[0]
        services.remove_rollout(gone)
        assert services.rollout_urls[1] == url and not _answers(gone)
        wait_for(lambda: ray.available_resources().get("CPU") == 1, 30, "its CPU freed")
        with pytest.raises(ValueError, match="no rollout service at http://nowhere"):
            services.remove_rollout("http://nowhere")
        urls = [*services.rollout_urls, services.trainer_url]
    assert not any(_answers(url) for url in urls)  # shut down with the `with` block
    assert not checkpoints.exists()  # the default (scratch) checkpoint folder is removed
    wait_for(lambda: ray.available_resources().get("CPU") == 4, 30, "resources freed")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rollout_actor_is_restarted_by_ray_and_rejoins(cluster, tmp_path):
    with launch_ray(rollout=[{**SERVICE, "count": 2}], timeout=180) as services:
        r0 = services.rollout_urls[0]
        with ab.Session(tmp_path / "runs", rollout=services.rollout_urls, token=services.token,
                        failure_timeout=1.0) as session:
            policy = session.policy("solver", ab.models.tiny())
            env = SlowCountA()
            env.registry_kwargs = {"delay": 0.4}  # the services build it with these
            session.wire(env, solver=policy)
            run = session.train(steps=1000, batch_size=16, group_size=4, max_staleness=1)
            wait_for(lambda: len(run.metrics) >= 2, 120, "two steps")
            ray.kill(services.rollout_actors[0], no_restart=False)  # as if it had crashed
            wait_for(lambda: session.rollout_services[r0] != "ready", 60, "the pool to notice")
            wait_for(lambda: session.rollout_services[r0] == "ready", 120, "the rejoin")
            info = services.info()[0]
            assert info["starts"] == 2 and info["url"] == r0  # same node, same port, same URL
            rejoined = len(run.metrics)
            wait_for(lambda: len(run.metrics) >= rejoined + 4, 120, "four more steps")
            run.stop()
            run.wait(progress=False)
            books = run.accounting
            assert books["lost"] == 0 and books["trained_twice"] == 0
            assert books["rejoins"] >= 1
            after = run.metrics.iloc[rejoined + 1:]  # the first may be published before it
            for _, row in after.iterrows():  # both services at every version since the rejoin
                assert row["rollout_checksums"].split(",") == [str(row["weights_checksum"])] * 2
            assert services.refresh() == {}  # nothing moved to another node
            assert run.metrics["staleness_max"].max() <= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_trainer_actor_comes_back_from_its_checkpoint(cluster, tmp_path):
    trainer = {"nproc": 1, "checkpoint_every": 2}
    steps = 20  # long enough that the run is still going when Ray has restarted the trainer
    with launch_ray(rollout=[SERVICE], trainer=trainer, timeout=180) as services:
        with ab.Session(tmp_path / "runs", rollout=services.rollout_urls,
                        trainer=services.trainer_url, token=services.token) as session:
            policy = session.policy("solver", ab.models.tiny())
            session.wire(CountA(), solver=policy)
            run = session.train(steps=steps, batch_size=16, group_size=4, max_staleness=1)
            wait_for(lambda: len(run.metrics) >= 3, 120, "three steps")
            killed_at = policy.version
            ray.kill(services.trainer_actor, no_restart=False)
            wait_for(lambda: services.info()[-1].get("starts") == 2, 120, "the trainer restarted")
            run.wait(progress=False)
            info = services.info()[-1]
            assert info["starts"] == 2 and info["url"] == services.trainer_url, info
            df = run.metrics
            recovered = [e["version"] for e in run.events if e["kind"] == "rollback"]
            restarts = df.get("trainer_restarts", 0)
            assert recovered or (restarts > 0).any(), "the session never noticed the restart"
            for version in recovered:  # back to a checkpoint (every 2) written before the kill
                assert version % 2 == 0 and killed_at - 2 <= version < steps, (version, killed_at)
            assert policy.version == steps
            assert (df["token_version_max"] <= df["step"]).all()  # no token from lost weights
            expected = status(services.trainer_url, services.token)["policies"]["solver"]
            held = status(services.rollout_urls[0], services.token)["policies"]["solver"]
            assert (held["version"], held["checksum"]) == (steps, expected["checksum"])
            assert run.accounting["lost"] == 0 and run.accounting["trained_twice"] == 0


@pytest.mark.slow  # a Ray actor process
def test_a_service_that_cannot_start_is_reported_with_its_log(cluster):
    started = time.monotonic()
    with pytest.raises(RayLaunchError, match=r"(?s)exited with status 2 before answering.*"
                                             r"--environment 'nonsense': write NAME=module:Class"):
        launch_ray(rollout=[{"args": ["--environment", "nonsense"]}], timeout=120)
    assert time.monotonic() - started < 90
    wait_for(lambda: ray.available_resources().get("CPU") == 4, 30, "resources freed")


@pytest.mark.slow  # a local Ray cluster
def test_an_address_is_not_silently_ignored_when_connected_already(cluster):
    with pytest.warns(RuntimeWarning, match="connected to Ray already and stays on that cluster"):
        with pytest.raises(RaySpecError):  # checked on the cluster it is connected to
            launch_ray(rollout=[{"region": "mars"}], address="10.0.0.1:6379")


def test_shutdown_disconnects_only_from_a_ray_that_launch_ray_connected(monkeypatch):
    calls = []

    class FakeRay:
        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def shutdown():
            calls.append("shutdown")

    monkeypatch.setattr("astranb.services.ray_launch._import_ray", lambda: FakeRay)
    for owns, expected in [(False, []), (True, ["shutdown"])]:
        calls.clear()
        services = RayServices("token", "test")
        services._owns_ray = owns
        services.shutdown()
        services.shutdown()  # twice: nothing more
        assert calls == expected
