"""Gymnasium environments as astranb environments: `ab.environments.load("gymnasium", id=...)`."""

from .env import ACTION_NAMES, Gymnasium, parse_action, text_of

__all__ = ["ACTION_NAMES", "Gymnasium", "parse_action", "text_of"]
