"""TextArena self-play on CPU: the tiny chat model's win rate against a fixed random player,
before and after self-play RL on TicTacToe-v0.

The game: TextArena's TicTacToe-v0 (textarena 0.7.4), a move is one of nine short strings
("[0]" ... "[8]"), the board and the free cells are in every prompt. Self-play: one policy wired
to both players, trained on both sides' turns, each with its side's reward (1 a win, -1 a loss,
0 a draw). The fixed opponent: `astranb_textarena.RandomMove`, a uniformly random legal move,
in the other seat (`bots=`): it is never trained and sees the same text a policy would.

The untrained tiny model writes no move at all (every game is lost by two invalid moves, every
group ties, RL has nothing to learn from), so a warm start comes first: `policy.sft` on the
moves of games played by two uniformly random legal players (the moves carry the format and
the free cells, no strategy). Then asynchronous GRPO with astranb's defaults (the session's
algorithm and optimizer, `session.train`'s staleness) on self-play games.

Win rate against random is measured by `session.evaluate` on the two seatings (the policy first
and second, `--eval-games` games each, the policy's sampling as it trains), at the start of RL
and at its end, with its standard error sqrt(p (1 - p) / n). Writes
results/textarena_selfplay.json.

    .venv/bin/python bench/textarena_selfplay.py
    .venv/bin/python bench/textarena_selfplay.py --seeds 0 1 2

Status (bench/RESULTS.md): the target is not reached. In a short trial the warm start took the
win rate against random from 0 to 0.21 +- 0.04, but self-play RL took no step: every group of
the policy was dropped by filter_groups with all rewards 0.0. Both seats are the same policy and
the game is zero-sum, so the policy's reward per episode (its roles' rewards together) is 0 in
every decided game. Each seat's reward is now normalised among that seat's episodes and
self-play steps; a rerun of 30 steps left the win rate at 0.14 (+0.00 +- 0.05).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from astranb_textarena import League, RandomMove, TextArena

import astranb as ab
from astranb.weights.publish import StatePublisher

ROOT = Path(__file__).resolve().parents[1]
GAME = "TicTacToe-v0"
SAMPLING = {"max_new_tokens": 6}
_FREE = re.compile(r"Available Moves: ([^\n]*)")


# -- warm start: moves of random legal players ---------------------------------------------------
class _Recording(TextArena):
    """TicTacToe that keeps every conversation it asks a role to answer, in order."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.asked: list[list[dict[str, Any]]] = []

    def _turn(self, *args: Any) -> list[dict[str, Any]]:
        messages = super()._turn(*args)
        self.asked.append([dict(m) for m in messages])
        return messages


class _RandomLegal:
    """An engine that answers each prompt with a uniformly random free cell (then EOS)."""

    def __init__(self, tokenizer: Any, seed: int):
        self.tokenizer, self.rng, self.moves = tokenizer, random.Random(seed), []

    async def generate(self, request: Any) -> ab.Generation:
        prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=True)
        move = self.rng.choice(re.findall(r"\[\d\]", _FREE.findall(prompt)[-1]))
        self.moves.append(move)
        ids = (*self.tokenizer.encode(move, add_special_tokens=False),
               self.tokenizer.eos_token_id)
        return ab.Generation(request.prompt_ids, ids, (-1.0,) * len(ids), (0,) * len(ids),
                             "stop", text=move)


def demonstrations(games: int, seed: int) -> list[dict[str, Any]]:
    """Each move of `games` games between two random legal players, as a conversation: the
    prompt the environment builds for that turn and the move."""
    env = _Recording(game=GAME, sampling=SAMPLING)
    spec = ab.models.tiny_chat()
    tokenizer = spec.tokenizer()
    engine = _RandomLegal(tokenizer, seed)
    player = ab.Policy("demo", spec, ab.GRPO(), ab.AdamWConfig(), engine, None,
                       StatePublisher("demo", engine, None), tokenizer)
    samples = env.split_samples("train", seed)
    for _ in range(games):
        trajectory = anyio.run(ab.play_episode, env, {"player0": player, "player1": player},
                               next(samples))
        assert trajectory.ok, trajectory.error
    assert len(env.asked) == len(engine.moves)
    return [{"messages": [*asked, {"role": "assistant", "content": move}]}
            for asked, move in zip(env.asked, engine.moves, strict=True)]


# -- win rate against random ---------------------------------------------------------------------
def against_random(session: ab.Session, games: int, seed: int) -> dict[str, Any]:
    """The policy's results against RandomMove in each seat, `games` games each."""
    seats = {}
    for seat, bot in (("first", "player1"), ("second", "player0")):
        league = League()
        env = TextArena(GAME, sampling=SAMPLING, league=league, bots={bot: RandomMove()})
        session.evaluate(env, split="test", n=games, k=1, seed=seed)
        table = league.table()["p"]
        seats[seat] = {"games": table.games, "wins": table.wins, "draws": table.draws,
                       "losses": table.losses}
    n = sum(s["games"] for s in seats.values())
    wins = sum(s["wins"] for s in seats.values())
    rate = wins / n
    return {"win_rate": rate, "se": math.sqrt(rate * (1 - rate) / n), "games": n,
            "draw_rate": sum(s["draws"] for s in seats.values()) / n, "seats": seats}


def _line(result: dict[str, Any]) -> str:
    seats = ", ".join(f"{k} {v['wins']}/{v['games']}" for k, v in result["seats"].items())
    return f"{result['win_rate']:.3f} +- {result['se']:.3f} ({seats})"


# -- one run -------------------------------------------------------------------------------------
def run(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    session = ab.Session(tempfile.mkdtemp(prefix="astranb-textarena-"))
    policy = session.policy("p", ab.models.tiny_chat(seed=seed))  # astranb's defaults
    selfplay = TextArena(GAME, sampling=SAMPLING, seed=seed)
    session.wire(selfplay, player0=policy, player1=policy)
    untrained = against_random(session, args.untrained_games, 10_000 + seed)
    print(f"seed {seed}: untrained, win rate against random {_line(untrained)}", flush=True)
    demos = demonstrations(args.demo_games, seed)
    sft_started = time.perf_counter()
    policy.sft(demos, steps=args.sft_steps, batch_size=16, lr=args.sft_lr)
    sft_seconds = time.perf_counter() - sft_started
    before = against_random(session, args.eval_games, 20_000 + seed)
    print(f"seed {seed}: after the warm start ({len(demos)} moves, {args.sft_steps} steps, "
          f"{sft_seconds:.0f} s), win rate against random {_line(before)}", flush=True)
    rl_started = time.perf_counter()
    training = session.train(steps=args.steps, batch_size=args.batch_size,
                             group_size=args.group_size)
    training.wait(progress=False)
    rl_seconds = time.perf_counter() - rl_started
    after = against_random(session, args.eval_games, 20_000 + seed)
    rows = training.rows
    rewards = [r["reward"] for r in rows]
    # self-play: a game counts one result for each seat, both p's
    games = [sum(r.get(f"count/{o}/p", 0) for o in ("win", "draw", "loss")) / 2 for r in rows]
    invalid = [r.get("count/lost_by_invalid_move", 0) / g if g else None
               for r, g in zip(rows, games, strict=True)]
    session.close()
    seconds = time.perf_counter() - started
    rise = after["win_rate"] - before["win_rate"]
    result = {"seed": seed, "untrained": untrained, "before_rl": before, "after_rl": after,
              "rise": rise, "rise_se": math.hypot(before["se"], after["se"]),
              "demo_moves": len(demos), "sft_seconds": sft_seconds, "rl_seconds": rl_seconds,
              "seconds": seconds, "steps": len(rows), "episodes": rows[-1]["episodes"],
              "train_reward_first": rewards[:5], "train_reward_last": rewards[-5:],
              "invalid_first": invalid[:5], "invalid_last": invalid[-5:]}
    print(f"seed {seed}: after RL ({len(rows)} steps, {rows[-1]['episodes']} games, "
          f"{rl_seconds:.0f} s), win rate against random {_line(after)}; rise {rise:+.3f} +- "
          f"{result['rise_se']:.3f}; {seconds:.0f} s in all", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--demo-games", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--sft-lr", type=float, default=5e-3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-games", type=int, default=200, help="per seat")
    parser.add_argument("--untrained-games", type=int, default=50, help="per seat")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    results = [run(seed, args) for seed in args.seeds]
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (args.out / "textarena_selfplay.json").write_text(
        json.dumps({"game": GAME, "settings": settings, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
