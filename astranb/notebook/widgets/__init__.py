"""Jupyter widgets for astranb: the only part of the package that imports ipywidgets.

    from astranb.notebook.widgets import wiring_widget, debugger_widget
    wiring_widget(session)      # a dropdown per role, Apply, live problems and the graph
    debugger_widget(run.episodes[0].debugger())   # step through an episode, edit, rescore

Needs the notebook extra: pip install 'astranb[notebook]'.
"""

try:
    import ipywidgets  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("astranb.notebook.widgets needs ipywidgets; install the notebook extra: "
                      "pip install 'astranb[notebook]'") from error

from .debugger import DebuggerWidget, debugger_widget
from .wiring import WiringWidget, wiring_widget

__all__ = ["DebuggerWidget", "WiringWidget", "debugger_widget", "wiring_widget"]
