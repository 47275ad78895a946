"""Imports run downward: astranb's layers, as data, and the rules checked against every import.

`LAYERS` below is the one description of the package's layers: each layer holds parts, each part
names its files and folders under astranb/. Every rule is derived from it:

- a module imports modules of lower layers, of its own part, and of the parts of its own layer
  that its part lists in `uses` (the order inside a layer is declared, not implied);
- import circles fail, printed `a -> b -> a`;
- privates (`_name`, `_module`) stay inside the package that holds them;
- the UI stays in notebook/ (reached only from `LAZY_NOTEBOOK_HOOKS`), the server apps are
  imported only by the CLI and services/, the HTTP client side only by the session, the CLI,
  services/ and notebook/;
- every module of the package belongs to exactly one part, and every part has a module;
- importing the core (layers 0 to 3 and the facade) loads no UI, no server and no tracker library.

Every `import` and `from ... import` of the package is read with `ast` (module level and inside
functions), resolved to an absolute module name and checked; a failure names the file and line.
`from pkg import name` depends on module `pkg.name` when that is a module, else on `pkg` itself;
the parent packages Python runs on the way are not counted. Imports under `if TYPE_CHECKING:`
count for the layer rules (annotations only name notebook types from below) and not for cycles.

docs/architecture.md shows the same table, generated from `LAYERS`:

    python -m tests.test_layers            # print it
    python -m tests.test_layers --write    # rewrite it in docs/architecture.md
"""

from __future__ import annotations

import ast
import difflib
import functools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "astranb"
DOCS = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"
REGENERATE = "python -m tests.test_layers --write"


@dataclass(frozen=True)
class Part:
    """A part of a layer."""

    name: str
    """What the docs and the messages call it."""
    files: tuple[str, ...]
    """Its files and folders under astranb/ ("chat.py", "session/")."""
    about: str
    """One line: what it is."""
    uses: tuple[str, ...] = ()
    """The parts of its own layer it may import (each listed part sits below it)."""


@dataclass(frozen=True)
class Layer:
    number: int
    name: str
    parts: tuple[Part, ...]


LAYERS = (
    Layer(6, "facade", (
        Part("facade", ("__init__.py",), "the names users import: `import astranb as ab`"),
    )),
    Layer(5, "notebook UI", (
        Part("notebook", ("notebook/",),
             "dashboard, debugger, viewer, widgets/: observe, loaded lazily"),
    )),
    Layer(4, "services and command line", (
        Part("services", ("services/",),
             "rollout and trainer server apps, `astranb serve`, launchers"),
        Part("papermill_run", ("papermill_run.py",),
             "-p values, the parameters cell's check, cell labels"),
        Part("sweep", ("sweep.py",), "`astranb sweep`: a notebook over a parameter grid",
             uses=("papermill_run",)),
        Part("cli", ("cli.py", "_kernel.py"), "the `astranb` command: serve, run, sweep",
             uses=("services", "sweep", "papermill_run")),
    )),
    Layer(3, "session", (
        Part("session", ("session/", "_loopthread.py", "_heap.py"),
             "Session over its RunContext: runs, policies, wiring, the run folder"),
        Part("sim", ("sim/",), "the real dataflow on simulated GPUs and a virtual clock",
             uses=("session",)),
    )),
    Layer(2, "remote", (
        Part("remote", ("remote/",),
             "HTTP clients, rollout pool (members, dispatch, broadcast), remote/process trainers"),
    )),
    Layer(1, "pure parts", (
        Part("models", ("models.py",), "model specs: tiny models built here, HF models"),
        Part("algorithms", ("algorithms/",), "advantages and losses, pure torch"),
        Part("weights", ("weights/",), "delta codec, store, mirror, publishers"),
        Part("chat", ("chat.py",), "chat templates, tool schemas, a conversation's tokens"),
        Part("data", ("data.py",), "DataSource: datasets as seeded streams"),
        Part("environments", ("environments/",),
             "Environment, episode context, registry, OpenAI endpoint",
             uses=("chat",)),
        Part("evaluation", ("evaluation.py",), "held-out scoring: avg@k, pass@k",
             uses=("environments",)),
        Part("engines", ("engines/",), "rollout engines: hf, sglang, vllm, instant",
             uses=("weights", "models")),
        Part("training", ("training/",), "trainers: local, FSDP; SFT batches; frozen references",
             uses=("algorithms", "models", "engines", "chat")),
        Part("dataflow", ("dataflow/",), "gate, buffers, batcher, orchestrator, train loop",
             uses=("environments", "algorithms", "evaluation")),
    )),
    Layer(0, "bottom", (
        Part("types", ("types.py",), "plain frozen data"),
        Part("errors", ("errors.py",), "the errors astranb raises"),
        Part("contracts", ("contracts.py",), "Protocols: Engine, Trainer, Publisher, ...",
             uses=("types",)),
        Part("lifeline", ("lifeline.py",), "children out of Ctrl-C's reach, following us"),
        Part("loopback", ("loopback.py",), "whether an address is this machine's own"),
    )),
)

# The only places outside notebook/ that may import the notebook UI, always inside a function (so
# `import astranb` never loads it): the display hooks of core objects.
LAZY_NOTEBOOK_HOOKS = {
    ("astranb", "__getattr__"),                             # ab.debug, ab.EpisodeDebugger
    ("astranb.session.recorder", "show"),                   # Episode.show()
    ("astranb.session.recorder", "debugger"),               # Episode.debugger()
    ("astranb.session.run", "dashboard"),                   # run.dashboard()
    ("astranb.session.run", "_repr_html_"),
    ("astranb.session.policy", "_repr_html_"),
    ("astranb.session.session", "_repr_html_"),
    ("astranb.session.steps", "show"),                      # run.steps[i].show()
    ("astranb.session.steps", "save_html"),
    ("astranb.session.steps", "_repr_html_"),
}
UI_LIBRARIES = ("ipywidgets", "plotly", "anywidget")
SERVER_APPS = ("astranb.services.rollout_app", "astranb.services.trainer_app",
               "astranb.services.trainer_main", "astranb.services.server")
HTTP_CLIENT_SIDE = ("astranb.remote", "astranb.services")
# session.py is the one module of the session that chooses local or remote parts; context.py
# holds the pool and the trainer client it chose
HTTP_CLIENT_USERS = ("astranb.session.session", "astranb.session.context",
                     "astranb.session.placement", "astranb.cli",
                     "astranb.remote", "astranb.services", "astranb.notebook")
NEVER_LOADED_BY_THE_CORE = (*UI_LIBRARIES, "astranb.notebook", "astranb.services", "fastapi",
                            "uvicorn", "starlette", "tensorboard", "torch.utils.tensorboard",
                            "wandb", "mlflow")


# -- reading the package ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    path: Path
    """The importing file, relative to the repository (astranb/...)."""
    line: int
    module: str
    """The importing module."""
    target: str
    """The imported module (or, for names that are no module, the module they come from)."""
    names: tuple[str, ...]
    """`from target import names` (empty for `import target`)."""
    function: str | None
    """The outermost function the import is in, None at module level."""
    typing_only: bool
    """Under `if TYPE_CHECKING:`."""

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def modules() -> list[str]:
    return [module_name(p) for p in sorted(PACKAGE.rglob("*.py"))]


def imports_of(path: Path) -> list[Import]:
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    shown = path.relative_to(PACKAGE.parent)
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner, typing = function, typing_only
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = function or child.name
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                typing = True
            if isinstance(child, ast.Import):
                found.extend(Import(shown, child.lineno, module, a.name, (), inner, typing)
                             for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                submodules = [a.name for a in child.names if is_module(f"{base}.{a.name}")]
                found.extend(Import(shown, child.lineno, module, f"{base}.{name}", (), inner,
                                    typing) for name in submodules)
                names = tuple(a.name for a in child.names if a.name not in submodules)
                if names:
                    found.append(Import(shown, child.lineno, module, base, names, inner, typing))
            visit(child, inner, typing)

    visit(ast.parse(path.read_text(), str(path)), None, False)
    return found


def all_imports() -> tuple[Import, ...]:
    return imports_under(PACKAGE)


@functools.cache  # every rule reads the same imports (a planted package is another PACKAGE)
def imports_under(package: Path) -> tuple[Import, ...]:
    return tuple(i for path in sorted(package.rglob("*.py")) for i in imports_of(path))


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def own_module(target: str) -> str | None:
    """The module of the package that `target` names (itself, or the nearest one above it);
    None outside astranb."""
    if not under(target, "astranb"):
        return None
    while not is_module(target) and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def file_of(module: str) -> str:
    """The module's file under astranb/: "session/run.py", "session/__init__.py"."""
    rel = module.split(".")[1:]
    folder = PACKAGE.joinpath(*rel)
    return "/".join([*rel, "__init__.py"]) if (folder / "__init__.py").is_file() else (
        "/".join(rel) + ".py")


def parts_of(module: str) -> list[tuple[Layer, Part]]:
    rel = file_of(module)
    return [(layer, part) for layer in LAYERS for part in layer.parts
            if any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in part.files)]


def part_of(module: str) -> tuple[Layer, Part]:
    found = parts_of(module)
    if len(found) != 1:
        raise LookupError(f"{module} is in {len(found)} parts of LAYERS; it must be in exactly one")
    return found[0]


# -- the rules -------------------------------------------------------------------------------------
def layer_violations() -> list[str]:
    """Imports of a higher layer, or of a part of the same layer not in the importer's `uses`.
    Upward imports of the notebook UI are the UI rule's (lazy hooks, annotations)."""
    found = []
    for imp in all_imports():
        target = own_module(imp.target)
        if target is None or target == imp.module:
            continue
        (layer, part), (their_layer, theirs) = part_of(imp.module), part_of(target)
        if their_layer.number > layer.number:
            if under(target, "astranb.notebook") and (imp.typing_only or imp.function):
                continue
            found.append(f"{imp}: layer {layer.number} ({part.name}) imports layer "
                         f"{their_layer.number} ({theirs.name})")
        elif their_layer.number == layer.number and theirs != part and theirs.name not in part.uses:
            found.append(f"{imp}: {part.name} may import only {', '.join(part.uses) or 'nothing'}"
                         f" of layer {layer.number} ({layer.name}), not {theirs.name}")
    return found


def import_graph() -> dict[str, dict[str, Import]]:
    """module -> {imported module: the first import of it}; type-checking imports left out."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for imp in all_imports():
        target = own_module(imp.target)
        if target is not None and target != imp.module and not imp.typing_only:
            graph[imp.module].setdefault(target, imp)
    return graph


def cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each the
    shortest way from the component's first module back to itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            components.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [shortest_cycle(graph, c) for c in components if len(c) > 1]


def shortest_cycle(graph: dict[str, dict[str, Import]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    for v in queue:  # breadth first, inside the component
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def cycle_violations() -> list[str]:
    graph = import_graph()
    return [" -> ".join(c) + "  (" + ", ".join(f"{graph[a][b].path}:{graph[a][b].line}"
                                               for a, b in zip(c, c[1:], strict=False)) + ")"
            for c in cycles(graph)]


def private_violations() -> list[str]:
    """`_name` and `_module` stay in the package holding them; at the top level, where every
    module shares the package, a module's private names stay in that module."""
    found = []
    for imp in all_imports():
        if own_module(imp.target) is None:
            continue
        path = imp.target.split(".")
        for i, word in enumerate(path):  # a private module on the way
            if word.startswith("_") and not word.startswith("__"):
                holder = ".".join(path[:i])
                if not under(imp.module, holder):
                    found.append(f"{imp}: {word} is private to {holder}")
                break
        else:
            names = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            target = own_module(imp.target) or imp.target
            top_level = target.count(".") == 1 and not file_of(target).endswith("__init__.py")
            holder = target if top_level or file_of(target).endswith("__init__.py") else (
                target.rsplit(".", 1)[0])
            if names and not under(imp.module, holder):
                found.append(f"{imp}: {', '.join(names)} private to {holder}")
    return found


def ui_violations() -> list[str]:
    """ipywidgets, plotly and anywidget only in notebook/; astranb.notebook outside it only in
    the lazy hooks (and in annotations, under `if TYPE_CHECKING:`)."""
    found = []
    for imp in all_imports():
        if under(imp.module, "astranb.notebook") or imp.typing_only:
            continue
        if under(imp.target, *UI_LIBRARIES):
            found.append(f"{imp}: widget libraries stay in astranb/notebook/")
        elif under(imp.target, "astranb.notebook") and (
                imp.function is None or (imp.module, imp.function) not in LAZY_NOTEBOOK_HOOKS):
            found.append(f"{imp}: the notebook UI is imported only inside LAZY_NOTEBOOK_HOOKS")
    return found


def server_app_violations() -> list[str]:
    return [f"{imp}: the server apps are imported only by the CLI and services/"
            for imp in all_imports()
            if under(imp.target, *SERVER_APPS) and not under(imp.module, "astranb.cli",
                                                             "astranb.services")]


def http_client_violations() -> list[str]:
    return [f"{imp}: only {', '.join(HTTP_CLIENT_USERS)} import remote/ or services/"
            for imp in all_imports()
            if under(imp.target, *HTTP_CLIENT_SIDE) and not under(imp.module, *HTTP_CLIENT_USERS)]


def table_problems() -> list[str]:
    problems = [f"astranb/{file_of(m)} is in no part of LAYERS: add it to the part it belongs to"
                for m in modules() if not parts_of(m)]
    problems += [f"astranb/{file_of(m)} is in {len(parts_of(m))} parts of LAYERS"
                 for m in modules() if len(parts_of(m)) > 1]
    files = {file_of(m) for m in modules()}
    for layer in LAYERS:
        names = [p.name for p in layer.parts]
        for i, part in enumerate(layer.parts):
            problems += [f"{part.name}: no module is {f}" for f in part.files
                         if not any(r == f or (f.endswith("/") and r.startswith(f)) for r in files)]
            problems += [f"{part.name} uses {u}, which is not listed before it in layer "
                         f"{layer.number}" for u in part.uses if u not in names[:i]]
    for module, function in LAZY_NOTEBOOK_HOOKS:
        if not is_module(module):
            problems.append(f"LAZY_NOTEBOOK_HOOKS: there is no module {module}")
            continue
        tree = ast.parse((PACKAGE / file_of(module)).read_text())
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
                   for n in ast.walk(tree)):
            problems.append(f"LAZY_NOTEBOOK_HOOKS: {module} has no function {function}")
    return problems


def check(found: list[str]) -> None:
    assert not found, "\n".join(found)


# -- the tests -------------------------------------------------------------------------------------
def test_every_module_is_in_one_part_of_the_table():
    check(table_problems())


def test_imports_run_down_the_layers_and_in_each_layers_declared_order():
    check(layer_violations())


def test_no_import_circles():
    check(cycle_violations())


def test_privates_stay_in_their_package():
    check(private_violations())


def test_widget_libraries_and_the_notebook_package_stay_in_notebook():
    check(ui_violations())


def test_only_the_cli_and_services_import_the_server_apps():
    check(server_app_violations())


def test_only_the_session_cli_services_and_notebook_reach_the_http_client_side():
    check(http_client_violations())


def test_the_layer_table_in_the_docs_is_the_one_generated_here():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"{DOCS} lost its {BEGIN} / {END} markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
    diff = "\n".join(difflib.unified_diff(shown.splitlines(), table().splitlines(),
                                          "docs/architecture.md", "LAYERS", lineterm=""))
    assert shown == table(), f"the layer table in docs/architecture.md is stale; run " \
                             f"`{REGENERATE}`\n{diff}"


@pytest.mark.slow  # a fresh interpreter; the static rules above stay fast
def test_importing_the_core_loads_no_ui_no_server_and_no_tracker():
    """One fresh interpreter (other tests in this process load the UI on purpose) imports every
    module of layers 0 to 3 and the facade, then looks at what got loaded."""
    core = [m for m in modules() if part_of(m)[0].number <= 3 or m == "astranb"]
    code = (f"import importlib, sys\nfor m in {core!r}:\n    importlib.import_module(m)\n"
            f"bad = [m for m in {NEVER_LOADED_BY_THE_CORE!r} if m in sys.modules]\n"
            "assert not bad, f'importing the core loaded {bad}'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


# -- the checker checks itself: one planted bad import per rule ------------------------------------
def plant(tmp_path: Path, monkeypatch, files: dict[str, str]) -> None:
    """A package tree under tmp_path/astranb (every folder gets an __init__.py) that the rules
    read instead of the real one."""
    for name, text in files.items():
        path = tmp_path / "astranb" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for folder in path.relative_to(tmp_path).parents:
            if folder != Path(".") and not (tmp_path / folder / "__init__.py").exists():
                (tmp_path / folder / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "astranb")


def planted(rule: Callable[[], list[str]], tmp_path: Path, monkeypatch,
            files: dict[str, str]) -> list[str]:
    plant(tmp_path, monkeypatch, files)
    return rule()


def test_planted_upward_import_is_caught(tmp_path, monkeypatch):
    found = planted(layer_violations, tmp_path, monkeypatch, {
        "session/run.py": "", "weights/bad.py": "import os\nfrom ..session import run\n"})
    assert found == [f"{Path('astranb/weights/bad.py')}:2 imports astranb.session.run: layer 1 "
                     "(weights) imports layer 3 (session)"]


def test_planted_type_checking_import_of_the_session_is_caught(tmp_path, monkeypatch):
    found = planted(layer_violations, tmp_path, monkeypatch, {
        "session/run.py": "",
        "dataflow/bad.py": "if TYPE_CHECKING:\n    from ..session.run import Run\n"})
    assert [f.split(": ")[0] for f in found] == [
        f"{Path('astranb/dataflow/bad.py')}:2 imports astranb.session.run"]


def test_planted_break_of_the_order_inside_layer_1_is_caught(tmp_path, monkeypatch):
    found = planted(layer_violations, tmp_path, monkeypatch, {
        "dataflow/flow.py": "", "models.py": "",
        "engines/hf.py": "from ..models import ModelSpec\nfrom ..dataflow import flow\n"})
    assert found == [f"{Path('astranb/engines/hf.py')}:2 imports astranb.dataflow.flow: engines "
                     "may import only weights, models of layer 1 (pure parts), not dataflow"]


def test_planted_cycle_is_caught_and_printed(tmp_path, monkeypatch):
    found = planted(cycle_violations, tmp_path, monkeypatch, {
        "cli.py": "def main():\n    from . import sweep\n",
        "sweep.py": "from .cli import main\n",
        "types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from .contracts import Engine\n",
        "contracts.py": "from .types import Generation\n"})  # type-only: no cycle
    assert found == [f"astranb.cli -> astranb.sweep -> astranb.cli  ({Path('astranb/cli.py')}:2, "
                     f"{Path('astranb/sweep.py')}:1)"]


def test_planted_import_of_another_packages_private_is_caught(tmp_path, monkeypatch):
    found = planted(private_violations, tmp_path, monkeypatch, {
        "engines/_fastlm.py": "", "engines/_sampling.py": "", "cli.py": "",
        "engines/hf.py": "from ._fastlm import FastLM\n",          # its own package's: fine
        "training/local.py": "from ..engines._sampling import top_p_filter\n",
        "sweep.py": "from .cli import _cell_label, parse_value\n"})
    assert found == [
        f"{Path('astranb/sweep.py')}:1 imports astranb.cli: _cell_label private to astranb.cli",
        f"{Path('astranb/training/local.py')}:1 imports astranb.engines._sampling: _sampling is "
        "private to astranb.engines"]


def test_planted_ui_import_outside_the_hooks_is_caught(tmp_path, monkeypatch):
    found = planted(ui_violations, tmp_path, monkeypatch, {
        "notebook/debugger.py": "import ipywidgets\n",            # inside notebook/: fine
        "session/recorder.py": "def show():\n    from ..notebook import debugger\n",  # a hook
        "session/run.py": "import plotly\ndef status():\n    from ..notebook import debugger\n"})
    assert found == [
        f"{Path('astranb/session/run.py')}:1 imports plotly: widget libraries stay in "
        "astranb/notebook/",
        f"{Path('astranb/session/run.py')}:3 imports astranb.notebook.debugger: the notebook UI "
        "is imported only inside LAZY_NOTEBOOK_HOOKS"]


def test_planted_server_app_import_is_caught(tmp_path, monkeypatch):
    found = planted(server_app_violations, tmp_path, monkeypatch, {
        "services/server.py": "", "cli.py": "from .services import server\n",
        "session/session.py": "from ..services.server import serve\n"})
    assert found == [f"{Path('astranb/session/session.py')}:1 imports astranb.services.server: "
                     "the server apps are imported only by the CLI and services/"]


def test_planted_http_client_import_is_caught(tmp_path, monkeypatch):
    found = planted(http_client_violations, tmp_path, monkeypatch, {
        "remote/client.py": "", "session/session.py": "from ..remote import client\n",
        "sim/engine.py": "from ..remote.client import TrainerClient\n"})
    assert [f.split(": ")[0] for f in found] == [
        f"{Path('astranb/sim/engine.py')}:1 imports astranb.remote.client"]


def test_planted_module_outside_the_table_is_caught(tmp_path, monkeypatch):
    found = planted(table_problems, tmp_path, monkeypatch, {"stray.py": ""})
    assert "astranb/stray.py is in no part of LAYERS: add it to the part it belongs to" in found


# -- the table as text (docs/architecture.md) ------------------------------------------------------
def table() -> str:
    """The layer table for docs/architecture.md, top layer first: each part's files, what it is,
    and the parts of its own layer it imports."""
    lines = ["```"]
    for layer in LAYERS:
        if layer is not LAYERS[0]:
            lines.append("    " + "─" * 92)
        lines.append(f"{layer.number:>2}  {layer.name}")
        for part in layer.parts:
            lines.append(f"    {' '.join(part.files):<34}{part.about}")
            if part.uses:
                lines.append(f"    {'':<34}also imports: {', '.join(part.uses)}")
    return "\n".join([*lines, "```"])


def write_docs() -> None:
    text = DOCS.read_text()
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_docs()
        print(f"wrote the layer table into {DOCS.relative_to(ROOT)}")
    else:
        print(table())
