"""The Ray actor that keeps one `astranb serve` process running on its node (`launch_ray`'s side
of it is services/ray_launch.py).

Each service `launch_ray` starts is one `ServiceSupervisor` actor in the service's placement
group. The actor starts the service under a keeper (services/_keeper.py) in a process group of its
own, waits until it answers /health, and watches it: when the process exits, the actor exits
(`os._exit`); when the actor dies (`ray.kill`, a crash) Ray restarts it, up to `max_restarts`
times, and it kills what its earlier life left running and starts the service again on the same
port. `_free_port` runs as a short Ray task in the service's bundle, so the launcher knows each
port before the actor starts.

This module travels to the Ray workers by value (`ray_launch._import_ray` registers it with
`ray.cloudpickle.register_pickle_by_value`) and needs only the standard library: a worker that
merely watches a process never imports astranb or torch. Import nothing from astranb here.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ServiceSupervisor"]


class ServiceSupervisor:
    """Ray actor that keeps one `astranb serve` process running on its node.

    The process runs under a keeper (services/_keeper.py) that dies with this actor and takes the
    whole process group along, so a restarted actor finds the port free. When the service exits
    on its own, this actor exits too (os._exit) and Ray restarts it.

    Args:
        config: plain settings from `launch_ray`: kind, name, launch, token, host, port, args,
            env, threads, work_dir, checkpoint_dir, timeout.
    """

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.kind, self.name = config["kind"], config["name"]
        self.host = config["host"] or _node_ip()
        self.port = int(config["port"])
        self.url = f"http://{_url_host(self.host)}:{self.port}"
        base = Path(config["work_dir"] or Path(tempfile.gettempdir()) / "astranb-ray")
        self.folder = base / config["launch"] / self.name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log_path = self.folder / "service.log"
        self.checkpoints = None
        if self.kind == "trainer":
            self.checkpoints = config["checkpoint_dir"] or str(self.folder / "checkpoints")
        self.starts = self._count_start()
        self.error = ""
        self._stopping = False
        self.process: subprocess.Popen | None = None
        try:
            self._reap_earlier()
            self.process = self._start()
            self._wait_healthy(float(config["timeout"]))
        except (OSError, RuntimeError, TimeoutError) as error:
            self._kill()
            if self.starts > 1:  # a restart that cannot start its service: the actor is dead
                raise RuntimeError(str(error)) from None
            self.error = str(error)  # the launcher reports it and stops everything
            return
        threading.Thread(target=self._watch, name="astranb-watch", daemon=True).start()

    def info(self) -> dict[str, Any]:
        """Where the service is and how it is doing ("pid": its keeper's, which leads the
        service's process group; "starts": 1 + the restarts)."""
        process = self.process
        return {"kind": self.kind, "name": self.name, "url": self.url, "host": self.host,
                "pid": process.pid if process else None, "starts": self.starts,
                "log": str(self.log_path), "checkpoint_dir": self.checkpoints,
                "running": process is not None and process.poll() is None, "error": self.error}

    def log(self, tail: int = 4000) -> str:
        """The last `tail` characters of the service's output."""
        return _tail(self.log_path, tail)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Stop the service (SIGTERM, then SIGKILL to its group); drop default checkpoints.

        Returns:
            The keeper's exit status (None if it had to be killed or never ran).
        """
        self._stopping = True
        code = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        if self.kind == "trainer" and not self.config["checkpoint_dir"] and self.checkpoints:
            shutil.rmtree(self.checkpoints, ignore_errors=True)  # our scratch copy only
        return code

    # -- inside --------------------------------------------------------------------------------
    def _count_start(self) -> int:
        counter = self.folder / "starts"
        starts = int(counter.read_text() or 0) + 1 if counter.exists() else 1
        counter.write_text(str(starts))
        return starts

    def _command(self) -> list[str]:
        spec = importlib.util.find_spec("astranb")  # finds it without importing it (torch)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"astranb is not installed on node {self.host}: install it "
                               "(pip install 'astranb[ray]') in the Python that Ray runs there")
        keeper = Path(spec.origin).parent / "services" / "_keeper.py"
        args = ["serve", self.kind, *self.config["args"], "--host", self.host,
                "--port", str(self.port)]
        if self.checkpoints is not None:
            args += ["--checkpoint-dir", self.checkpoints]
        return [sys.executable, str(keeper), str(os.getpid()),
                sys.executable, "-m", "astranb.cli", *args]

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.config["threads"]),
               **self.config["env"], "ASTRANB_TOKEN": self.config["token"]}  # not on argv
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(f"-- start {self.starts} of {self.name} at {self.url}\n".encode())
            log.flush()
            process = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
        (self.folder / "keeper.pid").write_text(str(process.pid))
        return process

    def _reap_earlier(self) -> None:
        """Kill what an earlier life of this actor left running, and wait for the port."""
        pid_file = self.folder / "keeper.pid"
        group = int(pid_file.read_text() or 0) if pid_file.exists() else 0
        if group > 0 and _ours(group):
            try:
                os.killpg(group, signal.SIGKILL)  # the keeper's group: service, torchrun
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while not _port_free(self.host, self.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} on {self.host} is taken by another "
                                   f"process; {self.name} needs it to keep its URL {self.url}")
            time.sleep(0.2)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.kind} service {self.name} on {self.url} exited with status "
                    f"{self.process.returncode} before answering; end of its log ({self.log_path} "
                    f"on {self.host}):\n{self.log()}")
            if _healthy(_url_host(self.host).strip("[]"), self.port):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.kind} service {self.name} on {self.url} did not answer "
                           f"/health within {timeout:.0f} s; end of its log ({self.log_path} on "
                           f"{self.host}):\n{self.log()}")

    def _watch(self) -> None:
        assert self.process is not None
        code = self.process.wait()
        if self._stopping:
            return
        with open(self.log_path, "a") as log:
            log.write(f"-- {self.name} exited with status {code}; its actor exits so that Ray "
                      "restarts it\n")
        os._exit(1)  # a crash to Ray: restarted if restarts are left

    def _kill(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)


def _ours(group: int) -> bool:
    """Whether process group `group` still holds a keeper or an astranb service (checked so that
    a recycled group id is never killed). Without /proc: assume it does."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                command = (entry / "cmdline").read_bytes()
                if b"_keeper.py" in command or b"astranb" in command:
                    return True
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return False


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = _node_ip()
    return f"[{host}]" if ":" in host else host


def _port_free(host: str, port: int) -> bool:
    host = _url_host(host).strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) != 0


def _healthy(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=1)  # no proxy, stdlib only
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _free_port(host: str | None) -> tuple[str, int]:
    """(node address, a free port there): run as a Ray task inside the service's bundle."""
    host = host or _node_ip()
    bind = _url_host(host).strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
        s.bind((bind, 0))
        return bind, int(s.getsockname()[1])


def _tail(path: Path, tail: int) -> str:
    return path.read_text(errors="replace")[-tail:] if path.exists() else ""
