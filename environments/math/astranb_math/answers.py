"""Reading answers: the model's final answer and the dataset's gold answer, as text to verify.

A model's answer is the content of its last `\\boxed{...}` (braces may nest:
`\\boxed{\\frac{1}{2}}`), else the text after its last GSM8K-style `#### ` line, else the rest of
its last line that starts with `Answer:` (the form DAPO-Math's prompts ask for). A gold answer is
the text after GSM8K's `####` line, else the last `\\boxed{}` of a MATH-style solution, else the
whole answer column (DeepScaleR and DAPO-Math store the bare answer). Both are plain string scans
(no regular expression that could backtrack on a long completion).
"""

from __future__ import annotations

from typing import Any

__all__ = ["extract_answer", "gold_answer", "last_boxed"]

_BOXED = ("\\boxed", "\\fbox")
_HASHES = "####"


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion, or None if it gives none.

    >>> extract_answer("so x = 3, hence \\\\boxed{\\\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
    >>> extract_answer("48 + 24 = 72\\n#### 72")
    '72'
    >>> extract_answer("so 5 + 7 = 12.\\nAnswer: $12$")
    '12'
    """
    boxed = last_boxed(completion)
    if boxed:
        return boxed
    return _after_hashes(completion) or _answer_line(completion) or None


def gold_answer(answer: Any) -> str:
    """The gold answer of a dataset's answer column: GSM8K's `#### 72`, a MATH solution's last
    `\\boxed{}`, or the bare value.

    Raises:
        ValueError: the column holds no answer (empty, or an empty `####` / `\\boxed{}`).
    """
    text = str(answer)
    if _HASHES in text:
        gold = _after_hashes(text)
    elif any(name in text for name in _BOXED):
        gold = last_boxed(text) or ""
    else:
        gold = text.strip()
    if not gold:
        raise ValueError(f"no gold answer in {text[:200]!r}; the answer column must hold the "
                         "answer, a GSM8K '#### <answer>' line or a solution with \\boxed{}")
    return gold


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`), stripped; None if there
    is none (an unclosed last box falls back to the one before it)."""
    end = len(text)
    while True:
        start = max(text.rfind(name, 0, end) for name in _BOXED)
        if start < 0:
            return None
        name = next(n for n in _BOXED if text.startswith(n, start))
        content = _braced(text, start + len(name))
        if content is not None:
            return content.strip()
        end = start


def _braced(text: str, i: int) -> str | None:
    """The text inside the brace group that opens at `i` (after spaces); None if unbalanced."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _answer_line(text: str) -> str:
    """The rest of the last line that starts with "Answer:", without $ signs and a final period."""
    for line in reversed(text.splitlines()):
        stripped = line.strip()
        if stripped[:7].lower() == "answer:":
            return stripped[7:].strip().strip("$").strip().rstrip(".").strip()
    return ""


def _after_hashes(text: str) -> str:
    """The rest of the line after the last `####`, stripped of spaces and a final period."""
    start = text.rfind(_HASHES)
    if start < 0:
        return ""
    line = text[start + len(_HASHES):].lstrip("#").split("\n", 1)[0]
    return line.strip().rstrip(".").strip()
