"""Plain data across the sandbox's boundary: the only values a program's function may take and
give back.

The judge calls the program's functions with arguments it encodes here, and decodes what comes
back here; nothing else the program sends is read. `encode` accepts exactly None, bool, int,
float (inf and nan included), str, bytes, list, tuple, dict, set and frozenset, by exact type
(a subclass of int whose `__eq__` is always True is refused, as is any other object), nested at
most `MAX_DEPTH` deep and `MAX_ITEMS` values in all, ints up to `MAX_INT_BITS`. `decode`
rebuilds the same values, checking the same bounds, from JSON text no longer than the caller's
byte cap:

    null, true, false, 12, 1.5, "text"   themselves (JSON's NaN and Infinity for those floats)
    [a, b]                               list
    {"tuple": [...]}                     tuple (likewise "set", "frozenset")
    {"dict": [[key, value], ...]}        dict, keys of any hashable plain type
    {"bytes": "hex"}                     bytes

Standard library only: the program's server in the job imports this file too.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of containers."""
MAX_ITEMS = 1_000_000
"""Most values in one encoded value, containers included."""
MAX_INT_BITS = 14_000
"""Largest int (about the 4300 decimal digits Python's int() reads at most)."""
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes")


class WireError(ValueError):
    """A value that is not plain data (or too big, too deep), in either direction."""


def encode(value: Any) -> Any:
    """`value` as JSON-ready data (see the module docstring); WireError for anything else."""
    return _Encoder().encode(value, 0)


def dumps(value: Any) -> str:
    """`encode` then JSON text."""
    return json.dumps(encode(value), allow_nan=True, separators=(",", ":"))


def decode(data: Any) -> Any:
    """The value `encode` gave `data` for; WireError when `data` is not such an encoding."""
    return _Decoder().decode(data, 0)


def loads(text: str | bytes) -> Any:
    """JSON text to data (no value check: `decode` does that). WireError on bad JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # a number of 5000 digits, [[[[...]]]]
        raise WireError(f"not JSON: {_short(error)}") from None


class _Counter:
    def __init__(self) -> None:
        self.items = 0

    def visit(self, depth: int) -> None:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise WireError(f"more than {MAX_ITEMS} values")
        if depth > MAX_DEPTH:
            raise WireError(f"nested more than {MAX_DEPTH} deep")


class _Encoder(_Counter):
    def encode(self, value: Any, depth: int) -> Any:
        self.visit(depth)
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is int:
            if value.bit_length() > MAX_INT_BITS:
                raise WireError(f"an int of more than {MAX_INT_BITS} bits")
            return value
        if kind is float:
            return value
        if kind is list:
            return [self.encode(item, depth + 1) for item in value]
        if kind in (tuple, set, frozenset):
            items = [self.encode(item, depth + 1) for item in value]
            return {kind.__name__: items}
        if kind is dict:
            return {"dict": [[self.encode(k, depth + 1), self.encode(v, depth + 1)]
                             for k, v in value.items()]}
        if kind is bytes:
            return {"bytes": value.hex()}
        raise WireError(f"a {kind.__module__}.{kind.__qualname__} (not plain data: only None, "
                        "bool, int, float, str, bytes, list, tuple, dict, set, frozenset cross)")


class _Decoder(_Counter):
    def decode(self, data: Any, depth: int) -> Any:
        self.visit(depth)
        kind = type(data)
        if kind is int and data.bit_length() > MAX_INT_BITS:
            raise WireError(f"an int of more than {MAX_INT_BITS} bits")
        if data is None or kind in (bool, int, str, float):
            return data
        if kind is list:
            return [self.decode(item, depth + 1) for item in data]
        if kind is dict and len(data) == 1:
            (tag, body), = data.items()
            if tag == "bytes" and type(body) is str:
                try:
                    return bytes.fromhex(body)
                except ValueError:
                    raise WireError("bytes that are not hex") from None
            if tag in _TAGS and type(body) is list:
                return self._container(tag, body, depth)
        raise WireError(f"not an encoded plain value: {_short(data)}")

    def _container(self, tag: str, body: list, depth: int) -> Any:
        try:
            if tag == "dict":
                if not all(type(pair) is list and len(pair) == 2 for pair in body):
                    raise WireError("a dict's items must be [key, value] pairs")
                return {self.decode(k, depth + 1): self.decode(v, depth + 1) for k, v in body}
            items = [self.decode(item, depth + 1) for item in body]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError as error:  # an unhashable key or set member
            raise WireError(f"bad {tag}: {error}") from None


def _short(thing: Any) -> str:
    text = repr(thing)
    return text if len(text) <= 120 else text[:117] + "..."

