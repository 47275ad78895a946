"""Test-wide settings.

Sessions in tests train in a worker thread (ASTRANB_TRAINER=thread) unless a test asks for
trainer="process": a child process per policy costs a few seconds to start, and many tests look at
`policy.trainer.model` directly. tests/test_process_trainer.py covers the child-process trainer.
"""

import os

os.environ.setdefault("ASTRANB_TRAINER", "thread")
