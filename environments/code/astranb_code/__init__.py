"""Programming tasks for LLM agents, scored by running their tests in a sandbox.

    from astranb_code import Code, CodeVerifier, Sandbox, Limits, synthetic_tasks

    env = Code("mbpp.jsonl")                                  # MBPP, HumanEval or own rows
    env = Code(load_dataset("openai/openai_humaneval")["test"], test_size=0.2)
    env = CodeVerifier(data)                                  # roles coder, verifier

The model answers with a program in a ```python block. The program and the task's tests run in
a subprocess with resource limits, its own process group (and, where the kernel allows it, its
own user, network and PID namespaces), an audit hook and a wall-clock kill (`Sandbox`). Reward:
the fraction of tests passed. A pool limits how many programs run at once, off the event loop.
"""

from __future__ import annotations

from .env import Code, CodeVerifier, extract_code, read_prediction
from .sandbox import Limits, Result, Sandbox, SandboxError
from .tasks import TaskError, humaneval_tests, normalize, synthetic_tasks

__all__ = ["Code", "CodeVerifier", "Sandbox", "Limits", "Result", "SandboxError", "TaskError",
           "extract_code", "read_prediction", "normalize", "humaneval_tests", "synthetic_tasks"]
