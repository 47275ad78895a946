"""`TextArena`: a TextArena game played by astranb policies, each player a role.

    episode(ctx, sample)
      game = textarena.make(game); game.reset(num_players, seed=sample["seed"])
      repeat up to max_turns:
        player, observation = the game's next player and what it has been told since its last
                              turn (the rules and board first, then moves and the game's notes)
        role = roles[player]: the observation is that role's next user message (ctx.chat),
                              or a fixed player's (`bots`, e.g. `RandomMove`) input
        game.step(the reply's content)   the game judges the move: an invalid one is answered
                                         as the game does (TicTacToe: one warning and a retry,
                                         then a loss), the reply text is never run
        done: stop
      rewards per role = the game's rewards (TextArena: 1 the winner, -1 the loser, 0 a draw)

Wire one policy to every role (self-play: it learns from both sides) or one policy per role
(each trains on its own turns with its own role's reward). A role given to a bot (`bots=`) is
played by it and is none of the environment's `roles`: nothing is wired to it or trained on it
(`RandomMove` plays a uniformly random legal move, the usual fixed opponent to measure against).
Each episode counts every role's result for its policy and its role (`count/win/<policy>`,
`count/loss_as/<role>`, ... in the run's rows) and moves the policies' Elo ratings in
`env.league` (league.py); `standings(rows)` gives each policy's win rate and Elo from the rows.

The game's own code consumes Python's global `random` (TextArena seeds it on reset): every
call into a game runs with that episode's own random state swapped in, so concurrent games do
not draw from each other's streams, a seed replays its game, and the process's global random
is left as it was.
"""

from __future__ import annotations

import contextlib
import difflib
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from astranb import Environment, SamplingParams

from .league import League, outcomes

__all__ = ["Bot", "RandomMove", "TextArena", "games"]

Bot = Callable[[str, random.Random], str]
"""A fixed player: what the game told it since its last move (the text a policy would get) and
a random state of the episode's own -> its move. Its `name` attribute, if any, is its name in the
counts and the league (default: its role's name)."""

_LEGAL = re.compile(r"(?:available|valid|legal)\s+(?:moves|actions)[^:\n]*:([^\n]*)", re.I)
_BRACKETED = re.compile(r"\[[^\[\]\n]+\]")


class RandomMove:
    """A bot that plays a uniformly random one of the moves the game lists as legal now: the
    bracketed moves on the last line of the form "Available Moves: '[0]', '[4]', ..." (also
    "Valid moves" / "legal actions") in what the game told it, as TicTacToe-v0 lists them.

    Raises:
        ValueError: (on its turn) the text lists no legal moves that way: give that game a bot
            of your own, a callable (text, rng) -> move.
    """

    name = "random"

    def __call__(self, text: str, rng: random.Random) -> str:
        found = _LEGAL.findall(text)
        moves = _BRACKETED.findall(found[-1]) if found else []
        if not moves:
            raise ValueError("RandomMove found no 'Available Moves: [..], ...' line in what the "
                             f"game told it ({text[-200:]!r}); give this game a bot of your "
                             "own: a callable (text, rng) -> move")
        return rng.choice(moves)

    def __repr__(self) -> str:
        return "RandomMove()"

_EXAMPLES = ("TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "KuhnPoker-v0",
             "IteratedRockPaperScissors-v0")


def games() -> list[str]:
    """Every game id TextArena registers (some need network or an API key to play)."""
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


class _Game:
    """One TextArena game with a random state of its own (see the module's docstring)."""

    def __init__(self, env: Any, seed: int | None):
        import textarena

        self.env, self._random = env, random.Random(seed).getstate()
        base = env
        while isinstance(base, textarena.Wrapper):  # the game under its wrappers
            base = base.env
        self.base = base

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def reset(self, num_players: int, seed: int | None) -> None:
        with self._own_random():
            self.env.reset(num_players=num_players, seed=seed)

    def observe(self) -> tuple[int, Any]:
        # the game's raw messages since the player's last turn, not its wrappers' whole-history
        # string: the role's conversation already holds what came before
        with self._own_random():
            return self.base.get_observation()

    def step(self, action: str) -> bool:
        # through the wrappers: their action formatting is part of the game's rules
        with self._own_random():
            done, _ = self.env.step(action=action)
        return bool(done)

    def close(self) -> tuple[dict[int, float], dict[int, Any]]:
        with self._own_random():
            rewards, info = self.env.close()
        return dict(rewards or {}), dict(info or {})

    def name_of(self, player: int) -> str:
        mapping = getattr(getattr(self.base, "state", None), "role_mapping", None) or {}
        return str(mapping.get(player, "GAME" if player < 0 else f"Player {player}"))


class TextArena(Environment):
    """A TextArena game (`textarena.make(game)`) whose players are astranb roles.

    A sample is {"seed": the game's seed, "split"}: "train" draws even seeds from `seed`'s
    stream, "test" odd ones.

    Args:
        game: a TextArena game id ("TicTacToe-v0", "ConnectFour-v0", "Nim-v0", ...; `games()`
            lists them). Its default wrappers stay on: their action formatting is the game's
            (TicTacToe's "4" is read as "[4]").
        num_players: players in a game.
        roles: the players' role names, in player order (default "player0", "player1", ...).
        bots: role -> a fixed player (`Bot`, e.g. `RandomMove()`) that plays that role: it is
            not one of this environment's `roles` (nothing is wired to it or trained on it),
            but its games count for it in the league under its `name`. The players' roles are
            in `players`.
        history: False (default): every turn is a fresh conversation, the game's rules and what
            it told the role since its last move (the moves, the game's notes, the board as it
            is now): short prompts, enough for board games, within a tiny model's context.
            True: each role's conversation grows turn by turn (token-in/token-out), a user
            message of that news, then its reply: for games whose past talk matters
            (negotiation, deduction) and models with room for it.
        max_turns: most replies a game takes, all roles together (invalid ones included); a
            game still going then ends with reward 0 for everyone, counted `out_of_turns`.
        league: the `League` whose Elo ratings and tallies this environment's games update
            (default: a new one); share one between environments (the two seatings of a pair of
            policies, several games) to rate the policies across all of them.
        seed: the training seeds' stream.
        sampling: SamplingParams, or a dict of its fields (default: max_new_tokens=32).
        make_kwargs: keyword arguments of `textarena.make` (the game's own settings).

    Raises:
        ValueError: a game TextArena does not have (the message lists close and common ones),
            a game that cannot start with `num_players` (or at all here, e.g. one that needs an
            API key), roles that do not name every player once, or bots that name no
            player or leave none to learn.

    Example:
        env = ab.environments.load("textarena", game="TicTacToe-v0")
        session.wire(env, player0=policy, player1=policy)        # self-play
        session.wire(env, player0=alice, player1=bob)            # one policy per role
        against = ab.environments.load("textarena", game="TicTacToe-v0",
                                       bots={"player1": RandomMove()})
        session.evaluate(against, split="test", n=200)          # player0 against random
        run = session.train(steps=20)
        standings(run.rows)["alice"].win_rate
    """

    splits = ("train", "test")

    def __init__(self, game: str, *, num_players: int = 2, roles: Sequence[str] | None = None,
                 history: bool = False, max_turns: int = 64, league: League | None = None,
                 seed: int = 0, sampling: SamplingParams | Mapping[str, Any] | None = None,
                 make_kwargs: Mapping[str, Any] | None = None,
                 bots: Mapping[str, Bot] | None = None):
        import textarena

        for name, value in (("num_players", num_players), ("max_turns", max_turns)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._ta, self.game, self.num_players = textarena, game, num_players
        self.make_kwargs = dict(make_kwargs or {})
        self.players = self._role_names(roles)
        """Every player's role name, in player order (bots' roles included)."""
        self.bots = dict(bots or {})
        unknown = sorted(set(self.bots) - set(self.players))
        if unknown or len(self.bots) == len(self.players):
            raise ValueError(f"bots must name some of the players {list(self.players)} and "
                             f"leave one to learn, got {sorted(self.bots)}")
        if not all(callable(bot) for bot in self.bots.values()):
            raise ValueError("each bot must be a callable (text, rng) -> move, e.g. "
                             "RandomMove()")
        self.roles = tuple(r for r in self.players if r not in self.bots)
        self.history, self.max_turns, self.seed = bool(history), max_turns, seed
        self.league = league if league is not None else League()
        self._probe()
        if sampling is None:
            sampling = SamplingParams(max_new_tokens=32)
        self.sampling = (sampling if isinstance(sampling, SamplingParams)
                         else SamplingParams(**sampling))

    @property
    def name(self) -> str:
        return f"textarena:{self.game}"

    # -- building ---------------------------------------------------------------------------------
    def _role_names(self, roles: Sequence[str] | None) -> tuple[str, ...]:
        if roles is None:
            return tuple(f"player{i}" for i in range(self.num_players))
        names = tuple(roles)
        if (len(names) != self.num_players or len(set(names)) != len(names)
                or not all(isinstance(r, str) and r for r in names)):
            raise ValueError(f"roles must name each of the {self.num_players} players once, in "
                             f"player order, got {list(names)}")
        return names

    def _make(self) -> Any:
        known = games()
        if self.game not in known:
            close = difflib.get_close_matches(str(self.game), known, n=5, cutoff=0.5)
            raise ValueError(f"textarena has no game {self.game!r}; games include "
                             f"{close or list(_EXAMPLES)} (astranb_textarena.games() lists all "
                             f"{len(known)})")
        return self._ta.make(self.game, **self.make_kwargs)

    def _probe(self) -> None:
        """Start a game once, so a game that cannot be played here says so now."""
        env = self._make()
        try:
            game = _Game(env, 0)
            game.reset(self.num_players, 0)
            game.observe()
        except Exception as error:
            raise ValueError(f"{self.game} cannot start with num_players={self.num_players} "
                             f"here ({type(error).__name__}: {error}); a board game such as "
                             f"TicTacToe-v0 needs no network and exactly 2 players") from error

    # -- samples ----------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[dict[str, Any]]:
        return self.split_samples("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"{self.name} has splits {self.splits}, not {split!r}")
        rng = random.Random(f"textarena-{split}-{self.seed}-{seed}")
        parity = 0 if split == "train" else 1
        while True:
            yield {"seed": 2 * rng.randrange(2**30) + parity, "split": split}

    # -- an episode -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> dict[str, float]:
        seed = int(sample["seed"])
        game = _Game(self._make(), seed)
        game.reset(self.num_players, seed)
        chats: dict[str, list[dict[str, Any]]] = {role: [] for role in self.players}
        rules: dict[str, str] = {}
        rngs = {role: random.Random(f"bot-{seed}-{role}") for role in self.bots}
        done = False
        for _ in range(self.max_turns):
            player, observation = game.observe()
            role = self.players[player]
            if role in self.bots:
                move = self.bots[role](self._text(game, player, observation, rules, role),
                                       rngs[role])
                ctx.count("bot_moves")
            else:
                messages = self._turn(game, player, observation, chats[role], rules)
                move = (await ctx.chat(role, messages)).content  # with self.sampling
                ctx.count("moves")
            if done := self._step(game, role, move):
                break
        if not done:
            ctx.count("out_of_turns")
        rewards, info = game.close()
        by_player = {role: float(rewards.get(i, 0.0)) if done else 0.0
                     for i, role in enumerate(self.players)}
        if done and any(isinstance(v, Mapping) and v.get("invalid_move") for v in info.values()):
            ctx.count("lost_by_invalid_move")
        if done and self.num_players > 1:
            self._score(ctx, by_player)
        return {role: by_player[role] for role in self.roles}

    def _step(self, game: _Game, role: str, text: str) -> bool:
        """The game's move with the reply; a game that raises on it (its own bug: the rules
        answer a bad move with a warning or a loss) fails this episode only, saying where."""
        try:
            return game.step(text)
        except Exception as error:
            raise RuntimeError(f"{self.game} raised on {role}'s reply {text[:200]!r} "
                               f"({type(error).__name__}: {error}); the episode fails, the "
                               "run goes on") from error

    def _turn(self, game: _Game, player: int, observation: Any, chat: list[dict[str, Any]],
              rules: dict[str, str]) -> list[dict[str, Any]]:
        """The conversation to answer: `chat` with the new messages (history), or them alone
        after the role's rules."""
        role = self.players[player]
        text = self._text(game, player, observation, rules, role)
        if self.history:
            chat.append({"role": "user", "content": text})
            return chat
        first = rules.get(role, "")
        return [{"role": "user", "content": text if text.startswith(first)
                 else f"{first}\n\n{text}"}]

    def _text(self, game: _Game, player: int, observation: Any, rules: dict[str, str],
              role: str) -> str:
        """What the game told `player` since its last move, as text: its own moves are left
        out (they are its replies already), another player's are named, and of the boards only
        the latest is kept."""
        if isinstance(observation, str):
            return observation
        parts = []
        kinds = self._ta.ObservationType
        prompt, moved, board = kinds.PROMPT, kinds.PLAYER_ACTION, kinds.GAME_BOARD
        boards = [i for i, (_, _, kind) in enumerate(observation) if kind == board]
        for i, (sender, message, kind) in enumerate(observation):
            if kind == prompt:
                rules.setdefault(role, str(message))
            if (kind == moved and sender == player) or (kind == board and i != boards[-1]):
                continue  # its own move, or a board that a later one in the news replaces
            parts.append(str(message) if sender < 0 or kind != moved
                         else f"[{game.name_of(sender)}] {message}")
        return "\n\n".join(parts) or "(nothing new)"

    def _score(self, ctx: Any, rewards: Mapping[str, float]) -> None:
        """Count each role's result for its policy and its role, and move the Elo ratings."""
        players = {role: str(getattr(self.bots[role], "name", role)) if role in self.bots
                   else ctx.wiring[role].name for role in self.players}
        for role, result in outcomes(rewards).items():
            ctx.count(f"{result}/{players[role]}")
            ctx.count(f"{result}_as/{role}")
        for policy, change in self.league.record(players, rewards).items():
            ctx.count(f"elo_milli/{policy}", round(change * 1000))
