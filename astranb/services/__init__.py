"""HTTP services: a rollout service and a trainer service a Session can drive remotely.

`create_app` factories build each service as an ASGI app (rollout_app, trainer_app). The
Session's side is `astranb.remote`: the httpx clients (client), the rollout pool (pool), the
remote trainer (trainer) and the wire encoding (serialize). Wire formats are JSON/msgpack and
safetensors; never pickle.

Launchers: `local.launch_local` (processes on this machine) and `launch_ray` (ray_launch: services
placed and supervised on a Ray cluster; needs `pip install 'astranb[ray]'`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["launch_ray"]


def __getattr__(name: str) -> Any:
    # loaded when asked for: importing the services never imports the launcher (nor Ray)
    if name == "launch_ray":
        from .ray_launch import launch_ray

        return launch_ray
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
