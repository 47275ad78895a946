"""Math problems for LLM agents: GSM8K- and MATH-style datasets, answers checked with math-verify.

    from astranb_math import Math, MathActorVerifier

    env = Math("gsm8k_train.jsonl", mode="single")                 # or "retry", "tools"
    env = Math(load_dataset("EleutherAI/hendrycks_math", "algebra"),
               columns={"question": "problem", "answer": "solution"})
    env = MathActorVerifier(data, columns=...)                     # roles actor, verifier

Data is anything `astranb.data.DataSource` reads; a sample needs a "question" and an "answer"
(GSM8K's "#### 72" solutions, MATH's \\boxed{} solutions and bare answers all work; `columns`
renames). A held-out "test" split (the dataset's own, or `test_size=`) is what evaluation reads.

Answers are read from the last \\boxed{} (or a "#### answer" line) of the model's message and
compared with the gold answer by math-verify (`1/2`, `0.5` and `\\frac{1}{2}` agree), in a worker
subprocess with a hard timeout (`AnswerVerifier`): a check that hangs scores 0, is counted as
`verify_timeout`, and never stalls other episodes. The calculator tool evaluates arithmetic with
`ast`, within bounds, and answers errors in words.
"""

from __future__ import annotations

from .actor_verifier import MathActorVerifier, read_verdict
from .answers import extract_answer, gold_answer, last_boxed
from .calculator import calculator
from .solver import Math
from .verify import AnswerVerifier, Verdict, VerifierUnavailable

__all__ = ["Math", "MathActorVerifier", "AnswerVerifier", "Verdict", "VerifierUnavailable",
           "calculator", "extract_answer", "gold_answer", "last_boxed", "read_verdict"]
