"""Imports run downward: each layer of astranb imports only the layers below it.

    notebook/        dashboard, debugger, viewer, display, widgets   (observes; imported lazily)
    services/  cli   server apps, `astranb serve`, launchers
    session          session, policy, run, recorder, records, wiring
    remote/          HTTP clients, rollout pool, remote trainer, wire format
    dataflow/ engines/ training/ environments/ weights/ algorithms/ models
    contracts  errors  types

Every `import` and `from ... import` statement of the package is read with `ast` (module level
and inside functions alike), resolved to an absolute module name and checked against the rules
below. A failure names the file, the line and the rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "astranb"

# The only places outside notebook/ that may reach the notebook UI, always inside a function (so
# `import astranb` never loads it): the display hooks of core objects and the lazy facade names.
LAZY_NOTEBOOK_HOOKS = {
    ("astranb", "__getattr__"),                     # ab.debug, ab.EpisodeDebugger
    ("astranb.session.recorder", "show"),                   # Episode.show()
    ("astranb.session.recorder", "debugger"),               # Episode.debugger()
    ("astranb.session.run", "dashboard"),                   # run.dashboard()
    ("astranb.session.run", "_repr_html_"),
    ("astranb.session.policy", "_repr_html_"),
    ("astranb.session.session", "_repr_html_"),
}

# session.py chooses local or remote parts; context.py holds them (the pool, the trainer client)
SESSION_LAYER = {"astranb.session.session", "astranb.session.context", "astranb.cli"}
BOTTOM = {"astranb.types", "astranb.contracts", "astranb.errors"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path):
    """(line, imported module, enclosing function or None, under `if TYPE_CHECKING:`) for every
    import in the file."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, function, typing_only):
        for child in ast.iter_child_nodes(node):
            inner, typing = function, typing_only
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = function or child.name
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                typing = True
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, inner, typing) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.append((child.lineno, target, inner, typing))
                # `from . import x` imports module x of the package (names that are modules)
                found.extend((child.lineno, f"{target}.{a.name}", inner, typing)
                             for a in child.names if is_module(f"{target}.{a.name}"))
            visit(child, inner, typing)

    visit(tree, None, False)
    return module, found


def all_imports():
    for path in sorted(PACKAGE.rglob("*.py")):
        module, found = imports(path)
        for line, target, function, typing_only in found:
            yield path.relative_to(PACKAGE.parent), module, line, target, function, typing_only


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(rule, *, typing_only_too: bool = True) -> list[str]:
    """Imports breaking `rule(module, target, function)`; `typing_only_too=False` leaves out
    imports that only type checkers run (`if TYPE_CHECKING:`)."""
    return [f"{path}:{line} imports {target}" for path, module, line, target, function, typing
            in all_imports() if (typing_only_too or not typing) and rule(module, target, function)]


def test_only_the_session_cli_services_and_notebook_reach_the_http_client_side():
    def rule(module, target, function):
        if not under(target, "astranb.remote", "astranb.services"):
            return False
        allowed = SESSION_LAYER | {"astranb.remote", "astranb.services", "astranb.notebook"}
        return not under(module, *allowed)

    assert violations(rule) == []


def test_only_the_cli_and_the_launchers_import_the_server_apps():
    apps = ("astranb.services.rollout_app", "astranb.services.trainer_app",
            "astranb.services.trainer_main", "astranb.services.server")

    def rule(module, target, function):
        return under(target, *apps) and not under(module, "astranb.cli", "astranb.services")

    assert violations(rule) == []


def test_widget_libraries_and_the_notebook_package_stay_in_notebook():
    def rule(module, target, function):
        if under(module, "astranb.notebook"):
            return False
        if under(target, "ipywidgets", "plotly", "anywidget"):
            return True
        if under(target, "astranb.notebook"):
            return function is None or (module, function) not in LAZY_NOTEBOOK_HOOKS
        return False

    # annotations may name notebook types (`Episode.show() -> EpisodeDebugger`)
    assert violations(rule, typing_only_too=False) == []


def test_algorithms_and_weights_import_only_the_bottom_layer():
    def rule(module, target, function):
        if not under(module, "astranb.algorithms", "astranb.weights"):
            return False
        own = module.split(".")[:2]
        return (under(target, "astranb") and not under(target, ".".join(own))
                and target not in BOTTOM and target != "astranb")

    assert violations(rule) == []


def test_the_bottom_layer_imports_nothing_above_it():
    def rule(module, target, function):
        if module not in BOTTOM or not under(target, "astranb"):
            return False
        below = {"astranb.types": set(), "astranb.errors": set(),
                 "astranb.contracts": {"astranb.types"}}[module]
        return target not in below

    assert violations(rule) == []


def test_the_dataflow_and_engines_reach_policies_and_recorders_only_through_contracts():
    def rule(module, target, function):
        return (under(module, "astranb.dataflow", "astranb.engines", "astranb.training",
                      "astranb.environments", "astranb.weights", "astranb.algorithms")
                and under(target, "astranb.session") and function is None)

    # type-only imports (under `if TYPE_CHECKING:`) are module level too, so none may exist
    assert violations(rule) == []


def test_the_rules_catch_a_violation(tmp_path, monkeypatch):
    """The checker itself: a planted upward import is reported with its file and line."""
    planted = tmp_path / "astranb" / "weights"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("")
    (planted / "bad.py").write_text("import os\nfrom ..session import Session\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "astranb")

    def rule(module, target, function):
        return under(module, "astranb.weights") and under(target, "astranb.session")

    assert violations(rule) == [f"{Path('astranb/weights/bad.py')}:2 imports astranb.session"]


@pytest.mark.slow  # three fresh interpreters; the static rules above stay fast
@pytest.mark.parametrize("module", ["astranb", "astranb.session.session", "astranb.session.wiring"])
def test_importing_the_core_loads_no_ui_and_no_server(module):
    # a fresh interpreter: other tests in this process load the UI on purpose
    code = (f"import {module}, sys; "
            "bad = [m for m in ('ipywidgets', 'plotly', 'astranb.notebook', 'astranb.services', "
            "'fastapi', 'uvicorn') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
