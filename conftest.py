"""Repo-wide pytest setup: notebooks run by nbmake use their small smoke-test parameters."""

import os

os.environ.setdefault("ASTRANB_SMOKE", "1")
