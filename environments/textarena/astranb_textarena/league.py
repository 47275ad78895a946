"""Who beat whom: each role's outcome from a game's rewards, Elo ratings, win rates per policy.

A game ends with a reward per role (TextArena: 1 to the winner, -1 to the loser, 0 each for a
draw). `outcomes` reads them as results: every role on the best reward wins, unless all rewards
are equal (a draw for everyone); the others lose.

Elo (`elo_update`): a player rated R_a against one rated R_b is expected to score
E_a = 1 / (1 + 10 ** ((R_b - R_a) / 400)); after scoring S_a (1 a win, 0.5 a draw, 0 a loss)
its rating moves by K * (S_a - E_a), and the opponent's by the opposite amount. A game of
more than two policies updates every pair of distinct policies, each with K divided by the
number of opponents. Roles played by one policy (self-play) never rate it against itself.

`League` keeps the ratings and the win/draw/loss tallies of the games played through one
environment object, in the order they ended. The run's metrics rows carry the same facts as
episode counts (`count/win/<policy>`, `count/elo_milli/<policy>`, ...: see `COUNTS`), and
`standings(rows)` adds them back up per policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["COUNTS", "League", "Standing", "elo_update", "expected_score", "outcomes",
           "standings"]

COUNTS = ("win", "draw", "loss")
"""Outcome names; an episode counts `<outcome>/<policy>` once per role the policy played,
`<outcome>_as/<role>` for each role, and `elo_milli/<policy>` (its Elo change in thousandths
of a point)."""


def outcomes(rewards: Mapping[str, float]) -> dict[str, str]:
    """Each role's result ("win", "draw" or "loss") from the game's reward per role.

    >>> outcomes({"player0": 1.0, "player1": -1.0})
    {'player0': 'win', 'player1': 'loss'}
    >>> outcomes({"player0": 0.0, "player1": 0.0})
    {'player0': 'draw', 'player1': 'draw'}
    """
    values = [float(v) for v in rewards.values()]
    best = max(values, default=0.0)
    if len(set(values)) <= 1:
        return {role: "draw" for role in rewards}
    return {role: "win" if float(v) == best else "loss" for role, v in rewards.items()}


def expected_score(rating: float, opponent: float) -> float:
    """The Elo expected score of a player rated `rating` against one rated `opponent`."""
    return 1.0 / (1.0 + 10.0 ** ((opponent - rating) / 400.0))


def elo_update(rating: float, opponent: float, score: float, k: float = 32.0
               ) -> tuple[float, float]:
    """Both ratings after one game in which the first player scored `score` (1, 0.5 or 0).

    >>> elo_update(1000.0, 1000.0, 1.0)
    (1016.0, 984.0)
    """
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"score must be in [0, 1] (1 win, 0.5 draw, 0 loss), got {score!r}")
    change = k * (score - expected_score(rating, opponent))
    return rating + change, opponent - change


_SCORE = {"win": 1.0, "draw": 0.5, "loss": 0.0}


@dataclass(frozen=True)
class Standing:
    """One policy's record."""

    games: int
    """Role-games played: a game counts once per role the policy played (twice in self-play)."""
    wins: int
    """Of those, the ones won."""
    draws: int
    """The ones drawn."""
    losses: int
    """The ones lost."""
    elo: float
    """Its Elo rating (self-play games leave it where it was)."""

    @property
    def win_rate(self) -> float:
        """Wins over role-games (NaN before the first game); a draw counts as no win."""
        return self.wins / self.games if self.games else float("nan")


class League:
    """Elo ratings and win/draw/loss tallies per policy, game after game.

    Args:
        k: the Elo K-factor (how far one game moves a rating).
        initial: every policy's rating before its first game.

    Example:
        league = League()
        league.record({"player0": "alice", "player1": "bob"}, {"player0": 1, "player1": -1})
        league.table()["alice"].elo    # 1016.0
    """

    def __init__(self, k: float = 32.0, initial: float = 1000.0):
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k!r}")
        self.k, self.initial = float(k), float(initial)
        self.ratings: dict[str, float] = {}
        self._tally: dict[str, dict[str, int]] = {}

    def record(self, players: Mapping[str, str], rewards: Mapping[str, float]
               ) -> dict[str, float]:
        """Count one finished game: `players` maps each role to its policy's name, `rewards`
        each role to its reward. Returns each policy's Elo change."""
        results = outcomes(rewards)
        for role, result in results.items():
            tally = self._tally.setdefault(players[role], dict.fromkeys(COUNTS, 0))
            tally[result] += 1
        before = {p: self.ratings.get(p, self.initial) for p in players.values()}
        change = dict.fromkeys(before, 0.0)
        seats = [(players[role], _SCORE[result]) for role, result in results.items()]
        opponents = max(len(before) - 1, 1)
        for i, (a, score_a) in enumerate(seats):
            for b, score_b in seats[i + 1:]:
                if a == b:
                    continue
                score = 0.5 + (score_a - score_b) / 2  # 1 when a beat b, 0.5 level, 0 lost
                new_a, _ = elo_update(before[a], before[b], score, self.k / opponents)
                change[a] += new_a - before[a]
                change[b] -= new_a - before[a]
        for policy, delta in change.items():
            self.ratings[policy] = before[policy] + delta
        return change

    def table(self) -> dict[str, Standing]:
        """Every policy's standing so far."""
        return {p: Standing(sum(t.values()), t["win"], t["draw"], t["loss"],
                            self.ratings.get(p, self.initial)) for p, t in self._tally.items()}


def standings(rows: Iterable[Mapping[str, Any]], initial: float = 1000.0
              ) -> dict[str, Standing]:
    """Each policy's standing from a run's metrics rows (`run.rows`).

    A policy's row sums the counts of the episodes it played since its previous step, so its
    own rows hold each of its games once (episodes after its last step are in none). Its Elo is
    `initial` plus its `elo_milli` counts over 1000: the league's rating where the run's games
    were all played through one environment object (an embedded run).
    """
    sums: dict[str, dict[str, int]] = {}
    for row in rows:
        policy = row.get("policy")
        if policy is None:
            continue
        mine = sums.setdefault(policy, {})
        for name in (*COUNTS, "elo_milli"):
            mine[name] = mine.get(name, 0) + int(row.get(f"count/{name}/{policy}", 0) or 0)
    return {p: Standing(s["win"] + s["draw"] + s["loss"], s["win"], s["draw"], s["loss"],
                        initial + s["elo_milli"] / 1000.0) for p, s in sums.items()}
