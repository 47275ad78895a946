"""Rollout and trainer services placed and supervised by Ray.

Why: researchers who outgrow one machine usually run a Ray cluster already. Rather than one more
launcher, astranb asks Ray for what Ray does well, and for nothing else:

- **Placement.** Each service gets a placement group of one bundle: the CPUs, GPUs and region
  its spec asks for (a trainer's bundle holds all `nproc` processes, since
  `astranb serve trainer --nproc N` runs torchrun on one node). Ray picks a node with room, and
  a restarted service lands on the same node: same address, same port, same checkpoint folder.
- **Supervision.** Each service is one `astranb serve rollout|trainer` process kept by a small
  Ray actor (`ServiceSupervisor`, services/ray_supervisor.py). When the process exits, the actor
  exits; when the actor dies (`ray.kill`, a crash) Ray restarts it, up to `max_restarts` times,
  and it starts the service again on the same port. The Session's pool sees the service's new
  instance id, resubmits what was in flight there and brings the service up to date (policies,
  weights, environments) before it gets work again. A restarted trainer resumes from its last
  checkpoint (`--checkpoint-dir`, kept on its node), and the session rolls back through its usual
  path.
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
(services/ray_supervisor.py) travels to the Ray workers by value and needs only the standard
library, so a worker that merely watches a process never imports astranb or torch.

If a node is lost, Ray places its services elsewhere and their URLs change: `services.refresh()`
says which, to pass to `session.remove_rollout(old)` and `session.add_rollout(new)`.
"""

from __future__ import annotations

import dataclasses
import html
import secrets
import socket
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AstranbError
from . import ray_supervisor
from .local import ServiceSet
from .ray_specs import (
    REGION,
    REGION_SHARE,
    ROLLOUT_KEYS,
    TRAINER_KEYS,
    RaySpecError,
    _check_capacity,
    _Plan,
    _plans,
)
from .ray_supervisor import ServiceSupervisor, _free_port

__all__ = ["launch_ray", "RayServices", "RayService", "ServiceSupervisor", "RaySpecError",
           "NoRayCluster", "RayLaunchError", "ROLLOUT_KEYS", "TRAINER_KEYS"]

class NoRayCluster(AstranbError, ConnectionError):
    """No Ray cluster answers at the address given."""


class RayLaunchError(AstranbError, RuntimeError):
    """A service could not be placed or did not start."""


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
    # the supervisor (and the _free_port task) travel by value: a Ray worker runs them without
    # importing astranb (torch); nothing of this module is shipped to the workers
    ray.cloudpickle.register_pickle_by_value(ray_supervisor)
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
