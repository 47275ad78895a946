"""Write notebooks/*.ipynb from the cell lists in scripts/notebooks/nNN_*.py (one module per
notebook, each defining NAME and CELLS; the library is the source of truth, these files only lay
out the notebooks). Run: .venv/bin/python scripts/make_notebooks.py"""

import importlib.util
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook

HERE = Path(__file__).resolve().parent.parent


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    sys.path.insert(0, str(HERE / "scripts" / "notebooks"))  # their shared _cells.py
    for path in sorted((HERE / "scripts" / "notebooks").glob("n[0-9][0-9]_*.py")):
        module = _load(path)
        nb = new_notebook(cells=module.CELLS)
        for i, cell in enumerate(nb.cells):  # stable ids: rerunning this script changes nothing
            cell.id = f"{module.NAME[:2]}-{i:02d}"
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.write(nb, HERE / "notebooks" / f"{module.NAME}.ipynb")


if __name__ == "__main__":
    main()
