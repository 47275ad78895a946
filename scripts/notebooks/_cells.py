"""A notebook's cell list, written cell by cell: `cells = Cells()`, then `cells.md(...)` and
`cells.code(...)`; the module's CELLS is `cells.list`."""

from nbformat.v4 import new_code_cell, new_markdown_cell


class Cells:
    def __init__(self) -> None:
        self.list: list = []

    def md(self, source: str) -> None:
        """A markdown cell; lines within a paragraph are joined (kept short in the script)."""
        paragraphs = [" ".join(part.split("\n")) for part in source.split("\n\n")]
        self.list.append(new_markdown_cell("\n\n".join(paragraphs)))

    def code(self, source: str, **kwargs) -> None:
        self.list.append(new_code_cell(source, **kwargs))
