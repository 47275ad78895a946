"""Reading the answer out of a completion: the bare reply, or the last `<answer>` tag.

Plain string scans (no regular expression that could backtrack on a long completion).
"""

from __future__ import annotations

__all__ = ["extract_answer"]

_OPEN, _CLOSE = "<answer>", "</answer>"
_THINK_END = "</think>"


def extract_answer(text: str, *, tag: bool = False, first_line: bool = False) -> str | None:
    """The answer a completion gives, stripped; None when it gives none.

    Args:
        text: the completion (a chat message's content, or a plain completion).
        tag: read the content of the last complete `<answer>...</answer>` instead.
        first_line: a bare answer is the completion's first line (plain models run on past it).

    >>> extract_answer("  -4 ")
    '-4'
    >>> extract_answer("<think>5-3-6</think>\\n-4")
    '-4'
    >>> extract_answer("so <answer>1</answer> no, <answer> -4 </answer>", tag=True)
    '-4'
    >>> extract_answer("-4", tag=True) is None
    True
    """
    if _THINK_END in text:
        text = text[text.rfind(_THINK_END) + len(_THINK_END):]
    if tag:
        end = text.rfind(_CLOSE)
        start = text.rfind(_OPEN, 0, end) if end >= 0 else -1
        answer = text[start + len(_OPEN):end] if start >= 0 else ""
    else:
        answer = text.strip().split("\n", 1)[0] if first_line else text
    answer = answer.strip()
    return answer or None
