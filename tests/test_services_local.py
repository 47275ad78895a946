"""astranb.services.local: service processes on loopback that answer, die on kill, stop on close,
and do not outlive the Python process that launched them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astranb.services import local
from astranb.services.local import launch_local

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(240)


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_closed(port: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while listening(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow  # real service processes
def test_services_answer_a_killed_one_is_gone_and_close_stops_the_rest(tmp_path):
    with launch_local(rollout=2, trainer=True, engine="instant", log_dir=tmp_path) as services:
        assert [s.status()["service"] for s in services.all] == ["rollout", "rollout", "trainer"]
        assert services.rollout[0].status()["engine"] == "instant"
        assert services.rollout_urls == [s.url for s in services.rollout]
        assert services.trainer_url == services.trainer.url
        assert all(s.url.startswith("http://127.0.0.1:") for s in services.all)  # loopback
        assert services.rollout[0].command.startswith("astranb serve rollout --engine instant ")
        assert "rollout" in services._repr_html_() and "running" in repr(services)
        victim = services.rollout[1]
        victim.kill()
        assert not victim.alive and wait_closed(victim.port)
        assert services.rollout[0].alive and services.trainer.alive
    assert not any(s.alive for s in services.all)
    assert all(wait_closed(s.port) for s in services.all)
    assert not set(services.all) & local._LIVE
    services.close()  # twice is fine
    assert (tmp_path / "trainer.log").exists()


@pytest.mark.slow  # real service processes
def test_a_service_that_cannot_start_is_reported_with_its_log_and_nothing_is_left(tmp_path):
    with pytest.raises(RuntimeError, match="invalid int value") as caught:
        launch_local(rollout=1, trainer=True, rollout_args=["--max-inflight", "many"],
                     log_dir=tmp_path)
    assert "rollout-0.log" in str(caught.value)
    assert not local._LIVE


@pytest.mark.slow  # real service processes
def test_services_stop_when_the_launching_process_exits_without_closing_them(tmp_path):
    script = ("from astranb.services.local import launch_local\n"
              "s = launch_local(rollout=1, trainer=False, engine='instant', "
              f"log_dir={str(tmp_path)!r})\n"
              "print(s.rollout[0].process.pid, s.rollout[0].port, flush=True)\n")  # no close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr
    pid, port = map(int, done.stdout.split())
    assert wait_closed(port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_at_least_one_rollout_service():
    with pytest.raises(ValueError, match="rollout must be >= 1"):
        launch_local(rollout=0)
