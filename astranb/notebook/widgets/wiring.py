"""An interactive form of `session.wiring`: a dropdown per role, Apply, live problems and the graph.

Every wired environment gets a row: one dropdown per role listing the session's policies (the
current choice preselected) and an Apply button. Apply only calls `session.wire` with the
dropdown choices (cheap, nothing trains), then the problems and the graph below are redrawn.
A run that is already going keeps the wiring it started with; new wiring applies from the next
`session.train()`.

    from astranb.notebook.widgets import wiring_widget
    wiring_widget(session)
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from ...environments.base import Environment
from ...session.wiring import EnvironmentView, graph_html, problems_html

if TYPE_CHECKING:
    from ...session.session import Session

__all__ = ["WiringWidget", "wiring_widget"]

AMBER, RED, GREEN = "#a05a00", "#c00000", "#187a00"


def wiring_widget(session: Session) -> WiringWidget:
    """Build the wiring form of `session` (a VBox; display it, or end a cell with it)."""
    return WiringWidget(session)


class _Row:
    """The controls of one wired environment."""

    def __init__(self, env: Environment, view: EnvironmentView, names: list[str]):
        self.env = env
        self.header = widgets.HTML()
        self.dropdowns = {
            role: widgets.Dropdown(description=role, options=names,
                                   style={"description_width": "initial"},
                                   layout=widgets.Layout(width="auto"))
            for role in view.edges
        }
        self.button = widgets.Button(description="Apply", tooltip=f"session.wire({env.name}, ...)")
        self.box = widgets.HBox([self.header, *self.dropdowns.values(), self.button])

    def sync(self, view: EnvironmentView, names: list[str]) -> None:
        """Show the session's current wiring (and its current policy names)."""
        self.header.value = (f"<b>{html.escape(view.label, quote=False)}</b> "
                             f'<span style="color:#666">weight {view.weight}</span>')
        for role, dropdown in self.dropdowns.items():
            if tuple(dropdown.options) != tuple(names):
                dropdown.options = names
            current = view.edges[role]
            dropdown.value = current if current in names else None

    def choice(self) -> dict[str, str]:
        """role -> chosen policy name (roles with no choice left out)."""
        return {role: d.value for role, d in self.dropdowns.items() if d.value is not None}

    def close(self) -> None:
        for widget in (self.header, *self.dropdowns.values(), self.button, self.box):
            widget.close()


class WiringWidget(widgets.VBox):
    """The wiring form (see the module docstring).

    Attributes:
        dropdowns: environment label -> role -> Dropdown of policy names.
        apply_buttons: environment label -> its Apply button.
        status: what the last click did, or the changes not applied yet.
        problems: `session.wiring.problems()` as HTML (errors red, warnings amber).
        graph: the wiring table (`session.wiring` in HTML).
    """

    def __init__(self, session: Session):
        super().__init__()
        self._session = session
        self._wiring = session.wiring
        self._rows: dict[int, _Row] = {}  # id(env) -> row; rows keep their order across Apply
        self.status = widgets.HTML()
        self.problems = widgets.HTML()
        self.graph = widgets.HTML()
        self._refresh_button = widgets.Button(description="Refresh",
                                              tooltip="re-read the session's policies and wiring")
        self._refresh_button.on_click(lambda _: self.refresh())
        self.refresh()

    @property
    def dropdowns(self) -> dict[str, dict[str, widgets.Dropdown]]:
        labels = self._labels()
        return {labels[key]: row.dropdowns for key, row in self._rows.items()}

    @property
    def apply_buttons(self) -> dict[str, widgets.Button]:
        labels = self._labels()
        return {labels[key]: row.button for key, row in self._rows.items()}

    def refresh(self) -> None:
        """Re-read the session: policies, wired environments, choices, problems, graph."""
        views = {id(v.env): v for v in self._wiring.environments}
        names = list(self._session.policies)
        for key in [k for k in self._rows if k not in views]:
            self._rows.pop(key).close()
        for key, view in views.items():
            if key not in self._rows:
                self._rows[key] = self._new_row(view, names)
            self._rows[key].sync(view, names)
        self.children = [*(row.box for row in self._rows.values()), self.status,
                         self.problems, self.graph, self._refresh_button]
        self.problems.value = problems_html(self._wiring.problems())
        self.graph.value = graph_html(self._wiring)
        self._show_pending()

    # -- internals -------------------------------------------------------------------------------
    def _new_row(self, view: EnvironmentView, names: list[str]) -> _Row:
        row = _Row(view.env, view, names)
        row.button.on_click(lambda _: self._apply(row))
        for dropdown in row.dropdowns.values():
            dropdown.observe(lambda _: self._show_pending(), names="value")
        return row

    def _apply(self, row: _Row) -> None:
        # role -> policy name; typed Any since mypy also matches the ** against weight=
        choice: dict[str, Any] = row.choice()
        try:
            self._wiring.apply(row.env, **choice)
        except (TypeError, ValueError, KeyError) as error:
            self.refresh()
            self.status.value = _colored(RED, f"Apply ({row.env.name}) failed: {error}")
            return
        self.refresh()
        pairs = ", ".join(f"{role} -> {name!r}" for role, name in choice.items())
        note = f"{row.env.name} wired: {pairs}."
        if any(not run.done for run in self._session.runs):
            note += (" The run going on keeps its wiring; this applies from the next "
                     "session.train().")
        self.status.value = _colored(GREEN, note)

    def _show_pending(self) -> None:
        """List dropdown choices that differ from the session's wiring."""
        views = {id(v.env): v for v in self._wiring.environments}
        labels = self._labels()
        changes = [f"{labels[key]}.{role}: {view.edges[role]!r} -> {dropdown.value!r}"
                   for key, row in self._rows.items() if (view := views.get(key))
                   for role, dropdown in row.dropdowns.items()
                   if dropdown.value != view.edges[role]]
        self.status.value = (_colored(AMBER, "not applied yet: " + "; ".join(changes)
                                      + " (click Apply)") if changes else "")

    def _labels(self) -> dict[int, str]:
        labels = {id(v.env): v.label for v in self._wiring.environments}
        return {key: labels.get(key, row.env.name) for key, row in self._rows.items()}


def _colored(color: str, text: str) -> str:
    return f'<span style="color:{color}">{html.escape(text, quote=False)}</span>'
