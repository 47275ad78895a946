"""reasoning-gym's tasks as astranb environments: any task by name, weighted mixes, held-out splits.

    import astranb as ab

    env = ab.environments.load("reasoning_gym", task="basic_arithmetic", size=1000, seed=0)
    mix = ab.environments.load("reasoning_gym", task={"chain_sum": 2, "spell_backward": 1})
    env.split_samples("test")      # generated from another seed, no question shared with train

Samples are reasoning-gym's entries (`reasoning_gym.create_dataset(task, size=, seed=)`, or its
composite dataset for a mix); the reward is the task's own `score_answer`, partial credit
included: reasoning-gym's plain string comparison (`string_score`) in the episode, any other
scorer in a child process forked for each answer, with limits and an audit hook (many
scorers `eval` the answer, which is model text). The answer is the bare reply, or with
`answer_tag=True` the last `<answer>...</answer>`.
"""

from __future__ import annotations

from .answers import extract_answer
from .env import ReasoningGym, compares_strings, string_score, task_names
from .scorer import ScoreError, Scorer, ScoreTimeout

__all__ = ["ReasoningGym", "Scorer", "ScoreError", "ScoreTimeout", "compares_strings",
           "extract_answer", "string_score", "task_names"]
