"""`serve`: an OpenEnv environment's server on a loopback port, in a thread of this process.

For notebooks and tests: the environment is openenv-core's own server (`create_fastapi_app`,
its HTTP routes and its WebSocket sessions) run by uvicorn on 127.0.0.1 at a port the OS picks.
An environment that is deployed already (a container, a Space) needs none of this: pass its
URL to `OpenEnv`.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

__all__ = ["LocalServer", "serve"]


class LocalServer:
    """A running server: `base_url` while it runs, `close()` (or `with`) to stop it."""

    def __init__(self, app: Any, host: str):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family)
        self._socket.bind((host, 0))
        self._socket.listen(64)
        port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"openenv-server-{port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the OpenEnv server did not start on {host}:{port}")
            time.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{port}"

    def close(self) -> None:
        """Stop the server: open sessions are closed (their clients see the connection go)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    env: Any,
    action_cls: Any = None,
    observation_cls: Any = None,
    *,
    max_sessions: int | None = None,
    host: str = "127.0.0.1",
) -> LocalServer:
    """Serve an OpenEnv environment on a loopback port (chosen by the OS) in this process.

    Args:
        env: an OpenEnv `Environment` subclass (or a factory of instances), served with
            `action_cls` and `observation_cls` by openenv-core's `create_fastapi_app`; or an
            app made already (then leave the classes out).
        action_cls, observation_cls: the environment's `Action` and `Observation` classes.
        max_sessions: sessions (episodes) the server holds at once (default: 64 for an
            environment that sets SUPPORTS_CONCURRENT_SESSIONS, else 1, as openenv-core
            requires).
        host: a loopback address (127.0.0.1 or ::1); nothing else is served from here.

    Returns:
        The `LocalServer`; its `base_url` goes to `OpenEnv(base_url=...)`.
    """
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(
            f"serve listens on loopback only (127.0.0.1 or ::1), not {host!r}; "
            "to expose an environment, run its server with uvicorn yourself"
        )
    if action_cls is None and observation_cls is None:
        app = env
    elif action_cls is None or observation_cls is None:
        raise ValueError("give both action_cls and observation_cls (or an app made already)")
    else:
        from openenv.core.env_server import create_fastapi_app

        if max_sessions is None:
            max_sessions = 64 if getattr(env, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
        app = create_fastapi_app(env, action_cls, observation_cls, max_concurrent_envs=max_sessions)
    return LocalServer(app, host)
