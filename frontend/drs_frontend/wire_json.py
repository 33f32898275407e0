"""JSON on the hot path: orjson, with the standard library's exact behaviour at the edges.

Each turn parses three bodies and writes three (``bench/relay.py``: the stdlib ``json`` module was
~15% of the frontend's Python time per turn; orjson does the same work several times faster).
orjson differs from ``json`` on inputs the relay must pass through unchanged, so those take the
stdlib path:

* integers of 20 or more digits (orjson would turn those past 2**64 into floats): a body whose bytes
  hold such a digit run is parsed by ``json``;
* ``NaN``/``Infinity``, floats that overflow, a byte-order mark, lone surrogates, UTF-16/32
  bodies: orjson refuses them, ``json`` parses them (or raises the same error as before);
  non-finite floats are parsed as :class:`NonFinite` so that :func:`dumps` writes them back as
  ``json`` does (orjson would write ``null``);
* :func:`dumps` falls back to ``json`` for whatever orjson refuses (big integers, lone
  surrogates, non-string keys, :class:`NonFinite`).

Output differs from ``json.dumps(..., separators=(",", ":"))`` only in that non-ASCII text is
written as UTF-8 rather than ``\\uXXXX`` escapes: the same JSON value.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

import orjson

#: Every digit to ``0``, so that a run of 20 digits is a plain substring search (a ``\d{20}``
#: regex costs ten times as much as parsing the body with orjson: ~30 µs for 3 kB).
_DIGITS_TO_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS: Final = b"0" * 20


class NonFinite(float):
    """A NaN or infinity read from JSON; a float subclass so that orjson refuses to write it."""


def _parse_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(value)


def _parse_constant(name: str) -> float:
    return NonFinite(name)


def _stdlib_loads(raw: bytes | str) -> Any:
    return json.loads(raw, parse_float=_parse_float, parse_constant=_parse_constant)


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``, faster: raises ``ValueError`` (or ``UnicodeDecodeError``) as it does."""
    if _LONG_DIGITS in raw.translate(_DIGITS_TO_ZERO):
        return _stdlib_loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _stdlib_loads(raw)


def dumps(obj: Any) -> bytes:
    """``json.dumps(obj, separators=(",", ":")).encode()``, faster (UTF-8 instead of ``\\u`` escapes)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()
