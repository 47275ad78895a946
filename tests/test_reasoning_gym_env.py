"""The reasoning-gym adapter against the real reasoning-gym 0.1.25: tasks by name and in mixes,
samples fixed by seed, held-out splits that share no question with train, the task's own scorer
as the reward (partial credit included), hostile answers scored where they cannot act, chat and
plain prompts, unknown names, and a short training run. No network."""

from __future__ import annotations

import anyio
import pytest
import reasoning_gym
from astranb_reasoning_gym import (
    ReasoningGym,
    ScoreError,
    Scorer,
    ScoreTimeout,
    extract_answer,
    task_names,
)
from astranb_reasoning_gym.env import compares_strings, string_score

import astranb as ab
from astranb.weights.publish import StatePublisher
from tests.test_math_env import TOKENIZER, ScriptedEngine

PLAIN = ab.models.tiny(hidden_size=32, num_heads=2)


def load(task="basic_arithmetic", **kw):
    kw = {"size": 40, "seed": 3, "test_size": 20, **kw}
    return ab.environments.load("reasoning_gym", task=task, **kw)


@pytest.fixture(scope="module")
def arithmetic():
    env = load()
    yield env
    env.close()


@pytest.fixture(scope="module")
def spelling():
    env = load("spell_backward")
    yield env
    env.close()


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def play(env, sample, policy):
    return anyio.run(ab.play_episode, env, {"solver": policy}, sample)


def scripted(*texts):
    engine = ScriptedEngine(texts)
    return ab.Policy("p", ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher("p", engine, None), TOKENIZER)


class PlainEngine:
    """Completes a plain-text prompt with the next scripted text, and keeps the prompt ids."""

    def __init__(self, texts):
        self.tokenizer = PLAIN.tokenizer()
        self.texts, self.prompts = list(texts), []

    async def generate(self, request):
        tok = self.tokenizer
        self.prompts.append(tuple(request.prompt_ids))
        ids = (*tok.encode(self.texts.pop(0), add_special_tokens=False), tok.eos_token_id)
        return ab.Generation(request.prompt_ids, ids, (-1.0,) * len(ids), (0,) * len(ids),
                             "stop", text=tok.decode(list(ids), skip_special_tokens=True))


def plain(*texts):
    engine = PlainEngine(texts)
    return ab.Policy("p", PLAIN, ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher("p", engine, None), engine.tokenizer)


# -- samples and splits -----------------------------------------------------------------------

def test_any_task_by_name_with_reasoning_gyms_own_entries(arithmetic, spelling):
    assert {"basic_arithmetic", "spell_backward", "chain_sum"} <= set(task_names())
    assert isinstance(arithmetic, ReasoningGym) and arithmetic.roles == ("solver",)
    assert arithmetic.splits == ("train", "test")
    for env, name in ((arithmetic, "basic_arithmetic"), (spelling, "spell_backward")):
        theirs = reasoning_gym.create_dataset(name, size=40, seed=3)
        ours = sorted(take(env.samples(0), 40), key=lambda s: s["index"])
        assert [s["question"] for s in ours] == [e["question"] for e in theirs]
        assert [s["answer"] for s in ours] == [e["answer"] for e in theirs]
        assert {s["task"] for s in ours} == {name} and {s["split"] for s in ours} == {"train"}


def test_samples_are_fixed_by_seed(arithmetic):
    first = take(arithmetic.samples(0), 50)
    assert first == take(arithmetic.samples(0), 50)
    assert first != take(arithmetic.samples(1), 50)          # another order
    assert sorted(s["index"] for s in first[:40]) == list(range(40))  # each once per epoch
    assert [s["_epoch"] for s in first[39:41]] == [0, 1]
    again = load()
    assert take(again.samples(0), 50) == first              # a new environment, same samples
    other = load(seed=4)
    assert {s["question"] for s in take(other.samples(0), 40)} != {
        s["question"] for s in first[:40]}
    again.close()
    other.close()


def test_the_test_split_shares_no_question_with_train():
    # chain_sum seeds entry i with seed + i: a test seed one away replays training entries,
    # and the split leaves those out
    env = load("chain_sum", test_seed=4)
    train = {s["question"] for s in take(env.samples(0), 40)}
    test = list(env.split_samples("test"))
    shifted = reasoning_gym.create_dataset("chain_sum", size=40, seed=4)
    assert sum(e["question"] in train for e in shifted) > 20   # the overlap is real
    assert test and not train & {s["question"] for s in test}
    assert {s["split"] for s in test} == {"test"}
    assert list(env.split_samples("test")) == test           # stored order, every time
    env.close()
    default = load("chain_sum")
    train = {s["question"] for s in take(default.samples(0), 40)}
    test = list(default.split_samples("test"))
    assert len(test) == 20 and not train & {s["question"] for s in test}
    default.close()


# -- rewards ----------------------------------------------------------------------------------

def test_the_reward_is_the_tasks_own_score(arithmetic, spelling):
    for env, name in ((arithmetic, "basic_arithmetic"), (spelling, "spell_backward")):
        theirs = reasoning_gym.create_dataset(name, size=40, seed=3)
        sample = next(env.samples(0))
        entry = theirs[sample["index"]]
        wrong = sample["answer"][:-1] + ("x" if name == "spell_backward" else "9")
        if wrong == sample["answer"]:
            wrong = sample["answer"] + "1"
        for answer in (sample["answer"], wrong):
            trajectory = play(env, sample, scripted(answer))
            assert trajectory.error is None
            assert trajectory.rewards == {"solver": theirs.score_answer(answer, entry)}
            (call,) = trajectory.tool_calls
            assert call.name == "score" and call.args["answer"] == answer
    partial = play(spelling, sample, scripted(wrong)).rewards["solver"]
    assert 0.0 < partial < 1.0                            # the scorer's partial credit


def test_held_out_samples_are_scored_against_their_own_entries(arithmetic):
    sample = list(arithmetic.split_samples("test"))[0]
    assert play(arithmetic, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}


def test_chat_and_plain_prompts_and_the_answer_tag(arithmetic):
    sample = next(arithmetic.samples(0))
    policy = scripted(f"<think>easy</think>{sample['answer']}")
    assert play(arithmetic, sample, policy).rewards == {"solver": 1.0}
    prompt = policy.engine.prompts[0]
    assert prompt.startswith("<|im_start|>system\nAnswer the question.")
    assert sample["question"] in prompt and prompt.endswith("<|im_start|>assistant\n")

    model = plain(f"{sample['answer']}\nCalculate 1 + 1.")      # plain models run on
    assert play(arithmetic, sample, model).rewards == {"solver": 1.0}
    expected = model.tokenizer.encode(sample["question"] + "\nAnswer: ", add_special_tokens=False)
    assert model.engine.prompts[0] == tuple(expected)

    tagged = load(answer_tag=True)
    assert play(tagged, sample, scripted(f"I think <answer>{sample['answer']}</answer>")
                ).rewards == {"solver": 1.0}
    untagged = play(tagged, sample, scripted(sample["answer"]))
    assert untagged.rewards == {"solver": 0.0} and untagged.counts["no_answer"] == 1
    assert "<answer>" in tagged.system_prompt
    tagged.close()


@pytest.mark.parametrize("text, tag, first_line, answer", [
    (" 42 ", False, False, "42"),
    ("<think>hmm</think>\n 42", False, False, "42"),
    ("42\nmore text", False, True, "42"),
    ("<answer>1</answer> then <answer> 2 </answer>", True, False, "2"),
    ("<answer>1</answer> then <answer>2", True, False, "1"),   # an unclosed last tag
    ("no tag", True, False, None),
    ("   ", False, False, None),
])
def test_extract_answer(text, tag, first_line, answer):
    assert extract_answer(text, tag=tag, first_line=first_line) == answer


def test_a_composite_mix_draws_from_both_tasks():
    mix = load({"basic_arithmetic": 1, "spell_backward": 1}, size=60)
    samples = take(mix.samples(0), 60)
    assert {s["task"] for s in samples} == {"basic_arithmetic", "spell_backward"}
    assert mix.name == "ReasoningGym(basic_arithmetic+spell_backward)"
    for task in ("basic_arithmetic", "spell_backward"):
        sample = next(s for s in samples if s["task"] == task)
        assert play(mix, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}
    weighted = load([("basic_arithmetic", 1.0), ("spell_backward", 3.0, {"min_word_len": 3})],
                    size=200)
    tasks = [s["task"] for s in take(weighted.samples(0), 200)]
    assert tasks.count("spell_backward") > 2 * tasks.count("basic_arithmetic")
    mix.close()
    weighted.close()


# -- hostile answers and failing scorers ------------------------------------------------------

def test_a_hostile_answer_is_not_executed(tmp_path):
    """string_insertion's scorer evals any wrong answer: in-process that runs the model's code;
    through the environment the worker refuses it and the answer just scores 0."""
    env = load("string_insertion", size=5)
    sample = next(env.samples(0))
    entry = reasoning_gym.create_dataset("string_insertion", size=5, seed=3)[sample["index"]]
    hostile = {name: f"__import__('pathlib').Path({str(tmp_path / name)!r}).write_text('x')"
               for name in "ab"}
    hostile["c"] = f"__import__('os').system('touch {tmp_path / 'c'}')"
    reasoning_gym.create_dataset("string_insertion", size=5, seed=3).score_answer(
        hostile["a"], entry)
    assert (tmp_path / "a").exists()                          # the hazard is real
    for name in "bc":
        trajectory = play(env, sample, scripted(hostile[name]))
        assert trajectory.error is None and trajectory.rewards == {"solver": 0.0}
        assert not (tmp_path / name).exists()
    assert play(env, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}
    env.close()


FORGE = '{"score": 1.0, "error": null}\n'


def exec_answer(*lines):
    """An answer the scorer's eval runs as a whole program."""
    return f"exec({chr(10).join(lines)!r})"


def on_every_fd(write):
    return exec_answer("import os", "for fd in range(3, 40):", "    try:",
                       f"        {write}", "    except OSError:", "        pass", "os._exit(0)")


FORGE_BY_WRITE = on_every_fd(f"os.write(fd, {FORGE.encode()!r})")
FORGE_BY_OPEN = on_every_fd(f"open(fd, 'w', closefd=False).write({FORGE!r})")
FORGE_BY_FRAMES = exec_answer(
    "import os, sys", "f = sys._getframe()", "while f is not None:",
    "    for v in list(f.f_locals.values()):", "        if getattr(v, 'mode', None) == 'w':",
    f"            v.write({FORGE!r})", "            v.flush()", "            os._exit(0)",
    "    f = f.f_back")
PATCH = ("setattr(__import__('reasoning_gym').algorithmic.string_insertion."
         "StringInsertionDataset, 'score_answer', lambda *a: 1.0)")


@pytest.mark.parametrize("hostile", [
    # a forged result line on every descriptor the child might hold, then an exit before the
    # scorer's own line (unguarded, this scores 1)
    FORGE_BY_WRITE,
    FORGE_BY_OPEN,
    # the child's result channel found through the frames
    FORGE_BY_FRAMES,
    "__import__('subprocess').run(['touch', {touched!r}])",
    "__import__('os').posix_spawn('/bin/touch', ['touch', {touched!r}], {{}})",
    PATCH,      # patches the scorer: the next answer is scored by a fresh child
])
def test_hostile_answers_score_zero_and_leave_the_next_score_alone(hostile, tmp_path):
    env = load("string_insertion", size=5)
    sample = next(env.samples(0))
    touched = tmp_path / "touched"
    answer = hostile.format(touched=str(touched)) if "touched" in hostile else hostile
    assert play(env, sample, scripted(answer)).rewards == {"solver": 0.0}
    assert not touched.exists()
    wrong = play(env, sample, scripted(sample["answer"] + "x"))
    assert wrong.error is None and wrong.rewards == {"solver": 0.0}
    assert play(env, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}
    env.close()


STRING_CASES = [("8", "8"), ("8.", "8"), (" 8", "8"), ("18", "8"), ("7", "8"), ("", "8"),
                ("-12", "-12"), ("12", "-12"), ("x-12y", "-12"), ("anything", ""),
                ("True", "True"), ("true", "True"), ("Yes, True!", "True")]


@pytest.mark.parametrize("answer, gold", STRING_CASES)
def test_string_score_is_reasoning_gyms_default_rule(answer, gold):
    from reasoning_gym.dataset import ProceduralDataset

    expected = ProceduralDataset.score_answer(None, answer, {"answer": gold})  # the reference
    assert string_score(answer, gold) == expected
    hand = {("8", "8"): 1.0, ("8.", "8"): 0.5, ("18", "8"): 0.5, ("7", "8"): 0.0,
            ("x-12y", "-12"): 0.6, ("Yes, True!", "True"): 0.4}
    if (answer, gold) in hand:
        assert expected == hand[(answer, gold)]


def test_tasks_that_only_compare_strings_skip_the_worker_and_score_as_it_does(arithmetic,
                                                                                spelling):
    assert compares_strings("basic_arithmetic") and compares_strings("letter_counting")
    assert not compares_strings("spell_backward") and not compares_strings("string_insertion")
    assert arithmetic.compared == {"basic_arithmetic"} and spelling.compared == frozenset()
    env = load()
    env.scorer = FailingScorer(ScoreError("the worker was asked"))   # never reached
    for sample in take(env.samples(0), 6):
        for answer in (sample["answer"], sample["answer"] + ".", "0", "x" + sample["answer"]):
            trajectory = play(env, sample, scripted(answer))
            worker = anyio.run(arithmetic.scorer.score, "train", sample["index"], answer)
            assert trajectory.error is None
            assert trajectory.rewards == {"solver": worker[0]}, (answer, sample["answer"])
    mix = load({"basic_arithmetic": 1, "spell_backward": 1})
    assert mix.compared == {"basic_arithmetic"}
    mix.close()


class FailingScorer:
    def __init__(self, outcome):
        self.outcome = outcome

    async def score(self, split, index, answer):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def close(self):
        pass


def test_a_scorer_that_raises_fails_its_episode_only(spelling):
    env = load("spell_backward")   # overrides score_answer: scored by the worker
    sample = next(env.samples(0))
    env.scorer = FailingScorer((0.0, "ValueError: cannot read it"))
    failed = play(env, sample, scripted("7"))
    assert "ScoreError" in failed.error and "cannot read it" in failed.error
    assert play(spelling, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}
    env.scorer = FailingScorer(ScoreTimeout("too slow"))
    slow = play(env, sample, scripted("7"))
    assert slow.error is None and slow.rewards == {"solver": 0.0}
    assert slow.counts["score_timeout"] == 1


def test_the_real_scorer_times_out_then_restarts(arithmetic):
    scorer = Scorer(arithmetic.spec, timeout=1e-9)
    sample = next(arithmetic.samples(0))
    with pytest.raises(ScoreTimeout, match="the worker was restarted"):
        anyio.run(scorer.score, "train", sample["index"], sample["answer"])
    scorer.timeout = 30.0
    assert anyio.run(scorer.score, "train", sample["index"], sample["answer"]) == (1.0, None)
    scorer.close()
    bad = Scorer({**arithmetic.spec, "tasks": [["no_such_task", 1.0, {}]]})
    with pytest.raises(ScoreError, match="cannot build the datasets"):
        anyio.run(bad.score, "train", 0, "1")


# -- arguments --------------------------------------------------------------------------------

def test_unknown_task_names_list_the_closest():
    with pytest.raises(ValueError, match=r"no task 'basic_arithmatic' \(closest: basic_arith"):
        load("basic_arithmatic")
    with pytest.raises(ValueError, match="no task 'spel_backwards'.*spell_backward"):
        load({"basic_arithmetic": 1, "spel_backwards": 1})
    with pytest.raises(ValueError, match="task_names"):
        load("zzzzzz")
    with pytest.raises(ValueError, match="weights must be > 0"):
        load({"basic_arithmetic": 0})
    with pytest.raises(ValueError, match="test_seed must differ"):
        load(test_seed=3)
    with pytest.raises(ValueError, match="config is for a single task"):
        load([("chain_sum", 1)], config={"min_terms": 2})
    with pytest.raises(ValueError, match="size and test_size"):
        load(size=0)


# -- training ---------------------------------------------------------------------------------

def test_a_short_training_run(tmp_path):
    env = load("basic_arithmetic", sampling={"max_new_tokens": 8})
    with ab.Session(tmp_path, trainer="thread") as session:
        policy = session.policy("solver", ab.models.tiny_chat(hidden_size=32, num_heads=2),
                                algorithm=ab.GRPO(filter_groups=False))
        session.wire(env, solver=policy)
        run = session.train(steps=3, batch_size=16, group_size=8, max_staleness=1)
        run.wait(progress=False)
    assert len(run.metrics) == 3
    assert run.episodes and all(e.error is None for e in run.episodes)
    assert {c["name"] for e in run.episodes for c in e.tool_calls} <= {"score"}
    env.close()


# -- README's table of what each library's environments can do --------------------------------

def readme_row(library):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("| library |")
             or line.startswith(f"| {library} |")]
    header, row = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return dict(zip(header, row, strict=True))


def test_the_readme_table_row_is_true(spelling):
    row = readme_row("reasoning-gym")
    sample = next(spelling.samples(0))
    wrong = sample["answer"][:-1] + "x"
    policy = scripted(wrong)
    trajectory = play(spelling, sample, policy)
    assert row["multi-turn"].startswith("no") and len(trajectory.turns) == 1
    assert row["tools"] == "no" and "<tools>" not in policy.engine.prompts[0]
    assert [c.name for c in trajectory.tool_calls] == ["score"]     # the scorer, not the model's
    assert row["multi-agent"].startswith("no") and spelling.roles == ("solver",)
    assert row["streaming"].startswith("no")
    assert row["partial rewards"].startswith("yes") and 0 < trajectory.rewards["solver"] < 1


def test_an_answer_that_hangs_its_scorer_times_out_and_the_next_one_is_scored():
    env = load("string_insertion", size=5, score_timeout=1.0)
    sample = next(env.samples(0))
    hung = play(env, sample, scripted(exec_answer("while True:", "    pass")))
    assert hung.error is None and hung.rewards == {"solver": 0.0}
    assert hung.counts["score_timeout"] == 1
    assert play(env, sample, scripted(sample["answer"])).rewards == {"solver": 1.0}
    env.close()
