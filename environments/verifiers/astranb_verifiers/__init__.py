"""verifiers environments as astranb environments: `ab.environments.load("verifiers", env=...)`.

The package is also verifiers' harness plugin `astranb_verifiers` (its `__all__` exports the one
`Harness` subclass verifiers looks for): `LocalChat`, verifiers' chat loop run by this Python.
"""

from .env import Verifiers
from .harness import HARNESS_ID, LocalChat, local_chat_config

__all__ = ["HARNESS_ID", "LocalChat", "Verifiers", "local_chat_config"]
