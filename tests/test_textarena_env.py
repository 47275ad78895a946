"""The TextArena adapter against the real textarena 0.7.4: TicTacToe played to the end by
scripted replies (self-play and one policy per role), per-role rewards from the game's outcome,
invalid and hostile replies judged by the game, win/loss counts and Elo in the episode counts,
the Elo rule against hand-computed values, clear errors, and short training runs. No network."""

from __future__ import annotations

import random
import re

import anyio
import pytest
import textarena
from astranb_textarena import (
    League,
    RandomMove,
    TextArena,
    elo_update,
    expected_score,
    outcomes,
    standings,
)

import astranb as ab
from astranb.weights.publish import StatePublisher
from tests.test_math_env import TOKENIZER, ScriptedEngine

# O (player0) takes the top row while X (player1) plays the middle
TOP_ROW = ("[0]", "[3]", "[1]", "[4]", "[2]")
# X takes the middle row while O wanders
MIDDLE_ROW = (("[0]", "[1]", "[8]"), ("[3]", "[4]", "[5]"))
# nine moves, no line: O X O / X X O / O X O ... worked out cell by cell in test_a_draw_...
DRAW = (("[0]", "[8]", "[6]", "[5]", "[1]"), ("[4]", "[2]", "[3]", "[7]"))


def scripted(name, *texts):
    engine = ScriptedEngine(texts)
    return ab.Policy(name, ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher(name, engine, None), TOKENIZER)


def play(env, **wiring):
    trajectory = anyio.run(ab.play_episode, env, wiring, {"seed": 0, "split": "x"})
    assert trajectory.ok, trajectory.error
    return trajectory


def tictactoe(**kwargs):
    return ab.environments.load("textarena", game="TicTacToe-v0", **kwargs)


# -- the Elo rule and outcomes, by hand ---------------------------------------------------------
def test_elo_moves_ratings_by_k_times_the_surprise():
    # equal ratings: expected 0.5 each, so a win moves 32 * 0.5 = 16 points
    assert expected_score(1000, 1000) == 0.5
    assert elo_update(1000.0, 1000.0, 1.0) == (1016.0, 984.0)
    assert elo_update(1000.0, 1000.0, 0.5) == (1000.0, 1000.0)
    # 1200 against 1000: E = 1 / (1 + 10 ** (-200 / 400)) = 1 / 1.3162278 = 0.7597469
    assert expected_score(1200, 1000) == pytest.approx(0.7597469266)
    # the favourite wins: + 32 * (1 - 0.7597469) = + 7.6880983; a draw: 32 * (0.5 - 0.7597469)
    assert elo_update(1200.0, 1000.0, 1.0) == pytest.approx((1207.6880983, 992.3119017))
    assert elo_update(1200.0, 1000.0, 0.5) == pytest.approx((1191.6880983, 1008.3119017))
    # the underdog wins: 1000 + 32 * (1 - 0.2402531) = 1024.3119017
    assert elo_update(1000.0, 1200.0, 1.0, k=32) == pytest.approx((1024.3119017, 1175.6880983))
    assert elo_update(1000.0, 1000.0, 1.0, k=10) == (1005.0, 995.0)
    with pytest.raises(ValueError, match="score must be in"):
        elo_update(1000.0, 1000.0, 2.0)


def test_outcomes_and_a_league_of_games():
    assert outcomes({"a": 1, "b": -1}) == {"a": "win", "b": "loss"}
    assert outcomes({"a": 0, "b": 0}) == {"a": "draw", "b": "draw"}
    assert outcomes({"a": 1, "b": 1, "c": -1}) == {"a": "win", "b": "win", "c": "loss"}
    league = League()
    seats = {"player0": "alice", "player1": "bob"}
    assert league.record(seats, {"player0": 1, "player1": -1}) == {"alice": 16.0, "bob": -16.0}
    # 1016 against 984 drawn: alice expected 1 / (1 + 10 ** (-32 / 400)) = 1 / 1.8317638 = 0.5459219
    change = league.record(seats, {"player0": 0, "player1": 0})
    assert change["alice"] == pytest.approx(32 * (0.5 - 0.5459219)) == -change["bob"]
    # self-play never rates a policy against itself, but counts both seats
    assert league.record({"player0": "alice", "player1": "alice"},
                         {"player0": -1, "player1": 1}) == {"alice": 0.0}
    table = league.table()
    assert (table["alice"].games, table["alice"].wins, table["alice"].draws,
            table["alice"].losses) == (4, 2, 1, 1)
    assert table["alice"].win_rate == 0.5 and table["bob"].win_rate == 0.0
    assert table["alice"].elo + table["bob"].elo == pytest.approx(2000.0)
    # three policies: each pair at K / 2
    three = League().record({"a": "x", "b": "y", "c": "z"}, {"a": 1, "b": -1, "c": -1})
    assert three == {"x": 16.0, "y": -8.0, "z": -8.0}


def test_standings_add_up_each_policy_s_own_rows():
    rows = [{"policy": "alice", "count/win/alice": 2, "count/loss/alice": 1,
             "count/win/bob": 1, "count/elo_milli/alice": 16000},
            {"policy": "bob", "count/win/bob": 1, "count/loss/bob": 2,
             "count/elo_milli/bob": -16000},
            {"policy": "alice", "count/draw/alice": 1, "count/elo_milli/alice": 500}]
    table = standings(rows)
    assert (table["alice"].games, table["alice"].wins, table["alice"].draws) == (4, 2, 1)
    assert table["alice"].elo == 1016.5 and table["bob"].elo == 984.0
    assert table["bob"].win_rate == pytest.approx(1 / 3)


# -- games played to the end --------------------------------------------------------------------
def test_self_play_one_policy_plays_both_sides_to_the_game_s_end():
    env = tictactoe(history=True)
    policy = scripted("p", *TOP_ROW)
    trajectory = play(env, player0=policy, player1=policy)
    assert trajectory.rewards == {"player0": 1.0, "player1": -1.0}
    assert [t.role for t in trajectory.turns] == ["player0", "player1"] * 2 + ["player0"]
    assert {t.policy for t in trajectory.turns} == {"p"}
    assert trajectory.counts == {"moves": 5, "win/p": 1, "loss/p": 1, "win_as/player0": 1,
                                 "loss_as/player1": 1, "elo_milli/p": 0, "retokenized": 0}
    prompts = policy.engine.prompts
    assert "You are Player 0 in Tic Tac Toe" in prompts[0] and "Available Moves" in prompts[0]
    assert "You are Player 1" in prompts[1] and "[Player 0] [0]" in prompts[1]
    assert "Player 0 placed their symbol (O) in cell 0." in prompts[1]
    # each role's conversation grows token-in/token-out: its next prompt extends its last one
    for role in ("player0", "player1"):
        mine = [t for t in trajectory.turns if t.role == role]
        for before, after in zip(mine, mine[1:], strict=False):
            done = before.generation.prompt_ids + before.generation.completion_ids
            assert after.generation.prompt_ids[:len(done)] == done
    assert env.league.table()["p"].elo == 1000.0


def test_one_policy_per_role_each_gets_its_own_turns_and_reward():
    env = tictactoe()
    alice, bob = scripted("alice", *MIDDLE_ROW[0]), scripted("bob", *MIDDLE_ROW[1])
    trajectory = play(env, player0=alice, player1=bob)
    assert trajectory.rewards == {"player0": -1.0, "player1": 1.0}  # X won the middle row
    assert [t.policy for t in trajectory.turns] == ["alice", "bob"] * 3
    assert len(alice.engine.prompts) == len(bob.engine.prompts) == 3
    assert "You are Player 1" not in "".join(alice.engine.prompts)  # each sees only its side
    counts = trajectory.counts
    assert (counts["win/bob"], counts["loss/alice"], counts["win_as/player1"]) == (1, 1, 1)
    assert counts["elo_milli/bob"] == 16000 and counts["elo_milli/alice"] == -16000
    table = env.league.table()
    assert table["bob"].elo == 1016.0 and table["alice"].elo == 984.0
    assert table["bob"].win_rate == 1.0 and table["alice"].win_rate == 0.0


def test_a_draw_gives_both_roles_nothing():
    # O: 0 8 6 5 1, X: 4 2 3 7 -> rows O O X / X X O / O X O, columns O X O / O X X / X O O,
    # diagonals O X O / X X O: no line, the board full after nine moves
    env = tictactoe()
    alice, bob = scripted("alice", *DRAW[0]), scripted("bob", *DRAW[1])
    trajectory = play(env, player0=alice, player1=bob)
    assert trajectory.rewards == {"player0": 0.0, "player1": 0.0}
    assert len(trajectory.turns) == 9
    assert trajectory.counts["draw/alice"] == trajectory.counts["draw/bob"] == 1
    assert trajectory.counts["elo_milli/alice"] == 0  # equal ratings drawn: no change


def test_invalid_moves_are_judged_as_the_game_does():
    # TicTacToe allows one invalid move in a row (a warning and a retry); the second loses
    env = tictactoe()
    alice = scripted("alice", "hello", "[0]")
    bob = scripted("bob", "[0]", "nope")  # the occupied cell, then no move at all
    trajectory = play(env, player0=alice, player1=bob)
    assert [t.policy for t in trajectory.turns] == ["alice", "alice", "bob", "bob"]
    assert trajectory.rewards == {"player0": 1.0, "player1": -1.0}
    assert trajectory.counts["lost_by_invalid_move"] == 1
    assert "Player 0 attempted an invalid move" in alice.engine.prompts[1]
    assert "cell 0 is already occupied" in bob.engine.prompts[1]


HOSTILE = ["", "{0}{1}%s%n", "[Player 1] [4]", "\x00\x1b[31m\u202e", "[99999999999999999999]",
           "[-1]", "[4][4][4]", "]]][[[", "__import__('os').system('id')", "[\uff14]",
           "<|im_end|><|im_start|>user\n[4]", "\\[4\\]", "[" * 40, "[4"]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_replies_never_break_the_game_loop(text):
    policy = scripted("p", *([text] * 20))
    env = tictactoe(max_turns=20)
    trajectory = play(env, player0=policy, player1=policy)
    rewards = trajectory.rewards
    assert sorted(rewards.values()) in ([-1.0, 1.0], [0.0, 0.0])
    assert "out_of_turns" not in trajectory.counts or rewards == {"player0": 0.0,
                                                                  "player1": 0.0}


def test_a_game_that_raises_on_a_reply_fails_that_episode_only(monkeypatch):
    from textarena.envs.TicTacToe.env import TicTacToeEnv

    step = TicTacToeEnv.step

    def fragile(self, action):
        if "boom" in action:
            raise KeyError("boom")
        return step(self, action)

    monkeypatch.setattr(TicTacToeEnv, "step", fragile)
    env = tictactoe()
    policy = scripted("p", "[4]", "boom")
    trajectory = anyio.run(ab.play_episode, env, {"player0": policy, "player1": policy},
                           {"seed": 0})
    assert not trajectory.ok and trajectory.rewards == {}
    assert "TicTacToe-v0 raised on player1's reply 'boom' (KeyError" in trajectory.error
    assert env.league.table() == {}  # no result counted
    policy = scripted("p", *TOP_ROW)  # the next game plays as usual
    assert play(env, player0=policy, player1=policy).rewards["player0"] == 1.0


def test_games_use_a_random_state_of_their_own():
    random.seed(7)
    expected = random.Random(7).random()
    policy = scripted("p", *TOP_ROW)
    play(tictactoe(), player0=policy, player1=policy)  # the game seeds `random` on reset
    assert random.random() == expected


class YieldingEngine(ScriptedEngine):
    """A scripted engine that lets other episodes run before each reply, as a real one does."""

    async def generate(self, request):
        await anyio.sleep(0)
        return await super().generate(request)


def test_a_seed_replays_its_deal_even_with_games_played_in_between():
    # Kuhn Poker deals from Python's random: each game draws from its own stream
    env = ab.environments.load("textarena", game="KuhnPoker-v0")

    def policy():
        engine = YieldingEngine(["[check]"] * 30)
        return ab.Policy("p", ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                         StatePublisher("p", engine, None), TOKENIZER)

    def cards(p):
        return re.findall(r"Your card is: '(\w)'", " ".join(p.engine.prompts))

    async def together(seeds):
        policies = [policy() for _ in seeds]
        async with anyio.create_task_group() as tg:
            for seed, p in zip(seeds, policies, strict=True):
                tg.start_soon(ab.play_episode, env, {"player0": p, "player1": p}, {"seed": seed})
        return [cards(p) for p in policies]

    alone = [anyio.run(together, [seed])[0] for seed in (0, 4)]
    assert alone[0] != alone[1] and len(alone[0]) == 6  # 3 rounds, a card each a round
    assert anyio.run(together, [0, 4]) == alone


def test_a_game_past_max_turns_ends_even():
    env = tictactoe(max_turns=3)
    policy = scripted("p", "[0]", "[3]", "[1]")
    trajectory = play(env, player0=policy, player1=policy)
    assert trajectory.rewards == {"player0": 0.0, "player1": 0.0}
    assert trajectory.counts == {"moves": 3, "out_of_turns": 1, "retokenized": 0}
    assert env.league.table() == {}


def test_without_history_each_turn_is_the_rules_and_the_news():
    env = tictactoe()
    policy = scripted("p", *TOP_ROW)
    trajectory = play(env, player0=policy, player1=policy)
    assert trajectory.rewards == {"player0": 1.0, "player1": -1.0}
    third = policy.engine.prompts[2]  # player0's second turn
    assert third.count("<|im_start|>user") == 1 and "<|im_start|>assistant\n[0]" not in third
    assert "You are Player 0 in Tic Tac Toe" in third and "[Player 1] [3]" in third


def test_named_roles_and_samples():
    env = tictactoe(roles=("o", "x"))
    assert env.roles == ("o", "x") and env.name == "textarena:TicTacToe-v0"
    policy = scripted("p", *TOP_ROW)
    assert play(env, o=policy, x=policy).rewards == {"o": 1.0, "x": -1.0}
    train = [s["seed"] for s, _ in zip(env.samples(0), range(100), strict=False)]
    test = [s["seed"] for s, _ in zip(env.split_samples("test"), range(100), strict=False)]
    assert not set(train) & set(test) and all(s % 2 == 0 for s in train)


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match=r"no game 'TicTacToe'; games include \['TicTacToe-v0'"):
        TextArena("TicTacToe")
    with pytest.raises(ValueError, match=r"no game 'Chekers-v9'.*Checkers"):
        TextArena("Chekers-v9")
    with pytest.raises(ValueError, match="cannot start with num_players=3"):
        TextArena("TicTacToe-v0", num_players=3)
    with pytest.raises(ValueError, match="roles must name each of the 2 players once"):
        TextArena("TicTacToe-v0", roles=("a", "a"))
    with pytest.raises(ValueError, match="max_turns must be"):
        TextArena("TicTacToe-v0", max_turns=0)
    with pytest.raises(ValueError, match="has splits"):
        next(tictactoe().split_samples("validation"))
    assert textarena.__version__ == "0.7.4"


# -- a fixed random player ------------------------------------------------------------------------
class FirstFree(ScriptedEngine):
    """Plays the lowest cell the board lists as free (always a legal move)."""

    async def generate(self, request):
        prompt = TOKENIZER.decode(list(request.prompt_ids), skip_special_tokens=False)
        self.texts = [re.findall(r"Available Moves: '(\[\d\])'", prompt)[-1]]
        return await super().generate(request)


def first_free(name):
    engine = FirstFree([])
    return ab.Policy(name, ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher(name, engine, None), TOKENIZER)


def test_random_move_draws_uniformly_among_the_listed_legal_moves():
    text = ("Current Board:\n\n O | 1 | 2 \n\nAvailable Moves: '[0]', '[5]'\n\n"
            "Current Board:\n\n O | X | 2 \n\nAvailable Moves: '[2]', '[4]', '[8]'")
    rng = random.Random(0)
    draws = [RandomMove()(text, rng) for _ in range(3000)]
    assert set(draws) == {"[2]", "[4]", "[8]"}  # the last list only
    for move in ("[2]", "[4]", "[8]"):  # 1000 expected each; sd sqrt(3000 * 1/3 * 2/3) = 26
        assert abs(draws.count(move) - 1000) < 130
    with pytest.raises(ValueError, match="no 'Available Moves"):
        RandomMove()("Your turn. Say something.", rng)


def test_a_bot_plays_its_role_legally_and_counts_in_the_league():
    env = tictactoe(bots={"player1": RandomMove()})
    assert env.roles == ("player0",) and env.players == ("player0", "player1")
    alice = first_free("alice")
    seen = set()
    for seed in range(12):
        trajectory = anyio.run(ab.play_episode, env, {"player0": alice},
                               {"seed": seed, "split": "x"})
        assert trajectory.ok, trajectory.error
        assert set(trajectory.rewards) == {"player0"}  # the bot's role is not trained
        counts = trajectory.counts
        assert "lost_by_invalid_move" not in counts  # both sides played legal moves only
        assert {t.role for t in trajectory.turns} == {"player0"}
        assert counts["moves"] == len(trajectory.turns)
        assert counts["bot_moves"] in (counts["moves"], counts["moves"] - 1)  # alice opens
        assert 5 <= counts["moves"] + counts["bot_moves"] <= 9
        # every game counts one result for alice and the opposite one for the bot
        result = {1.0: "win", 0.0: "draw", -1.0: "loss"}[trajectory.rewards["player0"]]
        other = {"win": "loss", "draw": "draw", "loss": "win"}[result]
        assert counts[f"{result}/alice"] == counts[f"{other}/random"] == 1
        assert counts[f"{other}_as/player1"] == 1
        seen.add(result)
        # each bot move was a cell still free after alice's move on the board she had seen
        prompts = alice.engine.prompts[-len(trajectory.turns):]
        for before, after, turn in zip(prompts, prompts[1:], trajectory.turns, strict=False):
            free = set(re.findall(r"'\[\d\]'", re.findall(r"Available Moves: (.*)", before)[-1]))
            free.discard(f"'{turn.generation.text}'")
            (bot,) = re.findall(r"\[Player 1\] (\[\d\])", after)
            assert f"'{bot}'" in free
    # the first free cell wins as first player against random more often than not
    table = env.league.table()
    assert table["alice"].games == table["random"].games == 12
    assert table["alice"].wins == table["random"].losses and "win" in seen
    assert table["alice"].elo + table["random"].elo == pytest.approx(2000.0)
    assert table["alice"].elo > 1000.0 > table["random"].elo


def test_bots_must_leave_a_role_to_learn():
    with pytest.raises(ValueError, match="leave one to learn"):
        tictactoe(bots={"player0": RandomMove(), "player1": RandomMove()})
    with pytest.raises(ValueError, match="leave one to learn"):
        tictactoe(bots={"player2": RandomMove()})
    with pytest.raises(ValueError, match="callable"):
        tictactoe(bots={"player1": "random"})


# -- training -------------------------------------------------------------------------------------
def _policy(session, name, seed=0):
    return session.policy(name, model=ab.models.tiny_chat(seed=seed), max_batch_size=32,
                          # untrained, nearly every game is lost by invalid moves: groups tie
                          algorithm=ab.GRPO(entropy_coef=0.01, filter_groups=False))


def _train(session):
    run = session.train(steps=2, batch_size=4, group_size=4)
    run.wait(timeout=240, progress=False)
    assert run.status == "finished", run.status
    return run.rows


SHORT = {"max_turns": 6, "sampling": {"max_new_tokens": 8}}


@pytest.mark.slow  # a real engine and trainer
def test_self_play_trains_one_policy_on_both_sides(tmp_path):
    with ab.Session(tmp_path, trainer="thread") as session:
        p = _policy(session, "p")
        session.wire(tictactoe(**SHORT), player0=p, player1=p)
        rows = _train(session)
    assert len(rows) == 2 and {r["policy"] for r in rows} == {"p"}
    table = standings(rows)["p"]
    # both seats are p's: every decided game is one win and one loss of p
    assert table.games > 0 and table.wins == table.losses and table.elo == 1000.0


@pytest.mark.slow  # a real engine and two trainers
def test_two_policies_train_one_role_each_with_win_rates_and_elo(tmp_path):
    # an untrained first player loses by two invalid moves before the second one moves, so
    # each policy takes the first seat in one of two seatings, rated in one league
    league = League()
    with ab.Session(tmp_path, trainer="thread") as session:
        alice, bob = _policy(session, "alice", 0), _policy(session, "bob", 1)
        session.wire(tictactoe(league=league, **SHORT), player0=alice, player1=bob)
        session.wire(tictactoe(league=league, **SHORT), player0=bob, player1=alice)
        rows = _train(session)
    assert {r["policy"] for r in rows} == {"alice", "bob"}
    table = standings(rows)
    for name in ("alice", "bob"):
        assert table[name].games > 0 and 0.0 <= table[name].win_rate <= 1.0
        # a row has a count column once some episode counted the name (run.metrics fills 0s)
        assert any(f"count/elo_milli/{name}" in r for r in rows)
    rated = league.table()
    assert rated["alice"].elo + rated["bob"].elo == pytest.approx(2000.0)
    assert rated["alice"].games == rated["bob"].games > 0
    assert rated["alice"].wins == rated["bob"].losses


def test_the_readme_table_row_is_true():
    from tests.test_reasoning_gym_env import readme_row

    row = readme_row("TextArena")
    env = tictactoe()
    alice, bob = scripted("alice", *MIDDLE_ROW[0]), scripted("bob", *MIDDLE_ROW[1])
    trajectory = play(env, player0=alice, player1=bob)
    assert row["multi-turn"].startswith("yes") and len(trajectory.turns) == 6
    assert row["tools"] == "no" and "<tools>" not in alice.engine.prompts[0]
    assert row["multi-agent"].startswith("yes") and env.roles == ("player0", "player1")
    assert row["streaming"].startswith("no")
    assert row["partial rewards"].startswith("no")
    assert set(trajectory.rewards.values()) == {-1.0, 1.0}  # the outcome only
