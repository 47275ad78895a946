"""Small HTML pieces for notebook displays (`_repr_html_`): escaped, inline-styled, no scripts."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["card", "table", "fmt"]

_TABLE = "border-collapse:collapse;font-size:12px;margin:4px 0"
_CELL = "padding:2px 10px;border-bottom:1px solid #ddd;text-align:left"


def fmt(value: Any) -> str:
    """A value as short, escaped text (floats to 4 significant digits)."""
    if isinstance(value, float):
        return html.escape(f"{value:.4g}")
    return html.escape(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """An HTML table; every cell escaped."""
    head = "".join(f"<th style='{_CELL}'>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td style='{_CELL}'>{fmt(v)}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table style='{_TABLE}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def card(title: str, subtitle: str, body: str = "", css_class: str = "") -> str:
    """A titled block: bold title, grey one-line subtitle, then `body` (already HTML)."""
    return (
        f"<div class='astranb {css_class}' style='font-family:sans-serif;margin:4px 0'>"
        f"<b>{html.escape(title)}</b> <span style='color:#666'>{html.escape(subtitle)}</span>"
        f"{body}</div>"
    )
