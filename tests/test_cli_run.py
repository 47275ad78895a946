"""`astranb run NOTEBOOK`: papermill with checked parameters, the executed notebook and an HTML
export; a failing cell still writes both and exits 1. Notebooks are built here with nbformat."""

from __future__ import annotations

import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from astranb.cli import main
from astranb.papermill_run import parse_value

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(180)


def write_notebook(path: Path, *cells, parameters: str | None = None) -> Path:
    """A notebook of code cells (strings), after a `parameters`-tagged cell if given."""
    nb_cells = [new_markdown_cell("# a test notebook")]
    if parameters is not None:
        nb_cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb_cells += [new_code_cell(source) for source in cells]
    nb = new_notebook(cells=nb_cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


class _Text(HTMLParser):
    """All text of an HTML document (parsing it also proves it is well-formed enough to read)."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.tags = 0

    def handle_starttag(self, tag, attrs):
        self.tags += 1

    def handle_data(self, data):
        self.parts.append(data)


def html_text(path: Path) -> str:
    parser = _Text()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    assert parser.tags > 10, "not an HTML document"
    return "".join(parser.parts)


def outputs(path: Path) -> str:
    """All text outputs of an executed notebook."""
    text = []
    for cell in nbformat.read(path, as_version=4).cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(text)


def test_values_are_read_like_papermill_does():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("-2.5") == -2.5 and parse_value("1e-3") == 0.001
    assert parse_value("True") is True and parse_value("False") is False
    assert parse_value("None") is None
    assert parse_value("true") == "true"  # only Python's spelling is a bool
    assert parse_value("../runs/x") == "../runs/x"


@pytest.mark.slow  # executes a notebook end to end
def test_parameters_are_applied_and_both_files_written(tmp_path):
    nb = write_notebook(
        tmp_path / "calc.ipynb",
        "print(f'answer={n * 3} word={word} flag={flag!r} rate={rate!r} nothing={nothing!r}')",
        parameters="n = 2\nword = 'a'\nflag = False\nrate = 0.5\nnothing = 1",
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "astranb.cli", "run", str(nb), "-p", "n", "7", "-p", "word", "hello",
         "-p", "flag", "True", "-p", "rate", "1e-3", "-p", "nothing", "None",
         "-o", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stderr
    executed, exported = tmp_path / "out" / "calc.ipynb", tmp_path / "out" / "calc.html"
    assert str(executed) in done.stdout and str(exported) in done.stdout
    expected = "answer=21 word=hello flag=True rate=0.001 nothing=None"
    assert expected in outputs(executed)
    assert expected in html_text(exported)
    assert "Executing" in done.stderr  # papermill's progress bar


@pytest.mark.slow  # executes a notebook in a kernel
def test_a_failing_cell_still_writes_both_files_and_exits_1(tmp_path, capsys):
    nb = write_notebook(tmp_path / "bad.ipynb", "print('before the failure')",
                        "raise ValueError('deliberate failure')", "print('never printed')",
                        parameters="x = 1")
    out = tmp_path / "results"
    assert main(["run", str(nb), "-o", str(out), "-p", "x", "2"]) == 1
    err = capsys.readouterr().err
    assert "raise ValueError('deliberate failure')" in err  # which cell
    assert "ValueError: deliberate failure" in err  # and the error
    executed = out / "bad.ipynb"
    assert "before the failure" in outputs(executed)
    assert "never printed" not in outputs(executed)
    text = html_text(out / "bad.html")
    assert "before the failure" in text and "deliberate failure" in text


def test_an_unknown_parameter_is_refused_before_anything_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    nb = write_notebook(tmp_path / "nb.ipynb", f"open({str(marker)!r}, 'w').close()",
                        parameters="steps = 10\nlr = 1e-3")
    assert main(["run", str(nb), "-p", "stpes", "3", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "stpes" in err and "steps, lr" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_parameters_for_a_notebook_without_a_parameters_cell(tmp_path, capsys):
    nb = write_notebook(tmp_path / "plain.ipynb", "x = 1")
    assert main(["run", str(nb), "-p", "x", "2", "-o", str(tmp_path / "out")]) == 2
    assert "no cell tagged 'parameters'" in capsys.readouterr().err


def test_a_missing_notebook(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.ipynb")]) == 2
    assert "nope.ipynb" in capsys.readouterr().err


def test_output_folder_cannot_be_the_notebook_itself(tmp_path, capsys):
    nb = write_notebook(tmp_path / "nb.ipynb", "x = 1")
    assert main(["run", str(nb), "-o", str(tmp_path)]) == 2
    assert "overwrite" in capsys.readouterr().err


def test_without_papermill_the_error_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "papermill", None)  # import papermill -> ImportError
    nb = write_notebook(tmp_path / "nb.ipynb", "x = 1")
    assert main(["run", str(nb)]) == 2
    assert 'pip install "astranb[notebook]"' in capsys.readouterr().err
