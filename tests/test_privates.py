"""Nothing outside session.py reaches into a Session's privates (nor outside context.py into a
RunContext's): other code goes through the Session's public methods or `session.context`.

Every .py file of the package, the tests, the benchmarks and the scripts is read with `ast`. A
private attribute (one leading underscore, not a dunder) read, written or deleted on something
that names a Session is reported with its file and line: a name or attribute called `session`
or `_session` (`session._pool`, `self._session._wiring`, `run.session._loop()`), or a name the
file binds to `Session(...)` (`again = ab.Session(folder)`, `with ab.Session(...) as s`); so is
`getattr`/`setattr`/`hasattr`/`delattr` of such a name with a private attribute's name. The same
for a RunContext (`context`, `_context`, `session.context`) outside context.py. `_repr_html_` is
a public display hook (IPython's), not a private.

A second rule keeps the run layer free of an import circle: no module of astranb/session/
imports session.py (not even for annotations), except the package's `__init__`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("astranb", "tests", "bench", "scripts")

SESSION = ("session", {"session", "_session"}, Path("astranb/session/session.py"))
CONTEXT = ("context", {"context", "_context"}, Path("astranb/session/context.py"))
"""(kind, names that hold one, the one file that may touch its privates)."""

PUBLIC_HOOKS = {"_repr_html_"}
REFLECTION = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(attribute: str) -> bool:
    return (attribute.startswith("_") and not attribute.startswith("__")
            and attribute not in PUBLIC_HOOKS)


def sessions_made(tree: ast.AST) -> set[str]:
    """Names the file binds to `Session(...)` / `ab.Session(...)` (assignments, `with ... as`)."""
    def makes_a_session(value: ast.AST | None) -> bool:
        if not isinstance(value, ast.Call):
            return False
        func = value.func
        return (isinstance(func, ast.Name) and func.id == "Session") or (
            isinstance(func, ast.Attribute) and func.attr == "Session")

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and makes_a_session(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.withitem) and makes_a_session(node.context_expr):
            if isinstance(node.optional_vars, ast.Name):
                names.add(node.optional_vars.id)
    return names


def holder_kind(node: ast.AST, made: set[str]) -> str | None:
    """"session" or "context" when `node` names one (see the module docstring), else None."""
    name = (node.id if isinstance(node, ast.Name)
            else node.attr if isinstance(node, ast.Attribute) else None)
    if name is None:
        return None
    if name in SESSION[1] or (isinstance(node, ast.Name) and name in made):
        return SESSION[0]
    if name in CONTEXT[1]:
        return CONTEXT[0]
    return None


def reaches(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line reaches <kind>.<attribute>' for each private reached in `path`."""
    rel = path.relative_to(root)
    tree = ast.parse(path.read_text(), str(path))
    made = sessions_made(tree)
    owners = {kind: owner for kind, _, owner in (SESSION, CONTEXT)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            holder, attribute = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in REFLECTION and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            holder, attribute = node.args[0], node.args[1].value
        else:
            continue
        kind = holder_kind(holder, made)
        if kind is not None and is_private(attribute) and rel != owners[kind]:
            found.append((node.lineno, f"{rel}:{node.lineno} reaches {kind}.{attribute}"))
    return [line for _, line in sorted(found)]


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            # a virtual environment a benchmark made (bench/.venv-trl) is not the project's code
            if not any(part.startswith(".venv") for part in path.relative_to(root).parts):
                found.extend(reaches(path, root))
    return found


def test_nothing_outside_session_py_touches_a_session_private():
    assert violations() == []


def test_the_rule_catches_a_violation(tmp_path):
    """The checker itself: planted reaches into privates are reported with file and line."""
    planted = tmp_path / "astranb" / "notebook"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text(
        "import astranb as ab\n"
        "def show(session, run):\n"
        "    session._pool.accounting()\n"             # 3: a name called session
        "    run.session._loop()\n"                    # 4: an attribute called session
        "    again = ab.Session('x')\n"
        "    again._wiring.clear()\n"                  # 6: a name bound to Session(...)
        "    getattr(session, '_flow')\n"              # 7: reflection
        "    session.context._portal\n"                # 8: the context's private
        "    session._repr_html_()\n"                  # a public display hook: allowed
        "    session.context.pool\n"                   # public: allowed
        "    session.__class__\n")                     # a dunder: allowed
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_bad.py").write_text(
        "class Holder:\n"
        "    def use(self):\n"
        "        with Session('y') as s:\n"
        "            s._runs\n"                        # 4: `with Session(...) as s`
        "        self._session._check_open()\n")       # 5: self._session
    bad, test = Path("astranb/notebook/bad.py"), Path("tests/test_bad.py")
    assert violations(tmp_path) == [
        f"{bad}:3 reaches session._pool", f"{bad}:4 reaches session._loop",
        f"{bad}:6 reaches session._wiring", f"{bad}:7 reaches session._flow",
        f"{bad}:8 reaches context._portal",
        f"{test}:4 reaches session._runs", f"{test}:5 reaches session._check_open",
    ]


def test_the_owner_files_may_touch_their_own_privates(tmp_path):
    """session.py may use a session's privates, context.py a context's, and not the other's."""
    folder = tmp_path / "astranb" / "session"
    folder.mkdir(parents=True)
    (folder / "session.py").write_text("def f(session, context):\n    session._x\n"
                                       "    context._y\n")
    (folder / "context.py").write_text("def f(session, context):\n    session._x\n"
                                       "    context._y\n")
    assert violations(tmp_path) == [
        f"{Path('astranb/session/context.py')}:2 reaches session._x",
        f"{Path('astranb/session/session.py')}:3 reaches context._y",
    ]


def test_no_module_of_the_run_layer_imports_session_py():
    """launch, heldout, restore, wiring, context... receive the RunContext: none imports the
    Session, not even under TYPE_CHECKING, so no import circle runs through session.py."""
    found = []
    for path in sorted((ROOT / "astranb" / "session").glob("*.py")):
        if path.name in ("__init__.py", "session.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (
                    (node.level == 1 and node.module == "session")
                    or node.module == "astranb.session.session"
                    or (node.level == 1 and node.module is None
                        and any(a.name == "session" for a in node.names))):
                found.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(
                    a.name == "astranb.session.session" for a in node.names):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


if __name__ == "__main__":  # python tests/test_privates.py: list what it finds
    print("\n".join(violations()) or "none", file=sys.stderr)
