"""Programming tasks for LLM agents, scored by running their tests in a sandbox.

    from astranb_code import Code, CodeVerifier, Sandbox, Limits, synthetic_tasks

    env = Code("mbpp.jsonl")                                  # MBPP, HumanEval or own rows
    env = Code(load_dataset("openai/openai_humaneval")["test"], test_size=0.2)
    env = CodeVerifier(data)                                  # roles coder, verifier

The model answers with a program in a ```python block. The program runs in a `Sandbox` (see
astranb_code.sandbox for its layers) as a server of its functions; a judge outside it runs the
task's tests, calling those functions with plain data (see astranb_code.harness), so the program
can neither read the tests nor forge their verdicts. Reward: the fraction of tests passed (a
HumanEval problem is one test, its whole check). A pool limits how many programs run at once,
off the event loop.
"""

from __future__ import annotations

from .env import Code, CodeVerifier, extract_code, read_prediction
from .sandbox import Job, Limits, Result, Sandbox, SandboxError
from .tasks import TaskError, humaneval_rows, humaneval_tests, normalize, synthetic_tasks

__all__ = ["Code", "CodeVerifier", "Sandbox", "Job", "Limits", "Result", "SandboxError",
           "TaskError", "extract_code", "read_prediction", "normalize", "humaneval_tests",
           "humaneval_rows", "synthetic_tasks"]
