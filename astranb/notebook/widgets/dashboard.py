"""The live run dashboard: one plotly FigureWidget with every panel, a status line, a Stop button.

It only observes: metrics events from the run set a flag, and a throttle thread redraws at most
once per `interval` seconds with one batched figure update (redraws made from that thread reach the
frontend, and nbclient captures them when a notebook runs headless). Only one FigureWidget: each
carries ~5 MB of JavaScript in a saved notebook. A failing redraw shows its error in the status
line and stops the redraws; the run goes on. Stop only asks the run to stop. A click on a point
of the reward panel opens the recorded train step nearest it below the panels (the step
inspector, `run.steps.at`).
"""

from __future__ import annotations

import html
import traceback
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import plotly.graph_objects as go

from ..display import cell_number
from ..inspector import StepInspector
from ..panels import Throttle, View

if TYPE_CHECKING:
    from ...session.run import Run

__all__ = ["LiveDashboard"]

_STATE_COLORS = {"running": "#1f77b4", "stalled": "#ff7f0e", "finished": "#2ca02c",
                 "stopped": "#7f7f7f", "failed": "#d62728"}


class LiveDashboard(View):
    """`run.dashboard()` in JupyterLab: live panels, status and Stop.

    Args:
        run: the run to watch.
        interval: smallest time between two redraws, in seconds.
    """

    def __init__(self, run: Run, interval: float = 0.5):
        super().__init__(run)
        self.error: BaseException | None = None
        """The exception that stopped the redraws, if any."""
        self.fig = go.FigureWidget(self.figure())
        self.fig.layout.title.text = ""  # the status line says it, live
        self.status_html = widgets.HTML(self._status_html())
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          tooltip="stop the run (collected data stays)")
        self.stop_button.on_click(lambda _: self.stop())
        self.step_view = widgets.HTML("")
        """The recorded step opened by the last click on the reward panel."""
        self._listen()
        self.widget = widgets.VBox(
            [widgets.HBox([self.stop_button, self.status_html]), self.fig, self.step_view],
            layout=widgets.Layout(width="100%"),
        )
        self.widget.add_class("astranb-dashboard")
        self._shown_in: int | None = -1
        self._finished = False
        self._throttle = Throttle(self._redraw, interval, self._failed, name="astranb-dashboard")
        self._unsubscribe = run.on_event(self._on_event)
        run._future.add_done_callback(lambda _: self._throttle.poke())
        if run.done:
            self._throttle.poke()

    @property
    def redraws(self) -> int:
        """How many batched figure updates were sent so far."""
        return self._throttle.renders

    # -- actions (click handlers only call these) ----------------------------------------------
    def stop(self) -> None:
        """Ask the run to stop; collected metrics and episodes stay."""
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        self.run.stop()
        self._throttle.poke()

    def open_step(self, policy: str, step: int) -> None:
        """Show the recorded step of `policy` nearest `step` below the panels."""
        try:
            recorded = self.run.steps.at(step, policy)
        except LookupError as error:
            self.step_view.value = f"<div style='color:#666'>{html.escape(str(error))}</div>"
            return
        self.step_view.value = StepInspector(recorded).html()

    def _clicked(self, trace: Any, points: Any, selector: Any) -> None:
        if points.xs:
            self.open_step(str(trace.legendgroup), int(points.xs[0]))

    def finish(self) -> None:
        """Final redraw from the waiting cell, so a saved notebook holds the last step."""
        if self._finished:
            return
        self._finished = True
        self._throttle.close()
        self._unsubscribe()
        if self.error is None:
            try:
                self._redraw()
            except Exception as error:  # noqa: BLE001 - never hide the run's own result
                self._failed(error)
        # plotly sends updates as transient messages; the saved widget state is _widget_data /
        # _widget_layout, which plotly itself only refreshes on display. Refresh it now.
        state = self.fig.to_plotly_json()
        self.fig._widget_data = state["data"]
        self.fig._widget_layout = state["layout"]
        self.stop_button.disabled = True

    # -- internals ------------------------------------------------------------------------------
    def _on_event(self, kind: str, payload: Any) -> None:
        if kind in ("metrics", "evaluation", "stalled"):  # a step, a held-out window, a stall
            self._throttle.poke()

    def _listen(self) -> None:
        for trace in self.fig.data:
            if trace.xaxis == "x" and trace.legendgroup in self.run.policies:  # reward panel
                trace.on_click(self._clicked)

    def _redraw(self) -> None:
        spec = self.figure()
        panels = spec["layout"]["meta"]["panels"]
        if list(self.fig.layout.meta["panels"]) != panels:  # the league panels came: rebuild
            with self.fig.batch_update():
                self.fig.data = ()
                self.fig.add_traces(spec["data"])
                self.fig.layout = {**spec["layout"], "title": {"text": ""}}
            self._listen()
        with self.fig.batch_update():
            for trace, new in zip(self.fig.data, spec["data"], strict=True):
                trace.x, trace.y = new["x"], new["y"]
        self.status_html.value = self._status_html()
        if self.run.done:
            self.stop_button.disabled = True
            self.stop_button.description = self.run.status.capitalize()

    def _failed(self, error: BaseException) -> None:
        self.error = error
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        self.status_html.value = self._status_html() + (
            "<div style='color:#d62728'>dashboard stopped updating (training goes on): "
            f"{html.escape(detail)}</div>"
        )

    def _status_html(self) -> str:
        color = _STATE_COLORS.get(self.run.status, "#333")
        return (f"<div class='astranb-status' style='color:{color};font-family:monospace;"
                f"padding:4px 8px'>{html.escape(self.status())}</div>")

    def _ipython_display_(self) -> None:
        if self._shown_in != cell_number():  # run.dashboard() ending a cell: shown already
            self._shown_in = cell_number()
            from IPython.display import display

            display(self.widget)

    def __repr__(self) -> str:
        return f"LiveDashboard({self.status()}, redraws={self.redraws})"
