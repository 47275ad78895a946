"""The math environments: answer extraction, the calculator, the math-verify worker (right, wrong,
equivalent, hanging) and every mode's rewards, played through the real EpisodeContext with a
tiny chat tokenizer and engines that answer from a script. No model, no download."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import astranb_math.verify as verify_module
import pytest
from astranb_math import (
    AnswerVerifier,
    Math,
    MathActorVerifier,
    Verdict,
    VerifierUnavailable,
    calculator,
    extract_answer,
    gold_answer,
    read_verdict,
)
from astranb_math._verify_worker import HANG_FOR_TESTS

import astranb as ab
from astranb.data import DataError, DataSource
from astranb.weights.publish import StatePublisher

GSM8K = [  # GSM8K's format: the solution ends with a "#### answer" line
    {"question": "Tom has 3 boxes of 4 apples. How many apples?",
     "answer": "3 boxes of 4 is 3*4 = 12 apples.\n#### 12"},
    {"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"},
    {"question": "What is 12 * 7?", "answer": "#### 84"},
]
MATH = [  # MATH's format: "problem" and a "solution" with the answer in \boxed{}
    {"problem": "What is $\\frac{2}{4}$ in lowest terms?",
     "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "Solve $x+1=3$.", "solution": "So $x = \\boxed{2}$.", "level": "Level 1"},
]
MATH_COLUMNS = {"question": "problem", "answer": "solution"}


# -- reading answers --------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer", [
    ("so the answer is \\boxed{72}.", "72"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                       # nested braces
    ("first \\boxed{3}, no wait: \\boxed{ \\sqrt{2} }", "\\sqrt{2}"),  # the last box, stripped
    ("\\boxed{5} and then \\boxed{6", "5"),                          # an unclosed box is skipped
    ("\\fbox{7}", "7"),
    ("48 + 24 = 72\n#### 72", "72"),                                 # GSM8K style
    ("#### 1,000.\nthat's it", "1,000"),
    ("\\boxed{9}\n#### 8", "9"),                                     # a box wins over ####
    ("so 5 + 7 = 12.\nAnswer: $12$", "12"),                          # DAPO-Math's form
    ("answer: 3/4.\nthanks", "3/4"),
    ("the answer is 72", None),
    ("\\boxed{}", None),
    ("", None),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_gold_answer_from_each_dataset_format():
    assert gold_answer(GSM8K[0]["answer"]) == "12"
    assert gold_answer(MATH[0]["solution"]) == "\\frac{1}{2}"
    assert gold_answer(" 42 ") == "42" and gold_answer(42) == "42"   # DeepScaleR, DAPO: bare
    for empty in ("", "#### ", "\\boxed{}"):
        with pytest.raises(ValueError, match="no gold answer"):
            gold_answer(empty)


# -- the calculator ---------------------------------------------------------------------------

@pytest.mark.parametrize("expression, result", [
    ("12 * 7", "84"),
    ("(12 + 7) * 3 / 4", "14.25"),
    ("2^10", "1024"),                      # ^ is a power, as people write it
    ("2 ** 0.5", "1.41421356237"),
    ("-(3 - 5) * --2", "4"),
    ("7 // 2 + 7 % 2", "4"),
    ("10 / 4", "2.5"),
    ("6 / 3", "2"),
    ("10**100", str(10**100)),             # the largest value allowed
])
def test_calculator(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "a function call is not allowed"),
    ("().__class__", "'().__class__' is not allowed"),
    ("x + 1", "the name 'x' is not allowed"),
    ("'a' * 3", "'a' is not a number"),
    ("True + 1", "True is not a number"),
    ("1 < 2", "'1 < 2' is not allowed"),
    ("1 << 10", "the operator LShift is not allowed"),
    ("lambda: 1", "'lambda: 1' is not allowed"),
    ("[1] * 10", "'[1]' is not allowed"),
    ("9**9**9", "the exponent 387420489 is too large"),
    ("2**2000", "the exponent 2000 is too large"),
    ("10**101", "the result is too large"),
    ("7**200", "the result is too large"),   # checked before it is computed
    ("10**100 * 10", "the result is too large"),
    ("1e999", "the result is too large"),
    ("0.5 ** -1000", "the result is too large"),
    ("1 / 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** (1/3)", "not a real number"),
    ("1,000 + 1", "a comma (write 1000, not 1,000) is not allowed"),
    ("2 +", "not an arithmetic expression"),
    ("1" * 201, "the limit is 200"),
    ("1j", "1j is not a number"),
])
def test_calculator_refuses_hostile_input_with_an_error_string(expression, error):
    answer = calculator(expression)
    assert answer.startswith("error: ") and error in answer


def test_calculator_wants_a_string():
    assert calculator(12) == "error: expression must be a string, got int"


# -- the verifier worker ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def verifier():
    checker = AnswerVerifier(timeout=10.0)
    yield checker
    checker.close()


@pytest.mark.parametrize("answer, gold, correct", [
    ("72", "72", True),
    ("73", "72", False),
    ("0.5", "\\frac{1}{2}", True),             # equivalent forms
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("1,000", "1000", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("x + 1", "1 + x", True),
    ("\\frac{1}{3}", "0.33", False),
    ("banana", "72", False),
])
def test_verifier_checks_answers(verifier, answer, gold, correct):
    assert anyio.run(verifier.check, answer, gold) == Verdict(correct)


def test_verifier_reports_an_unreadable_gold_answer_and_an_overlong_answer(verifier):
    verdict = anyio.run(verifier.check, "5", "")
    assert not verdict.correct and "cannot read the gold answer ''" in verdict.error
    verdict = anyio.run(verifier.check, "1" * 1001, "1")
    assert not verdict.correct and "1001 characters" in verdict.error


def test_concurrent_checks_each_get_their_own_verdict(verifier):
    results = {}

    async def check(i):
        results[i] = await verifier.check(str(i), "3")

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(check, i)

    anyio.run(main)
    assert {i: v.correct for i, v in results.items()} == {i: i == 3 for i in range(6)}


@pytest.mark.slow  # waits out the check's time limit
def test_a_hanging_check_times_out_scores_zero_and_the_next_call_works(monkeypatch):
    monkeypatch.setenv(HANG_FOR_TESTS, "\\hang")
    checker = AnswerVerifier(timeout=1.0)
    try:
        assert anyio.run(checker.check, "2", "2") == Verdict(True)
        hung_pid = checker._workers[0].proc.pid
        verdict = anyio.run(checker.check, "\\hang", "2")
        assert verdict.timed_out and not verdict.correct
        assert "longer than 1 s" in verdict.error and "restarted" in verdict.error
        with pytest.raises(ProcessLookupError):   # killed and reaped: not even a zombie
            os.kill(hung_pid, 0)
        assert anyio.run(checker.check, "4", "2+2") == Verdict(True)   # a fresh worker
        live_pid = checker._workers[0].proc.pid
        assert live_pid != hung_pid
    finally:
        checker.close()
    with pytest.raises(ProcessLookupError):
        os.kill(live_pid, 0)


def test_workers_stop_when_the_program_exits_without_close():
    # a program that checks one answer and exits without close(): the worker must be gone
    # (verify.py loaded on its own: importing the package would import astranb and torch)
    code = ("import importlib.util, sys, anyio\n"
            f"spec = importlib.util.spec_from_file_location('verify', {verify_module.__file__!r})\n"
            "module = sys.modules['verify'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "v = module.AnswerVerifier()\n"
            "assert anyio.run(v.check, '1/2', '0.5').correct\n"
            "print(v._workers[0].proc.pid)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    with pytest.raises(ProcessLookupError):
        os.kill(int(done.stdout.strip()), 0)


def test_a_worker_that_cannot_load_math_verify_is_a_setup_error(tmp_path, monkeypatch):
    (tmp_path / "math_verify.py").write_text("raise ImportError('broken for this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    checker = AnswerVerifier()
    with pytest.raises(VerifierUnavailable, match="broken for this test.*pip install math-verify"):
        anyio.run(checker.check, "1", "1")
    checker.close()


def test_verifier_arguments():
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        AnswerVerifier(timeout=0)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        AnswerVerifier(workers=0)


# -- episodes through the real EpisodeContext -------------------------------------------------

TOKENIZER = ab.models.tiny_chat().tokenizer()


class ScriptedEngine:
    """Completes each prompt with the next scripted text (then EOS), and keeps the prompts."""

    def __init__(self, texts):
        self.texts, self.prompts = list(texts), []

    async def generate(self, request):
        self.prompts.append(TOKENIZER.decode(list(request.prompt_ids), skip_special_tokens=False))
        ids = (*TOKENIZER.encode(self.texts.pop(0), add_special_tokens=False),
               TOKENIZER.eos_token_id)
        ids = ids[:request.sampling.max_new_tokens]
        return ab.Generation(request.prompt_ids, ids, (-1.0,) * len(ids), (0,) * len(ids),
                             "stop" if ids[-1] == TOKENIZER.eos_token_id else "length",
                             text=TOKENIZER.decode(list(ids), skip_special_tokens=True))


def scripted(name, *texts):
    engine = ScriptedEngine(texts)
    return ab.Policy(name, ab.models.tiny_chat(), ab.GRPO(), ab.AdamWConfig(), engine, None,
                     StatePublisher(name, engine, None), TOKENIZER)


def play(env, sample, **wiring):
    return anyio.run(ab.play_episode, env, wiring, sample)


def tool_messages(policy):
    """Every <tool_response> block of the policy's last prompt, in order."""
    prompt = policy.engine.prompts[-1]
    return [part.split("\n</tool_response>")[0] for part in prompt.split("<tool_response>\n")[1:]]


@pytest.fixture(scope="module")
def gsm8k(verifier):
    return lambda **kw: Math(GSM8K, verifier=verifier, **kw)


@pytest.mark.parametrize("completion, reward, counts", [
    ("3*4 = 12, so \\boxed{12}", 1.0, {}),
    ("<think>maybe \\boxed{11}</think>It is \\boxed{12}.", 1.0, {}),   # the content decides
    ("<think>it is \\boxed{12}</think>I am not sure.", 0.0, {"no_answer": 1}),
    ("3*4 = 12\n#### 12", 1.0, {}),
    ("\\boxed{12.0}", 1.0, {}),
    ("\\boxed{13}", 0.0, {}),
    ("twelve", 0.0, {"no_answer": 1}),
])
def test_single_mode(gsm8k, completion, reward, counts):
    policy = scripted("p", completion)
    trajectory = play(gsm8k(), GSM8K[0], solver=policy)
    assert trajectory.rewards == {"solver": reward}
    assert dict(trajectory.counts) == {"retokenized": 0, **counts}
    assert trajectory.error is None and trajectory.truncated is None
    prompt = policy.engine.prompts[0]
    assert prompt.startswith("<|im_start|>system\nSolve the math problem.")
    assert "Tom has 3 boxes" in prompt and prompt.endswith("<|im_start|>assistant\n")
    if "no_answer" not in counts:     # the check is a recorded tool call, "verify"
        (call,) = trajectory.tool_calls
        assert call.name == "verify" and call.args["gold"] == "12"
        assert call.result == {"correct": bool(reward), "timed_out": False, "error": None}


def test_single_mode_on_math_style_data(verifier):
    env = Math(MATH, columns=MATH_COLUMNS, verifier=verifier)
    sample = next(env.split_samples("train"))
    one_half = [s for s in env.data.rows("train") if "frac" in s["answer"]][0]
    assert play(env, one_half, solver=scripted("p", "\\boxed{0.5}")).rewards == {"solver": 1.0}
    assert set(sample) >= {"question", "answer", "level", "_epoch", "_index"}


@pytest.mark.parametrize("completions, reward, feedback", [
    (["\\boxed{12}"], 1.0, None),                                   # right at once: one turn
    (["\\boxed{11}", "\\boxed{12}"], 0.5, "Your answer 11 is not correct"),
    (["no idea", "\\boxed{12}"], 0.5, "I could not find a final answer"),
    (["\\boxed{11}", "\\boxed{10}"], 0.0, "Your answer 11 is not correct"),
])
def test_retry_mode(gsm8k, completions, reward, feedback):
    policy = scripted("p", *completions)
    trajectory = play(gsm8k(mode="retry"), GSM8K[0], solver=policy)
    assert trajectory.rewards == {"solver": reward}
    assert len(trajectory.turns) == len(completions)
    if feedback:   # the retry sees its first try and the feedback
        retry_prompt = policy.engine.prompts[1]
        assert completions[0] in retry_prompt and f"user\n{feedback}" in retry_prompt


def test_retry_discount_is_an_argument(gsm8k):
    policy = scripted("p", "\\boxed{11}", "\\boxed{12}")
    assert play(gsm8k(mode="retry", retry_discount=0.25), GSM8K[0],
                solver=policy).rewards == {"solver": 0.25}


def call(expression):
    return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
            + expression + '"}}\n</tool_call>')


def test_tools_mode_calls_the_calculator_then_answers(gsm8k):
    policy = scripted("p", call("12 * 7"), "So \\boxed{84}")
    trajectory = play(gsm8k(mode="tools"), GSM8K[2], solver=policy)
    assert trajectory.rewards == {"solver": 1.0} and len(trajectory.turns) == 2
    assert tool_messages(policy) == ["84"]
    assert [(c.name, c.args, c.result) for c in trajectory.tool_calls][0] == (
        "calculator", {"expression": "12 * 7"}, "84")
    assert '"name": "calculator"' in policy.engine.prompts[0]   # the schema is in the prompt


def test_tools_mode_several_calls_and_hostile_input(gsm8k):
    policy = scripted("p", call("3 * 4"), call("__import__(1)") + call("9**9**9"),
                      "\\boxed{12}")
    trajectory = play(gsm8k(mode="tools"), GSM8K[0], solver=policy)
    assert trajectory.rewards == {"solver": 1.0} and trajectory.error is None
    messages = tool_messages(policy)
    assert messages[0] == "12" and "a function call is not allowed" in messages[1]
    assert "the exponent 387420489 is too large" in messages[2]


def test_tools_mode_malformed_and_unknown_calls_are_shown_to_the_model(gsm8k):
    policy = scripted("p", '<tool_call>\n{"name": "calculator", "arguments": {"expr\n</tool_call>',
                      '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
                      "\\boxed{84}")
    trajectory = play(gsm8k(mode="tools"), GSM8K[2], solver=policy)
    assert trajectory.rewards == {"solver": 1.0} and trajectory.error is None
    assert trajectory.counts["malformed_tool_calls"] == 1
    malformed, unknown = tool_messages(policy)
    assert malformed.startswith("error: malformed tool call: the tool call is not valid JSON")
    assert unknown == "error: unknown tool 'search'; the tools are ['calculator']"


def test_tools_mode_a_raising_tool_ends_nothing(verifier):
    def lookup(key: str) -> str:
        """Look a constant up."""
        raise KeyError(key)

    env = Math(GSM8K, mode="tools", tools=[calculator, lookup], verifier=verifier)
    policy = scripted("p", '<tool_call>\n{"name": "lookup", "arguments": {"key": "pi"}}\n'
                           "</tool_call>", "\\boxed{84}")
    trajectory = play(env, GSM8K[2], solver=policy)
    assert trajectory.rewards == {"solver": 1.0} and trajectory.counts["tool_errors"] == 1
    assert tool_messages(policy) == ["error: KeyError: 'pi'"]
    assert trajectory.tool_calls[0].error == "KeyError: 'pi'"


def test_tools_mode_runs_out_of_turns(gsm8k):
    policy = scripted("p", call("1 + 1"), call("2 + 2"), call("4 + 4"))
    trajectory = play(gsm8k(mode="tools", max_turns=3), GSM8K[0], solver=policy)
    assert trajectory.rewards == {"solver": 0.0} and len(trajectory.turns) == 3
    assert trajectory.counts == {"retokenized": 0, "out_of_turns": 1, "no_answer": 1}
    assert [c.name for c in trajectory.tool_calls] == ["calculator", "calculator"]


def test_truncation_by_the_token_budget_ends_the_episode(gsm8k):
    # a call is 22 tokens + EOS: the first turn spends 23 of the 30, the second is cut at the 7
    # left (an unclosed call: malformed), and the third would pass the budget: truncated
    assert len(TOKENIZER.encode(call("1 + 1"), add_special_tokens=False)) == 22
    env = gsm8k(mode="tools", max_episode_tokens=30)
    policy = scripted("p", call("1 + 1"), call("2 + 2"), "\\boxed{12}")
    trajectory = play(env, GSM8K[0], solver=policy)
    assert trajectory.error is None and trajectory.rewards == {"solver": 0.0}
    assert trajectory.truncated == "budget: 30 tokens sampled, max_episode_tokens=30"
    assert [len(t.generation.completion_ids) for t in trajectory.turns] == [23, 7]
    assert [t.generation.finish_reason for t in trajectory.turns] == ["stop", "length"]
    assert [c.result for c in trajectory.tool_calls] == ["2"]


def test_truncation_by_the_context(gsm8k):
    long_question = {"question": "why? " * 2000, "answer": "#### 1"}
    policy = scripted("p", "\\boxed{1}")
    trajectory = play(gsm8k(), long_question, solver=policy)
    assert trajectory.truncated.startswith("context: ") and trajectory.rewards == {"solver": 0.0}
    assert trajectory.turns == () and policy.engine.prompts == []


@pytest.mark.slow  # waits out a check's time limit
def test_a_verify_timeout_ends_only_its_own_episode(monkeypatch):
    monkeypatch.setenv(HANG_FOR_TESTS, "99")
    checker = AnswerVerifier(timeout=1.0)
    env = Math(GSM8K, verifier=checker)
    answers = {0: "\\boxed{12}", 1: "\\boxed{99}", 2: "\\boxed{84}"}
    results = {}

    async def one(i):
        results[i] = await ab.play_episode(env, {"solver": scripted(f"p{i}", answers[i])},
                                           GSM8K[i])

    async def main():
        async with anyio.create_task_group() as tg:
            for i in answers:
                tg.start_soon(one, i)

    try:
        anyio.run(main)
    finally:
        checker.close()
    assert results[1].rewards == {"solver": 0.0}
    assert results[1].counts == {"retokenized": 0, "verify_timeout": 1}
    assert results[1].error is None
    assert results[1].tool_calls[0].result["timed_out"] is True
    assert "longer than 1 s" in results[1].tool_calls[0].result["error"]
    assert results[0].rewards == {"solver": 1.0} and results[2].rewards == {"solver": 1.0}
    assert results[0].counts == results[2].counts == {"retokenized": 0}


def test_a_sample_without_a_gold_answer_fails_its_episode_only(gsm8k):
    trajectory = play(gsm8k(), {"question": "q", "answer": ""}, solver=scripted("p", "x"))
    assert "no gold answer" in trajectory.error and trajectory.rewards == {}


# -- the actor and the verifier ---------------------------------------------------------------

@pytest.mark.parametrize("actor, verifier_says, rewards", [
    (["\\boxed{12}"], "Looks right. \\boxed{yes}", {"actor": 1.0, "verifier": 1.0}),
    (["\\boxed{11}", "\\boxed{12}"], "\\boxed{no}", {"actor": 0.5, "verifier": 0.75}),
    (["\\boxed{12}", "\\boxed{12}"], "\\boxed{no}", {"actor": 1.0, "verifier": 0.5}),
    (["\\boxed{12}", "\\boxed{13}"], "\\boxed{no}", {"actor": 0.0, "verifier": 0.0}),
    (["\\boxed{11}"], "\\boxed{yes}", {"actor": 0.0, "verifier": 0.0}),
    (["\\boxed{11}", "\\boxed{10}"], "\\boxed{\\text{no}}", {"actor": 0.0, "verifier": 0.5}),
    (["\\boxed{11}", "\\boxed{12}"], "hmm", {"actor": 0.5, "verifier": 0.25}),
])
def test_actor_verifier_rewards(verifier, actor, verifier_says, rewards):
    env = MathActorVerifier(GSM8K, verifier=verifier)
    alice, bob = scripted("alice", *actor), scripted("bob", verifier_says)
    trajectory = play(env, GSM8K[0], actor=alice, verifier=bob)
    assert trajectory.rewards == rewards and trajectory.error is None
    assert [(t.role, t.policy) for t in trajectory.turns] == [
        ("actor", "alice"), ("verifier", "bob"), ("actor", "alice")][: 1 + len(actor)]
    assert trajectory.counts.get("no_verdict", 0) == (verifier_says == "hmm")
    review = bob.engine.prompts[0]   # the verifier reads the problem and the actor's solution
    assert "You check solutions" in review and "Tom has 3 boxes" in review
    assert f"Proposed solution:\n{actor[0]}" in review
    if len(actor) == 2:              # the rejected actor reads the reply
        retry_prompt = alice.engine.prompts[1]
        assert f"A reviewer thinks your answer is wrong:\n{verifier_says}" in retry_prompt


def test_actor_verifier_lazy_fixed_point_earns_less_than_honest_play(verifier):
    env = MathActorVerifier(GSM8K, verifier=verifier)
    golds = [gold_answer(s["answer"]) for s in GSM8K]

    def mean(rewards):
        return {role: sum(r[role] for r in rewards) / len(rewards) for role in env.roles}

    lazy, honest = [], []
    for sample, gold in zip(GSM8K, golds, strict=True):
        lazy.append(play(env, sample, actor=scripted("a", "\\boxed{0}", f"\\boxed{{{gold}}}"),
                         verifier=scripted("v", "\\boxed{no}")).rewards)
        honest.append(play(env, sample, actor=scripted("a", f"\\boxed{{{gold}}}"),
                           verifier=scripted("v", "\\boxed{yes}")).rewards)
    assert mean(lazy) == {"actor": 0.5, "verifier": 0.75}
    assert mean(honest) == {"actor": 1.0, "verifier": 1.0}


def test_read_verdict():
    assert read_verdict("fine \\boxed{yes}") == "y" and read_verdict("\\boxed{Correct.}") == "y"
    assert read_verdict("\\boxed{\\text{No}}") == "n" and read_verdict("#### wrong") == "n"
    assert read_verdict("yes") is None and read_verdict("\\boxed{maybe}") is None


# -- data, splits, registry -------------------------------------------------------------------

def test_splits_and_evaluation_order(tmp_path, verifier):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K * 4))  # 12 rows
    env = Math(path, test_size=4, verifier=verifier)
    assert env.splits == ("train", "test")
    first = [s["_index"] for s, _ in zip(env.split_samples("test", seed=5), range(6),
                                         strict=False)]
    assert first == [0, 1, 2, 3, 0, 1]                     # stored order, every epoch
    train = [s["_index"] for s, _ in zip(env.samples(seed=5), range(8), strict=False)]
    assert sorted(train) == list(range(8))                 # shuffled, each row once
    with pytest.raises(DataError, match=r"no split 'validation'; this data has \['train', "
                                        r"'test'\]"):
        next(env.split_samples("validation"))


def test_missing_columns_fail_when_the_environment_is_built(verifier):
    with pytest.raises(DataError, match=r"field 'question' reads column 'question'.*"
                                        r"\['level', 'problem', 'solution'\]"):
        Math(MATH, verifier=verifier)
    with pytest.raises(DataError, match=r"field 'answer' reads column 'soluton'"):
        Math(MATH, columns={"question": "problem", "answer": "soluton"}, verifier=verifier)
    source = DataSource(MATH)
    with pytest.raises(DataError, match=r"no \['question', 'answer'\]"):
        Math(source, verifier=verifier)
    with pytest.raises(ValueError, match="give them to DataSource"):
        Math(source, columns=MATH_COLUMNS, verifier=verifier)
    assert Math(DataSource(MATH, columns=MATH_COLUMNS), verifier=verifier).splits == ("train",)


def test_bad_arguments(verifier):
    with pytest.raises(ValueError, match=r"mode must be one of \('single', 'retry', 'tools'\)"):
        Math(GSM8K, mode="chat", verifier=verifier)
    with pytest.raises(ValueError, match="retry_discount must be in"):
        Math(GSM8K, retry_discount=2, verifier=verifier)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        Math(GSM8K, max_turns=0, verifier=verifier)
    with pytest.raises(ValueError, match="needs at least one tool"):
        Math(GSM8K, mode="tools", tools=[], verifier=verifier)
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['temp'\]"):
        Math(GSM8K, sampling={"temp": 0.5}, verifier=verifier)
    with pytest.raises(ValueError, match="team_weight must be in"):
        MathActorVerifier(GSM8K, team_weight=-1, verifier=verifier)
    env = Math(GSM8K, sampling={"temperature": 0.5, "max_new_tokens": 64}, verifier=verifier)
    assert (env.sampling.temperature, env.sampling.max_new_tokens) == (0.5, 64)


def test_loads_by_name(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH))
    env = ab.environments.load("math", data=str(path), columns=MATH_COLUMNS, mode="retry")
    assert isinstance(env, Math) and env.mode == "retry" and env.roles == ("solver",)
    pair = ab.environments.load("math_actor_verifier", data=str(path), columns=MATH_COLUMNS)
    assert pair.roles == ("actor", "verifier")
    assert {"math", "math_actor_verifier"} <= set(ab.environments.available())
    env.close()
    pair.close()
