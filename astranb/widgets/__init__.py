"""Deprecated location of the notebook widgets: use `astranb.notebook.widgets` (this alias goes
away in the next release)."""

from __future__ import annotations

from typing import Any

_NAMES = ("DebuggerWidget", "debugger_widget", "WiringWidget", "wiring_widget")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'astranb.widgets' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn("astranb.widgets moved to astranb.notebook.widgets", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("astranb.notebook.widgets"), name)
