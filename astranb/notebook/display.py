"""Where astranb's views go: live widgets in a Jupyter frontend, static figures when headless.

A kernel looks the same to us under papermill, nbmake and JupyterLab; only a kernel launched by
jupyter_server carries `JPY_SESSION_NAME`, so that is the hint for "a person is watching". The
`ASTRANB_DISPLAY` environment variable overrides the guess:

- ``widgets``: live ipywidgets/plotly views (JupyterLab, Notebook 7, VS Code).
- ``static``: the same panels as static figures once the work ends, plus short text progress
  (papermill, nbmake, saved notebooks, GitHub previews).
- ``none``: text only (scripts, logs).

This module imports neither ipywidgets nor plotly; `astranb.notebook.widgets` does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["MODES", "display_mode", "in_kernel", "publish", "cell_number"]

MODES = ("widgets", "static", "none")


def display_mode() -> str:
    """"widgets", "static" or "none": `ASTRANB_DISPLAY` if set, else a guess (see module doc)."""
    value = os.environ.get("ASTRANB_DISPLAY", "").strip().lower()
    if value:
        if value not in MODES:
            raise ValueError(
                f"ASTRANB_DISPLAY={value!r} is not a display mode; set it to one of "
                f"{', '.join(MODES)} (or unset it to let astranb guess)"
            )
        return value
    if not in_kernel():
        return "none"
    return "widgets" if os.environ.get("JPY_SESSION_NAME") else "static"


def in_kernel() -> bool:
    """True inside a Jupyter kernel (IPython with a kernel attached), without importing IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def publish(bundle: Mapping[str, Any], *, display_id: str | None = None, update: bool = False):
    """Show a mimebundle in the current cell (or update the output with `display_id`); print its
    text/plain part outside a kernel. Returns the display handle, if any."""
    if not in_kernel():
        print(bundle.get("text/plain", ""))
        return None
    from IPython.display import display, update_display

    if update and display_id is not None:
        update_display(dict(bundle), raw=True, display_id=display_id)
        return None
    return display(dict(bundle), raw=True, display_id=display_id)


def cell_number() -> int | None:
    """The kernel's execution count (which cell runs now), or None outside a kernel.

    Objects that display themselves when created (`run.dashboard()`, `episode.show()`) remember
    it, so the same cell ending in that call does not show them twice, while a later cell still
    can.
    """
    if not in_kernel():
        return None
    return sys.modules["IPython"].get_ipython().execution_count
