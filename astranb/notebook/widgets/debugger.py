"""The episode debugger as a widget: back/forward buttons, a slider, the current step, an editor.

Every control only calls the core `EpisodeDebugger` methods (`back`, `forward`, `goto`,
`run_until`, `edit`, `rescore`) and redraws; everything it does can be done headless with them.
"Edit & rescore" replaces the current turn's completion with the editor's text and swaps in the
re-scored episode (`widget.debugger`); the debugger it started from is left as it was.

    from astranb.notebook.widgets import debugger_widget
    debugger_widget(run.episodes[3].debugger())
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as widgets

if TYPE_CHECKING:  # the debugger imports this module to show itself (EpisodeDebugger.display)
    from ..debugger import EpisodeDebugger

__all__ = ["DebuggerWidget", "debugger_widget"]


def debugger_widget(debugger: EpisodeDebugger) -> DebuggerWidget:
    """Build the debugger widget (a VBox; display it, or end a cell with it)."""
    return DebuggerWidget(debugger)


class DebuggerWidget(widgets.VBox):
    """Buttons and panes over an EpisodeDebugger (see the module docstring).

    Attributes:
        debugger: the debugger shown (replaced by the re-scored one after "Edit & rescore").
        back_button, forward_button, next_tool_button: move one step, or to the next tool call.
        slider: the current step's index.
        pane: the current step as HTML.
        editor: the current turn's completion, editable (disabled on tool and reward steps).
        rescore_button: edit the current turn with the editor's text and re-score.
        status: what the last action did, or why it failed.
    """

    def __init__(self, debugger: EpisodeDebugger):
        super().__init__()
        self.debugger = debugger
        self._syncing = False
        self.back_button = widgets.Button(description="◀ Back", tooltip="debugger.back()")
        self.forward_button = widgets.Button(description="Forward ▶",
                                             tooltip="debugger.forward()")
        self.next_tool_button = widgets.Button(
            description="Next tool call", tooltip='debugger.run_until(lambda s: s.kind == "tool")')
        self.slider = widgets.IntSlider(min=0, description="step", continuous_update=False)
        self.pane = widgets.HTML()
        self.editor = widgets.Textarea(description="completion", rows=2,
                                       layout=widgets.Layout(width="100%"))
        self.rescore_button = widgets.Button(description="Edit & rescore",
                                             tooltip="debugger.edit(turn, text).rescore()")
        self.status = widgets.HTML()
        self.back_button.on_click(lambda _: self._act(self.debugger.back))
        self.forward_button.on_click(lambda _: self._act(self.debugger.forward))
        self.next_tool_button.on_click(
            lambda _: self._act(lambda: self.debugger.run_until(lambda s: s.kind == "tool")))
        self.slider.observe(self._on_slider, names="value")
        self.rescore_button.on_click(lambda _: self._act(self._rescore))
        self.children = [
            widgets.HTML(f"<b>{html.escape(debugger.title, quote=False)}</b>"),
            widgets.HBox([self.back_button, self.forward_button, self.next_tool_button,
                          self.slider]),
            self.pane, self.editor, self.rescore_button, self.status,
        ]
        self.refresh()

    def refresh(self) -> None:
        """Redraw from the debugger: slider range and value, the step pane, the editor."""
        dbg = self.debugger
        self._syncing = True  # the slider follows the debugger here, not the other way round
        try:
            self.slider.max = len(dbg.steps) - 1
            self.slider.value = dbg.position
        finally:
            self._syncing = False
        self.pane.value = dbg.step_html()
        step = dbg.current
        editable = step.kind == "generate"
        self.editor.disabled = self.rescore_button.disabled = not editable
        self.editor.value = step.completion if editable else ""

    # -- internals -------------------------------------------------------------------------------
    def _act(self, action) -> None:
        self.status.value = ""
        try:
            action()
        except (LookupError, ValueError, TypeError, RuntimeError) as error:
            message = html.escape(str(error), quote=False)
            self.status.value = f'<span style="color:#b00000">{message}</span>'
        self.refresh()

    def _on_slider(self, change) -> None:
        if not self._syncing and change["new"] != self.debugger.position:
            self._act(lambda: self.debugger.goto(change["new"]))

    def _rescore(self) -> None:
        turn = self.debugger.current.turn
        before = self.debugger.rewards
        self.debugger = self.debugger.edit(turn, self.editor.value).rescore()
        self.status.value = html.escape(f"turn {turn} edited: rewards {before} -> "
                                        f"{self.debugger.rewards}", quote=False)
