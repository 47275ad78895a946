"""Repo-wide pytest setup: notebooks run by nbmake use their small smoke-test parameters."""

import os

import pytest

os.environ.setdefault("ASTRANB_SMOKE", "1")

# tests/test_notebooks_headless.py executes this notebook itself (smoke sized, as nbmake would)
# and checks its saved outputs: nbmake's own run of it would only repeat that execution.
QUICKSTART = "01_quickstart.ipynb"
QUICKSTART_TESTS = "test_notebooks_headless.py"


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    """Notebook runs (nbmake items for notebooks/*.ipynb) are end-to-end: mark them slow, so
    `pytest -m "not slow"` (make test-fast) skips them and plain `pytest` still runs them.
    nbmake's quickstart item is deselected when tests/test_notebooks_headless.py is collected
    in the same run (it runs the quickstart once for all its checks)."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    if any(item.path.name == QUICKSTART_TESTS for item in items):
        repeated = [item for item in items if item.path.name == QUICKSTART]
        if repeated:
            items[:] = [item for item in items if item.path.name != QUICKSTART]
            config.hook.pytest_deselected(items=repeated)
