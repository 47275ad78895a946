"""The run dashboard: its headless forms and the choice among forms.

`run.dashboard()` picks a form from `astranb.notebook.display.display_mode()`:

- ``widgets``: `astranb.notebook.widgets.dashboard.LiveDashboard`, one plotly FigureWidget holding
  every panel, a status line and a Stop button, redrawn at most a few times a second.
- ``static``: an output that shows a one-line progress while the run goes and becomes the same
  panels as a static figure (plotly JSON for JupyterLab, PNG for everything else) when the
  waiting cell (`await run` / `run.wait()`) sees the run end.
- ``none``: one line of text when the run ends.

Every form shows the same panels, plain plotly-JSON dicts built from the run's metrics rows in
`astranb.notebook.panels` (with `View`, the base of every form, and the redraw `Throttle`), so the
live widget, the static figure and the tests read the same numbers. A run that evaluates adds the
held-out panel; one whose games count wins and losses per policy (TextArena's) adds win rate
and Elo panels from its first such row. This module imports neither
plotly nor ipywidgets; it imports the live form only when asked for it (`open_dashboard`).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Any

from .display import cell_number, publish
from .panels import (
    HELDOUT_PANEL,
    LEAGUE_PANELS,
    PANELS,
    Throttle,
    View,
    figure,
    status_line,
    to_png,
)

if TYPE_CHECKING:
    from ..session.run import Run

# the panels and the View live in panels.py (the live widget builds on them too); named here as
# well, since this is the dashboard's module
__all__ = ["PANELS", "HELDOUT_PANEL", "LEAGUE_PANELS", "figure", "status_line", "to_png",
           "Throttle", "View", "StaticDashboard", "TextDashboard", "open_dashboard"]


class StaticDashboard(View):
    """Headless dashboard: a progress line now, the panels as a static figure at the end."""

    def __init__(self, run: Run, interval: float = 5.0):
        super().__init__(run)
        self.interval = interval
        self.display_id = f"astranb-dashboard-{uuid.uuid4().hex[:12]}"
        self._last_tick = time.monotonic()
        self._shown = False
        self._shown_in: int | None = -1
        self._final: dict[str, Any] | None = None

    def _ipython_display_(self) -> None:
        if self._shown_in != cell_number():  # run.dashboard() ending a cell: shown already
            self._shown, self._shown_in = True, cell_number()
            publish(self._final or {"text/plain": "dashboard: " + self.status()},
                    display_id=self.display_id)

    def tick(self) -> None:
        now = time.monotonic()
        if self._shown and now - self._last_tick >= self.interval:
            self._last_tick = now
            publish({"text/plain": "dashboard: " + self.status()}, display_id=self.display_id,
                    update=True)

    def bundle(self) -> dict[str, Any]:
        """The static form: plotly JSON (JupyterLab draws it), PNG (everything else), text."""
        spec = self.figure()
        return {
            "application/vnd.plotly.v1+json": spec,
            "image/png": base64.b64encode(to_png(spec)).decode("ascii"),
            "text/plain": "dashboard: " + self.status(),
        }

    def finish(self) -> None:
        self._final = self.bundle()
        publish(self._final, display_id=self.display_id, update=self._shown)
        self._shown = True

    def __repr__(self) -> str:
        return f"StaticDashboard({self.status()})"


class TextDashboard(View):
    """No display: one status line when the run ends (scripts, logs)."""

    def finish(self) -> None:
        print("dashboard: " + self.status(), flush=True)

    def __repr__(self) -> str:
        return f"TextDashboard({self.status()})"


def open_dashboard(run: Run, mode: str, interval: float) -> View:
    """The dashboard form for a display mode (see module doc)."""
    if mode == "widgets":
        try:
            from .widgets.dashboard import LiveDashboard
        except ImportError as error:
            raise ImportError(
                f"the live dashboard needs ipywidgets and plotly ({error}); install them with "
                "pip install 'astranb[notebook]', or set ASTRANB_DISPLAY=static for static figures"
            ) from error
        return LiveDashboard(run, interval)
    if mode == "static":
        return StaticDashboard(run)
    return TextDashboard(run)
