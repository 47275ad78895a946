"""TextArena's games as astranb environments: `ab.environments.load("textarena", game=...)`."""

from .env import Bot, RandomMove, TextArena, games
from .league import League, Standing, elo_update, expected_score, outcomes, standings

__all__ = ["Bot", "League", "RandomMove", "Standing", "TextArena", "elo_update",
           "expected_score", "games", "outcomes", "standings"]
