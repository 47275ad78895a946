"""What `launch_ray` is asked for: the rollout and trainer specs, checked before anything is placed.

A spec is a dict of the keys in `ROLLOUT_KEYS` / `TRAINER_KEYS`; unknown keys, bad values, flags
the launcher sets itself, regions no node offers and services larger than the cluster are a
`RaySpecError` that says what to write instead. Each service becomes one `_Plan`: its name, the
resources of its placement-group bundle, its port and its `astranb serve` arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AstranbError

__all__ = ["ROLLOUT_KEYS", "TRAINER_KEYS", "RaySpecError"]

ROLLOUT_KEYS: dict[str, Any] = {
    "engine": "hf",  # hf | sglang | vllm | instant
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

ENGINES = ("hf", "sglang", "vllm", "instant")
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
