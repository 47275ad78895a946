"""Jupyter widgets for astranb: the only part of the package that imports ipywidgets.

    from astranb.widgets import wiring_widget
    wiring_widget(session)      # a dropdown per role, Apply, live problems and the graph

Needs the notebook extra: pip install 'astranb[notebook]'.
"""

try:
    import ipywidgets  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("astranb.widgets needs ipywidgets; install the notebook extra: "
                      "pip install 'astranb[notebook]'") from error

from .wiring import WiringWidget, wiring_widget

__all__ = ["WiringWidget", "wiring_widget"]
