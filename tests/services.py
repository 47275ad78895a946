"""Helpers for service tests: in-process apps wired to a Session, and real service processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from astranb.services import rollout_app, trainer_app
from astranb.services.http import free_port

from .waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
TEST_ENVS = {"CountA": "tests.envs:CountA", "SlowCountA": "tests.envs:SlowCountA",
             "ToolBetween": "tests.envs:ToolBetween", "ChatTool": "tests.envs:ChatTool"}


class Switchable(httpx.AsyncBaseTransport):
    """An ASGI transport that can be 'killed': while down, every request fails to connect, and an
    answer that arrives after it went down is dropped (the link died while the request was out)."""

    def __init__(self, app):
        self.inner = httpx.ASGITransport(app)
        self.down = False

    async def handle_async_request(self, request):
        if self.down:
            raise httpx.ConnectError("service is down (test)", request=request)
        response = await self.inner.handle_async_request(request)
        if self.down:
            await response.aclose()
            raise httpx.ReadError("service went down while answering (test)", request=request)
        return response


def in_process_services(session_factory, rollouts=2, trainer=True, engine="hf", **rollout_kw):
    """Build apps, a Session whose clients reach them in-process, and start the apps' lifespans
    on the session's loop. Returns (session, apps, transports)."""
    apps = {f"http://r{i}": rollout_app.create_app(rollout_app.RolloutConfig(
        engine=engine, environments=TEST_ENVS, **rollout_kw)) for i in range(rollouts)}
    if trainer:
        apps["http://t"] = trainer_app.create_app(trainer_app.TrainerConfig())
    transports = {url: Switchable(app) for url, app in apps.items()}
    session = session_factory(
        rollout=[u for u in apps if "/r" in u], trainer="http://t" if trainer else None,
        transport=lambda url: transports[url],
    )
    for url, app in apps.items():
        if "/r" in url:
            service = app.state.service
            service.transport = transports.get("http://t")
            session.context.stack.enter_context(
                session.context.loop().wrap_async_context_manager(service.running()))
    return session, apps, transports


class Process:
    """A service started as a real process (its own process group, so kill -9 takes it all)."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict | None = None):
        self.args, self.port, self.log_path = args, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> Process:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(self.env or {}))
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "astranb.cli", *self.args,
                                          "--port", str(self.port)], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"{self.args} did not become healthy in {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (torchrun and its workers too)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30  # workers in other sessions follow their launcher
        while _listening(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} still answers 30 s after kill -9")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def status(url: str, token: str | None = None) -> dict:
    """A service's GET /v1/status (with the bearer token when given)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{url}/v1/status", headers=headers, timeout=10)
    answer.raise_for_status()
    return answer.json()


def wait_for(condition, timeout: float, what: str) -> None:
    """`tests.waiting.wait_until` at a slower poll: these conditions ask live services, Ray or
    `run.metrics` (a new DataFrame each time), and a run's progress is in steps of seconds."""
    wait_until(condition, timeout, what, interval=0.1)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def processes(*procs: Process):
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.kill()


def rollout_process(tmp: Path, name: str, port: int | None = None, *extra: str) -> Process:
    port = port or free_port()
    envs = [arg for name, target in TEST_ENVS.items()
            for arg in ("--environment", f"{name}={target}")]
    args = ["serve", "rollout", *envs, *extra]
    return Process(args, port, tmp / f"{name}.log")


def trainer_process(tmp: Path, nproc: int = 2, port: int | None = None, *extra: str) -> Process:
    port = port or free_port()
    args = ["serve", "trainer", "--nproc", str(nproc), *extra]
    return Process(args, port, tmp / f"trainer-{port}.log")
