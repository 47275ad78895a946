"""Rollout and trainer services placed and supervised by Ray.

Why: researchers who outgrow one machine usually run a Ray cluster already. Rather than one more
launcher, astranb asks Ray for what Ray does well, and for nothing else:

- **Placement.** Each service gets a placement group of one bundle: the CPUs, GPUs and region
  its spec asks for (a trainer's bundle holds all `nproc` processes, since
  `astranb serve trainer --nproc N` runs torchrun on one node). Ray picks a node with room, and
  a restarted service lands on the same node: same address, same port, same checkpoint folder.
- **Supervision.** Each service is one `astranb serve rollout|trainer` process kept by a small
  Ray actor (`ServiceSupervisor`). When the process exits, the actor exits; when the actor dies
  (`ray.kill`, a crash) Ray restarts it, up to `max_restarts` times, and it starts the service
  again on the same port. The Session's pool sees the service's new instance id, resubmits what
  was in flight there and brings the service up to date (policies, weights, environments) before
  it gets work again. A restarted trainer resumes from its last checkpoint (`--checkpoint-dir`,
  kept on its node), and the session rolls back through its usual path.
- **Teardown.** `RayServices.shutdown()`, or leaving its `with` block, stops every process and
  frees the placement groups.

What Ray does not do is carry astranb's data: episodes, batches and weights go over astranb's own
HTTP, exactly as between services started by hand. Ray only passes each actor its plain settings
(strings and numbers). A service binds its node's IP and requires the bearer token, which is
generated when none is given; pass `services.token` to the Session.

    from astranb.services import launch_ray

    with launch_ray(rollout=[{"engine": "hf", "count": 2, "gpus": 1}],
                    trainer={"nproc": 4, "gpus_per_proc": 1}, address="auto") as services:
        session = ab.Session("runs/x", rollout=services.rollout_urls,
                             trainer=services.trainer_url, token=services.token)
        ...

A spec's `region` names a Ray custom resource `region:<name>`, which the nodes of that region
offer (`ray start ... --resources '{"region:eu": 1000}'`); each service takes a sliver of it, so
many fit on one node. The services are started with `--region <name>`, so a session pulls each
version into a region once, through a relay among them (astranb.remote.pool).

astranb must be installed on every node that runs a service. The supervisor's own code
travels to the Ray workers by value and needs only the standard library, so a worker that merely
watches a process never imports astranb or torch.

If a node is lost, Ray places its services elsewhere and their URLs change: `services.refresh()`
says which, to pass to `session.remove_rollout(old)` and `session.add_rollout(new)`.
"""

from __future__ import annotations

import dataclasses
import html
import http.client
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AstranbError
from .local import ServiceSet

__all__ = ["launch_ray", "RayServices", "RayService", "ServiceSupervisor", "RaySpecError",
           "NoRayCluster", "RayLaunchError", "ROLLOUT_KEYS", "TRAINER_KEYS"]

ROLLOUT_KEYS: dict[str, Any] = {
    "engine": "hf",  # hf | sglang | instant
    "count": 1,  # services of this spec
    "region": None,  # a custom resource region:<name> the node must offer; None: any node
    "cpus": 1,  # per service
    "gpus": 0,  # per service
    "device": None,  # torch device; default "cuda" with GPUs, else "cpu"
    "port": None,  # first port (service i of the spec takes port + i); default a free one
    "args": (),  # further `astranb serve rollout` arguments, e.g. ["--max-inflight", "64"]
    "env": {},  # further environment variables of the service process
}
"""The keys of a rollout spec and their defaults."""

TRAINER_KEYS: dict[str, Any] = {
    "nproc": 1,  # trainer processes (FSDP over torchrun when > 1), all on one node
    "cpus_per_proc": 1,
    "gpus_per_proc": 0,
    "region": None,
    "device": None,
    "port": None,
    "checkpoint_dir": None,  # a folder on the trainer's node; default: under work_dir there
    "checkpoint_every": 1,
    "args": (),
    "env": {},
}
"""The keys of the trainer spec and their defaults."""

ENGINES = ("hf", "sglang", "instant")
REGION = "region:"  # prefix of the custom resource that marks a node's region
REGION_SHARE = 0.001  # of that resource each service takes
# flags the launcher sets itself, and where to say them instead
RESERVED = {"--host": "launch_ray(host=...)", "--port": "the spec's 'port'",
            "--token": "launch_ray(token=...)", "--engine": "the spec's 'engine'",
            "--device": "the spec's 'device'", "--nproc": "the spec's 'nproc'",
            "--checkpoint-dir": "the spec's 'checkpoint_dir'",
            "--checkpoint-every": "the spec's 'checkpoint_every'",
            "--region": "the spec's 'region'"}


class RaySpecError(AstranbError, ValueError):
    """A service spec is malformed, or asks for more than the cluster has."""


class NoRayCluster(AstranbError, ConnectionError):
    """No Ray cluster answers at the address given."""


class RayLaunchError(AstranbError, RuntimeError):
    """A service could not be placed or did not start."""


# -- the actor (runs on the service's node) --------------------------------------------------------
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


# -- the launcher (runs in the notebook) -----------------------------------------------------------
@dataclass(eq=False)
class RayService:
    """One service `launch_ray` started.

    Attributes:
        kind: "rollout" or "trainer".
        name: "rollout-0", "rollout-1", ..., "trainer".
        url: where the Session reaches it.
        region: the region asked for (None: any node).
        actor: its `ServiceSupervisor` actor handle (`ray.kill(actor, no_restart=False)` restarts
            it, as a crash would).
        placement_group: its Ray placement group.
    """

    kind: str
    name: str
    url: str
    region: str | None
    actor: Any
    placement_group: Any


@dataclass
class _Plan:
    kind: str
    name: str
    where: str  # how errors name the spec
    region: str | None
    cpus: float
    gpus: float
    port: int | None
    config: dict[str, Any]

    @property
    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        if self.region:
            bundle[REGION + self.region] = REGION_SHARE
        return bundle


class RayServices(ServiceSet[RayService]):
    """The services `launch_ray` started; a context manager that shuts them down on exit.

    Attributes:
        token: the bearer token every service requires (pass it to the Session).
        rollout: the rollout services.
        trainer: the trainer service, if any.
    """

    def __init__(self, token: str, launch: str):
        self.token, self.launch = token, launch
        self.rollout: list[RayService] = []
        self.trainer: RayService | None = None
        self._groups: list[Any] = []
        self._actors: list[Any] = []
        self._closed = False
        self._settings: dict[str, Any] = {}  # launch_ray's host, max_restarts, timeout, work_dir
        self._rollout_plan: _Plan | None = None  # what add_rollout() starts by default
        self._made = 0  # rollout services made so far (names are never reused)
        self._owns_ray = False  # launch_ray connected to Ray itself

    @property
    def rollout_actors(self) -> list[Any]:
        """The rollout services' supervisor actors, in the order of `rollout_urls`."""
        return [s.actor for s in self.rollout]

    @property
    def trainer_actor(self) -> Any:
        """The trainer's supervisor actor (None without a trainer service)."""
        return self.trainer.actor if self.trainer else None

    def info(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Each service's state from its actor: url, host, pid, starts (1 + restarts), log path;
        {"name", "error"} for an actor that does not answer (restarting, or dead)."""
        ray = _import_ray()
        answers = []
        for service in self.all:
            try:
                answers.append(ray.get(service.actor.info.remote(), timeout=timeout))
            except Exception as error:  # Ray's actor errors and GetTimeoutError alike
                answers.append({"name": service.name, "url": service.url,
                                "error": f"{type(error).__name__}: {str(error)[:300]}"})
        return answers

    def log(self, name: str, tail: int = 4000, timeout: float = 10.0) -> str:
        """The end of a service's output (`name` as in `info()`: "rollout-0", "trainer")."""
        ray = _import_ray()
        for service in self.all:
            if service.name == name:
                return str(ray.get(service.actor.log.remote(tail), timeout=timeout))
        raise KeyError(f"no service {name!r}; services: {[s.name for s in self.all]}")

    def refresh(self, timeout: float = 10.0) -> dict[str, str]:
        """Ask each actor for its URL, which changes only when Ray moved a service to another
        node (the old one was lost).

        Returns:
            old URL -> new URL of each rollout service that moved; pass each pair to
            `session.remove_rollout(old)` and `session.add_rollout(new)`. (A moved trainer needs
            a new Session: `Session(trainer=...)` takes one URL.)
        """
        moved = {}
        for service, info in zip(self.all, self.info(timeout), strict=True):
            url = info.get("url")
            if info.get("error") or not url or url == service.url:
                continue  # not answering, or where it was
            if service.kind == "rollout":
                moved[service.url] = url
            service.url = url
        return moved

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every service and free its resources; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        ray = _import_ray()
        if not ray.is_initialized():  # the driver left the cluster: Ray took the actors along
            return
        stops = []
        for actor in self._actors:
            try:
                stops.append(actor.stop.remote())
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to stop
                pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - removed already
                pass
        if self._owns_ray:  # launch_ray connected (or started Ray here): undo that too
            ray.shutdown()

    def add_rollout(self, spec: Mapping[str, Any] | None = None) -> str:
        """Start one more rollout service on the cluster: like the first rollout spec, or as
        `spec` says (a rollout spec; its `count` is ignored). Returns its URL once it answers,
        for `session.add_rollout(url)` or an autoscaler (`services.autoscaler()`).

        Raises:
            RaySpecError: a bad spec. RayLaunchError: it was not placed or did not start.
        """
        if self._closed:
            raise RuntimeError("these services were shut down; launch_ray() again")
        ray = _import_ray()
        base = self._rollout_plan if spec is None else _plans([spec], None)[0]
        assert base is not None  # launch_ray always starts a rollout service
        plan = dataclasses.replace(base, name=f"rollout-{self._made}", port=None)
        self._made += 1
        before = len(self.rollout)
        _start(ray, self, [plan], **self._settings)
        return self.rollout[before].url

    def remove_rollout(self, url: str, timeout: float = 30.0) -> None:
        """Stop the rollout service at `url` and free its resources (drain it in the session
        first: an autoscaler does)."""
        service = next((s for s in self.rollout if s.url == url.rstrip("/")), None)
        if service is None:
            raise ValueError(f"no rollout service at {url}: {self.rollout_urls}")
        ray = _import_ray()
        try:
            ray.get(service.actor.stop.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - dead or slow: killed below either way
            pass
        ray.kill(service.actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(service.placement_group)
        self.rollout.remove(service)
        self._actors = [a for a in self._actors if a is not service.actor]
        self._groups = [g for g in self._groups if g is not service.placement_group]

    def close(self, timeout: float = 30.0) -> None:
        """The same as `shutdown()` (the name `LocalServices` uses)."""
        self.shutdown(timeout)

    def __enter__(self) -> RayServices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _repr_html_(self) -> str:
        state = "shut down" if self._closed else "running"
        rows = "".join(
            f"<tr><td>{html.escape(s.name)}</td><td><code>{html.escape(s.url)}</code></td>"
            f"<td>{html.escape(s.region or '')}</td></tr>" for s in self.all)
        return (f"<b>RayServices</b> ({state}, token required)<table><tr><th>service</th>"
                f"<th>url</th><th>region</th></tr>{rows}</table>")

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "running"
        lines = "".join(f"  {s.name}: {s.url}" + (f" (region {s.region})" if s.region else "")
                        + "\n" for s in self.all)
        return f"RayServices({state}, token required,\n{lines})"


def launch_ray(
    rollout: Mapping[str, Any] | Sequence[Mapping[str, Any]] = ({"engine": "hf"},),
    trainer: Mapping[str, Any] | bool | None = None,
    *,
    address: str | None = None,
    token: str | None = None,
    host: str | None = None,
    max_restarts: int = 5,
    timeout: float = 300.0,
    work_dir: str | None = None,
    autoscale: bool = False,
) -> RayServices:
    """Start rollout (and trainer) services on a Ray cluster and wait until they answer.

    Args:
        rollout: one spec or a list of specs; each starts `count` rollout services. Keys (all
            optional) and defaults: `ROLLOUT_KEYS` (engine, count, region, cpus, gpus, device,
            port, args, env).
        trainer: the trainer service's spec (`TRAINER_KEYS`: nproc, cpus_per_proc,
            gpus_per_proc, region, device, port, checkpoint_dir, checkpoint_every, args, env);
            True for the defaults; None: no trainer service (the Session trains in its own
            process and pushes weights to the services).
        address: the Ray cluster: "auto" (the one this machine belongs to), "HOST:PORT" of its
            head, or "ray://HOST:10001" (Ray Client); None: `ray.init()`'s own choice, which
            starts a Ray instance on this machine when there is no cluster. A process connected
            to Ray already keeps its connection (`address` is then not used).
        token: bearer token of the services; default: a new random one (`RayServices.token`).
        host: address each service binds; default: its node's IP. The URL says where it is.
        max_restarts: how often Ray restarts a service's actor (-1: without limit).
        timeout: seconds to place the services and for each to answer /health.
        work_dir: folder on each node for the services' logs and, by default, the trainer's
            checkpoints (default: the node's temporary folder /astranb-ray).
        autoscale: the cluster grows on demand: skip the check of the specs against the nodes
            there are now, and wait up to `timeout` for Ray to place them.

    Returns:
        The running services: `rollout_urls`, `trainer_url`, `token` for the Session; a context
        manager that shuts them down.

    Raises:
        ImportError: Ray is not installed (`pip install 'astranb[ray]'`).
        RaySpecError: unknown keys or bad values in a spec, or a spec the cluster cannot hold.
        NoRayCluster: nothing answers at `address`.
        RayLaunchError: a service was not placed in time or did not start (with the end of its
            log); everything started is shut down again.
    """
    ray = _import_ray()
    if max_restarts < -1:
        raise RaySpecError(f"max_restarts must be -1 (no limit) or >= 0, got {max_restarts}")
    plans = _plans(rollout, trainer)
    token = token or secrets.token_urlsafe(32)
    connected = ray.is_initialized()
    _connect(ray, address)
    if not autoscale:
        _check_capacity(plans, [n for n in ray.nodes() if n.get("Alive")])
    launch = uuid.uuid4().hex[:8]
    services = RayServices(token, launch)
    services._owns_ray = not connected  # shutdown() then disconnects (and stops a local Ray)
    services._settings = {"host": host, "max_restarts": max_restarts, "timeout": timeout,
                          "work_dir": work_dir}
    services._rollout_plan = next(p for p in plans if p.kind == "rollout")
    services._made = sum(1 for p in plans if p.kind == "rollout")
    try:
        _start(ray, services, plans, host=host, max_restarts=max_restarts, timeout=timeout,
               work_dir=work_dir)
    except BaseException:
        services.shutdown()
        raise
    return services


def _import_ray() -> Any:
    try:
        import ray
        import ray.cloudpickle
    except ImportError:
        raise ImportError("launch_ray needs Ray: pip install 'astranb[ray]' (on every node of the "
                          "cluster too)") from None
    # the supervisor travels by value: a Ray worker runs it without importing astranb (torch)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray


def _connect(ray: Any, address: str | None) -> None:
    if ray.is_initialized():
        if address not in (None, "auto"):
            warnings.warn(f"launch_ray(address={address!r}): this process is connected to Ray "
                          "already and stays on that cluster; call ray.shutdown() first to use "
                          "another", RuntimeWarning, stacklevel=3)
        return
    how = ("start a cluster with `ray start --head` and pass its HOST:PORT (or address='auto' "
           "on one of its nodes), or pass address=None to start Ray on this machine")
    if address not in (None, "auto", "local") and "://" not in address:
        hostname, _, port = address.rpartition(":")
        try:
            with socket.create_connection((hostname or "127.0.0.1", int(port)), timeout=3):
                pass
        except (OSError, ValueError):
            raise NoRayCluster(f"no Ray cluster at {address!r}: nothing answers there; {how}"
                               ) from None
    try:
        ray.init(address=address)
    except ConnectionError as error:
        raise NoRayCluster(f"no Ray cluster at {address!r} ({error}); {how}") from None


def _plans(rollout: Any, trainer: Any) -> list[_Plan]:
    specs = [rollout] if isinstance(rollout, Mapping) else list(rollout)
    if not specs:
        raise RaySpecError("rollout needs at least one spec (a session needs a rollout "
                           f"service), e.g. [{{'engine': 'hf'}}]; keys: {', '.join(ROLLOUT_KEYS)}")
    plans: list[_Plan] = []
    for i, given in enumerate(specs):
        spec = _checked("rollout", given, f"rollout spec {i}", ROLLOUT_KEYS)
        for j in range(spec["count"]):
            n = len(plans)
            port = spec["port"] + j if spec["port"] else None
            plans.append(_Plan(
                "rollout", f"rollout-{n}", f"rollout spec {i}", spec["region"], spec["cpus"],
                spec["gpus"], port,
                {"args": ["--engine", spec["engine"], "--device", _device(spec, "gpus"),
                          *(["--region", spec["region"]] if spec["region"] else []),
                          *spec["args"]],
                 "env": dict(spec["env"]), "threads": max(1, int(spec["cpus"])),
                 "checkpoint_dir": None}))
    if trainer is True:
        trainer = {}
    if trainer is not None and trainer is not False:
        spec = _checked("trainer", trainer, "trainer spec", TRAINER_KEYS)
        nproc = spec["nproc"]
        plans.append(_Plan(
            "trainer", "trainer", "trainer spec", spec["region"], spec["cpus_per_proc"] * nproc,
            spec["gpus_per_proc"] * nproc, spec["port"],
            {"args": ["--nproc", str(nproc), "--device", _device(spec, "gpus_per_proc"),
                      "--checkpoint-every", str(spec["checkpoint_every"]), *spec["args"]],
             "env": dict(spec["env"]), "threads": max(1, int(spec["cpus_per_proc"])),
             "checkpoint_dir": (str(spec["checkpoint_dir"]) if spec["checkpoint_dir"] is not None
                                else None)}))
    return plans


def _device(spec: Mapping[str, Any], gpus: str) -> str:
    return str(spec["device"] or ("cuda" if spec[gpus] else "cpu"))


def _checked(kind: str, given: Any, where: str, keys: Mapping[str, Any]) -> dict[str, Any]:
    valid = ", ".join(keys)
    if not isinstance(given, Mapping):
        raise RaySpecError(f"{where} must be a dict, got {type(given).__name__}; keys: {valid}")
    unknown = sorted(set(given) - set(keys))
    if unknown:
        raise RaySpecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                           f"{valid}")
    spec = {**keys, **given}

    def bad(key: str, want: str) -> RaySpecError:
        return RaySpecError(f"{where}: {key!r} must be {want}, got {spec[key]!r}")

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    counts = ["count"] if kind == "rollout" else ["nproc", "checkpoint_every"]
    for key in counts:
        if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 1:
            raise bad(key, "a whole number >= 1")
    cpus, gpus = ("cpus", "gpus") if kind == "rollout" else ("cpus_per_proc", "gpus_per_proc")
    if not number(spec[cpus]) or spec[cpus] <= 0:
        raise bad(cpus, "a number > 0")
    if not number(spec[gpus]) or spec[gpus] < 0:
        raise bad(gpus, "a number >= 0")
    if kind == "rollout" and spec["engine"] not in ENGINES:
        raise bad("engine", " or ".join(map(repr, ENGINES)))
    if spec["region"] is not None and (not isinstance(spec["region"], str) or not spec["region"]):
        raise bad("region", "a region name (a string) or None")
    port = spec["port"]
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)
                             or not 0 < port < 65536 - spec.get("count", 1)):
        raise bad("port", "a TCP port (1-65535) or None")
    if spec["device"] is not None and not isinstance(spec["device"], str):
        raise bad("device", "a torch device such as 'cpu' or 'cuda', or None")
    args = spec["args"]
    if isinstance(args, str) or not isinstance(args, Sequence) or \
            not all(isinstance(a, str) for a in args):
        raise bad("args", "a list of strings such as ['--max-inflight', '64']")
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED:
            raise RaySpecError(f"{where}: args may not hold {flag}; the launcher sets it (use "
                               f"{RESERVED[flag]})")
    env = spec["env"]
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise bad("env", "a dict of strings")
    if kind == "trainer" and spec["checkpoint_dir"] is not None and \
            not isinstance(spec["checkpoint_dir"], str | os.PathLike):
        raise bad("checkpoint_dir", "a folder path on the trainer's node, or None")
    return spec


def _check_capacity(plans: list[_Plan], nodes: list[dict[str, Any]]) -> None:
    """Refuse specs the cluster cannot hold now: a region no node offers, a service larger than
    every node, more CPUs or GPUs in all than the cluster has."""
    resources = [n.get("Resources", {}) for n in nodes]
    regions = sorted({k[len(REGION):] for r in resources for k in r if k.startswith(REGION)})
    for plan in plans:
        where = f"{plan.where} ({plan.name})"
        candidates = resources
        if plan.region:
            candidates = [r for r in resources if r.get(REGION + plan.region, 0) >= REGION_SHARE]
            if not candidates:
                raise RaySpecError(
                    f"{where} asks for region {plan.region!r}, which no node of the cluster "
                    f"offers (regions: {', '.join(regions) or 'none'}). Start that region's "
                    f"nodes with `ray start ... --resources '{{\"{REGION}{plan.region}\": "
                    "1000}'`, or leave 'region' out")
        if not any(r.get("CPU", 0) >= plan.cpus and r.get("GPU", 0) >= plan.gpus
                   for r in candidates):
            largest_cpu = max((r.get("CPU", 0) for r in candidates), default=0)
            largest_gpu = max((r.get("GPU", 0) for r in candidates), default=0)
            scope = f" in region {plan.region!r}" if plan.region else ""
            raise RaySpecError(
                f"{where} needs {plan.cpus:g} CPUs and {plan.gpus:g} GPUs on one node, but the "
                f"largest node{scope} has {largest_cpu:g} CPUs and {largest_gpu:g} GPUs: ask for "
                "less, add a larger node, or pass autoscale=True if the cluster grows on demand")
    for what in ("CPU", "GPU"):
        need = sum(p.cpus if what == "CPU" else p.gpus for p in plans)
        have = sum(r.get(what, 0) for r in resources)
        if need > have + 1e-9:
            parts = ", ".join(f"{p.name} {p.cpus if what == 'CPU' else p.gpus:g}"
                              for p in plans if (p.cpus if what == "CPU" else p.gpus))
            raise RaySpecError(
                f"the services need {need:g} {what}s in all ({parts}), but the cluster has "
                f"{have:g}: ask for fewer, add nodes, or pass autoscale=True if the cluster "
                "grows on demand")


def _start(ray: Any, services: RayServices, plans: list[_Plan], *, host: str | None,
           max_restarts: int, timeout: float, work_dir: str | None) -> None:
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    groups = []
    for plan in plans:  # recorded at once: shutdown() frees whatever was made
        group = placement_group([plan.bundle], strategy="STRICT_PACK",
                                name=f"astranb-{services.launch}-{plan.name}")
        services._groups.append(group)
        groups.append(group)
    refs = [g.ready() for g in groups]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if waiting:
        late = [p.name for p, ref in zip(plans, refs, strict=True) if ref in waiting]
        raise RayLaunchError(f"Ray did not place {', '.join(late)} within {timeout:.0f} s (other "
                             "jobs hold the resources, or the autoscaler is still adding nodes); "
                             "`ray status` shows what is free")

    def pinned(group: Any) -> Any:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    ports = _ports(ray, plans, groups, host, pinned)
    supervisor = ray.remote(ServiceSupervisor)
    actors = []
    for plan, group, port in zip(plans, groups, ports, strict=True):
        config = {**plan.config, "kind": plan.kind, "name": plan.name, "launch": services.launch,
                  "token": services.token, "host": host, "port": port, "work_dir": work_dir,
                  "timeout": timeout}
        actor = supervisor.options(
            num_cpus=plan.cpus, num_gpus=plan.gpus,
            resources={REGION + plan.region: REGION_SHARE} if plan.region else None,
            max_restarts=max_restarts, scheduling_strategy=pinned(group),
            name=f"astranb-{services.launch}-{plan.name}",
        ).remote(config)
        services._actors.append(actor)
        actors.append(actor)
    refs = [a.info.remote() for a in actors]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout + 60)
    if waiting:
        late = [p.name for p, ref in zip(plans, refs, strict=True) if ref in waiting]
        raise RayLaunchError(f"{', '.join(late)} did not start within {timeout + 60:.0f} s; "
                             "their logs are in work_dir on their nodes")
    try:
        infos = ray.get(refs)
    except ray.exceptions.RayError as error:  # the actor itself failed (not its service)
        raise RayLaunchError(f"a service's Ray actor failed: {error}") from None
    failed = [i for i in infos if i["error"]]
    if failed:
        raise RayLaunchError("\n\n".join(i["error"] for i in failed))
    for plan, group, actor, info in zip(plans, groups, actors, infos, strict=True):
        service = RayService(plan.kind, plan.name, info["url"], plan.region, actor, group)
        if plan.kind == "rollout":
            services.rollout.append(service)
        else:
            services.trainer = service


def _ports(ray: Any, plans: list[_Plan], groups: list[Any], host: str | None,
           pinned: Any) -> list[int]:
    """A port per service: the spec's, or one free on the node Ray placed the service on (a
    short task in its bundle), distinct per node. The actor keeps it across restarts."""
    probe = ray.remote(_free_port)
    ports: list[int | None] = [p.port for p in plans]
    taken: set[tuple[str, int]] = set()
    for i, group in enumerate(groups):
        for _attempt in range(10):
            if ports[i] is not None:
                break
            node, port = ray.get(probe.options(num_cpus=0, scheduling_strategy=pinned(group))
                                 .remote(host), timeout=120)
            if (node, port) not in taken:
                taken.add((node, port))
                ports[i] = port
        if ports[i] is None:
            raise RayLaunchError(f"no free port found for {plans[i].name}; give the spec a 'port'")
    return [int(p) for p in ports if p is not None]
