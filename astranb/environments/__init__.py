"""Environments: the base class and context (`base`), playing one episode (`play`), an
episode's OpenAI-compatible endpoint for agents written against the `openai` client
(`openai_endpoint`, `openai_api`), and finding installed environments by name (`load`,
`available`).

Environment packages register a class under the `astranb.environments` entry-point group, so a
researcher's own environment becomes loadable by name with one line in its pyproject.toml:

    [project.entry-points."astranb.environments"]
    my_env = "my_package:MyEnvironment"

The environments shipped in this repository live under `environments/` (one installable folder
each); `make setup` installs them.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from .base import Environment, EpisodeContext
from .play import play_episode

__all__ = ["load", "available", "Environment", "EpisodeContext", "play_episode"]

GROUP = "astranb.environments"


def available() -> list[str]:
    """Names of the installed environments."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load(name: str, **kwargs: Any) -> Environment:
    """Build the environment registered as `name`, passing `kwargs` to its constructor.

    Raises:
        ValueError: no installed environment has that name (the message lists those that do).
    """
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        names = ", ".join(available()) or "none"
        raise ValueError(
            f"unknown environment {name!r}; installed: {names}. Install the environment's "
            f"package (in this repo: pip install -e environments/{name}) or pass an "
            "Environment instance instead of a name."
        )
    cls = matches[0].load()
    env = cls(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"entry point {name!r} built {env!r}, which is not an astranb Environment")
    # how a rollout service builds the same environment (by name, never by shipping code)
    env.registry_name, env.registry_kwargs = name, dict(kwargs)
    return env
