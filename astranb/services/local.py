"""Rollout and trainer services on this machine, as real processes on loopback.

The remote setup without remote hosts: each service is `astranb serve rollout|trainer` in its own
process (and process group), reached over HTTP exactly as a GPU host would be. Used by
notebooks/04_services.ipynb and handy for trying a deployment before renting machines.

    from astranb.services.local import launch_local

    with launch_local(rollout=2, trainer=True) as services:
        session = ab.Session("runs/x", rollout=services.rollout_urls, trainer=services.trainer_url)
        ...

The processes stop when the `with` block ends, on `close()`, when the Python process that
launched them exits normally (an `atexit` hook), so a notebook whose cell failed under papermill
does not leave them behind, and, as a last resort, when that process is killed: each service
watches it (astranb/lifeline.py). Each runs in a session of its own, so Ctrl-C and the kernel's
stop button do not reach it.
"""

from __future__ import annotations

import atexit
import html
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import httpx

from ..lifeline import shielded
from ..remote.scaling import Autoscaler
from .http import free_port

__all__ = ["LocalService", "LocalServices", "launch_local"]

_LIVE: set[LocalService] = set()  # started and not stopped yet: stopped at exit


class _HasURL(Protocol):
    url: str


S = TypeVar("S", bound=_HasURL)


class LocalService:
    """One service process on loopback (`astranb serve KIND ... --port PORT`).

    Args:
        kind: "rollout" or "trainer".
        args: further `astranb serve KIND` arguments (e.g. ["--engine", "hf"]).
        log_path: file that receives the process's stdout and stderr.
        port: TCP port (default: a free one).
        env: extra environment variables for the process.
    """

    def __init__(self, kind: str, args: Sequence[str], log_path: str | os.PathLike,
                 port: int | None = None, env: dict[str, str] | None = None):
        if kind not in ("rollout", "trainer"):
            raise ValueError(f"kind must be 'rollout' or 'trainer', got {kind!r}")
        self.kind, self.args, self.env = kind, list(args), dict(env or {})
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        """The same service as an `astranb` shell command (a GPU host would add a token and its
        own --host)."""
        return shlex.join(["astranb", "serve", self.kind, *self._args()])

    def _args(self) -> list[str]:
        return [*self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> LocalService:
        """Start the process; it does not wait for the service to answer (see `wait_healthy`).

        Returns:
            self.

        Raises:
            RuntimeError: it is running already.
        """
        if self.alive:
            raise RuntimeError(f"{self.kind} service on {self.url} is running already")
        command = [sys.executable, "-m", "astranb.cli", "serve", self.kind, *self._args()]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            # its own session and process group: Ctrl-C and the kernel's stop button do not
            # reach it, kill() takes torchrun's workers (--nproc > 1) too, and it ends when this
            # process does, however that ends (astranb/lifeline.py)
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                **shielded({**os.environ, **self.env}))
        _LIVE.add(self)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Wait until GET /health answers.

        Raises:
            RuntimeError: the process exited first (the message holds the end of its log).
            TimeoutError: it did not answer within `timeout` seconds (it is then killed).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.process.returncode if self.process else None
                raise RuntimeError(f"{self.kind} service on {self.url} exited with status {code} "
                                   f"before answering; end of {self.log_path}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"{self.kind} service on {self.url} did not answer /health within "
                           f"{timeout:.0f} s; end of {self.log_path}:\n{self.log()}")

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def status(self) -> dict:
        """The service's GET /v1/status answer.

        Returns:
            The status JSON; "policies" holds each policy's version and weights checksum.

        Raises:
            httpx.HTTPError: the service did not answer, or answered with an error.
        """
        answer = httpx.get(f"{self.url}/v1/status", timeout=10)
        answer.raise_for_status()
        return answer.json()

    def kill(self) -> None:
        """SIGKILL the service's process group, as if its host had crashed (no clean shutdown)."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)
        _LIVE.discard(self)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the service to shut down (SIGTERM); kill it if it has not within `timeout` s."""
        self._signal(signal.SIGTERM)
        try:
            if self.process is not None:
                self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        _LIVE.discard(self)

    def _signal(self, sig: signal.Signals) -> None:
        process = self.process
        if process is not None and process.poll() is None:  # self.alive
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:  # exited in between
                pass

    def log(self, tail: int = 4000) -> str:
        """The last `tail` characters of the service's output."""
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-tail:]

    def __repr__(self) -> str:
        pid = self.process.pid if self.process else None
        state = "running" if self.alive else "stopped"
        return f"LocalService({self.kind!r}, {self.url!r}, pid={pid}, {state})"


class ServiceSet(Generic[S]):
    """Started rollout services and a trainer, and the URLs a Session takes (the base of the
    handles `launch_local` and `launch_ray` return)."""

    rollout: list[S]
    trainer: S | None

    @property
    def all(self) -> list[S]:
        """Every service, rollout services first."""
        return [*self.rollout, *([self.trainer] if self.trainer else [])]

    @property
    def rollout_urls(self) -> list[str]:
        """What to pass as `Session(rollout=...)`."""
        return [s.url for s in self.rollout]

    @property
    def trainer_url(self) -> str | None:
        """What to pass as `Session(trainer=...)` (None without a trainer service)."""
        return self.trainer.url if self.trainer else None

    def add_rollout(self) -> str:
        """Start one more rollout service like the first; its URL once it answers."""
        raise NotImplementedError

    def remove_rollout(self, url: str) -> None:
        """Stop one rollout service (drain it first: `session.train(autoscale=...)` does)."""
        raise NotImplementedError

    def autoscaler(self, **settings: Any) -> Autoscaler:
        """An `Autoscaler` that adds and removes rollout services of this set, for
        `session.train(autoscale=...)`; `settings`: rule, min_services, max_services, interval."""
        return Autoscaler(add=self.add_rollout, remove=self.remove_rollout, **settings)


class LocalServices(ServiceSet[LocalService]):
    """The services `launch_local` started; a context manager that stops them on exit.

    Args:
        rollout: the rollout services.
        trainer: the trainer service, if any.
    """

    def __init__(self, rollout: list[LocalService], trainer: LocalService | None):
        self.rollout, self.trainer = rollout, trainer

    def add_rollout(self, timeout: float = 120.0) -> str:
        """Start one more rollout service with the first one's settings; its URL once it
        answers /health (for `session.add_rollout(url)`, or an autoscaler)."""
        first = self.rollout[0]
        service = LocalService("rollout", first.args,
                               first.log_path.parent / f"rollout-{len(self.rollout)}.log",
                               env=first.env).start()
        try:
            service.wait_healthy(timeout)
        except BaseException:
            service.stop()
            raise
        self.rollout.append(service)
        return service.url

    def remove_rollout(self, url: str) -> None:
        """Stop the rollout service at `url` and forget it (drain it in the session first)."""
        service = next((s for s in self.rollout if s.url == url.rstrip("/")), None)
        if service is None:
            raise ValueError(f"no rollout service at {url}: {self.rollout_urls}")
        service.stop()
        self.rollout.remove(service)

    def close(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL after 10 s); safe to call twice."""
        for service in self.all:
            service._signal(signal.SIGTERM)  # all at once: they shut down in parallel
        for service in self.all:
            service.stop()

    def __enter__(self) -> LocalServices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return "LocalServices(\n" + "".join(f"  {s!r},\n" for s in self.all) + ")"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{s.kind}</td><td><code>{html.escape(s.url)}</code></td>"
            f"<td>{s.process.pid if s.process else ''}</td>"
            f"<td>{'running' if s.alive else 'stopped'}</td>"
            f"<td><code>{html.escape(s.command)}</code></td></tr>"
            for s in self.all
        )
        return ("<table><tr><th>service</th><th>url</th><th>pid</th><th>state</th>"
                "<th>same as</th></tr>"
                f"{rows}</table>")


def launch_local(
    rollout: int = 2,
    trainer: bool = True,
    *,
    engine: str = "hf",
    log_dir: str | os.PathLike | None = None,
    rollout_args: Sequence[str] = (),
    trainer_args: Sequence[str] = (),
    threads: int | None = None,
    timeout: float = 120.0,
) -> LocalServices:
    """Start rollout (and trainer) services as processes on loopback and wait until they answer.

    Args:
        rollout: how many rollout services.
        trainer: also start a trainer service.
        engine: rollout engine of every rollout service ("hf", "instant", ...).
        log_dir: where each service's output goes (default: a new temporary folder).
        rollout_args: further `astranb serve rollout` arguments, e.g. ["--max-inflight", "64"].
        trainer_args: further `astranb serve trainer` arguments, e.g. ["--checkpoint-dir", "ckpt"].
        threads: torch threads per service process (OMP_NUM_THREADS); default: torch's own.
        timeout: seconds each service may take to answer /health.

    Returns:
        The running services (a context manager: leaving it stops them).

    Raises:
        ValueError: `rollout` < 1 (a session needs at least one rollout service).
        RuntimeError, TimeoutError: a service did not come up; the message holds the end of its
            log, and every service started here is stopped again.
    """
    if rollout < 1:
        raise ValueError(f"rollout must be >= 1 (a session needs a rollout service), got {rollout}")
    logs = Path(log_dir if log_dir is not None else tempfile.mkdtemp(prefix="astranb-services-"))
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    rollouts = [LocalService("rollout", ["--engine", engine, *rollout_args],
                             logs / f"rollout-{i}.log", env=env) for i in range(rollout)]
    trainer_service = LocalService("trainer", trainer_args, logs / "trainer.log", env=env)
    services = LocalServices(rollouts, trainer_service if trainer else None)
    try:
        for service in services.all:  # start all, then wait: they import torch in parallel
            service.start()
        for service in services.all:
            service.wait_healthy(timeout)
    except BaseException:
        services.close()
        raise
    return services


@atexit.register
def _stop_leftovers() -> None:
    """Stop services whose owner never closed them (e.g. a notebook cell failed before the end)."""
    for service in list(_LIVE):
        service.stop(timeout=5)
