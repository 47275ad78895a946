"""The notebook UI: dashboards, the step-through debugger, the episode viewer, display detection,
HTML helpers and the ipywidgets front ends (`astranb.notebook.widgets`).

Everything here observes: it reads runs, sessions and episodes through their public APIs and
never changes training. Nothing below this package imports it at module level; core objects reach
it lazily when they are shown (`run.dashboard()`, `episode.show()`, `_repr_html_`), so `import
astranb` loads no display code.
"""
