"""Autoscaling rollout services: the rule on hand-made loads, the clamp, and a live run that adds a
service (a real process), then drains and removes one with nothing lost or resubmitted."""

from __future__ import annotations

import math

import httpx
import pytest

import astranb as ab
from astranb.remote.scaling import Autoscaler, BacklogRule, Load
from astranb.services.local import launch_local
from tests.envs import SlowCountA
from tests.services import ROOT, TEST_ENVS
from tests.waiting import wait_until


def load(**given) -> Load:
    values = dict(time=10.0, services=2, starting=0, draining=0, queued=0, inflight=8,
                  trainer_idle=0.5, steps=3)
    return Load(**{**values, **given})


@pytest.mark.parametrize("given, change", [
    ({}, 1),                                         # the trainer waits half the time: add
    ({"trainer_idle": 0.3}, 1),                      # at the threshold
    ({"trainer_idle": 0.29}, 0),                     # between the thresholds: keep
    ({"trainer_idle": 0.5, "inflight": 0}, 0),       # it waits, but nothing is being played
    ({"trainer_idle": 0.5, "inflight": 0, "queued": 3}, 1),
    ({"trainer_idle": 0.05}, -1),                    # it never waits: drain one
    ({"trainer_idle": 0.0, "services": 1}, 0),       # ...unless only one serves
    ({"trainer_idle": 0.9, "starting": 1}, 0),       # a change is under way: wait for it
    ({"trainer_idle": 0.0, "draining": 1}, 0),
    ({"trainer_idle": math.nan, "steps": 0}, 0),     # no step in the interval: nothing to judge
])
def test_the_backlog_rule(given, change):
    assert BacklogRule()(load(**given)) == change


def test_the_clamp_keeps_services_within_bounds():
    scaler = Autoscaler(add=lambda: None, remove=lambda url: None, min_services=2,
                        max_services=4)
    assert scaler._clamp(5, load(services=2, starting=1)) == 1  # 3 serve or start: 1 more
    assert scaler._clamp(-3, load(services=3)) == -1  # down to min_services
    assert scaler._clamp(-1, load(services=1)) == 1  # below the minimum: back up to it
    assert scaler._clamp(0, load(services=3)) == 0
    only_add = Autoscaler(add=lambda: None)
    assert only_add._clamp(-1, load(services=3)) == 0  # nothing to remove with


def test_bad_settings_say_what_to_give():
    with pytest.raises(ValueError, match="min_services <= max_services"):
        Autoscaler(add=lambda: None, min_services=3, max_services=2)
    with pytest.raises(ValueError, match="give add="):
        Autoscaler()
    with pytest.raises(ValueError, match="interval"):
        Autoscaler(add=lambda: None, interval=0)


def test_autoscale_needs_rollout_services(tmp_path):
    with ab.Session(tmp_path) as session:
        policy = session.policy("solver", ab.models.tiny())
        session.wire(SlowCountA(), solver=policy)
        with pytest.raises(ValueError, match="Session\\(rollout="):
            session.train(steps=1, autoscale=Autoscaler(add=lambda: None))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_adds_a_service_then_drains_one_with_nothing_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the services import tests.envs
    envs = [arg for name, target in TEST_ENVS.items()
            for arg in ("--environment", f"{name}={target}")]
    looks: list[Load] = []

    def scripted(seen: Load) -> int:  # add at the first look; drain once both served a while
        looks.append(seen)
        if len(looks) == 1:
            return 1
        serving_two = [x for x in looks if x.services == 2]
        return -1 if len(serving_two) == 3 else 0

    with launch_local(rollout=1, trainer=False, engine="hf", log_dir=tmp_path / "logs",
                      rollout_args=envs, threads=1) as services:
        first = services.rollout_urls[0]
        scaler = services.autoscaler(rule=scripted, interval=1.0, max_services=2)
        with ab.Session(tmp_path / "runs", rollout=services.rollout_urls,
                        failure_timeout=5.0) as session:
            policy = session.policy("solver", ab.models.tiny())
            env = SlowCountA()
            env.registry_kwargs = {"delay": 0.2}
            session.wire(env, solver=policy)
            run = session.train(steps=1000, batch_size=16, group_size=4, max_staleness=1,
                                autoscale=scaler)
            wait_until(lambda: len(scaler.history) >= 2 or run.done, 240,
                       lambda: f"scaling (the last looks: {looks[-3:]})")
            run.stop()
            run.wait(progress=False)
            added, drained = scaler.history
            assert (added.change, drained.change) == (1, -1)
            assert added.url not in (None, first) and drained.url in (first, added.url)
            assert len(services.rollout) == 1 and drained.url not in services.rollout_urls
            with pytest.raises(httpx.HTTPError):  # its process was stopped
                httpx.get(f"{drained.url}/health", timeout=2)
            assert drained.url not in session.rollout_services
            df = run.metrics
            assert (df["rollout_services"] == 2).any()  # both got the weights while serving
            books = run.accounting
            assert books["lost"] == 0 and books["trained_twice"] == 0
            assert books["resubmitted"] == 0 and books["failovers"] == 0  # drained, not failed
            kinds = [e["kind"] for e in run.events]
            assert kinds.count("scaled") == 2
