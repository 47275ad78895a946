"""Run a service app with uvicorn until it is told to shut down (POST /v1/shutdown or a signal)."""

from __future__ import annotations

import sys

import uvicorn

from .http import ServiceConfig, free_port

__all__ = ["serve"]


def serve(app, config: ServiceConfig, kind: str) -> int:
    """Serve `app` on config.host:config.port (0: a free port, printed once listening)."""
    port = config.port or free_port(config.host)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    app.state.service.on_shutdown = lambda: setattr(server, "should_exit", True)
    print(f"astranb {kind} service on http://{config.host}:{port}"
          f"{' (token required)' if config.token else ''}", file=sys.stderr, flush=True)
    server.run()
    return 0
