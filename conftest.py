"""Repo-wide pytest setup: notebooks run by nbmake use their small smoke-test parameters."""

import os

import pytest

os.environ.setdefault("ASTRANB_SMOKE", "1")


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    """Notebook runs (nbmake items for notebooks/*.ipynb) are end-to-end: mark them slow, so
    `pytest -m "not slow"` (make test-fast) skips them and plain `pytest` still runs them."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
