"""Write the tokenizer of `astranb.models.tiny_chat()` to astranb/assets/tiny_chat/.

    .venv/bin/python scripts/make_tiny_chat.py           # rewrite the shipped files
    .venv/bin/python scripts/make_tiny_chat.py --check   # exit 1 if they are not current

The tokenizer is a byte-level BPE trained here, on text this script generates from one seeded
random.Random: chat transcripts in the tiny chat template (arithmetic questions, word problems
solved with a calculator tool, answers such as "The answer is \\boxed{85}." and "#### 85"), plain
English sentences, numbers and bits of LaTeX. Numbers are split into single digits before BPE, so
no merge ever spans two digits and a small model can copy a number digit by digit. Every step is
deterministic, so rerunning `build` gives the shipped files byte for byte (tests check it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from astranb.chat import CHAT_TEMPLATE, tool_schema

ASSETS = Path(__file__).resolve().parent.parent / "astranb" / "assets" / "tiny_chat"
FILES = ("tokenizer.json", "tokenizer_config.json")

PAD, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL = (PAD, START, END)
"""Control tokens: skipped when a completion is decoded for display."""
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
         "</think>")
"""Single tokens that stay in decoded text (a parser reads them)."""
VOCAB_SIZE = 1024
MAX_LENGTH = 1024
SEED = 0
CONVERSATIONS = 3000
SENTENCES = 1500


# -- the corpus -----------------------------------------------------------------------------------

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: the expression, with + - * / and parentheses, such as "12 * (3 + 4)".
    """
    raise NotImplementedError  # only its schema is used here


def convert_units(value: float, unit: str, to: str) -> str:
    """Convert a quantity from one unit to another.

    Args:
        value: the amount to convert.
        unit: the unit it is in, such as "km".
        to: the unit wanted, such as "m".
    """
    raise NotImplementedError


TOOLS = [tool_schema(calculator), tool_schema(convert_units)]
NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena",
         "Max", "Nora", "Omar", "Priya", "Sam", "Tara", "Yusuf", "Zoe", "Mia"]
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "cards",
          "shells", "stamps", "eggs", "flowers", "toys", "boxes", "tickets", "oranges"]
SYSTEMS = ["You are a helpful assistant.",
           "You are a careful math tutor. Put the final answer in \\boxed{}.",
           "Solve the problem step by step. End with the final answer after ####.",
           "Answer briefly."]
ADJECTIVES = ["small", "quiet", "bright", "old", "green", "quick", "heavy", "warm", "tall",
              "happy", "busy", "cold", "round", "soft", "long", "new"]
NOUNS = ["dog", "river", "teacher", "garden", "window", "city", "train", "bird", "student",
         "house", "road", "market", "friend", "cloud", "village", "kitchen"]
VERBS = ["walks past", "looks at", "waits near", "runs to", "sits by", "moves toward",
         "reads about", "listens to", "thinks about", "writes about"]
PLACES = ["in the morning", "after school", "before dinner", "on Monday", "every week",
          "at the station", "near the park", "in winter", "at noon", "by the sea"]


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(word problem, calculator expression, answer)."""
    name, other = rng.sample(NAMES, 2)
    things = rng.choice(THINGS)
    a, b = rng.randint(2, 99), rng.randint(2, 60)
    kind = rng.randrange(5)
    if kind == 0:
        return (f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have "
                "now?", f"{a} + {b}", a + b)
    if kind == 1:
        a = a + b
        return (f"{name} had {a} {things} and gave {b} to {other}. How many {things} are left?",
                f"{a} - {b}", a - b)
    if kind == 2:
        b = b % 12 + 2
        return (f"A bag holds {a} {things}. How many {things} are in {b} bags?", f"{a} * {b}",
                a * b)
    if kind == 3:
        b = b % 9 + 2
        return (f"{name} shares {a * b} {things} equally among {b} friends. How many {things} "
                "does each friend get?", f"{a * b} / {b}", a)
    c = rng.randint(2, 9)
    return (f"{name} buys {c} packs of {a} {things} and {b} single {things}. How many {things} "
            "is that in total?", f"{c} * {a} + {b}", c * a + b)


def _final(rng: random.Random, answer: int) -> str:
    return rng.choice([f"The answer is \\boxed{{{answer}}}.", f"#### {answer}",
                       f"So the total is {answer}.\n#### {answer}",
                       f"That makes {answer}. The answer is \\boxed{{{answer}}}."])


def _arithmetic_chat(rng: random.Random) -> list[dict]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.",
                           f"{a} {op} {b} = ?", f"Please calculate {a}{op}{b}."])
    answer = f"{a} {op} {b} = {result}. " + _final(rng, result)
    if rng.random() < 0.3:
        answer = f"<think>\nI need {a} {op} {b}. That is {result}.\n</think>\n\n" + answer
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return messages


def _tool_chat(rng: random.Random) -> list[dict]:
    problem, expression, answer = _problem(rng)
    call = {"name": "calculator", "arguments": {"expression": expression}}
    opening = rng.choice(["", "", "Let me compute it.",
                          f"<think>\nI should work out {expression}.\n</think>"])
    messages = [
        {"role": "user", "content": problem},
        {"role": "assistant", "content": opening, "tool_calls": [{"function": call}]},
        {"role": "tool", "content": str(answer)},
        {"role": "assistant", "content": _final(rng, answer)},
    ]
    if rng.random() < 0.15:  # two calls in one message, answered in one user block
        second = {"name": "convert_units", "arguments": {"value": answer, "unit": "km",
                                                          "to": "m"}}
        messages[1]["tool_calls"].append({"function": second})
        messages.insert(3, {"role": "tool", "content": json.dumps({"value": answer * 1000})})
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return messages


def _sentence(rng: random.Random) -> str:
    a, b = rng.randint(0, 100), rng.randint(1, 100)
    return rng.choice([
        f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the "
        f"{rng.choice(NOUNS)} {rng.choice(PLACES)}.",
        f"{rng.choice(NAMES)} said that the {rng.choice(NOUNS)} was {rng.choice(ADJECTIVES)}, "
        f"and {rng.choice(NAMES)} agreed.",
        f"There are {a} {rng.choice(THINGS)} on the table and {b} more in the {rng.choice(NOUNS)}.",
        f"We know that $\\frac{{{a}}}{{{b}}} + \\frac{{{b}}}{{{a + 1}}}$ is a fraction.",
        f"Solve $x^2 + {a}x + {b} = 0$ for $x$.",
        f"Since $\\sqrt{{{a * a}}} = {a}$, we get $x = {a} \\times {b} = {a * b}$.",
        f"\\[ \\left( {a} + {b} \\right) \\cdot 2 = {(a + b) * 2} \\]",
        f"Numbers: {rng.randint(0, 10**9)}, {rng.randint(0, 9999)}.{rng.randint(0, 99)}, "
        f"-{rng.randint(0, 500)} and {rng.random():.4f}.",
        f'{{"name": "{rng.choice(NAMES)}", "age": {a}, "items": [{a}, {b}]}}',
    ])


def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja set up the way transformers renders chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env


def corpus(seed: int = SEED) -> Iterator[str]:
    """The training text, one document at a time."""
    rng = random.Random(seed)
    template = _environment().from_string(CHAT_TEMPLATE)
    for _ in range(CONVERSATIONS):
        tools = rng.random() < 0.6
        messages = _tool_chat(rng) if tools else _arithmetic_chat(rng)
        yield template.render(messages=messages, tools=TOOLS if tools else None,
                              add_generation_prompt=False)
    for _ in range(SENTENCES):
        yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


# -- the tokenizer --------------------------------------------------------------------------------

def train(texts: Iterator[str]) -> Tokenizer:
    """A byte-level BPE over `texts`, with the chat tokens as single tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL + ADDED])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL + ADDED), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer registers every reserved token as special; the tool and think tags are not
    # (decoding with skip_special_tokens must keep them for the parser).
    data = json.loads(tokenizer.to_str())
    for token in data["added_tokens"]:
        token["special"] = token["content"] in SPECIAL
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_config() -> dict:
    """What transformers reads next to tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build(directory: Path) -> list[Path]:
    """Train the tokenizer and write its files into `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train(corpus())
    paths = [directory / name for name in FILES]
    paths[0].write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    paths[1].write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the shipped files instead of writing them")
    args = parser.parse_args(argv)
    if not args.check:
        for path in build(ASSETS):
            print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in build(Path(tmp)) if not (ASSETS / p.name).is_file()
                 or (ASSETS / p.name).read_bytes() != p.read_bytes()]
    if stale:
        print(f"{stale} are stale; run .venv/bin/python scripts/make_tiny_chat.py")
        return 1
    print("the tiny chat tokenizer files are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
