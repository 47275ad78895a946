"""OpenEnv environments as astranb environments: `ab.environments.load("openenv", base_url=...)`."""

from .env import JSONClient, OpenEnv, OpenEnvError, render_observation, text_action
from .server import LocalServer, serve

__all__ = [
    "JSONClient",
    "LocalServer",
    "OpenEnv",
    "OpenEnvError",
    "render_observation",
    "serve",
    "text_action",
]
