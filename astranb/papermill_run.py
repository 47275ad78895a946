"""What `astranb run` and `astranb sweep` share about executing a notebook with papermill: the
`-p` values as papermill reads them, the check of `-p` names against the notebook's parameters
cell, and the name a failed cell goes by in messages and tables.

    parse_value("1e-3")                          # 0.001, as papermill's command line reads it
    papermill = import_papermill()               # or a ValueError naming the extra to install
    check_parameters(papermill, notebook, {"steps": 20})
    cell_label(3, "run.wait()")                  # "In [3] ('run.wait()')"

Both commands sit above this module and import it; it imports nothing of astranb.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["cell_label", "check_parameters", "import_papermill", "parse_value"]


def parse_value(text: str) -> Any:
    """A -p VALUE as papermill's command line reads it.

    Args:
        text: the value as typed.

    Returns:
        True, False or None for those words, else an int, else a float, else the text itself.
    """
    words = {"True": True, "False": False, "None": None}
    if text in words:
        return words[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def import_papermill() -> ModuleType:
    """papermill, after checking that nbconvert (the HTML export) is there too, so a missing
    extra is said before anything runs."""
    try:
        import nbconvert  # noqa: F401  (the HTML export, checked before anything runs)
        import papermill
    except ImportError:
        raise ValueError('`astranb run` needs papermill and nbconvert: '
                         'pip install "astranb[notebook]"') from None
    return papermill


def check_parameters(papermill: Any, notebook: Path, parameters: dict) -> None:
    """Refuse -p names the notebook's parameters cell does not set (papermill only warns)."""
    if not parameters:
        return
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    if not any("parameters" in cell.metadata.get("tags", []) for cell in cells):
        raise ValueError(f"{notebook} has no cell tagged 'parameters', so -p has nothing to "
                         "override; tag the cell that sets its defaults 'parameters' "
                         "(JupyterLab: property inspector, cell tags)")
    known = papermill.inspect_notebook(str(notebook))
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise ValueError(f"{notebook} has no parameter(s) {', '.join(unknown)}; its parameters "
                         f"cell sets: {', '.join(known) or 'nothing'}")


def cell_label(exec_count: int | None, source: str) -> str:
    """A cell as messages name it: its execution count and its first non-blank line."""
    first_line = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return f"In [{exec_count}] ({first_line[:80]!r})"
