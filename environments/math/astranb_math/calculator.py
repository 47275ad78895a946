"""The calculator tool: arithmetic on numbers, read with `ast` and never run as Python code.

Only number literals, `+ - * / // %`, powers (`**`, or `^` as people write it), unary signs and
parentheses are allowed. Sizes are bounded so that no expression can take long or fill memory: at
most `MAX_CHARS` characters, exponents of at most `MAX_EXPONENT`, and no value beyond
`MAX_MAGNITUDE` (checked before a power is computed, and after every operation). Whatever goes
wrong comes back as a string starting with "error:" that says what to write instead; the tool
never raises, so a model that calls it badly reads why and can try again.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

__all__ = ["calculator", "MAX_CHARS", "MAX_EXPONENT", "MAX_MAGNITUDE"]

MAX_CHARS = 200
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**100

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_POWER = (ast.Pow, ast.BitXor)


class _Refused(Exception):
    """An expression the calculator will not evaluate; the message is shown to the model."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** (or ^) and parentheses, e.g. "(12 + 7) * 3".
    """
    if not isinstance(expression, str):
        return f"error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_CHARS:
        return (f"error: the expression has {len(expression)} characters; the limit is "
                f"{MAX_CHARS}, so split it into steps")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return ("error: not an arithmetic expression; use numbers (no commas inside them), "
                "+ - * / // % ** and parentheses")
    except RecursionError:
        return "error: the expression nests too deeply; split it into steps"
    try:
        return _format(_evaluate(tree.body))
    except _Refused as refused:
        return f"error: {refused}"
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, RecursionError):
        return f"error: the result is too large (the limit is 1e{len(str(MAX_MAGNITUDE)) - 1})"


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Refused(f"{value!r} is not a number; the calculator works on numbers only")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, _POWER):
            return _bounded(_power(left, right))
        if type(node.op) in _BINARY:
            return _bounded(_BINARY[type(node.op)](left, right))
    raise _Refused(f"{_describe(node)} is not allowed; use numbers, + - * / // % ** and "
                   "parentheses")


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise _Refused(f"the exponent {_format(exponent)} is too large (the limit is "
                       f"{MAX_EXPONENT})")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > 100:
        raise OverflowError
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    result = base**exponent
    if isinstance(result, complex):
        raise _Refused("a negative number to a fractional power is not a real number")
    return result


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    if abs(value) > MAX_MAGNITUDE:
        raise OverflowError
    return value


def _format(value: int | float) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def _describe(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Tuple):
        return "a comma (write 1000, not 1,000)"
    if isinstance(node, ast.BinOp):
        return f"the operator {type(node.op).__name__}"
    return repr(ast.unparse(node)[:40])
